"""The report side of ``launch bench``: a load point's records become metrics, a table and a plot.

Latencies are in milliseconds and summarised as mean, p50, p90 and p99, with vLLM's names: TTFT (time to
first token), ITL (inter-token latency: the gaps between streamed chunks), TPOT (time per output token
after the first, per request) and E2EL (end-to-end latency). Goodput counts the requests per second that
met every SLO given (``ttft:500 e2el:2000``, in ms).

For the shared-prefix workloads the report adds what the prefix cache served (the prompt tokens the server
reports as cached, in total and as a share of all prompt tokens) and, when the server names the engine of each
response (zserve's ``X-Zserve-Engine``), the engine agreement: per prefix (or conversation) the share of its
requests that the engine serving most of them served, averaged over the groups weighted by their requests.
1.0 means every group stayed on one engine; a router that ignores prefixes spreads each over all of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .load import RequestRecord

LATENCIES = ("ttft", "itl", "tpot", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)
MAX_ERRORS = 5  # distinct error messages kept in a result


def parse_slos(items: tuple[str, ...]) -> dict[str, float]:
    """``("ttft:500 e2el:2000",)`` or ``("ttft:500", "e2el:2000")`` as {"ttft": 500.0, "e2el": 2000.0}."""
    slos: dict[str, float] = {}
    for item in (part for raw in items for part in raw.replace(",", " ").split()):
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"{item!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number of milliseconds") from None
        if slos[key] <= 0:
            raise ValueError(f"{item!r}: an SLO must be positive")
    return slos


def stats(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles of latencies given in seconds, in milliseconds (None when there are none)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def tpot(rec: RequestRecord) -> float | None:
    """Seconds per output token after the first (None for a single token or an unstreamed request)."""
    if rec.ttft is None or rec.output_tokens < 2:
        return None
    return (rec.latency - rec.ttft) / (rec.output_tokens - 1)


def meets(rec: RequestRecord, slos: dict[str, float]) -> bool:
    got = {"ttft": rec.ttft if rec.ttft is not None else rec.latency, "tpot": tpot(rec) or 0.0, "e2el": rec.latency}
    return all(got[k] * 1000.0 <= limit for k, limit in slos.items())


def summarize(records: list[RequestRecord], duration: float, load: dict[str, Any], slos: dict[str, float],
              detailed: bool = False) -> dict[str, Any]:
    """Every metric of one load point (what --result-file holds per point)."""
    ok = [r for r in records if r.ok]
    duration = max(duration, 1e-9)
    inputs, outputs = sum(r.input_tokens for r in ok), sum(r.output_tokens for r in ok)
    errors = Counter(r.error or "unknown error" for r in records if not r.ok)
    point: dict[str, Any] = {
        "load": load,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "input_throughput": inputs / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "ttft_ms": stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": stats([t for r in ok for t in r.itl]),
        "tpot_ms": stats([t for r in ok if (t := tpot(r)) is not None]),
        "e2el_ms": stats([r.latency for r in ok]),
        "goodput": None,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "cached_prompt_share": sum(r.cached_tokens for r in ok) / inputs if inputs else 0.0,
        "engine_agreement": engine_agreement(records),
        "engine_requests": dict(sorted(Counter(r.engine for r in ok if r.engine is not None).items())),
        "errors": [{"message": m, "count": n} for m, n in errors.most_common(MAX_ERRORS)],
    }
    if slos:
        good = sum(meets(r, slos) for r in ok)
        point["goodput"] = {"slo_ms": slos, "good": good, "requests_per_s": good / duration,
                            "fraction": good / len(records) if records else 0.0}
    if detailed:
        point["requests"] = [dataclasses.asdict(r) for r in records]
    return point


def engine_agreement(records: list[RequestRecord]) -> dict[str, Any] | None:
    """How well each group (prefix or conversation) stayed on one engine, over the completed requests that name
    both: {"share", "groups", "requests"}; None when no request named an engine (another server) or a group."""
    served: dict[int, Counter[str]] = {}
    for r in records:
        if r.ok and r.engine is not None and r.group is not None:
            served.setdefault(r.group, Counter())[r.engine] += 1
    if not served:
        return None
    requests = sum(sum(c.values()) for c in served.values())
    # weighted by requests, the mean of max/n is the sum of the maxima over all requests
    top = sum(max(c.values()) for c in served.values())
    return {"share": top / requests, "groups": len(served), "requests": requests}


def load_label(load: dict[str, Any]) -> str:
    rate, conc = load.get("request_rate"), load.get("max_concurrency")
    parts = [f"rate {_num(rate)}/s" if rate is not None and not math.isinf(rate) else "rate inf"]
    if conc:
        parts.append(f"conc {conc}")
    return ", ".join(parts)


def _num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{x:.0f}"


def _pcts(s: dict[str, float | None]) -> str:
    return "/".join(f"{s[f'p{p}']:.1f}" if s[f"p{p}"] is not None else "-" for p in PERCENTILES)


def table(points: list[dict[str, Any]]) -> str:
    """One row per load point: counts, throughput, and p50/p90/p99 of each latency in ms."""
    head = ("load", "ok", "fail", "req/s", "in tok/s", "out tok/s", "TTFT p50/90/99", "ITL p50/90/99",
            "TPOT p50/90/99", "E2EL p50/90/99", "goodput")
    rows = [head]
    for p in points:
        gp = p["goodput"]
        rows.append((load_label(p["load"]), str(p["completed"]), str(p["failed"]), f"{p['request_throughput']:.2f}",
                     f"{p['input_throughput']:.1f}", f"{p['output_throughput']:.1f}", _pcts(p["ttft_ms"]),
                     _pcts(p["itl_ms"]), _pcts(p["tpot_ms"]), _pcts(p["e2el_ms"]),
                     f"{gp['requests_per_s']:.2f} req/s" if gp else "-"))
    lines = _aligned(rows)
    lines.append("(latencies in ms)")
    if any(p["cached_prompt_tokens"] or p["engine_agreement"] for p in points):
        lines.append("")
        lines.append(cache_table(points))
    for p in points:
        for e in p["errors"]:
            lines.append(f"error ({load_label(p['load'])}, {e['count']}x): {e['message']}")
    return "\n".join(lines)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Columns padded to their widest cell (the first left-aligned, the rest right), a rule under the head."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def cache_table(points: list[dict[str, Any]]) -> str:
    """One row per load point: prompt tokens the prefix cache served, TTFT beside them, and engine agreement."""
    head = ("load", "cached prompt tok", "of prompt tok", "TTFT mean/p50/p99", "engine agreement", "requests by engine")
    rows = [head]
    for p in points:
        t, agree = p["ttft_ms"], p["engine_agreement"]
        ttft = "/".join(f"{t[k]:.1f}" if t[k] is not None else "-" for k in ("mean", "p50", "p99"))
        rows.append((load_label(p["load"]), str(p["cached_prompt_tokens"]), f"{p['cached_prompt_share']:.1%}", ttft,
                     f"{agree['share']:.3f} ({agree['groups']} groups)" if agree else "-",
                     " ".join(f"{e}:{n}" for e, n in p["engine_requests"].items()) or "-"))
    return "\n".join(_aligned(rows))


def plot(points: list[dict[str, Any]], path: Path, axis: str) -> None:
    """TTFT, ITL and E2EL p50/p90/p99 against the load (``axis``: "request_rate" or "max_concurrency"),
    and output throughput against p50/p99 E2EL: the curve that sizes a deployment."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    xs = list(range(len(points)))
    ticks = [_num(p["load"].get(axis)) if p["load"].get(axis) is not None else "inf" for p in points]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, key, title in zip(axes.flat, ("ttft_ms", "itl_ms", "e2el_ms"), ("TTFT", "ITL", "E2E latency")):
        for pct in PERCENTILES:
            ys = [p[key][f"p{pct}"] for p in points]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=f"p{pct}")
        ax.set_title(f"{title} (ms)")
        ax.set_xticks(xs, ticks)
        ax.set_xlabel("request rate (req/s)" if axis == "request_rate" else "max concurrency")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes.flat[3]
    throughput = [p["output_throughput"] for p in points]
    for pct in (50, 99):
        ys = [p["e2el_ms"][f"p{pct}"] for p in points]
        ax.plot(throughput, [float("nan") if y is None else y for y in ys], marker="o", label=f"E2EL p{pct}")
    for x, y, t in zip(throughput, [p["e2el_ms"]["p50"] for p in points], ticks):
        if y is not None:
            ax.annotate(t, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_title("throughput vs latency")
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
