"""``launch bench``: drive a running OpenAI-compatible server with a workload and report its latencies.

Like ``vllm bench serve``: the operator picks a workload (random prompts of given token lengths, a JSONL
dataset, prompts repeating a few shared prefixes, or multi-turn conversations), a load (Poisson request
rate and/or a concurrency cap, or a sweep of either) and gets throughput, TTFT, ITL, TPOT, end-to-end
latency and goodput per load point, with the prompt tokens the prefix cache served and how well each
prefix stayed on one engine, as a table, a JSON result and a plot. Load and timing live in ``load``, the
shared-prefix workloads in ``workloads``, metrics and output in ``report``; this module runs the load
points in order and decides the exit code (2: unreachable, 1: every request failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
import random
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from . import report, workloads
from .load import (
    Conversation,
    Progress,
    PromptMaker,
    RequestSpec,
    Target,
    Unreachable,
    drive,
    drive_conversations,
    first_model,
    load_dataset,
    normalize_base_url,
    sample_lengths,
)

EXIT_ALL_FAILED = 1
EXIT_UNREACHABLE = 2


@dataclasses.dataclass
class BenchConfig:
    """Everything one ``launch bench`` run needs (and what its result file records as "config")."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    lora_modules: tuple[str, ...] = ()  # each request asks for one of these instead of ``model``
    endpoint_type: str = "completions"
    api_key: str | None = dataclasses.field(default=None, repr=False)
    num_prompts: int = 200
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    dataset_path: Path | None = None
    dataset_name: str = "random"  # or "prefix_repetition", "multi_turn"; "random" with dataset_path: the file
    prefix_repetition_prefix_len: int = 256  # vLLM's defaults
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    multi_turn_conversations: int = 16
    multi_turn_turns: int = 4
    multi_turn_user_len: int = 128
    multi_turn_output_len: int = 64
    request_rate: float = math.inf
    max_concurrency: int | None = None
    sweep_rates: tuple[float, ...] = ()
    sweep_concurrency: tuple[int, ...] = ()
    stream: bool = True
    temperature: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    goodput: dict[str, float] = dataclasses.field(default_factory=dict)
    timeout: float = 600.0
    result_file: Path | None = None
    save_detailed: bool = False
    plot: Path | None = None
    progress: bool = True

    def load_points(self) -> tuple[str, list[dict[str, Any]]]:
        """The plot's x axis and each load point's {"request_rate", "max_concurrency"}."""
        if self.sweep_rates:
            return "request_rate", [{"request_rate": r, "max_concurrency": self.max_concurrency}
                                    for r in self.sweep_rates]
        if self.sweep_concurrency:
            return "max_concurrency", [{"request_rate": self.request_rate, "max_concurrency": c}
                                       for c in self.sweep_concurrency]
        axis = "max_concurrency" if self.max_concurrency and math.isinf(self.request_rate) else "request_rate"
        return axis, [{"request_rate": self.request_rate, "max_concurrency": self.max_concurrency}]

    def to_json(self) -> dict[str, Any]:
        cfg = {k: v for k, v in dataclasses.asdict(self).items() if k != "api_key"}
        return {k: str(v) if isinstance(v, Path) else v for k, v in cfg.items()}


def run(cfg: BenchConfig) -> int:
    """Run every load point, print the table, write the result and plot; the exit code."""
    try:
        return asyncio.run(_run(cfg))
    except Unreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE


