"""The ``launch`` command line.

``launch api-server`` starts and supervises both tiers; ``launch scale``, ``launch status`` and
``launch stop`` talk to a running supervisor over its owner-only control socket.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time

import click

from zserve import control
from zserve.catalog import DEFAULT_CHAT_MODEL, ModelNotFound, resolve
from gateway.store import DEFAULT_MAX_ITEMS, DEFAULT_TTL_S, check_store_url
from gateway.text.reasoning import REASONING_PARSERS
from gateway.text.tool_parsers import TOOL_PARSERS
from zserve.proc import set_title, setup_logging
from zserve.registry import Registry

from .sockets import ListenError
from .supervisor import ServeConfig, StartupError, Supervisor


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """zserve: serve language models over OpenAI-compatible HTTP."""


@main.command("api-server")
@click.option("--count", type=click.IntRange(1, 256), default=1, show_default=True, help="Gateway (HTTP) processes.")
@click.option("--engines", type=click.IntRange(1, 64), default=1, show_default=True, help="Engine worker processes.")
@click.option("--model", default=DEFAULT_CHAT_MODEL, show_default=True,
              help="Model id from the catalog, 'tiny-random', a .gguf file or an HF directory.")
@click.option("--served-model-name", multiple=True, help="Name(s) clients use for the model (default: the model id).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="Sequences an engine runs at once.")
@click.option("--max-model-len", type=click.IntRange(16, 1 << 20), default=4096, show_default=True,
              help="Context length (prompt + output) per sequence.")
@click.option("--max-num-batched-tokens", type=click.IntRange(1, 1 << 20), default=512, show_default=True,
              help="Token budget of one engine step (chunked prefill).")
@click.option("--block-size", type=click.IntRange(1, 1024), default=16, show_default=True, help="Tokens per KV block.")
@click.option("--kv-cache-memory", default=None, callback=lambda ctx, p, v: _memory(v),
              help="KV cache per engine: bytes (2GiB, 512MB) or a fraction of free device memory (0.3).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="Reuse KV blocks of shared prompt prefixes across requests.")
@click.option("--enforce-eager", is_flag=True, default=False,
              help="CUDA: never capture decode steps as CUDA graphs (they are on by default).")
@click.option("--engine-threads", type=click.IntRange(1, 1024), default=None, help="CPU threads per engine.")
@click.option("--ready-timeout", type=click.FloatRange(1, 86400), default=600, show_default=True,
              help="Seconds a process may take to become ready.")
@click.option("--shutdown-timeout", type=click.FloatRange(0, 3600), default=30, show_default=True,
              help="Seconds in-flight requests may take to finish on SIGTERM or scale-down.")
@click.option("--heartbeat-timeout", type=click.FloatRange(0.5, 3600), default=30, show_default=True,
              help="A process silent for this long is hung and gets replaced.")
@click.option("--tool-call-parser", default=None, callback=lambda ctx, p, v: _parser(v, TOOL_PARSERS, p),
              help=f"Turn model output into tool calls: {TOOL_PARSERS.names()}. Without it, requests "
                   "with tools are refused.")
@click.option("--reasoning-parser", default=None, callback=lambda ctx, p, v: _parser(v, REASONING_PARSERS, p),
              help=f"Split reasoning from the answer: {REASONING_PARSERS.names()}.")
@click.option("--state-url", default=None, callback=lambda ctx, p, v: _state_url(v),
              help="State every gateway shares (stored responses): redis://HOST:PORT/DB for several hosts, or "
                   "sqlite:///PATH. Default: a SQLite file in the private run directory.")
@click.option("--responses-ttl", type=click.FloatRange(1, 365 * 86400), default=None,
              help=f"Seconds a stored response is kept  [default: {DEFAULT_TTL_S:.0f}]")
@click.option("--responses-max-items", type=click.IntRange(1, 10**8), default=None,
              help=f"Most stored responses kept; the oldest go first  [default: {DEFAULT_MAX_ITEMS}]")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def api_server(count: int, engines: int, model: str, served_model_name: tuple[str, ...], host: str, port: int,
               dtype: str, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, block_size: int,
               kv_cache_memory: str | None, enable_prefix_caching: bool, enforce_eager: bool, engine_threads: int | None,
               ready_timeout: float, shutdown_timeout: float, heartbeat_timeout: float, tool_call_parser: str | None,
               reasoning_parser: str | None, state_url: str | None, responses_ttl: float | None,
               responses_max_items: int | None, log_level: str) -> None:
    """Serve MODEL over HTTP with COUNT gateways in front of ENGINES engine workers."""
    os.environ["ZSERVE_LOG_LEVEL"] = log_level.upper()
    setup_logging("launch")
    set_title("zserve: supervisor")
    try:
        source = resolve(model)
    except ModelNotFound as e:
        raise click.BadParameter(str(e), param_hint="--model") from None
    cfg = ServeConfig(source=source, host=host, port=port, gateways=count, engines=engines, dtype=dtype,
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                      kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
                      enforce_eager=enforce_eager,
                      served_model_names=list(served_model_name),
                      engine_threads=engine_threads, ready_timeout=ready_timeout, shutdown_timeout=shutdown_timeout,
                      heartbeat_timeout=heartbeat_timeout, heartbeat_interval=min(1.0, heartbeat_timeout / 4),
                      tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, state_url=state_url,
                      responses_ttl=responses_ttl, responses_max_items=responses_max_items)
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
    finally:
        code = sup.stop() or code
        logging.getLogger("zserve.launch").info("stopped (exit code %d)", code)
    sys.exit(code)


_MEMORY = re.compile(r"^(\d+(\.\d+)?)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib)?$", re.I)


def _memory(value: str | None) -> str | None:
    """Check a --kv-cache-memory value here, so a typo fails at once instead of crash-looping engines."""
    if value is None:
        return None
    m = _MEMORY.match(value.strip())
    if not m or float(m.group(1)) <= 0 or (m.group(3) is None and "." in m.group(1) and float(m.group(1)) > 1):
        raise click.BadParameter(f"{value!r}: expected bytes (2GiB, 512MB, 1073741824) or a fraction like 0.3",
                                 param_hint="--kv-cache-memory")
    return value.strip()


def _parser(value: str | None, registry: Registry, param: click.Parameter) -> str | None:
    """Unknown parser names fail here, listing the valid ones, instead of in every gateway."""
    if value is not None:
        try:
            registry.create(value)
        except ValueError as e:
            raise click.BadParameter(str(e), param=param) from None
    return value


def _state_url(value: str | None) -> str | None:
    if value is not None:
        try:
            check_store_url(value)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--state-url") from None
    return value


def _ask(port: int, cmd: dict, timeout: float = 30.0) -> dict:
    try:
        reply = control.request(control.find_control_socket(port), cmd, timeout)
    except (ConnectionError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if not reply.get("ok"):
        raise click.ClickException(reply.get("error", "the supervisor refused"))
    return reply


port_option = click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
                           help="Port of the server to control.")


@main.command("scale")
@click.argument("tier", type=click.Choice(["api-server", "engine"]))
@click.argument("count", type=click.IntRange(1, 256))
@port_option
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until the tier has COUNT ready processes.")
@click.option("--timeout", type=float, default=600, show_default=True)
def scale(tier: str, count: int, port: int, wait: bool, timeout: float) -> None:
    """Scale the gateway (api-server) or engine tier to COUNT processes while serving."""
    _ask(port, {"cmd": "scale", "tier": tier, "count": count})
    name = "gateway" if tier == "api-server" else "engine"
    deadline = time.monotonic() + timeout
    while wait:
        procs = _ask(port, {"cmd": "status"})["processes"]
        mine = [p for p in procs if p["tier"] == name]
        if len([p for p in mine if p["state"] == "ready"]) == count and len(mine) == count:
            break
        if time.monotonic() > deadline:
            raise click.ClickException(f"the {name} tier did not reach {count} ready processes in {timeout:.0f}s")
        time.sleep(0.2)
    click.echo(f"{name} tier: {count}")


@main.command("status")
@port_option
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(port: int, as_json: bool) -> None:
    """Print every process of a running server: tier, index, pid, state, restarts, uptime, load."""
    st = _ask(port, {"cmd": "status"})
    if as_json:
        import orjson

        click.echo(orjson.dumps(st, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(f"{st['model']} at {st['url']}  supervisor pid {st['pid']}  up {st['uptime_s']:.0f}s  "
               f"{'PAUSED  ' if st['paused'] else ''}desired: {st['desired']['gateway']} gateways, "
               f"{st['desired']['engine']} engines")
    click.echo(f"{'TIER':8} {'IDX':>3} {'PID':>7} {'STATE':10} {'RESTARTS':>8} {'UPTIME':>8}  LOAD")
    for p in st["processes"]:
        if p["tier"] == "engine":
            load = f"running {p.get('running', '-')} waiting {p.get('waiting', '-')} kv {p.get('kv_used', 0):.0%}"
        else:
            load = f"in-flight {p.get('in_flight', '-')}"
        if p.get("crash_looping"):
            load += "  CRASH-LOOPING" + (f" ({p['last_exit']})" if p.get("last_exit") else "")
        uptime = f"{p['uptime_s']:.0f}s" if p.get("uptime_s") is not None else "-"
        click.echo(f"{p['tier']:8} {p['index']:>3} {p['pid'] or '-':>7} {p['state']:10} {p['restarts']:>8} "
                   f"{uptime:>8}  {load}")


@main.command("stop")
@port_option
def stop(port: int) -> None:
    """Drain and stop a running server (like SIGTERM to its supervisor)."""
    _ask(port, {"cmd": "stop"})
    click.echo("stopping")
