"""The ``launch`` command line.

``launch api-server`` starts and supervises both tiers; ``launch render`` the gateways alone (a
CPU-only server that renders requests and never generates), through the same ``serve``.
``launch scale``, ``launch status`` and ``launch stop`` talk to a running supervisor over its
owner-only control socket. ``launch bench`` measures any running OpenAI-compatible server (launch/bench/).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import NoReturn, TypeVar

import click

from gateway.config import MAX_AUDIO_MB, MAX_AUDIO_SECONDS, GatewayConfig
from gateway.routing import ROUTING_POLICIES
from gateway.security import ADMIN_KEY_ENV, API_KEY_ENV
from gateway.text.reasoning import REASONING_PARSERS
from gateway.text.tool_parsers import TOOL_PARSERS
from protocol import ProtocolError
from protocol.control import (
    ControlMessage,
    ErrorReply,
    ReloadCommand,
    ReloadReply,
    ScaleCommand,
    ScaleReply,
    StatusCommand,
    StatusReply,
    StopCommand,
    StopReply,
)
from zserve import control
from zserve.catalog import DEFAULT_CHAT_MODEL, ModelNotFound, ModelSource, pools_only, resolve
from zserve.config import (
    DTYPES,
    MAX_ENGINES_PER_MODEL,
    QUANTIZATIONS,
    SCHEDULING,
    EngineConfig,
    ModelSpec,
    parse_lora_module,
)
from zserve.proc import SECRET_OPTIONS, redact_option, set_title, setup_logging
from zserve.tenants import BURST_SECONDS

from .children import restart_backoff
from .sockets import ListenError
from .supervisor import EXIT_SUPERVISOR_FAILED, ServeConfig, StartupError, Supervisor

T = TypeVar("T")
R = TypeVar("R", bound=ControlMessage)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """zserve: serve language models over OpenAI-compatible HTTP."""


_ENGINE = EngineConfig()  # the defaults shown in --help come from the configuration itself
_GATEWAY = GatewayConfig()
CRASH_LOOP_HELP = ("A model whose engines are all crash-looping is marked failed (its requests get 503, /health "
                   "says degraded) and the other models serve on; the server stops only once every model failed. "
                   "With this, it stops at the first failed model (exit code 1), for an orchestrator that restarts "
                   "the pod.")


def _options(*options):
    """Apply click options in the order written (the order --help shows them in)."""
    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f
    return apply


# What every serving command takes: where to listen, how many gateways, the supervisor's timeouts, and the
# options that change how a request is checked and rendered. Options named after a field of
# zserve.config.EngineConfig or gateway.config.GatewayConfig fill that field (--max-model-len fills both).
server_options = _options(
    click.option("--count", type=click.IntRange(1, 256), default=1, show_default=True,
                 help="Gateway (HTTP) processes."),
    click.option("--model", "models", multiple=True, default=(DEFAULT_CHAT_MODEL,), show_default=True,
                 help="Model id from the catalog, 'tiny-random', a .gguf file or an HF directory; repeat it to serve "
                      "several models behind one endpoint, each with its own engines and options: "
                      "ID:engines=2,max_num_seqs=64,name=NAME,lora=NAME=PATH (keys: engines, name, lora and the "
                      "engine options' names)."),
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address the gateways listen on; an IPv6 address works too (::1; :: for every interface)."),
    click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
                 help="Port the gateways listen on; 0 picks a free port (the ready line says which)."),
    click.option("--uds", default=None, metavar="PATH",
                 help="Serve on a Unix socket at PATH instead of --host/--port (mode 0660, removed on exit; every "
                      "gateway serves it), for a proxy on the same host such as nginx or HAProxy."),
    click.option("--ready-timeout", type=click.FloatRange(1, 86400), default=600, show_default=True,
                 help="Seconds a process may take to become ready."),
    click.option("--shutdown-timeout", type=click.FloatRange(0, 3600), default=30, show_default=True,
                 help="Seconds in-flight requests may take to finish when a process drains: on SIGTERM, "
                      "scale-down or a rolling restart."),
    click.option("--heartbeat-timeout", type=click.FloatRange(0.5, 3600), default=30, show_default=True,
                 help="A process silent for this long is hung and gets replaced."),
    click.option("--exit-on-crash-loop", is_flag=True,
                 help=CRASH_LOOP_HELP),
    click.option("--lora-dir", "lora_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
                 help="The only directories LoRA adapters may be loaded from while serving (POST "
                      "/v1/load_lora_adapter, POST /adapters; symlinks and .. resolved first). Several after one "
                      "--lora-dir, or repeated. Without it, adapters are given only at start (--lora-modules)."),
    click.option("--profiler-dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
                 help="Where each engine writes its torch profiler trace (a Chrome trace, named by engine and time) "
                      "between POST /start_profile and POST /stop_profile. Without it, profiling is off."),
    click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                 show_default=True, help="Log level of the supervisor and of every process it starts (on stderr)."),
    click.option("--max-model-len", type=int, default=_ENGINE.max_model_len,
                 help="Context length (prompt + output) per sequence. Default: the model's own, lowered to what "
                      "the KV cache holds (the engine's start-up line says which); a given value is capped to the "
                      "model's own, and a render server checks requests against it as given."),
    click.option("--served-model-name", "served_model_names", multiple=True,
                 help="Name(s) clients use for the model (default: the model id); with several --model, give "
                      "each model its names as ID:name=NAME."),
    click.option("--tool-call-parser", default=_GATEWAY.tool_call_parser,
                 help=f"Turn model output into tool calls: {TOOL_PARSERS.names()}. Without it, requests "
                      "with tools are refused."),
    # -- who may call it (gateway.security; keys never reach a child's command line or a log) ------------
    click.option("--api-key", "api_keys", multiple=True, envvar=API_KEY_ENV, metavar="KEY",
                 help="Require this key (Authorization: Bearer KEY, or x-api-key) on every route but /health, "
                      "/ping and the readiness probes /ready and /readyz. Repeatable; also ZSERVE_API_KEY (keys "
                      "separated by spaces)."),
    click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="A file of API keys, one per line (# comments)."),
    click.option("--admin-key", "admin_keys", multiple=True, envvar=ADMIN_KEY_ENV, metavar="KEY",
                 help="The key of admin routes (/pause, /resume); API keys are refused there. Also ZSERVE_ADMIN_KEY."),
    click.option("--tenants", "tenants", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                 help="A tenants file (TOML, docs/tenants.md): each tenant's keys (SHA-256 digests: `launch keys "
                      "hash`), requests and tokens per minute, concurrent requests, scheduling weight and priority, "
                      "models, admin. Limits hold across every gateway of the host, and of every host sharing "
                      "--state-url redis://. Read again on SIGHUP and `launch reload`."),
    click.option("--metrics-auth/--no-metrics-auth", default=_GATEWAY.metrics_auth, show_default=True,
                 help="With API keys, /metrics needs one too (default: open to scrapers)."),
    click.option("--allowed-origins", callback=lambda c, p, v: _names(v), default=None,
                 help="CORS: origins allowed to call the API from a browser, comma-separated or a JSON list "
                      "('*' for any). Default: none."),
    click.option("--allowed-methods", callback=lambda c, p, v: _names(v, ("*",)), default=None,
                 help="CORS: allowed methods (default: any)."),
    click.option("--allowed-headers", callback=lambda c, p, v: _names(v, ("*",)), default=None,
                 help="CORS: allowed request headers (default: any)."),
    click.option("--allow-credentials", is_flag=True, default=_GATEWAY.allow_credentials,
                 help="CORS: allow cookies and Authorization from allowed origins."),
    click.option("--max-concurrent-requests", type=int, default=_GATEWAY.max_concurrent_requests, show_default=True,
                 help="Requests one gateway serves at once; past it, 429 with Retry-After."),
    click.option("--body-timeout", type=click.FloatRange(0.1, 3600), default=_GATEWAY.body_timeout, show_default=True,
                 help="Seconds a request's body may take to arrive after its headers, plus its length at 1 MiB/s; "
                      "a client that trickles it (slowloris) gets a 408 and its connection closed."),
    click.option("--max-audio-mb", type=click.FloatRange(0.01, MAX_AUDIO_MB), default=_GATEWAY.max_audio_mb,
                 show_default=True, help="Speech to text: the largest audio upload in MB (larger: 413)."),
    click.option("--max-audio-seconds", type=click.FloatRange(1, MAX_AUDIO_SECONDS),
                 default=_GATEWAY.max_audio_seconds, show_default=True,
                 help="Speech to text: the longest recording a request may hold, in seconds (longer: 400)."),
    click.option("--stream-interval", type=int, default=_GATEWAY.stream_interval, show_default=True,
                 help="Output tokens per stream chunk after the first (which goes at once; the last goes at the "
                      "finish): above 1, fewer and larger chunks for less gateway CPU per token, as vLLM's option."),
    click.option("--disable-family", "disabled_families", multiple=True, metavar="NAME",
                 help="Do not mount this route family (openai, anthropic, responses, ...; not core) or endpoint "
                      "plugin: its routes answer 404. Repeatable."),
)


def _lora_modules(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """--lora-modules' values as (name, path) pairs."""
    try:
        return tuple(parse_lora_module(v) for v in values)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


