"""The ``launch`` command line: ``launch api-server`` starts and supervises both tiers."""

from __future__ import annotations

import logging
import sys

import click

from zserve.catalog import DEFAULT_CHAT_MODEL, ModelNotFound, resolve
from zserve.proc import set_title, setup_logging

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
@click.option("--engine-threads", type=click.IntRange(1, 1024), default=None, help="CPU threads per engine.")
@click.option("--ready-timeout", type=click.FloatRange(1, 86400), default=600, show_default=True)
@click.option("--shutdown-timeout", type=click.FloatRange(0, 3600), default=10, show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def api_server(count: int, engines: int, model: str, served_model_name: tuple[str, ...], host: str, port: int,
               dtype: str, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
               engine_threads: int | None, ready_timeout: float, shutdown_timeout: float, log_level: str) -> None:
    """Serve MODEL over HTTP with COUNT gateways in front of ENGINES engine workers."""
    import os

    os.environ["ZSERVE_LOG_LEVEL"] = log_level.upper()
    setup_logging("launch")
    set_title("zserve: supervisor")
    try:
        source = resolve(model)
    except ModelNotFound as e:
        raise click.BadParameter(str(e), param_hint="--model") from None
    cfg = ServeConfig(source=source, host=host, port=port, gateways=count, engines=engines, dtype=dtype,
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens, served_model_names=list(served_model_name),
                      engine_threads=engine_threads, ready_timeout=ready_timeout, shutdown_timeout=shutdown_timeout)
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
    except KeyboardInterrupt:
        code = 0
    finally:
        sup.stop()
        logging.getLogger("zserve.launch").info("stopped")
    sys.exit(code)
