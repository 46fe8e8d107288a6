"""`launch bench` against the shared tiny-random server: metrics, exact token counts, the plot, sweeps,
a dataset on the chat route, and how an unreachable or failing server is reported (exit codes 2 and 1)."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import zlib
from collections import Counter
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


def test_bench_prefix_repetition_reports_the_cached_prompt_tokens_of_token_exact_shared_prefixes(tiny_server,
                                                                                                   tmp_path):
    result = tmp_path / "prefix.json"
    p = bench(tiny_server.url, "--dataset-name", "prefix_repetition", "--num-prompts", "12",
              "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8",
              "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-output-len", "4", "--ignore-eos",
              "--max-concurrency", "2", "--result-file", str(result), "--save-detailed")
    assert p.returncode == 0, p.stderr
    [point] = orjson.loads(result.read_bytes())["results"]
    assert (point["completed"], point["total_input_tokens"], point["total_output_tokens"]) == (12, 12 * 72, 12 * 4)
    assert Counter(r["group"] for r in point["requests"]) == {0: 4, 1: 4, 2: 4}
    # the prefix cache served the shared prefixes (whole KV blocks of them) to all but the first of each
    assert 0 < point["cached_prompt_tokens"] <= 9 * 64
    assert point["cached_prompt_share"] == point["cached_prompt_tokens"] / (12 * 72)
    # one engine: when the server names it, every prefix stayed on it
    agreement = point["engine_agreement"]
    assert agreement is None or agreement == {"share": 1.0, "groups": 3, "requests": 12}
    assert "cached prompt tok" in p.stdout and "prefix repetition: 3 prefixes of 64 tokens" in p.stdout


def test_bench_multi_turn_conversations_grow_their_prompts_and_hit_the_cache(tiny_server, tmp_path):
    result = tmp_path / "turns.json"
    p = bench(tiny_server.url, "--dataset-name", "multi_turn", "--multi-turn-conversations", "3",
              "--multi-turn-turns", "3", "--multi-turn-user-len", "24", "--multi-turn-output-len", "4",
              "--ignore-eos", "--result-file", str(result), "--save-detailed")
    assert p.returncode == 0, p.stderr
    [point] = orjson.loads(result.read_bytes())["results"]
    assert (point["num_prompts"], point["completed"], point["total_output_tokens"]) == (9, 9, 9 * 4)
    for conv in range(3):
        turns = point["requests"][conv * 3:conv * 3 + 3]
        assert [r["group"] for r in turns] == [conv] * 3
        # each turn carries the last one's prompt, its answer and a new 24-token question (and template tokens)
        assert turns[0]["input_tokens"] > 24
        assert all(b["input_tokens"] > a["input_tokens"] + 4 + 24 for a, b in zip(turns, turns[1:]))
    assert point["cached_prompt_tokens"] > 0  # later turns find the earlier ones in the prefix cache
    assert "multi-turn: 3 conversations of 3 turns" in p.stdout and ", chat, streaming, 9 requests" in p.stdout


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


# -- the shared-prefix workloads and their report, against an in-process fake server -------------------------

class FakeServer:
    """An OpenAI-shaped app whose tokenizer counts words (so lengths are checkable by eye): /tokenize and
    /detokenize, and a streamed /v1/chat/completions that answers "answer N" (after a role-only chunk), reports
    ``cached`` prompt tokens and names an engine per conversation (by its first user turn), as zserve's
    X-Zserve-Engine does."""

    def __init__(self, engine_header: bool = True, fail_on: int | None = None):
        self.vocab: dict[str, int] = {}
        self.chats: list[list[dict]] = []  # the messages of every chat request, in arrival order
        self.in_flight: dict[str, int] = {}  # per conversation (first user turn)
        self.overlapped = False
        self.engine_header, self.fail_on = engine_header, fail_on

    def app(self):
        from aiohttp import web

        async def tokenize(request):
            body = await request.json()
            return web.json_response({"tokens": [self.vocab.setdefault(w, len(self.vocab))
                                                 for w in body["prompt"].split()]})

        async def detokenize(request):
            words = {i: w for w, i in self.vocab.items()}
            return web.json_response({"prompt": " ".join(words[i] for i in (await request.json())["tokens"])})

        async def chat(request):
            import asyncio

            body = await request.json()
            n = len(self.chats)
            self.chats.append(body["messages"])
            key = body["messages"][0]["content"]
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.overlapped |= self.in_flight[key] > 1
            try:
                if n == self.fail_on:
                    return web.json_response({"error": {"message": "boom"}}, status=500)
                engine = str(zlib.crc32(key.encode()) % 2)
                headers = {"X-Zserve-Engine": engine} if self.engine_header else {}
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
                await resp.prepare(request)
                # the role first, before the model ran (zserve's chat stream does): no first token yet
                role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                await resp.write(b"data: " + orjson.dumps(role) + b"\n\n")
                for piece in ("answer", f" {n}"):
                    await asyncio.sleep(0.02)
                    chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
                    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                prompt = sum(len(m["content"].split()) for m in body["messages"])
                usage = {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2,
                         "prompt_tokens_details": {"cached_tokens": prompt // 2}}
                await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
                return resp
            finally:
                self.in_flight[key] -= 1

        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/detokenize", detokenize)
        app.router.add_post("/v1/chat/completions", chat)
        return app

    def run(self, work):
        """``await work(session, target)`` with the app served on a free port."""
        import asyncio

        import aiohttp
        from aiohttp import web

        from launch.bench.load import Target

        async def main():
            runner = web.AppRunner(self.app())
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                async with aiohttp.ClientSession() as session:
                    return await work(session, Target(base_url=f"http://127.0.0.1:{port}", model="fake"))
            finally:
                await runner.cleanup()

        return asyncio.run(main())


def test_prefix_repetition_spreads_shuffled_prompts_evenly_over_shared_token_exact_prefixes():
    from launch.bench.load import PromptMaker
    from launch.bench.workloads import prefix_repetition

    async def work(session, target):
        maker = PromptMaker(session, target, random.Random(3))
        specs = await prefix_repetition(maker, random.Random(3), 11, prefix_len=12, suffix_len=5, num_prefixes=3,
                                        output_len=7)
        return maker.exact, specs

    exact, specs = FakeServer().run(work)
    assert exact
    assert len(specs) == 11
    assert sorted(Counter(s.group for s in specs).values()) == [3, 4, 4]  # 11 over 3: as even as can be
    assert all(len(s.prompt.split()) == s.prompt_len == 17 and s.max_tokens == 7 for s in specs)
    prefixes = {g: {" ".join(s.prompt.split()[:12]) for s in specs if s.group == g} for g in range(3)}
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group ...
    assert len({p for ps in prefixes.values() for p in ps}) == 3  # ... and a different one for each
    assert len({" ".join(s.prompt.split()[12:]) for s in specs}) == 11  # every suffix its own
    assert [s.group for s in specs] != sorted(s.group for s in specs)  # shuffled


def test_prefix_repetition_without_a_tokenizer_approximates_by_words():
    from launch.bench.load import PromptMaker
    from launch.bench.workloads import prefix_repetition

    async def work(session, target):
        target.base_url = f"http://127.0.0.1:{free_port()}"  # nothing there: /tokenize fails
        maker = PromptMaker(session, target, random.Random(1))
        return maker, await prefix_repetition(maker, random.Random(1), 4, 6, 2, 2, 3)

    maker, specs = FakeServer().run(work)
    assert maker.exact is False
    assert all(len(s.prompt.split()) == 8 for s in specs)
    assert len({" ".join(s.prompt.split()[:6]) for s in specs}) == 2


def test_multi_turn_sends_each_turn_with_the_whole_history_and_the_real_answers():
    from launch.bench.load import PromptMaker, drive_conversations
    from launch.bench.report import summarize
    from launch.bench.workloads import multi_turn

    server = FakeServer()

    async def work(session, target):
        convs = await multi_turn(PromptMaker(session, target, random.Random(5)), 3, turns=3, user_len=9,
                                 output_len=4)
        records, duration = await drive_conversations(session, target, convs, math.inf, None, random.Random(5),
                                                      lambda rec: None)
        return convs, records, duration

    convs, records, duration = server.run(work)
    assert [len(c.turns) for c in convs] == [3, 3, 3] and all(len(t.split()) == 9 for c in convs for t in c.turns)
    assert len(server.chats) == 9 and all(r.ok for r in records)
    assert not server.overlapped  # the turns of one conversation one after another
    assert len({m[0]["content"] for m in server.chats[:3]}) == 3  # the conversations at once: 3 first turns first
    for conv, recs in zip(convs, (records[0:3], records[3:6], records[6:9])):
        assert [r.group for r in recs] == [conv.group] * 3
        sent = [m for m in server.chats if m[0]["content"] == conv.turns[0]]
        assert [len(m) for m in sent] == [1, 3, 5]  # the history grows by a question and its answer a turn
        last = sent[-1]
        assert [m["content"] for m in last if m["role"] == "user"] == conv.turns
        # the assistant turns are the model's own answers to the earlier turns
        assert [m["content"] for m in last if m["role"] == "assistant"] == [r.output_text for r in recs[:2]]
        assert all(r.output_text.startswith("answer ") for r in recs)
    # TTFT at the first chunk with content, not the role-only one before it; one gap to the second piece
    assert all(r.ttft >= 0.02 and len(r.itl) == 1 for r in records)
    point = summarize(records, duration, {"request_rate": math.inf, "max_concurrency": None}, {})
    assert point["cached_prompt_tokens"] == sum(r.input_tokens // 2 for r in records) > 0
    assert point["cached_prompt_share"] == point["cached_prompt_tokens"] / point["total_input_tokens"]
    # the fake names one engine per conversation: each stayed on it
    assert point["engine_agreement"] == {"share": 1.0, "groups": 3, "requests": 9}
    assert sum(point["engine_requests"].values()) == 9


def test_a_failed_turn_ends_its_conversation_and_its_unsent_turns_count_as_failed():
    from launch.bench.load import Conversation, drive_conversations

    server = FakeServer(engine_header=False, fail_on=1)

    async def work(session, target):
        convs = [Conversation(turns=["a b", "c d", "e f"], max_tokens=2, group=0)]
        return await drive_conversations(session, target, convs, math.inf, 1, random.Random(0), lambda rec: None)

    records, _ = server.run(work)
    assert [r.ok for r in records] == [True, False, False]
    assert records[1].error.startswith("HTTP 500") and "earlier turn" in records[2].error
    assert len(server.chats) == 2
    assert records[0].engine is None  # no header: no engine


def test_engine_agreement_is_the_top_engines_share_per_group_weighted_by_requests():
    from launch.bench.load import RequestRecord
    from launch.bench.report import engine_agreement

    def rec(group, engine, ok=True):
        return RequestRecord(index=0, ok=ok, group=group, engine=engine)

    # group 0: 3 of 4 on engine 0; group 1: 1 of 2 (a tie); the failed and the unnamed do not count
    records = [rec(0, "0"), rec(0, "0"), rec(0, "1"), rec(0, "0"), rec(1, "0"), rec(1, "1"), rec(1, "1", ok=False),
               rec(2, None), rec(None, "1")]
    assert engine_agreement(records) == {"share": (3 + 1) / 6, "groups": 2, "requests": 6}
    assert engine_agreement([rec(0, None), rec(None, "0")]) is None