SEVERAL_VALUES = frozenset({"--lora-modules", "--lora-dir"})
"""Options that take several values after one flag, as vLLM's argparse ``nargs='+'`` does."""


def spread_values(args: list[str], options: frozenset[str] = SEVERAL_VALUES) -> list[str]:
    """``--lora-modules a=/x b=/y`` as click reads it: ``--lora-modules a=/x --lora-modules b=/y`` (every argument
    after such an option's value, up to the next option, is one more value of it)."""
    out: list[str] = []
    current: str | None = None  # the option that the bare arguments that follow belong to
    value_next = False  # its first value is the next argument
    for arg in args:
        if value_next:
            out.append(arg)
            value_next = False
        elif current is not None and not arg.startswith("-"):
            out += [current, arg]
        else:
            name = arg.partition("=")[0]
            current = name if name in options else None
            value_next = current is not None and "=" not in arg
            out.append(arg)
    return out


class SeveralValuesCommand(click.Command):
    """A command whose SEVERAL_VALUES options take vLLM's form (each is ``multiple`` for click)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_values(args))


# What every command that runs engines takes: each option is a field of zserve.config.EngineConfig (named
# after it).
engine_options = _options(
    click.option("--dtype", type=click.Choice(DTYPES), default=_ENGINE.dtype, show_default=True,
                 help="Precision of weights and activations (of the activations only, for weights kept quantized); "
                      "auto: bfloat16 on CUDA and on CPUs with native bfloat16, else float32. float32 computes the "
                      "float32 model's text; bfloat16 flips ~4% of its greedy tokens, at up to twice the speed."),
    click.option("--quantization", type=click.Choice(QUANTIZATIONS), default=_ENGINE.quantization, show_default=True,
                 help="auto: a GGUF file's quantized weights (Q4_0, Q4_1, Q4_K, Q5_*, Q6_K, Q8_0) stay quantized in "
                      "the engines and the linear layers run on them, 4 or 8 bits a weight; none: every weight is "
                      "dequantized to --dtype at load."),
    click.option("--max-num-seqs", type=int, default=_ENGINE.max_num_seqs, show_default=True,
                 help="Sequences an engine runs at once."),
    click.option("--max-num-batched-tokens", type=int, default=_ENGINE.max_num_batched_tokens, show_default=True,
                 help="Token budget of one engine step (chunked prefill)."),
    click.option("--block-size", type=int, default=_ENGINE.block_size, show_default=True, help="Tokens per KV block."),
    click.option("--kv-cache-memory", default=_ENGINE.kv_cache_memory,
                 help="KV cache per engine: bytes (2GiB, 512MB) or a fraction of free device memory (0.3). Default: "
                      "room for --max-num-seqs sequences of the full context, at most 25% of free device memory."),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=_ENGINE.enable_prefix_caching,
                 show_default=True, help="Reuse KV blocks of shared prompt prefixes across requests."),
    click.option("--enforce-eager", is_flag=True, default=_ENGINE.enforce_eager,
                 help="CUDA: never capture decode steps as CUDA graphs (they are on by default)."),
    click.option("--threads", "--engine-threads", type=int, default=_ENGINE.threads,
                 help="CPU threads per engine (default: the cores divided among the engines)."),
    click.option("--max-waiting", type=int, default=_ENGINE.max_waiting, show_default=True,
                 help="Requests an engine queues; past it the engine refuses more, and once every engine of the model "
                      "is full requests get 429. Each choice or pooled input of a request queues as one: a request "
                      "with more is a 400."),
    click.option("--scheduling", type=click.Choice(SCHEDULING), default=_ENGINE.scheduling, show_default=True,
                 help="How an engine admits a contended queue of requests from several tenants (--tenants): fair "
                      "(weighted fairness of tokens served, then priority) or fifo (priority, then arrival)."),
    click.option("--expert-parallel", is_flag=True, default=_ENGINE.expert_parallel,
                 help="Mixture-of-experts models: the model's ENGINES engines form one expert-parallel group, each "
                      "holding a share of the experts (attention stays data parallel); resize it while serving with "
                      "POST /scale_elastic_ep or `launch scale engine K`."),
    click.option("--seed", type=int, default=_ENGINE.seed,
                 help="Seed of the generator unseeded requests sample from (engine rank r uses seed + r), so a run "
                      "can be repeated; default: a fresh seed from the OS."),
    # -- LoRA adapters (engine_worker.lora), with vLLM's names and defaults ------------------------------
    click.option("--enable-lora", is_flag=True, default=_ENGINE.enable_lora,
                 help="Serve LoRA adapters (PEFT directories) in the same batches as the base model; "
                      "--lora-modules gives them and implies this."),
    click.option("--max-loras", type=int, default=_ENGINE.max_loras, show_default=True,
                 help="LoRA adapters one engine step runs at once; requests for others wait for a slot."),
    click.option("--max-lora-rank", type=int, default=_ENGINE.max_lora_rank, show_default=True,
                 help="The largest adapter rank an engine takes (a higher one is refused)."),
    click.option("--max-cpu-loras", type=int, default=_ENGINE.max_cpu_loras,
                 help="Adapters an engine keeps read in host memory; others are read again from their directory "
                      "when used (default: --max-loras)."),
    click.option("--lora-modules", "lora_modules", multiple=True, callback=_lora_modules, metavar="NAME=PATH",
                 help="LoRA adapters loaded at start: each NAME is served as a model name (its requests run the "
                      "base model with the adapter at PATH). Several after one --lora-modules, or repeated; vLLM's "
                      "JSON form {\"name\": NAME, \"path\": PATH} too. Implies --enable-lora. With several --model, "
                      "give each model its adapters as ID:lora=NAME=PATH."),
)


# Tiers on different hosts (launch.hosts.engine_registry, zserve.curve): how their TCP traffic is secured.
across_hosts_options = _options(
    click.option("--keys", "keys_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
                 help="CURVE keys (written by `launch keys --dir DIR`) that encrypt and authenticate the engine "
                      "traffic between hosts: an engine host accepts only the client keys in DIR/authorized, a "
                      "gateway host checks the engine host's DIR/server.key."),
    click.option("--insecure", is_flag=True,
                 help="Allow plain TCP between hosts (no encryption, no authentication; logged at every start)."),
)


@main.command("api-server", cls=SeveralValuesCommand)
@server_options
@click.option("--engines", type=click.IntRange(1, MAX_ENGINES_PER_MODEL), default=1, show_default=True,
              help="Engine worker processes per model (ID:engines=N sets one model's).")
@click.option("--engine", "remote_engines", multiple=True, metavar="tcp://HOST:PORT",
              help="Run no engine here: use the engines of the engine host (`launch engine --bind`) whose registry "
                   "is at this address, following its engines as they start, drain and die. Repeatable (several "
                   "engine hosts); needs --keys or --insecure.")
@across_hosts_options
@engine_options
# -- gateway tier: each option is a field of gateway.config.GatewayConfig ----------------------------
@click.option("--reasoning-parser", default=_GATEWAY.reasoning_parser,
              help=f"Split reasoning from the answer: {REASONING_PARSERS.names()}.")
@click.option("--state-url", default=_GATEWAY.state_url,
              help="State every gateway shares (stored responses): redis://HOST:PORT/DB for several hosts, or "
                   "sqlite:///PATH. Default: a SQLite file in the private run directory.")
@click.option("--responses-ttl", type=float, default=_GATEWAY.responses_ttl, show_default=True,
              help="Seconds a stored response is kept after its last change.")
@click.option("--responses-max-items", type=int, default=_GATEWAY.responses_max_items, show_default=True,
              help="Most stored responses kept; the oldest go first.")
@click.option("--scaling-wait", type=float, default=_GATEWAY.scaling_wait, show_default=True,
              help="Seconds a request is held, then served, while a model's engines are briefly unavailable: an "
                   "expert-parallel resize or recovery, or a rolling restart (launch reload, SIGHUP) replacing a "
                   "model's only engine. Past it, 503 with Retry-After (0: refused at once, as during /pause). A "
                   "request moving to another engine waits as long for one when none is left.")
@click.option("--migration-limit", type=click.IntRange(0, 100), default=_GATEWAY.migration_limit, show_default=True,
              help="Times one request may move to another engine when its engine is lost while it streams (dies, "
                   "hangs, its host is cut off, its drain reaches --shutdown-timeout, its expert-parallel group loses "
                   "a member): the prompt and the tokens generated so far go to another engine of the model, which "
                   "goes on from the next token; the client sees nothing. 0: such a request fails.")
@click.option("--migration-max-len", type=click.IntRange(1, 1 << 20), default=_GATEWAY.migration_max_len,
              help="The longest request (prompt + generated tokens) a migration re-sends; a longer one fails as its "
                   "engine does. Default: any the engines take.")
@click.option("--routing-policy", type=click.Choice(ROUTING_POLICIES), default=_GATEWAY.routing_policy,
              show_default=True,
              help="Which engine of a model takes a request. prefix: the one whose prefix cache holds most of the "
                   "prompt, as the engines' KV cache events tell every gateway (the same choice from any gateway), "
                   "within --routing-max-share; load: the least loaded; round-robin.")
@click.option("--routing-max-share", type=click.FloatRange(1.0, 100.0), default=_GATEWAY.routing_max_share,
              show_default=True,
              help="With --routing-policy prefix, the most load an engine is sent as a multiple of its fair share "
                   "(the model's running and waiting requests over its engines): past it, a hot prefix spills to "
                   "other engines.")
def api_server(**options) -> None:
    """Serve MODEL(s) over HTTP with COUNT gateways in front of each model's ENGINES engine workers."""
    serve(**options)


