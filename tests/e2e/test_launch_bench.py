"""`launch bench` against the shared tiny-random server: metrics, exact token counts, the plot, sweeps,
a dataset on the chat route, and how an unreachable or failing server is reported (exit codes 2 and 1)."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from launch.bench.report import parse_slos
from launch.bench.run import _jsonable
from tests.helpers import LAUNCH, ROOT, free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
POINT_FIELDS = {"load", "num_prompts", "completed", "failed", "duration_s", "total_input_tokens",
                "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
                "total_token_throughput", "ttft_ms", "itl_ms", "tpot_ms", "e2el_ms", "goodput", "errors"}


def bench(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, "bench", "--base-url", url, "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_reports_every_metric_with_exact_token_counts_and_a_png(tiny_server, tmp_path):
    result, png = tmp_path / "bench.json", tmp_path / "bench.png"
    # --goodput as vLLM takes it: several KEY:MS after the one flag
    p = bench(tiny_server.url, "--num-prompts", "24", "--random-input-len", "32", "--random-output-len", "8",
              "--max-concurrency", "4", "--ignore-eos", "--goodput", "ttft:60000", "e2el:60000",
              "--result-file", str(result), "--save-detailed", "--plot", str(png))
    assert p.returncode == 0, p.stderr
    out = orjson.loads(result.read_bytes())
    assert out["model"] == "tiny-random"
    assert out["config"]["num_prompts"] == 24 and out["config"]["request_rate"] == "inf"
    assert "api_key" not in out["config"]
    [point] = out["results"]
    assert POINT_FIELDS <= set(point)
    assert point["load"] == {"request_rate": "inf", "max_concurrency": 4}
    assert (point["completed"], point["failed"], point["errors"]) == (24, 0, [])
    # /tokenize made every prompt exactly 32 tokens; ignore_eos made every output exactly 8
    assert point["total_input_tokens"] == 24 * 32
    assert point["total_output_tokens"] == 24 * 8
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms"):
        s = point[key]
        assert set(s) == {"mean", "p50", "p90", "p99"}
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], key
    assert point["ttft_ms"]["p99"] <= point["e2el_ms"]["p99"]
    assert point["request_throughput"] > 0 and point["output_throughput"] > 0
    assert point["goodput"]["slo_ms"] == {"ttft": 60000, "e2el": 60000}
    assert point["goodput"]["good"] == 24  # a minute is an SLO every request meets
    records = point["requests"]
    # one gap per chunk after the first: at most 7 for 8 tokens (a chunk may carry several, e.g. when the
    # detokenizer holds back half a UTF-8 character)
    assert len(records) == 24 and all(r["ok"] and 1 <= len(r["itl"]) <= 7 for r in records)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "TTFT p50/90/99" in p.stdout and "rate inf, conc 4" in p.stdout


def test_bench_sweep_runs_one_load_point_per_value(tiny_server, tmp_path):
    result, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    p = bench(tiny_server.url, "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "4",
              "--ignore-eos", "--sweep-concurrency", "1,4", "--result-file", str(result), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    points = orjson.loads(result.read_bytes())["results"]
    assert [pt["load"]["max_concurrency"] for pt in points] == [1, 4]
    assert all(pt["completed"] == 8 and pt["total_output_tokens"] == 32 for pt in points)
    rows = [line for line in p.stdout.splitlines() if line.startswith("rate inf, conc ")]
    assert len(rows) == 2
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_bench_replays_a_jsonl_dataset_on_the_chat_route_unstreamed(tiny_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(orjson.dumps({"prompt": "Tell me about Paris.", "max_tokens": 3}) + b"\n\n"
                     + orjson.dumps({"messages": [{"role": "user", "content": "Hi there"}]}) + b"\n")
    result = tmp_path / "chat.json"
    p = bench(tiny_server.url, "--dataset-path", str(data), "--num-prompts", "6", "--random-output-len", "5",
              "--endpoint-type", "chat", "--no-stream", "--ignore-eos", "--request-rate", "50",
              "--result-file", str(result))
    assert p.returncode == 0, p.stderr
    [point] = orjson.loads(result.read_bytes())["results"]
    assert point["completed"] == 6
    assert point["total_output_tokens"] == 3 * 3 + 3 * 5  # each line's max_tokens, else --random-output-len
    assert point["total_input_tokens"] > 0  # from the server's usage
    assert point["ttft_ms"]["p50"] is None and point["e2el_ms"]["p50"] > 0  # no stream, no TTFT


def test_bench_unreachable_url_exits_2_with_one_clear_line():
    url = f"http://127.0.0.1:{free_port()}"
    p = bench(url, "--num-prompts", "4", timeout=30)
    assert p.returncode == 2
    assert p.stdout == ""
    [line] = p.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot reach {url}")


def test_bench_counts_server_errors_and_exits_1_when_every_request_fails(tiny_server, tmp_path):
    result = tmp_path / "fail.json"
    p = bench(tiny_server.url, "--model", "no-such-model", "--num-prompts", "6", "--random-input-len", "8",
              "--random-output-len", "4", "--result-file", str(result))
    assert p.returncode == 1, p.stdout + p.stderr
    [point] = orjson.loads(result.read_bytes())["results"]
    assert (point["completed"], point["failed"]) == (0, 6)
    [error] = point["errors"]
    assert error["count"] == 6 and error["message"].startswith("HTTP 404") and "no-such-model" in error["message"]
    assert "HTTP 404" in p.stdout


# -- the parts that need no server -----------------------------------------------------------------------

def test_goodput_slos_parse_as_vllm_writes_them():
    assert parse_slos(("ttft:500 e2el:2000",)) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_slos(("ttft:500", "tpot:50,e2el:1e3")) == {"ttft": 500.0, "tpot": 50.0, "e2el": 1000.0}
    for bad in ("ttft", "itl:5", "ttft:fast", "e2el:-1"):
        with pytest.raises(ValueError):
            parse_slos((bad,))


def test_lengths_stay_in_the_range_ratio_and_infinity_is_written_as_a_string():
    from launch.bench.load import sample_lengths

    lengths = sample_lengths(random.Random(1), 500, 100, 0.25)
    assert min(lengths) >= 75 and max(lengths) <= 125 and len(set(lengths)) > 10
    assert sample_lengths(random.Random(1), 5, 7, 0.0) == [7] * 5
    assert _jsonable({"r": [math.inf, 1.0]}) == {"r": ["inf", 1.0]}


def test_plot_without_matplotlib_names_the_install_command_of_this_checkout(monkeypatch):
    """Without matplotlib, --plot is a usage error that names this venv's pip and the bench extra (zserve is not on
    PyPI: 'pip install zserve[bench]' installed nothing)."""
    from click.testing import CliRunner

    from launch.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    result = CliRunner().invoke(main, ["bench", "--base-url", "http://127.0.0.1:9", "--plot", "p.png"])
    assert result.exit_code == 2, result.output
    assert f"{Path(sys.executable).with_name('pip')} install -e '.[bench]'" in result.output