async def _run(cfg: BenchConfig) -> int:
    base_url = normalize_base_url(cfg.base_url)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=cfg.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        target = Target(base_url=base_url, model=cfg.model or "", endpoint_type=cfg.endpoint_type,
                        api_key=cfg.api_key, stream=cfg.stream, temperature=cfg.temperature,
                        ignore_eos=cfg.ignore_eos, timeout=cfg.timeout)
        listed = await first_model(session, base_url, target.headers)  # also: is anyone there?
        if not target.model:
            if listed is None:
                raise Unreachable(f"{base_url}/v1/models listed no model; give --model")
            target.model = listed
        rng = random.Random(cfg.seed)
        axis, loads = cfg.load_points()
        points, how = [], ""
        for n, load in enumerate(loads, 1):
            work, how = await _workload(cfg, session, target, rng)
            conversations = work if work and isinstance(work[0], Conversation) else None
            total = sum(len(c.turns) for c in conversations) if conversations else len(work)
            label = f"[{n}/{len(loads)}] {report.load_label(load)}"
            progress = Progress(total, label, enabled=cfg.progress)
            try:
                if conversations:
                    records, duration = await drive_conversations(session, target, conversations,
                                                                  load["request_rate"], load["max_concurrency"],
                                                                  rng, progress.update)
                else:
                    records, duration = await drive(session, target, work, load["request_rate"],
                                                    load["max_concurrency"], rng, progress.update)
            finally:
                progress.close()
            points.append(report.summarize(records, duration, load, cfg.goodput, cfg.save_detailed))
    route = "chat" if cfg.dataset_name == "multi_turn" else cfg.endpoint_type
    print(f"launch bench: {target.model} at {base_url}, {route}, "
          f"{'streaming' if cfg.stream else 'not streaming'}, {total} requests per point ({how})")
    print(report.table(points))
    if cfg.result_file:
        result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "model": target.model,
                  "config": cfg.to_json(), "results": points}
        cfg.result_file.write_bytes(orjson.dumps(_jsonable(result), option=orjson.OPT_INDENT_2))
        print(f"result: {cfg.result_file}")
    if cfg.plot:
        report.plot(points, cfg.plot, axis)
        print(f"plot: {cfg.plot}")
    return 0 if any(p["completed"] for p in points) else EXIT_ALL_FAILED


async def _workload(cfg: BenchConfig, session: aiohttp.ClientSession, target: Target,
                    rng: random.Random) -> tuple[list[RequestSpec] | list[Conversation], str]:
    """A fresh workload per load point (so a prefix cache cannot serve one point from the last) and how its
    prompt lengths were made: requests, or conversations for multi_turn."""
    maker = PromptMaker(session, target, rng)
    if cfg.dataset_name == "prefix_repetition":
        specs = await workloads.prefix_repetition(
            maker, rng, cfg.num_prompts, cfg.prefix_repetition_prefix_len, cfg.prefix_repetition_suffix_len,
            cfg.prefix_repetition_num_prefixes, cfg.prefix_repetition_output_len)
        how = f"prefix repetition: {cfg.prefix_repetition_num_prefixes} prefixes of " \
              f"{cfg.prefix_repetition_prefix_len} tokens, suffixes of {cfg.prefix_repetition_suffix_len}, " \
              f"output {cfg.prefix_repetition_output_len} tokens; prompt lengths {_counted(maker)}"
    elif cfg.dataset_name == "multi_turn":
        convs = await workloads.multi_turn(maker, cfg.multi_turn_conversations, cfg.multi_turn_turns,
                                           cfg.multi_turn_user_len, cfg.multi_turn_output_len)
        return convs, f"multi-turn: {cfg.multi_turn_conversations} conversations of {cfg.multi_turn_turns} turns, " \
                      f"{cfg.multi_turn_user_len} tokens per user turn, answers of up to " \
                      f"{cfg.multi_turn_output_len}; user turns {_counted(maker)}"
    elif cfg.dataset_path is not None:
        specs = load_dataset(cfg.dataset_path, cfg.num_prompts, cfg.random_output_len)
        how = f"from {cfg.dataset_path}"
    else:
        inputs = sample_lengths(rng, cfg.num_prompts, cfg.random_input_len, cfg.random_range_ratio)
        outputs = sample_lengths(rng, cfg.num_prompts, cfg.random_output_len, cfg.random_range_ratio)
        specs = await maker.make(inputs, outputs)
        how = f"random: input {cfg.random_input_len}, output {cfg.random_output_len} tokens, " \
              f"range ratio {cfg.random_range_ratio}; prompt lengths {_counted(maker)}"
    if cfg.lora_modules:
        for spec in specs:
            spec.model = rng.choice(cfg.lora_modules)
        how += f"; each through one of {len(cfg.lora_modules)} LoRA adapters"
    return specs, how


def _counted(maker: PromptMaker) -> str:
    return "counted by the server's /tokenize" if maker.exact else "approximated by words"


def _jsonable(x: Any) -> Any:
    """JSON has no infinity: an unbounded request rate is written as the string "inf"."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x