@main.command("render")
@server_options
def render(**options) -> None:
    """Serve MODEL's render routes with COUNT gateways and no engine (CPU only, no torch).

    /v1/chat/completions/render and /v1/completions/render answer what a request would send to the
    engine (prompt text, token ids, sampling parameters); /tokenize, /detokenize, /v1/models and
    /health work as on an api-server; generation routes answer a 400 saying this server renders only."""
    serve(engines=0, **options)


@main.command("engine", cls=SeveralValuesCommand)
@click.option("--count", "engines", type=click.IntRange(1, MAX_ENGINES_PER_MODEL), default=1, show_default=True,
              help="Engine worker processes per model (ID:engines=N sets one model's).")
@click.option("--model", "models", multiple=True, default=(DEFAULT_CHAT_MODEL,), show_default=True,
              help="As for launch api-server; gateway hosts must serve the same model ids.")
@click.option("--bind", default="tcp://127.0.0.1:7100", show_default=True, metavar="tcp://ADDR:PORT",
              help="Where gateway hosts reach this host's engine registry; engine rank r listens on PORT + 1 + r. "
                   "Loopback unless told otherwise (tcp://0.0.0.0:7100: every interface).")
@click.option("--kv-events-port", type=click.IntRange(1, 65535), default=None, metavar="PORT",
              help="Engine rank r publishes its KV cache events (GET /kv_event_sources on a gateway host lists them) "
                   "on PORT + 2r and answers replays on PORT + 2r + 1, on --bind's address, with its CURVE keys. "
                   "Default: the first port after every engine port the models could ever take, PORT + 1 + 64 x "
                   "models (one model on 7100: 7165..7292).")
