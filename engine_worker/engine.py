"""An engine: one model's runner, scheduler and announced identity, assembled from one ``EngineLaunch``, and the
loop that serves them.

``Engine.build`` chooses the kind from the launch value and the model's files — an encoder pools (no KV cache, no
sampler), any other model generates, in an expert-parallel group when the launch carries a share of the experts —
loads the model and assembles runner, scheduler and ``EngineHello``. ``Engine.generation`` and ``Engine.pooling``
assemble from parts a caller already has (tests and benchmarks build their engines through them). ``Engine.serve``
binds the server the kind needs (``server.EngineServer`` or ``ep_server.GroupedEngineServer``), tells the
supervisor it is ready and steps until drained. ``python -m engine_worker`` is ``main()``: parse, build, serve.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch

from protocol import EngineHello
from protocol.control import Heartbeat, Ready
from protocol.messages import MODEL_TASKS
from zserve.catalog import ModelSource
from zserve.config import EngineConfig
from zserve.curve import BindError, CurveKeys
from zserve.heap import settle
from zserve.launch_spec import ChildPipes, EngineLaunch, parse_child_argv
from zserve.proc import (
    StatusPipe,
    boot_phase,
    die_with_parent,
    exit_now,
    ignore_terminal_signals,
    set_title,
    setup_logging,
)

from .device import configure_cpu_threads, parse_memory, resolve_dtype, select_device
from .grammar import Grammars, tokenizer_json_loader
from .loader import LoadedModel, load_model
from .runner import ModelRunner
from .scheduler import Scheduler
from .server import EngineServer

# Windows a speech engine decodes in one step at most: on a CPU batching gives little per window (whisper-base on 2
# cores: 0.76 s a window in a batch of 8, 0.92 s alone), and a bigger step delays every window in it.
SPEECH_MAX_BATCH = 16

log = logging.getLogger("zserve.engine")


@dataclass
class Engine:
    """An assembled engine. ``runner`` and ``scheduler`` are a ``ModelRunner`` and ``Scheduler`` (generation) or a
    ``PoolingRunner`` and ``PoolingScheduler`` (an encoder); ``grammars`` compiles structured output (generation)."""

    runner: Any
    scheduler: Any
    hello: EngineHello
    grammars: Grammars | None = None
    expert_parallel: bool = False  # one member of an expert-parallel group (steps with the group)
    started: float | None = None  # when loading began (time.monotonic), for the ready line

    # -- assembling ----------------------------------------------------------------------------------
    @classmethod
    def build(cls, launch: EngineLaunch, status: StatusPipe | None = None) -> Engine:
        """Load ``launch.source`` on the device it names and assemble the engine its kind needs. A model that
        cannot load or a KV cache too small for one request can never start: a boot error (EXIT_BOOT_ERROR, which
        the supervisor treats as fatal at once instead of reloading in a loop)."""
        status = status or StatusPipe(None)
        cfg, source = launch.config, launch.source
        device = select_device(launch.device)
        dtype = resolve_dtype(cfg.dtype, device)
        if device.type == "cpu":
            configure_cpu_threads(cfg.threads)
        started = time.monotonic()
        if source.weights == "ct2-whisper":
            with boot_phase(status, f"engine {launch.rank}"):
                engine = cls.speech(source, device, cfg, rank=launch.rank)
            engine.started = started
            return engine
        if source.weights == "hf":
            from .pooling import is_pooling_model

            if is_pooling_model(source.path):
                with boot_phase(status, f"engine {launch.rank}"):
                    engine = cls.pooling(source, device, dtype, cfg, rank=launch.rank)
                engine.started = started
                return engine
        if launch.loras is not None:
            cfg = cfg.replace(lora_modules=())  # the cluster's adapters, loaded below, replace the configuration's
        with boot_phase(status, f"engine {launch.rank}"):
            loaded = load_model(source, dtype, device, progress=_progress, expert_share=launch.expert_share,
                                quantization=cfg.quantization)
            engine = cls.generation(loaded, device, dtype, cfg, rank=launch.rank,
                                    tokenizer_json=tokenizer_json_loader(source.tokenizer_path),
                                    expert_parallel=launch.expert_share is not None)
        for name, path in launch.loras or ():
            error = engine.scheduler.load_lora(name, path)
            if error is not None:  # (reported in its LoraReport: its requests go to the engines that have it)
                log.warning("engine %d could not load LoRA adapter %r the cluster serves: %s", launch.rank, name,
                            error)
        engine.started = started
        return engine

    @classmethod
    def generation(cls, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                   config: EngineConfig | None = None, *, rank: int = 0,
                   tokenizer_json: Callable[[], str] | None = None, expert_parallel: bool = False,
                   **runner_options: Any) -> Engine:
        """A generating engine for a loaded model: a paged KV cache sized by ``config``, a continuous-batching
        scheduler, and (with ``tokenizer_json``, the model's ``tokenizers`` JSON) structured output.
        ``runner_options``: ``ModelRunner`` keywords that replace what ``config`` chooses (``num_blocks``,
        ``attention``, ``cuda_graphs``: tests and benchmarks). With ``enable_lora``, the configuration's
        ``lora_modules`` are loaded before it returns: a bad adapter is a ``LoraError`` (a ``ValueError``, so a boot
        error in ``build``) that names it."""
        cfg = config or EngineConfig()
        own = loaded.config.max_position_embeddings
        options: dict[str, Any] = {
            "block_size": cfg.block_size,
            "kv_cache_bytes": parse_memory(cfg.kv_cache_memory, device) if cfg.kv_cache_memory is not None else None,
            "cuda_graphs": False if cfg.enforce_eager else None, "expert_parallel": expert_parallel,
            "fit_context": cfg.max_model_len is None, "max_loras": cfg.max_loras if cfg.enable_lora else 0,
            "max_lora_rank": cfg.max_lora_rank, "max_cpu_loras": cfg.max_cpu_loras, **runner_options}
        runner = ModelRunner(loaded, device, dtype, cfg.max_num_seqs,
                             own if cfg.max_model_len is None else min(cfg.max_model_len, own), **options)
        max_model_len = runner.max_model_len
        if cfg.seed is not None:
            runner.sampler.seed_shared(cfg.seed + rank)
        log.info("engine %d KV cache: %d blocks of %d tokens (%.0f MiB), prefix caching %s; context %d tokens (%s)",
                 rank, runner.num_blocks, runner.block_size, runner.kv_cache_bytes / (1 << 20),
                 "on" if cfg.enable_prefix_caching else "off", max_model_len,
                 _context_origin(cfg.max_model_len, own, max_model_len))
        if runner.loras is not None:
            for name, path in cfg.lora_modules:
                runner.loras.load(name, path)
            log.info("engine %d LoRA: %d adapter(s) of rank <= %d, %d per step, %d kept in host memory%s", rank,
                     len(cfg.lora_modules), runner.loras.max_lora_rank, runner.loras.max_loras,
                     runner.loras.max_cpu_loras, f" ({', '.join(runner.loras.names())})" if cfg.lora_modules else "")
        grammars = (Grammars(tokenizer_json, runner.vocab_size, runner.eos_token_ids)
                    if tokenizer_json is not None else None)
        scheduler = Scheduler(runner, cfg.max_num_seqs, max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
                              enable_prefix_caching=cfg.enable_prefix_caching, grammars=grammars,
                              loras=runner.loras, fair=cfg.scheduling == "fair")
        hello = EngineHello(
            rank=rank,
            model_id=loaded.model_id,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            vocab_size=runner.vocab_size,
            eos_token_ids=tuple(runner.eos_token_ids),
            pid=os.getpid(),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            tasks=("generate", "embed"),  # embeddings by last-token pooling (Scheduler.add_pool)
            embed_size=loaded.config.hidden_size,
        )
        return cls(runner, scheduler, hello, grammars, expert_parallel)

    @classmethod
    def pooling(cls, source: ModelSource, device: torch.device, dtype: torch.dtype,
                config: EngineConfig | None = None, *, rank: int = 0) -> Engine:
        """An engine for an encoder (embed / classify): no KV cache, no sampler, batches of whole inputs. Its step
        budget is at least 4096 tokens: one forward pass per step, however many inputs fill it."""
        from .pooling import PoolingRunner
        from .pooling_scheduler import PoolingScheduler

        cfg = config or EngineConfig()
        budget = max(cfg.max_num_batched_tokens, 4096)
        runner = PoolingRunner(source.path, device, dtype, max_batch_tokens=budget)
        scheduler = PoolingScheduler(runner, max(cfg.max_num_seqs, 256), budget)
        model_config = orjson.loads((Path(source.path) / "config.json").read_bytes())
        embeds = "embed" in runner.tasks
        hello = EngineHello(
            rank=rank, model_id=source.model_id, max_num_seqs=scheduler.max_num_seqs,
            max_model_len=runner.max_model_len if cfg.max_model_len is None else min(cfg.max_model_len,
                                                                                      runner.max_model_len),
            vocab_size=runner.vocab_size, eos_token_ids=(),
            pid=os.getpid(), device=str(device), dtype=str(dtype).removeprefix("torch."),
            tasks=tuple(t for t in runner.tasks if t in MODEL_TASKS), embed_size=runner.hidden_size if embeds else 0,
            labels=tuple(runner.labels or ()),
            matryoshka=embeds and bool(model_config.get("matryoshka_dimensions")
                                       or model_config.get("is_matryoshka")))
        return cls(runner, scheduler, hello)

    @classmethod
    def speech(cls, source: ModelSource, device: torch.device, config: EngineConfig | None = None, *,
               rank: int = 0) -> Engine:
        """An engine for a Whisper model (transcribe, and translate into English when it is multilingual): no KV
        cache of its own (CTranslate2 keeps the decoder's), batches of 30 s windows of up to
        ``min(--max-num-seqs, SPEECH_MAX_BATCH)`` recordings a step."""
        from .speech import MAX_LENGTH, WhisperRunner
        from .speech_scheduler import SpeechScheduler

        cfg = config or EngineConfig()
        threads = torch.get_num_threads() if device.type == "cpu" else 1
        runner = WhisperRunner(source.path, device, threads)
        scheduler = SpeechScheduler(runner, min(cfg.max_num_seqs, SPEECH_MAX_BATCH))
        log.info("engine %d: Whisper (%s, %s) on CTranslate2 %s, %s; up to %d windows a step", rank,
                 "multilingual" if runner.multilingual else "English only", ", ".join(runner.tasks),
                 runner.compute_type, str(device), scheduler.max_batch)
        hello = EngineHello(
            rank=rank, model_id=source.model_id, max_num_seqs=scheduler.max_batch, max_model_len=MAX_LENGTH,
            vocab_size=runner.vocab_size, eos_token_ids=(runner.special.eot,), pid=os.getpid(), device=str(device),
            dtype=runner.compute_type, tasks=runner.tasks)
        return cls(runner, scheduler, hello)

    # -- serving -------------------------------------------------------------------------------------
    def server(self, launch: EngineLaunch, status: StatusPipe, control_fd: int | None = None,
               keys: CurveKeys | None = None) -> EngineServer:
        """Bind ``launch.endpoint`` with the server this kind of engine needs (``keys``: CURVE on a TCP one)."""
        cfg = launch.config
        if self.expert_parallel:
            from .ep_server import GroupedEngineServer

            return GroupedEngineServer(launch.rank, launch.endpoint, self.runner, self.scheduler, self.hello,
                                       max_waiting=cfg.max_waiting, keys=keys, control_fd=control_fd, status=status,
                                       source=launch.source, weight_version=launch.weight_version,
                                       kv_events=launch.kv_events)
        return EngineServer(launch.rank, launch.endpoint, self.runner, self.scheduler, self.hello,
                            max_waiting=cfg.max_waiting, keys=keys, drain_timeout=launch.shutdown_timeout,
                            control_fd=control_fd, status=status, source=launch.source,
                            weight_version=launch.weight_version, kv_events=launch.kv_events)

    def serve(self, launch: EngineLaunch, status: StatusPipe, control_fd: int | None = None,
              keys: CurveKeys | None = None) -> None:
        """Bind, say ready (log line, SIGTERM drain, heartbeat thread, Ready to the supervisor) and step until
        drained."""
        server = self.server(launch, status, control_fd, keys)
        if self.expert_parallel and self.grammars is not None:
            # Before Ready: a resize pauses admission once its new members are ready, and this half second of
            # work would otherwise land inside that pause.
            self.grammars.prepare().result()
        hello = server.hello
        took = time.monotonic() - self.started if self.started is not None else 0.0
        log.info("engine %d ready: %s (%s) on %s (%s) in %.1fs, endpoint %s", launch.rank, launch.source.model_id,
                 ", ".join(hello.tasks), hello.device, hello.dtype, took, launch.endpoint)
        signal.signal(signal.SIGTERM, server.start_draining)
        threading.Thread(target=_heartbeat, args=(server, status, launch.heartbeat_interval), daemon=True,
                         name="heartbeat").start()
        server.report_loras()  # before Ready: gateways route an adapter's requests only to engines that have it
        status.send(server.ops.condition())  # (its weight version; the supervisor puts it to sleep with its model)
        settle()  # the model and everything built for it live as long as the engine: out of the cycle collector's way
        status.send(Ready(index=launch.rank, endpoint=launch.endpoint, device=hello.device, dtype=hello.dtype))
        if not self.expert_parallel and self.grammars is not None:
            self.grammars.prepare()
        server.serve_forever()
        server.close()

    @classmethod
    def run(cls, launch: EngineLaunch, pipes: ChildPipes | None = None) -> None:
        """Build the engine ``launch`` describes and serve it until drained (an engine process's life)."""
        pipes = pipes or ChildPipes()
        status = StatusPipe(pipes.status_fd)
        with boot_phase(status, f"engine {launch.rank}"):  # keys that cannot be read never will be
            keys = CurveKeys.for_server(launch.keys_dir) if launch.keys_dir else None
        try:
            cls.build(launch, status).serve(launch, status, pipes.control_fd, keys)
        except BindError as e:  # a port another process holds: one line, and the supervisor restarts us with back-off
            log.error("%s", e)
            raise SystemExit(1) from None


def _heartbeat(server: EngineServer, status: StatusPipe, interval: float) -> None:
    """Beat while the step loop is healthy, so a long forward pass is not mistaken for a hang."""
    while True:
        if server.alive():
            f = server.scheduler.stats_fields()
            status.send(Heartbeat(running=f["running"], waiting=f["waiting"], kv_used=round(f["kv_used"], 4),
                                  kv_blocks_cached=f.get("kv_blocks_cached"), draining=server.draining))
        time.sleep(interval)


def _progress(stage: str, done: int, total: int) -> None:
    # One line on start, every 10%, and at the end: readable under systemd as well as a terminal.
    step = max(1, total // 10)
    if done == total or done % step == 0 or done == 1:
        print(f"[engine] {stage}: {done}/{total} ({100 * done // max(1, total)}%)", file=sys.stderr, flush=True)


def _context_origin(asked: int | None, own: int, got: int) -> str:
    """Where an engine's context length came from, for its start-up line."""
    if asked is None:
        return "the model's own" if got == own else f"the model's {own}, lowered to what the KV cache holds"
    return "--max-model-len" if got == asked else f"--max-model-len {asked}, capped to the model's own"


def main(argv: list[str] | None = None) -> None:
    """``python -m engine_worker --launch JSON``: the ``EngineLaunch`` the supervisor built (``launch.handoff``)."""
    launch, pipes = parse_child_argv(argv, "python -m engine_worker", "zserve engine worker (started by `launch`)",
                                     EngineLaunch.from_json)
    die_with_parent(pipes.parent_pid)
    ignore_terminal_signals()
    set_title(f"zserve: engine {launch.rank}")
    setup_logging(f"engine {launch.rank}")
    Engine.run(launch, pipes)
    exit_now(0)
