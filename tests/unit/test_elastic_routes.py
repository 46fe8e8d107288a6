"""Elastic expert parallelism at the gateway, in process with real aiohttp and a fake supervisor: ``POST
/scale_elastic_ep`` checks its body, forwards an ``ElasticScaleCommand`` and maps each outcome to vLLM's status;
``/is_scaling_elastic_ep`` reads the cluster state; and while a resize pauses admission new requests are held
(``serving.admission.ScalingPaused``) until it ends or ``--scaling-wait`` runs out, whereas an operator's pause refuses
them at once."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.admission import GUARD, Guard
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient, ModelEngines
from gateway.security import Keys
from gateway.serving.admission import admit
from gateway.state import STATE, GatewayState, ModelState, ServedModel
from protocol.cluster import ClusterState
from protocol.control import (
    COMMANDS,
    DEFAULT_DRAIN_TIMEOUT,
    ELASTIC_OUTCOMES,
    ControlMessage,
    ElasticScaleCommand,
    ElasticScaleReply,
    ErrorReply,
    decode_line,
    encode_line,
)
from protocol.holds import Hold
from zserve.catalog import resolve

SCALING = ClusterState(version=2, scaling="draining", holds=(Hold("resizing", "tiny-random", detail="draining"),))
RESUMED = ClusterState(version=3)
CALLS: web.AppKey[list] = web.AppKey("test_calls", list)  # the bodies ``POST /held`` ran with


class _Words:
    """A stand-in tokenizer: one token per word."""

    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def _state(control_socket: str | None = None, scaling_wait: float = 5.0) -> GatewayState:
    engines = EngineClient([])
    model = ServedModel(resolve("tiny-random"), ["tiny-random", "tiny"], _Words(), None,  # type: ignore[arg-type]
                        ModelEngines(engines, "tiny-random"))
    return GatewayState(0, [model], engines, control_socket=control_socket, scaling_wait=scaling_wait)


def _app(state: GatewayState, max_concurrent: int | None = None) -> web.Application:
    """The gateway's app plus ``POST /held``: a generation route in miniature (``admit``, then 200), its model
    always ready, counting how often it ran."""
    app = build_app(state, guard=Guard(Keys(), metrics_auth=False, max_concurrent=max_concurrent))
    ready = ModelState(state, SimpleNamespace(model_id="tiny-random",
                                              engines=SimpleNamespace(has_ready=True, tasks=frozenset(),
                                                                      max_waiting=None)),  # type: ignore[arg-type]
                       "stub")
    calls = []

    async def held(request: web.Request) -> web.Response:
        calls.append(await request.json())  # the body, read again on each try
        admit(ready)
        return web.json_response({"served": len(calls)})

    app.router.add_post("/held", held)
    app[CALLS] = calls
    return app


def _run(app: web.Application, check: Callable[[TestClient], Awaitable[None]]) -> None:
    async def run() -> None:
        async with TestClient(TestServer(app)) as client:
            await check(client)
    asyncio.run(run())


@pytest.fixture()
def socket_path():
    """A path for the fake supervisor's Unix socket, short enough for sun_path."""
    where = tempfile.mkdtemp(prefix="zs-", dir="/tmp")
    yield f"{where}/ctl.sock"
    shutil.rmtree(where, ignore_errors=True)


class FakeSupervisor:
    """The supervisor's control socket: one command line in, ``answer(command)``'s reply out."""

    def __init__(self, path: str, answer: Callable[[ControlMessage], ControlMessage]):
        self.path = path
        self.answer = answer
        self.commands: list[ControlMessage] = []
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> FakeSupervisor:
        self.server = await asyncio.start_unix_server(self._serve, self.path)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cmd = decode_line((await reader.readline()).rstrip(b"\n"), COMMANDS)
        self.commands.append(cmd)
        writer.write(encode_line(self.answer(cmd)))
        await writer.drain()
        writer.close()


def _scale(socket_path: str, body, answer: Callable[[ControlMessage], ControlMessage]):
    """POST ``body`` to /scale_elastic_ep with a fake supervisor; (status, JSON, commands it received)."""
    out = {}

    async def check(client: TestClient) -> None:
        async with FakeSupervisor(socket_path, answer) as sup:
            kwargs = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
            resp = await client.post("/scale_elastic_ep", **kwargs)
            out.update(status=resp.status, body=await resp.json(), commands=sup.commands)

    _run(_app(_state(socket_path)), check)
    return out["status"], out["body"], out["commands"]