@across_hosts_options
@click.option("--ready-timeout", type=click.FloatRange(1, 86400), default=600, show_default=True,
              help="Seconds an engine may take to become ready.")
@click.option("--shutdown-timeout", type=click.FloatRange(0, 3600), default=30, show_default=True,
              help="Seconds in-flight requests may take to finish when an engine drains: on SIGTERM, "
                   "scale-down or a rolling restart.")
@click.option("--heartbeat-timeout", type=click.FloatRange(0.5, 3600), default=30, show_default=True,
              help="An engine silent for this long is hung and gets replaced; a gateway host silent for this long "
                   "gets no more registry updates.")
@click.option("--exit-on-crash-loop", is_flag=True,
              help=CRASH_LOOP_HELP)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="Log level of the supervisor and of every engine it starts (on stderr).")
@click.option("--max-model-len", type=int, default=_ENGINE.max_model_len,
              help="Context length (prompt + output) per sequence. Default: the model's own, lowered to what the "
                   "KV cache holds; a given value is capped to the model's own.")
@engine_options
def engine(**options) -> None:
    """Run only the engine tier, for gateway hosts (`launch api-server --engine tcp://THIS:PORT`) to use.

    The same supervisor as an api-server's, without gateways: engines restart when they die, drain on
    SIGTERM and scale with `launch scale engine N --port PORT`; `launch status --port PORT` lists them."""
    serve(count=0, **options)


@main.group("keys", invoke_without_command=True)
@click.option("--dir", "directory", default=None, type=click.Path(file_okay=False),
              help="Where to write the keys (created mode 0700; every file 0600; nothing is overwritten).")
@click.option("--name", default=None, metavar="NAME",
              help="The gateway host the client key is for: its public key is written as authorized/NAME.key, the "
                   "file the engine host's authorized/ holds for that host (default: client; needed with "
                   "--client-only, so a second host's key never replaces the first's).")
@click.option("--client-only", is_flag=True,
              help="Write only another gateway host's client keypair and authorized/NAME.key: copy that file into "
                   "the engine host's authorized/ directory to let the host in.")
@click.pass_context
def keys(ctx: click.Context, directory: str | None, name: str | None, client_only: bool) -> None:
    """Write CURVE keys for engines on other hosts (--dir): server.key[_secret] (the engine host's),
    client.key[_secret] (a gateway host's) and authorized/NAME.key (what the engine host accepts). Give the
    directory as --keys to `launch engine` and `launch api-server --engine`; a gateway host needs server.key and
    client.key_secret only. `launch keys hash` prints an API key's digest for a tenants file."""
    from zserve.curve import CLIENT, write_keys

    if ctx.invoked_subcommand is not None:
        return
    if directory is None:
        raise click.UsageError("give --dir DIR to write CURVE keys, or `launch keys hash` for a tenant's key digest")

    if client_only and name is None:
        raise click.UsageError("--client-only needs --name NAME (e.g. the gateway host's name): the engine host "
                               "keeps one authorized/NAME.key per gateway host, and a copied authorized/client.key "
                               "would replace the first host's")
    try:
        written = write_keys(directory, client_only=client_only, name=name or CLIENT)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--name") from None
    except (FileExistsError, OSError) as e:
        raise click.ClickException(str(e)) from None
    for path in written:
        click.echo(path)


@keys.command("hash")
@click.argument("key", required=False)
@click.option("--new", is_flag=True, help="Make a new random API key: print it, then its digest.")
def keys_hash(key: str | None, new: bool) -> None:
    """Print the SHA-256 digest of API key KEY (read from standard input when not given, so it stays out of the
    shell's history) for a tenants file's key_sha256; with --new, make a key first."""
    import secrets

    from zserve.tenants import key_digest

    if new:
        if key is not None:
            raise click.UsageError("--new makes the key: give no KEY with it")
        key = "sk-" + secrets.token_urlsafe(32)
        click.echo(f"key:        {key}")
        click.echo(f"key_sha256: {key_digest(key)}")
        return
    if key is None:
        key = click.get_text_stream("stdin").readline().strip()
    if not key or any(c.isspace() for c in key):
        raise click.UsageError("an API key must be non-empty and hold no spaces")
    click.echo(key_digest(key))


