"""An engine is assembled in one place (``engine_worker.engine.Engine``) from one ``EngineLaunch``: the kind comes
from the model (an encoder pools, any other model generates), the runner and scheduler are sized by the launch's
``EngineConfig``, and the engine announces what it was built with. It then serves requests like the process does."""

from __future__ import annotations

import pytest

from engine_worker.engine import Engine
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from engine_worker.server import EngineServer
from protocol.messages import SamplingParams
from zserve import catalog
from zserve.catalog import ModelNotFound, ModelSource, resolve
from zserve.config import EngineConfig
from zserve.launch_spec import EngineLaunch
from zserve.proc import StatusPipe


def test_a_generating_engine_is_sized_by_its_launch_value_and_generates(tmp_path):
    cfg = EngineConfig(dtype="float32", max_num_seqs=3, max_model_len=128, max_num_batched_tokens=2, block_size=8,
                       seed=5, threads=1)
    launch = EngineLaunch(4, f"ipc://{tmp_path}/e.sock", resolve("tiny-random"), cfg)
    engine = Engine.build(launch)
    assert isinstance(engine.scheduler, Scheduler) and engine.grammars is not None and not engine.expert_parallel
    # The step budget is at least one token per sequence; the context is what the launch asked for.
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (3, 3)
    assert (engine.runner.max_model_len, engine.runner.block_size) == (128, 8)
    hello = engine.hello
    assert (hello.rank, hello.model_id, hello.max_num_seqs, hello.max_model_len, hello.dtype, hello.tasks) == (
        4, "tiny-random", 3, 128, "float32", ("generate", "embed"))
    engine.scheduler.add(Sequence("a", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    assert sum(len(o.new_token_ids) for o in run_until_done(engine.scheduler)["a"]) == 4
    server = engine.server(launch, StatusPipe(None))
    try:
        assert type(server) is EngineServer and server.max_waiting == cfg.max_waiting
    finally:
        server.sock.close(0)
    engine.grammars.close()


def test_an_encoder_builds_a_pooling_engine(tmp_path):
    try:
        path = catalog.minilm_model_dir()
    except ModelNotFound as e:
        pytest.skip(str(e))
    source = ModelSource("all-MiniLM-L6-v2", "hf", str(path), str(path))
    engine = Engine.build(EngineLaunch(0, f"ipc://{tmp_path}/e.sock", source,
                                       EngineConfig(dtype="float32", max_model_len=64, threads=1)))
    assert engine.grammars is None and "embed" in engine.hello.tasks and engine.hello.max_model_len == 64
    assert engine.scheduler.max_num_batched_tokens == 4096 and engine.scheduler.max_num_seqs == 256


def test_the_engine_package_has_no_import_circle():
    """``ep_server`` builds on ``server`` one way; ``engine`` assembles and picks between them."""
    from tests.unit.import_graph import cycles, import_graph, within

    assert cycles(within(import_graph(), "engine_worker")) == []