# -- POST /scale_elastic_ep ---------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[4]", None),
    ({}, "new_data_parallel_size"),
    ({"new_data_parallel_size": 0}, "new_data_parallel_size"),
    ({"new_data_parallel_size": 257}, "new_data_parallel_size"),
    ({"new_data_parallel_size": True}, "new_data_parallel_size"),
    ({"new_data_parallel_size": "4"}, "new_data_parallel_size"),
    ({"new_data_parallel_size": 2.5}, "new_data_parallel_size"),
    ({"new_data_parallel_size": 4, "drain_timeout": 0}, "drain_timeout"),
    ({"new_data_parallel_size": 4, "drain_timeout": -1}, "drain_timeout"),
    ({"new_data_parallel_size": 4, "drain_timeout": True}, "drain_timeout"),
    ({"new_data_parallel_size": 4, "drain_timeout": "60"}, "drain_timeout"),
    ({"new_data_parallel_size": 4, "model": 7}, "model"),
])
def test_a_bad_scale_body_is_a_400_naming_the_field_and_reaches_no_supervisor(socket_path, body, param):
    status, err, commands = _scale(socket_path, body, lambda c: pytest.fail("forwarded a bad body"))
    assert status == 400 and commands == []
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param
    assert err["error"]["message"]


def test_a_resize_is_forwarded_with_its_size_drain_timeout_and_model_id(socket_path):
    ok = lambda c: ElasticScaleReply("ok", "Scaled to 4 data parallel engines", 4, pause_s=2.5)  # noqa: E731
    status, body, commands = _scale(socket_path, {"new_data_parallel_size": 4, "drain_timeout": 30, "model": "tiny"},
                                    ok)
    assert status == 200
    assert body == {"message": "Scaled to 4 data parallel engines", "new_data_parallel_size": 4, "pause_s": 2.5,
                    "gateway": 0}
    assert commands == [ElasticScaleCommand(4, 30.0, "tiny-random")]  # the served name, as the supervisor's id
    _, _, commands = _scale(socket_path, {"new_data_parallel_size": 2}, ok)
    assert commands == [ElasticScaleCommand(2, DEFAULT_DRAIN_TIMEOUT, None)]


def test_a_model_no_one_serves_is_a_404(socket_path):
    status, err, commands = _scale(socket_path, {"new_data_parallel_size": 2, "model": "nope"},
                                   lambda c: pytest.fail("forwarded"))
    assert status == 404 and err["error"]["code"] == "model_not_found" and commands == []


@pytest.mark.parametrize("outcome", [o for o in ELASTIC_OUTCOMES if o != "ok"])
def test_each_failed_outcome_answers_its_status_with_the_supervisors_message(socket_path, outcome):
    reply = ElasticScaleReply(outcome, f"resize {outcome}", 2, pause_s=1.0)
    status, err, _ = _scale(socket_path, {"new_data_parallel_size": 4}, lambda c: reply)
    assert status == ELASTIC_OUTCOMES[outcome]
    assert err["error"]["code"] == outcome
    assert err["error"]["message"].startswith(f"resize {outcome}") and "2 members" in err["error"]["message"]
    assert "new_data_parallel_size 4" in err["error"]["message"]


def test_a_request_the_supervisor_cannot_carry_out_is_a_400(socket_path):
    status, err, _ = _scale(socket_path, {"new_data_parallel_size": 4},
                            lambda c: ErrorReply("model tiny-random is not expert parallel"))
    assert status == 400 and err["error"]["message"] == "model tiny-random is not expert parallel"


def test_without_a_supervisor_scaling_is_a_503(socket_path):
    async def check(client: TestClient) -> None:
        resp = await client.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
        assert resp.status == 503 and "without a supervisor" in (await resp.json())["error"]["message"]

    _run(_app(_state()), check)

    async def unreachable(client: TestClient) -> None:  # a socket path nobody listens on
        resp = await client.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"

    _run(_app(_state(socket_path)), unreachable)


# -- /is_scaling_elastic_ep ---------------------------------------------------------------------------

def test_is_scaling_reflects_the_cluster_state_on_get_and_post():
    state = _state()

    async def check(client: TestClient) -> None:
        for cluster, want in ((None, {"is_scaling_elastic_ep": False, "phase": None}),
                              (ClusterState(version=1, scaling="starting"),  # new members load; still serving
                               {"is_scaling_elastic_ep": True, "phase": "starting"}),
                              (SCALING, {"is_scaling_elastic_ep": True, "phase": "draining"}),
                              (RESUMED, {"is_scaling_elastic_ep": False, "phase": None})):
            if cluster is not None:
                state.apply_cluster(cluster)
            for method in ("GET", "POST"):
                resp = await client.request(method, "/is_scaling_elastic_ep")
                assert resp.status == 200 and await resp.json() == {**want, "gateway": 0}

    _run(_app(state), check)


# -- holding requests during a resize -----------------------------------------------------------------