def serve(*, count: int, engines: int, models: tuple[str, ...], served_model_names: tuple[str, ...] = (),
          host: str = "127.0.0.1", port: int = 0, uds: str | None = None, ready_timeout: float,
          shutdown_timeout: float, heartbeat_timeout: float, log_level: str, api_keys: tuple[str, ...] = (),
          api_key_file: str | None = None, admin_keys: tuple[str, ...] = (), tenants: str | None = None,
          bind: str | None = None, remote_engines: tuple[str, ...] = (), keys_dir: str | None = None,
          insecure: bool = False,
          exit_on_crash_loop: bool = False, lora_dirs: tuple[str, ...] = (), profiler_dir: str | None = None,
          kv_events_port: int | None = None, **tier_options) -> NoReturn:
    """Start a supervisor for COUNT gateways and ENGINES engines per model (0: a render server), serve until
    told to stop, and exit with its code: the one start-up path of every serving command."""
    engine = _tier_config(EngineConfig, tier_options)
    gateway = _tier_config(GatewayConfig, tier_options)
    unknown = set(tier_options) - _field_names(EngineConfig) - _field_names(GatewayConfig)
    assert not unknown, f"options without a configuration field: {sorted(unknown)}"
    remote_engines = tuple(dict.fromkeys(remote_engines))
    _check_across_hosts(bind, remote_engines, keys_dir, insecure)
    if remote_engines:
        source = click.get_current_context().get_parameter_source("engines")
        if source is not None and source.name != "DEFAULT":
            raise click.UsageError("--engine runs no engine here: --engines does not go with it")
        engines = 0
    served = _models(models, engine, engines, served_model_names)
    if bind is not None:
        _check_kv_events_ports(bind, len(served), kv_events_port)
    if remote_engines and any(spec.engines for _, spec in served):
        raise click.UsageError("--engine runs no engine here: ID:engines=N does not go with it")
    api_keys = _keys(api_keys, api_key_file)
    if tenants is not None:
        _check_tenants(tenants)
    try:
        restart_backoff()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    os.environ["ZSERVE_LOG_LEVEL"] = log_level.upper()
    setup_logging("launch")
    set_title("zserve: supervisor")
    logging.getLogger("zserve.launch").info("%s", _start_line())
    cfg = ServeConfig(models=served, gateway=gateway, api_keys=api_keys, admin_keys=tuple(admin_keys),
                      tenants=os.path.abspath(tenants) if tenants else None, host=host,
                      port=port, uds=uds, gateways=count, bind=bind, remote_engines=remote_engines,
                      keys_dir=keys_dir, kv_events_port=kv_events_port, ready_timeout=ready_timeout,
                      shutdown_timeout=shutdown_timeout,
                      heartbeat_timeout=heartbeat_timeout, heartbeat_interval=min(1.0, heartbeat_timeout / 4),
                      exit_on_crash_loop=exit_on_crash_loop, lora_dirs=tuple(os.path.abspath(d) for d in lora_dirs),
                      profiler_dir=os.path.abspath(profiler_dir) if profiler_dir else None)
    sup = Supervisor(cfg)
    code = 0
    try:
        sup.start()
        code = sup.run()
    except ListenError as e:
        click.echo(f"error: {e}", err=True)
        code = 2
    except StartupError as e:
        click.echo(f"error: {e}", err=True)
        code = 1
    except Exception:  # a bug in the supervisor: its children still stop cleanly, and the exit says it failed
        logging.getLogger("zserve.launch").exception("the supervisor failed; stopping every process (exit code %d)",
                                                     EXIT_SUPERVISOR_FAILED)
        code = EXIT_SUPERVISOR_FAILED
    finally:
        code = sup.stop() or code
        logging.getLogger("zserve.launch").info("stopped (exit code %d)", code)
    sys.exit(code)


def _check_across_hosts(bind: str | None, remote: tuple[str, ...], keys_dir: str | None, insecure: bool) -> None:
    """TCP between hosts is CURVE (--keys) or, said out loud, plain (--insecure); the keys must be readable."""
    from zserve.curve import CurveKeys, KeyFileError, is_tcp, tcp_port

    for url, option in [(bind, "--bind"), *((u, "--engine") for u in remote)]:
        if url is None:
            continue
        try:
            port = tcp_port(url) if is_tcp(url) else 0
        except ValueError:
            port = 0
        if not 0 < port < 65535 - MAX_ENGINES_PER_MODEL:
            raise click.BadParameter(f"{url!r} is not tcp://HOST:PORT (a port below "
                                     f"{65535 - MAX_ENGINES_PER_MODEL})", param_hint=option)
    if bind is None and not remote:
        if keys_dir or insecure:
            raise click.UsageError("--keys and --insecure secure the TCP between hosts: they go with --engine "
                                   "(launch api-server) or launch engine")
        return
    if keys_dir and insecure:
        raise click.UsageError("--keys and --insecure contradict each other")
    if not keys_dir and not insecure:
        raise click.UsageError("plain TCP between hosts is refused: give --keys DIR (`launch keys --dir DIR` writes "
                               "one) or, on a network you trust, --insecure")
    if keys_dir:
        try:
            CurveKeys.for_server(keys_dir) if bind is not None else CurveKeys.for_client(keys_dir)
        except KeyFileError as e:
            raise click.BadParameter(str(e), param_hint="--keys") from None


def _check_kv_events_ports(bind: str, models: int, first: int | None) -> None:
    """An engine host's KV event ports fit below 65536 and never meet its registry's or engines' ports."""
    from launch.hosts.engine_registry import engine_ports, kv_events_ports
    from zserve.curve import tcp_port

    engines, kv = engine_ports(bind, models), kv_events_ports(bind, models, first)
    where = f"the KV event ports of {models} model(s) ({kv.start}..{kv.stop - 1}, two per engine rank)"
    if kv.stop - 1 > 65535:
        raise click.BadParameter(f"{where} run past 65535: give a lower port", param_hint="--kv-events-port"
                                 if first is not None else "--bind (or --kv-events-port)")
    if kv.start < engines.stop and tcp_port(bind) < kv.stop:
        raise click.BadParameter(f"{where} meet the registry's and engines' ports ({tcp_port(bind)}.."
                                 f"{engines.stop - 1}, 64 engine ranks per model)", param_hint="--kv-events-port")


def _start_line() -> str:
    """``zserve VERSION: launch COMMAND`` and every option given a value other than its default (from the
    command line or the environment), secrets redacted, so a log says how the server was started."""
    from click.core import ParameterSource

    from zserve import __version__

    ctx = click.get_current_context()
    given = []
    for p in ctx.command.params:
        if ctx.get_parameter_source(p.name) in (None, ParameterSource.DEFAULT) or p.name not in ctx.params:
            continue
        value = ctx.params[p.name]
        if isinstance(value, (tuple, list)) and p.name not in SECRET_OPTIONS:
            shown = ",".join("=".join(v) if isinstance(v, tuple) else str(v) for v in value)  # (name, path) pairs
        else:
            shown = str(redact_option(p.name, value))
        given.append(f"{p.opts[-1] if p.opts else p.name}={shown}")
    return f"zserve {__version__}: launch {ctx.info_name} {' '.join(given) or '(every option at its default)'}"


