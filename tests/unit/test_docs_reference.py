"""The reference pages name what the code serves: every Prometheus metric a gateway exports (the gateways' own and
the engine metrics it exports from EngineStats) has its row in docs/operations.md with its exact label names, and
every route family the app mounts has its row in docs/api.md. A metric or family added without its row fails here.
The Grafana dashboard we ship queries only metrics we export.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from gateway.app import ROUTE_FAMILIES
from gateway.metrics import EngineCollector, Recorder
from gateway.state import STATE
from protocol.messages import EngineStats

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([a-z]+)\s*\|")


def exported(registry: CollectorRegistry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{name as scraped: (kind, label names)} of every metric ``registry`` collects."""
    labels_of = {c._name: tuple(c._labelnames) for c in registry._collector_to_names if hasattr(c, "_labelnames")}
    out = {}
    for fam in registry.collect():
        labels = labels_of.get(fam.name)
        if labels is None:  # a custom collector's family: its samples carry the labels
            labels = tuple(dict.fromkeys(k for s in fam.samples for k in s.labels if k != "le"))
        out[fam.name + ("_total" if fam.type == "counter" else "")] = (fam.type, labels)
    return out


def every_metric() -> dict[str, tuple[str, tuple[str, ...]]]:
    gateways = CollectorRegistry()
    Recorder(gateways)
    engine = SimpleNamespace(hello=SimpleNamespace(rank=0, model_id="m"), routable=True,
                             stats=EngineStats(rank=0, running=1, waiting=0, kv_used=0.1, generated_tokens=5, steps=5,
                                               timestamp=time.time(), max_loras=2, running_loras=("a",)))
    engines = CollectorRegistry()
    state = SimpleNamespace(engines=SimpleNamespace(engines={0: engine}), cluster=None,
                            models=[SimpleNamespace(model_id="m")])
    engines.register(EngineCollector({STATE: state}))
    return {**exported(gateways), **exported(engines)}


def documented_metrics() -> dict[str, str]:
    """{`name{labels}` as the first cell of a table row of docs/operations.md: the kind in its second cell}."""
    rows = (ROW.match(line) for line in (ROOT / "docs" / "operations.md").read_text().splitlines())
    return {m.group(1): m.group(2) for m in rows if m and m.group(1).startswith(("zserve_", "vllm:"))}


def test_every_exported_metric_has_a_row_with_its_kind_and_exact_labels():
    docs = documented_metrics()
    metrics = every_metric()
    assert len(metrics) >= 20  # (the gateway's 7, EngineStats' 12, zserve_engine_up)
    missing = []
    for name, (kind, labels) in sorted(metrics.items()):
        cell = f"{name}{{{','.join(labels)}}}" if labels else name
        if docs.get(cell) != kind:
            missing.append(f"| `{cell}` | {kind} | ... |")
    assert not missing, "docs/operations.md#metrics lacks these rows (or gives another kind):\n" + "\n".join(missing)
    stale = sorted(set(docs) - {f"{n}{{{','.join(ls)}}}" if ls else n for n, (_, ls) in metrics.items()})
    assert not stale, f"docs/operations.md documents metrics no code exports: {stale}"


def test_every_route_family_has_a_row_in_the_api_reference():
    text = (ROOT / "docs" / "api.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\|\s*(\w+)\s*\|\s*`\w+\.py`", text, re.M)}
    assert set(ROUTE_FAMILIES) <= rows, f"docs/api.md's family table lacks {sorted(set(ROUTE_FAMILIES) - rows)}"


DASHBOARD = ROOT / "deploy" / "grafana" / "zserve-dashboard.json"
METRIC_NAME = re.compile(r"(?<![\w:])((?:vllm:|zserve_)[A-Za-z0-9_:]*)")


def dashboard_queries(node: object) -> list[str]:
    """Every PromQL expression in the dashboard: its panels' targets and its variables' queries."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        if isinstance(node.get("definition"), str):
            found.append(node["definition"])
        return found + [q for v in node.values() for q in dashboard_queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in dashboard_queries(v)]
    return []


def test_the_grafana_dashboard_queries_only_metrics_we_export():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    metrics = every_metric()
    # a histogram is queried through its series, a counter with _total (as scraped)
    series = {name + suffix for name, (kind, _) in metrics.items()
              for suffix in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))}
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 10
    used = {name for q in queries for name in METRIC_NAME.findall(q)}
    assert used and used <= series, f"the dashboard queries metrics no code exports: {sorted(used - series)}"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    # built on vLLM's names: each of them is charted
    vllm = {n for n in metrics if n.startswith("vllm:")}
    charted = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert vllm <= charted, f"vLLM metrics the dashboard does not chart: {sorted(vllm - charted)}"