def test_a_request_during_a_resize_is_held_and_served_once_it_ends():
    state = _state(scaling_wait=10)
    state.apply_cluster(SCALING)
    app = _app(state)

    async def check(client: TestClient) -> None:
        held = asyncio.create_task(client.post("/held", json={"n": 1}))
        await asyncio.sleep(0.2)
        assert not held.done() and app[CALLS] == [{"n": 1}]  # refused once by admit, now waiting
        state.apply_cluster(ClusterState(version=3, scaling="regrouping",  # the next phase: still held
                                         holds=(Hold("resizing", "tiny-random", detail="regrouping"),)))
        await asyncio.sleep(0.1)
        assert not held.done()
        health = await client.get("/health")  # monitoring answers all along
        assert (await health.json())["paused"] is True
        status = await client.get("/is_scaling_elastic_ep")
        assert (await status.json())["phase"] == "regrouping"
        state.apply_cluster(RESUMED)
        resp = await asyncio.wait_for(held, 2)
        assert resp.status == 200 and await resp.json() == {"served": 2}
        assert app[CALLS] == [{"n": 1}, {"n": 1}]  # the same body, read again

    _run(app, check)


def test_a_resize_that_outlasts_scaling_wait_is_a_503_with_retry_after():
    state = _state(scaling_wait=0.3)
    state.apply_cluster(SCALING)

    async def check(client: TestClient) -> None:
        start = time.monotonic()
        resp = await client.post("/held", json={})
        waited = time.monotonic() - start
        err = (await resp.json())["error"]
        assert resp.status == 503 and resp.headers["Retry-After"] == "5" and err["code"] == "server_scaling"
        assert "draining" in err["message"] and 0.25 <= waited < 2

    _run(_app(state), check)


def test_scaling_wait_zero_refuses_at_once():
    state = _state(scaling_wait=0)
    state.apply_cluster(SCALING)

    async def check(client: TestClient) -> None:
        resp = await client.post("/held", json={})
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "server_scaling"

    _run(_app(state), check)


def test_an_operators_pause_still_refuses_at_once():
    state = _state(scaling_wait=10)
    state.apply_cluster(ClusterState(version=2, holds=(Hold("paused"),)))

    async def check(client: TestClient) -> None:
        start = time.monotonic()
        resp = await client.post("/held", json={})
        assert time.monotonic() - start < 1
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "server_paused"

    _run(_app(state), check)


def test_a_resize_that_hands_over_to_an_operators_pause_refuses_the_held_request():
    state = _state(scaling_wait=10)
    state.apply_cluster(SCALING)

    async def check(client: TestClient) -> None:
        held = asyncio.create_task(client.post("/held", json={}))
        await asyncio.sleep(0.2)
        state.apply_cluster(ClusterState(version=3, holds=(Hold("paused"),)))  # resized, but /pause came meanwhile
        resp = await asyncio.wait_for(held, 2)
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "server_paused"

    _run(_app(state), check)


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"input": "two words"}),
                                        ("/invocations", {"input": "two words"})])
def test_real_routes_are_held_too_and_then_go_on_past_admission(path, body):
    state = _state(scaling_wait=10)
    state.apply_cluster(SCALING)

    async def check(client: TestClient) -> None:
        held = asyncio.create_task(client.post(path, json=body))
        await asyncio.sleep(0.2)
        assert not held.done()
        state.apply_cluster(RESUMED)
        resp = await asyncio.wait_for(held, 2)
        err = (await resp.json())["error"]
        assert resp.status == 503 and "no engine" in err["message"]  # past the pause: no engine runs in this test

    _run(_app(state), check)


def test_a_held_request_keeps_its_concurrency_slot_and_status_routes_still_answer():
    state = _state(scaling_wait=10)
    state.apply_cluster(SCALING)
    app = _app(state, max_concurrent=1)
    assert app[GUARD].max_concurrent == 1

    async def check(client: TestClient) -> None:
        held = asyncio.create_task(client.post("/held", json={}))
        await asyncio.sleep(0.2)
        assert app[STATE].hold_for("tiny-random").waits and app[GUARD].active == 1
        assert (await client.post("/held", json={})).status == 429  # held requests stay bounded
        assert (await client.get("/is_scaling_elastic_ep")).status == 200
        state.apply_cluster(RESUMED)
        assert (await asyncio.wait_for(held, 2)).status == 200

    _run(app, check)


def test_scaling_wait_is_checked():
    assert GatewayConfig(scaling_wait=0).scaling_wait == 0
    assert GatewayConfig.from_json(GatewayConfig(scaling_wait=2.5).to_json()).scaling_wait == 2.5
    for bad in (-1, 3601, True, "30"):
        with pytest.raises(ValueError, match="scaling_wait"):
            GatewayConfig(scaling_wait=bad)