def _models(models: tuple[str, ...], engine: EngineConfig, engines: int, names: tuple[str, ...]
            ) -> list[tuple[ModelSource, ModelSpec]]:
    """Each --model as its resolved files and its spec; ids, served names and adapter names must not repeat, and
    adapters go only to models that generate."""
    if engine.lora_modules and len(models) > 1:
        raise click.UsageError("--lora-modules gives adapters to one model; with several --model, give each model "
                               "its adapters as ID:lora=NAME=PATH")
    try:
        specs = [ModelSpec.parse(m, engine, engines) for m in models]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model") from None
    if names:
        if len(specs) > 1:
            raise click.UsageError("--served-model-name names one model; with several --model, give each model "
                                   "its names as ID:name=NAME")
        specs[0] = dataclasses.replace(specs[0], names=names)
    served = []
    for spec in specs:
        try:
            served.append((resolve(spec.model), spec))
        except ModelNotFound as e:
            raise click.BadParameter(str(e), param_hint="--model") from None
    seen: set[str] = set()
    for source, spec in served:
        for name in {source.model_id, *spec.names}:
            if name in seen:
                raise click.BadParameter(f"{name!r} names two models; each model id and name must be unique",
                                         param_hint="--model")
            seen.add(name)
    for source, spec in served:  # adapters after every model's names: a clash names the adapter
        if spec.engine.lora_modules and pools_only(source):
            raise click.BadParameter(f"{source.model_id!r} only pools (embed, classify): LoRA adapters need a model "
                                     "that generates", param_hint="--lora-modules")
        for name, _ in spec.engine.lora_modules:
            if name in seen:
                raise click.BadParameter(f"LoRA adapter {name!r} has the name of another model or adapter; each "
                                         "adapter name must be unique among the served names",
                                         param_hint="--lora-modules")
            seen.add(name)
    return served


def _check_tenants(path: str) -> None:
    """A tenants file that cannot be served stops the start (exit 2) with its file and line."""
    from zserve.tenants import TenantsError, load_tenants

    try:
        load_tenants(path)
    except TenantsError as e:
        raise click.BadParameter(str(e), param_hint="--tenants") from None


def _keys(given: tuple[str, ...], path: str | None) -> tuple[str, ...]:
    """The API keys of --api-key and --api-key-file; a usage error (that quotes no key) for a blank one."""
    keys = list(given)
    if path is not None:
        with open(path) as f:
            keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if any(not k.strip() or any(c.isspace() for c in k.strip()) for k in keys):
        raise click.BadParameter("an API key must be non-empty and hold no spaces", param_hint="--api-key")
    return tuple(dict.fromkeys(k.strip() for k in keys))


def _names(value: str | None, default: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A list option as vLLM writes it (a JSON list) or comma-separated."""
    if value is None:
        return default
    value = value.strip()
    if value.startswith("["):
        import orjson

        try:
            items = orjson.loads(value)
        except orjson.JSONDecodeError as e:
            raise click.BadParameter(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise click.BadParameter("expected a JSON list of strings")
        return tuple(items)
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


_FLAGS = {"disabled_families": "--disable-family"}  # fields whose option is not named after them


def _tier_config(cls: type[T], options: dict) -> T:
    """Build a tier's configuration from the click options named after its fields; its own checks become
    usage errors that name the option."""
    names = _field_names(cls)
    values = {k: v for k, v in options.items() if k in names}
    try:
        return cls(**values)
    except ValueError as e:
        field = next((n for n in names if str(e).startswith(n)), None)
        message = f"{_FLAGS.get(field, f'--{field}'.replace('_', '-'))}{str(e)[len(field):]}" if field else str(e)
        raise click.UsageError(message) from None


def _ask(port: int | str, cmd: ControlMessage, expect: type[R], timeout: float = 30.0) -> R:
    """Send one command to the server on ``port`` (a TCP port, or the path of its ``--uds`` socket); return its
    reply of type ``expect`` or fail with its error."""
    try:
        reply = control.request(control.find_control_socket(port), cmd, timeout)
    except control.NotPermitted as e:
        raise click.ClickException(f"{e}; run: sudo {_this_command()}") from None
    except (ConnectionError, OSError, ProtocolError) as e:
        raise click.ClickException(str(e)) from None
    if isinstance(reply, ErrorReply):
        raise click.ClickException(reply.error)
    if not isinstance(reply, expect):
        raise click.ClickException(f"the supervisor answered {reply.TYPE} to {cmd.TYPE}")
    return reply


def _this_command() -> str:
    """The command line this process was started with, to repeat in a hint (as root, say)."""
    argv0 = sys.argv[0]
    head = [sys.executable, "-m", "launch"] if argv0.endswith(".py") else [os.path.abspath(argv0)]
    return shlex.join(head + sys.argv[1:])


def _status(port: int | str) -> StatusReply:
    return _ask(port, StatusCommand(), StatusReply)


def port_option(f):
    """``--port`` or ``--uds``: which running server to control; the command gets one of them as ``port``."""
    @functools.wraps(f)
    def command(*args, port: int, uds: str | None, **kw):
        return f(*args, port=uds or port, **kw)

    command = click.option("--uds", default=None, metavar="PATH",
                           help="The server on this Unix socket (launch api-server --uds) instead of --port.")(command)
    return click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
                        help="Port of the server to control.")(command)


@main.command("scale")
@click.argument("tier", type=click.Choice(["api-server", "engine"]))
@click.argument("count", type=click.IntRange(1, 256))
@port_option
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the tier has COUNT ready processes.")
@click.option("--timeout", type=float, default=600, show_default=True,
              help="Seconds to wait for the supervisor's answer and, with --wait, for the tier to be ready.")
@click.option("--model", default=None,
              help="engine: the model whose engines to scale (its id or a served name); needed when several are "
                   "served.")
def scale(tier: str, count: int, port: int, wait: bool, timeout: float, model: str | None) -> None:
    """Scale the gateway (api-server) tier, or one model's engine tier, to COUNT processes while serving."""
    if model is not None and tier != "engine":
        raise click.UsageError("--model chooses an engine tier; gateways serve every model")
    # (an expert-parallel group answers when its resize is over: new members may take minutes to load)
    reply = _ask(port, ScaleCommand(tier, count, model), ScaleReply, timeout=timeout)
    name = "gateway" if tier == "api-server" else f"engine ({reply.model})"
    deadline = time.monotonic() + timeout
    while wait:
        mine = [p for p in _status(port).processes
                if p.tier == reply.tier and p.model == reply.model]
        if len([p for p in mine if p.state == "ready"]) == count and len(mine) == count:
            break
        if time.monotonic() > deadline:
            raise click.ClickException(f"the {name} tier did not reach {count} ready processes in {timeout:.0f}s")
        time.sleep(0.2)
    click.echo(f"{name} tier: {count}")


@main.command("status")
@port_option
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--tenants", "tenants", is_flag=True,
              help="Print each tenant's limits (--tenants FILE) and what it uses now instead: its requests and tokens "
                   "buckets' levels and its requests in flight, across every gateway (and host, with Redis).")
def status(port: int, as_json: bool, tenants: bool) -> None:
    """Print every process of a running server: tier, index, pid, state, restarts, uptime, load (and each engine's
    prefix-cache blocks and LoRA adapters)."""
    reply = _ask(port, StatusCommand(tenants=tenants), StatusReply) if tenants else _status(port)
    st = reply.to_wire()
    if tenants and not as_json:
        _print_tenants(reply.tenants or [])
        return
    if as_json:
        import orjson

        click.echo(orjson.dumps(st, option=orjson.OPT_INDENT_2).decode())
        return
    engines = (", ".join(f"{n} engine{'s' * (n != 1)} for {m}" for m, n in st["models"].items())
               if st["desired"]["engine"] else "no engine (render only)")
    click.echo(f"{', '.join(st['models'])} at {st['url']}  supervisor pid {st['pid']}  up {st['uptime_s']:.0f}s  "
               f"{'PAUSED  ' if st['paused'] else ''}desired: {st['desired']['gateway']} gateways, {engines}")
    for model, g in (st.get("expert_parallel") or {}).items():
        pause = f", last pause {g['last_pause_s']:.2f}s" if g.get("last_pause_s") is not None else ""
        click.echo(f"expert parallel {model}: {g['size']} members, generation {g['generation']}, "
                   f"{g['phase'] or 'serving'}{pause}" + (f"; last error: {g['last_error']}" if g.get("last_error")
                                                         else ""))
    for hold in reply.holds:  # what gateways hold or refuse now, and since when
        click.echo(f"held: {hold.model or 'every model'} ({hold.reason}{': ' + hold.detail if hold.detail else ''}) "
                   f"for {max(0.0, time.time() - hold.since):.0f}s")
    click.echo(f"{'TIER':8} {'IDX':>3} {'PID':>7} {'STATE':10} {'RESTARTS':>8} {'UPTIME':>8}  LOAD")
    for p in st["processes"]:
        if p["tier"] == "engine":
            load = f"running {p.get('running', '-')} waiting {p.get('waiting', '-')} kv {p.get('kv_used', 0):.0%}"
            if p.get("kv_blocks_cached") is not None:
                load += f" cached {p['kv_blocks_cached']} blocks"
        else:
            load = f"in-flight {p.get('in_flight', '-')}"
        if p.get("crash_looping"):
            load += "  CRASH-LOOPING" + (f" ({p['last_exit']})" if p.get("last_exit") else "")
        uptime = f"{p['uptime_s']:.0f}s" if p.get("uptime_s") is not None else "-"
        if p.get("model") and len(st["models"]) > 1:
            load = f"{p['model']}: {load}"
        if p.get("endpoint"):
            load = f"at {p['endpoint']}"  # on another host: its own supervisor knows its load
        if p.get("loras"):
            load += f"  lora: {', '.join(p['loras'])}"
        if p.get("weight_version") not in (None, "default"):
            load += f"  weights: {p['weight_version']}"
        if p.get("sleeping"):
            load += f"  ASLEEP (level {p['sleeping']})"
        click.echo(f"{p['tier']:8} {p['index']:>3} {p['pid'] or '-':>7} {p['state']:10} {p['restarts']:>8} "
                   f"{uptime:>8}  {load}")


def _print_tenants(rows: list[dict]) -> None:
    """``launch status --tenants``: a line per tenant, each limit as "left of limit" (a bucket's level) or "-"."""
    if not rows:
        click.echo("no tenants (start the server with --tenants FILE)")
        return

    def left(level, limit) -> str:
        return "-" if limit is None else f"{max(0, math.floor(level or 0)):g}/{limit * BURST_SECONDS / 60:g}"

    click.echo(f"{'TENANT':20} {'WEIGHT':>6} {'PRIO':>5} {'REQUESTS LEFT':>14} {'TOKENS LEFT':>16} {'IN FLIGHT':>10}  "
               "STORE")
    for t in rows:
        flight = "-" if t["max_concurrent"] is None else f"{t.get('concurrent', 0)}/{t['max_concurrent']}"
        click.echo(f"{t['name']:20} {t['weight']:>6g} {t['priority']:>5} "
                   f"{left(t.get('requests'), t['requests_per_minute']):>14} "
                   f"{left(t.get('tokens'), t['tokens_per_minute']):>16} {flight:>10}  {t.get('store', '-')}")
    click.echo(f"(a bucket holds {BURST_SECONDS:g} s of its per-minute rate and refills continuously)")


@main.command("reload")
@port_option
@click.option("--timeout", type=float, default=1800, show_default=True,
              help="Seconds to wait for every process to be replaced.")
@click.option("--tenants-only", is_flag=True,
              help="Only read the tenants file (--tenants) again: every gateway applies it, no process is replaced.")
def reload(port: int | str, timeout: float, tenants_only: bool) -> None:
    """Replace every process one at a time, dropping no request (like SIGHUP to the supervisor): gateways
    start before the old ones drain, engines drain before their replacements start. The tenants file is read
    again first; a malformed one refuses the reload and the tenants in force stay."""
    reply = _ask(port, ReloadCommand(tenants_only), ReloadReply, timeout=timeout)
    if tenants_only:
        click.echo("reloaded: the tenants file is in force on every gateway")
    else:
        click.echo(f"reloaded: {reply.replaced} process(es) replaced in {reply.seconds:.1f}s")


@main.command("stop")
@port_option
def stop(port: int) -> None:
    """Drain and stop a running server (like SIGTERM to its supervisor)."""
    _ask(port, StopCommand(), StopReply)
    click.echo("stopping")


def _rates(value: str | None) -> tuple[float, ...]:
    """"1,2,4,inf" as request rates per second."""
    try:
        rates = tuple(float(v) for v in _names(value))
    except ValueError as e:
        raise click.BadParameter(f"expected rates like 1,2,4,inf: {e}") from None
    if any(r <= 0 for r in rates):
        raise click.BadParameter("a request rate must be positive (inf: all at once)")
    return rates


def _concurrencies(value: str | None) -> tuple[int, ...]:
    try:
        counts = tuple(int(v) for v in _names(value))
    except ValueError as e:
        raise click.BadParameter(f"expected concurrencies like 1,4,16: {e}") from None
    if any(c < 1 for c in counts):
        raise click.BadParameter("a concurrency must be at least 1")
    return counts


@main.command("bench")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True,
              help="Any OpenAI-compatible server (zserve, vLLM, ...).")
@click.option("--model", default=None, help="Model to ask for (default: the first of GET /v1/models).")
@click.option("--lora-modules", multiple=True, metavar="NAME",
              help="LoRA adapters the server serves (repeatable): each request asks for one of them, drawn with "
                   "--seed, instead of --model (vLLM's benchmark option).")
@click.option("--endpoint-type", type=click.Choice(["completions", "chat"]), default="completions",
              show_default=True, help="/v1/completions or /v1/chat/completions.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Sent as Bearer (also OPENAI_API_KEY).")
@click.option("--num-prompts", type=click.IntRange(1), default=200, show_default=True,
              help="Requests per load point (multi_turn: --multi-turn-conversations times --multi-turn-turns).")
@click.option("--dataset-name", type=click.Choice(["random", "prefix_repetition", "multi_turn"]), default="random",
              show_default=True,
              help="random: random prompts (or --dataset-path); prefix_repetition: prompts sharing a few random "
                   "prefixes (vLLM's dataset); multi_turn: chats whose turns carry the whole conversation.")
@click.option("--prefix-repetition-prefix-len", type=click.IntRange(1), default=256, show_default=True,
              help="prefix_repetition: tokens of each shared prefix.")
@click.option("--prefix-repetition-suffix-len", type=click.IntRange(1), default=256, show_default=True,
              help="prefix_repetition: tokens of each prompt's own random suffix.")
@click.option("--prefix-repetition-num-prefixes", type=click.IntRange(1), default=10, show_default=True,
              help="prefix_repetition: distinct prefixes; --num-prompts are spread evenly over them and shuffled.")
@click.option("--prefix-repetition-output-len", type=click.IntRange(1), default=128, show_default=True,
              help="prefix_repetition: max_tokens of each request.")
@click.option("--multi-turn-conversations", type=click.IntRange(1), default=16, show_default=True,
              help="multi_turn: conversations, held at once (their turns one after another, on the chat route).")
@click.option("--multi-turn-turns", type=click.IntRange(1), default=4, show_default=True,
              help="multi_turn: user turns per conversation.")
@click.option("--multi-turn-user-len", type=click.IntRange(1), default=128, show_default=True,
              help="multi_turn: tokens of each user turn.")
@click.option("--multi-turn-output-len", type=click.IntRange(1), default=64, show_default=True,
              help="multi_turn: max_completion_tokens of each answer.")
@click.option("--random-input-len", type=click.IntRange(1), default=1024, show_default=True,
              help="Prompt tokens of random prompts (made exact with the server's /tokenize when it has one).")
@click.option("--random-output-len", type=click.IntRange(1), default=128, show_default=True,
              help="max_tokens of each request (a dataset line's own max_tokens wins).")
@click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Lengths uniform in [LEN*(1-R), LEN*(1+R)].")
@click.option("--dataset-path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="JSONL prompts instead of random ones: one object a line with \"prompt\" or \"messages\" and "
                   "optionally \"max_tokens\".")
@click.option("--request-rate", type=click.FloatRange(min=0, min_open=True), default=float("inf"),
              show_default=True,
              help="Poisson arrivals per second (inf: every request at once; multi_turn: conversation starts).")
@click.option("--max-concurrency", type=click.IntRange(1), default=None, help="Requests in flight at most.")
@click.option("--sweep-rates", callback=lambda c, p, v: _rates(v), default=None,
              help="Run one load point per request rate, e.g. 1,2,4,inf.")
@click.option("--sweep-concurrency", callback=lambda c, p, v: _concurrencies(v), default=None,
              help="Run one load point per concurrency, e.g. 1,4,16.")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Stream (SSE): needed for TTFT and inter-token latency.")
@click.option("--temperature", type=click.FloatRange(0), default=1.0, show_default=True,
              help="Sampling temperature of every request.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the workload: prompt words and lengths, arrival times.")
@click.option("--ignore-eos", is_flag=True, help="Send vLLM's ignore_eos so every request generates max_tokens.")
@click.option("--goodput", "slos", multiple=True, metavar="KEY:MS",
              help="SLO of goodput in ms, keys ttft, tpot, e2el; as vLLM writes it: --goodput ttft:500 e2el:2000.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600, show_default=True,
              help="Seconds a request may wait for its next bytes.")
@click.option("--result-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write every metric and the configuration as JSON.")
@click.option("--save-detailed", is_flag=True, help="With --result-file: add every request's record.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw latency percentiles against load, and throughput against latency, as a PNG "
                   "(needs matplotlib, the bench extra: .venv/bin/pip install -e '.[bench]' in the checkout).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress on stderr.")
@click.argument("more_slos", nargs=-1, metavar="[KEY:MS]...")
def bench(slos: tuple[str, ...], more_slos: tuple[str, ...], **options) -> None:
    """Measure a running server: throughput, TTFT, ITL, TPOT, end-to-end latency and goodput under a load.

    KEY:MS arguments are more goodput SLOs (--goodput ttft:500 e2el:2000, as vLLM takes them).
    Exits 2 if the server cannot be reached, 1 if every request failed."""
    from .bench import run as bench_run
    from .bench.report import parse_slos

    if options["dataset_name"] != "random" and options["dataset_path"] is not None:
        raise click.UsageError(f"--dataset-path is a file of prompts: --dataset-name {options['dataset_name']} "
                               "makes its own")
    if options["dataset_name"] == "multi_turn" and options["lora_modules"]:
        raise click.UsageError("--lora-modules is not supported with --dataset-name multi_turn")
    if options["sweep_rates"] and options["sweep_concurrency"]:
        raise click.UsageError("sweep either --sweep-rates or --sweep-concurrency, not both")
    if more_slos and not slos:
        raise click.UsageError(f"unexpected argument {more_slos[0]!r} (goodput SLOs follow --goodput)")
    try:
        goodput = parse_slos(slos + more_slos)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--goodput") from None
    if options["plot"] is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pip = Path(sys.executable).with_name("pip")
            raise click.UsageError(f"--plot needs matplotlib, the bench extra: {pip} install -e '.[bench]' "
                                   "in the zserve checkout (make test installs it too)") from None
    sys.exit(bench_run.run(bench_run.BenchConfig(goodput=goodput, **options)))
