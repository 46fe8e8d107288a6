"""A request waits for an engine the supervisor reports ready but that has not yet greeted its gateway.

A replacement engine (a rolling restart of a model's only engine, a restart after a crash) is ready, and the hold
on its model released, before every gateway's socket has reconnected to it: ZeroMQ retries a lost connection up
to a second apart. A request in that gap found no engine and got a 503 although the engine was up (seen in
tests/e2e/test_holds_per_model.py under load). It now waits for the greeting (up to ``CONNECT_WAIT``); without
such an engine it still fails at once, and a waiting request fails as soon as what it waits for is gone.

Real ZeroMQ sockets: the engine is a ROUTER bound only after the request came, answering ``ClientHello`` with
``EngineHello`` as an engine does.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from gateway.engine_client import EngineClient, NoEngineAvailable
from protocol import AddRequest, ClientHello, EngineHello, SamplingParams, decode, encode
from protocol.cluster import ClusterState, EngineInfo

MODEL = "m"


class Sink:
    def __init__(self) -> None:
        self.outputs: list = []
        self.failed = asyncio.get_running_loop().create_future()

    def output(self, out) -> None:
        self.outputs.append(out)

    def fail(self, error: Exception) -> None:
        if not self.failed.done():
            self.failed.set_result(error)


def ready_at(endpoint: str, version: int = 2) -> ClusterState:
    return ClusterState(version=version, engines=(EngineInfo(0, endpoint, "ready", model=MODEL),))


async def serve_engine(endpoint: str) -> tuple[zmq.asyncio.Socket, list]:
    """Bind the engine's socket; greet the first client; return it with what it received after the greeting."""
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    ident, *frames = await asyncio.wait_for(router.recv_multipart(), 10)
    assert isinstance(decode(frames), ClientHello)
    hello = EngineHello(0, MODEL, 8, 64, 100, (2,), 1, "cpu", "float32")
    await router.send_multipart([ident, *encode(hello)])
    _, *frames = await asyncio.wait_for(router.recv_multipart(), 10)
    return router, [decode(frames)]


def submit(client: EngineClient, sink: Sink, request_id: str = "r1") -> None:
    client.submit(request_id, [1, 2, 3], SamplingParams(max_tokens=4), sink, model=MODEL)


@pytest.fixture
def endpoint(tmp_path) -> str:
    return f"ipc://{tmp_path}/engine-0.sock"


def test_a_request_waits_for_a_ready_engine_that_has_not_greeted_the_gateway_yet(endpoint):
    async def scenario() -> None:
        client = EngineClient([])
        await client.apply_cluster(ready_at(endpoint))  # ready by the supervisor's word; nothing listens yet
        sink = Sink()
        submit(client, sink)  # raised NoEngineAvailable (a 503) before
        assert client.in_flight == 1
        router, got = await serve_engine(endpoint)  # the engine comes up: the gateway connects and is greeted
        assert isinstance(got[0], AddRequest) and got[0].request_id == "r1"
        assert not sink.failed.done()
        router.close()
        await client.close()

    asyncio.run(scenario())


def test_without_an_engine_on_its_way_a_request_still_fails_at_once(endpoint):
    async def scenario() -> None:
        client = EngineClient([])
        await client.apply_cluster(ClusterState(version=2, engines=(EngineInfo(0, endpoint, "draining",
                                                                                 model=MODEL),)))
        with pytest.raises(NoEngineAvailable):
            submit(client, Sink())
        assert client.in_flight == 0
        await client.close()

    asyncio.run(scenario())


def test_a_waiting_request_fails_as_soon_as_its_engine_leaves_the_cluster(endpoint):
    async def scenario() -> None:
        client = EngineClient([])
        await client.apply_cluster(ready_at(endpoint))
        sink = Sink()
        submit(client, sink)
        await client.apply_cluster(ClusterState(version=3))  # the supervisor reports it gone
        error = await asyncio.wait_for(sink.failed, 1.0)  # not after CONNECT_WAIT
        assert isinstance(error, NoEngineAvailable) and client.in_flight == 0
        await client.close()

    asyncio.run(scenario())


def test_admission_lets_a_request_through_to_wait_for_an_engine_on_its_way(endpoint):
    """Admission refused with a 503 before the engine client could wait: a gateway started while serving (a rolling
    restart) answered a request of a model whose engines had not greeted it yet (tests/e2e/test_holds_per_model)."""
    from types import SimpleNamespace

    from gateway.engine_client import ModelEngines
    from gateway.errors import APIError
    from gateway.serving.admission import admit

    async def scenario() -> None:
        client = EngineClient([])
        engines = ModelEngines(client, MODEL)
        state = SimpleNamespace(render_only=False, hold=None, engines=engines, check_task=lambda *_: None)
        await client.apply_cluster(ready_at(endpoint))
        assert not engines.has_ready and engines.coming
        admit(state)  # admitted: the request waits for the greeting
        await client.apply_cluster(ClusterState(version=3, engines=(EngineInfo(0, endpoint, "draining",
                                                                                 model=MODEL),)))
        assert not engines.coming
        with pytest.raises(APIError) as refused:
            admit(state)
        assert refused.value.status == 503
        await client.close()

    asyncio.run(scenario())


def test_a_lost_greeting_is_sent_again_when_the_engine_shows_it_knows_the_gateway(endpoint):
    """The gateway greets an engine once per handshake, and an engine answers only a greeting: a greeting lost on the
    way (the connection not ready for it) left the engine up, publishing its stats to the gateway, and never routed
    to (seen once in tests/e2e/test_migration.py after an engine was killed twice in 6 s). Stats from an engine
    without a hello now bring a new greeting."""
    from protocol import EngineStats

    async def scenario() -> None:
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        client = EngineClient([])
        await client.apply_cluster(ready_at(endpoint))
        ident, *frames = await asyncio.wait_for(router.recv_multipart(), 10)
        assert isinstance(decode(frames), ClientHello)  # ... and not answered: the greeting is lost
        greeted = []
        for _ in range(40):  # the engine publishes its stats to the clients it knows, every 0.1 s
            await router.send_multipart([ident, *encode(EngineStats(0, 0, 0, 0.0, 0, 0, timestamp=1.0))])
            try:
                _, *frames = await asyncio.wait_for(router.recv_multipart(), 0.1)
                greeted.append(decode(frames))
                break
            except TimeoutError:
                continue
        assert greeted and isinstance(greeted[0], ClientHello)
        await router.send_multipart([ident, *encode(EngineHello(0, MODEL, 8, 64, 100, (2,), 1, "cpu", "float32"))])
        for _ in range(100):
            if client.engines[endpoint].routable:
                break
            await asyncio.sleep(0.01)
        assert client.engines[endpoint].routable
        router.close()
        await client.close()

    asyncio.run(scenario())


def test_a_gateway_whose_old_connection_to_a_restarted_engine_is_still_open_is_greeted_on_its_new_one(endpoint):
    """A restarted engine's endpoint is reached first by the gateway's old socket (ZeroMQ reconnects it on its own);
    the supervisor's cluster state then drops the dead engine (the gateway closes that socket) and brings the new
    one (a new socket, the same identity), and the two can overlap at the engine. The engine's socket
    (``bind_engine_socket``) hands the identity over to the newest connection, so its greeting is answered. Without
    handover the engine dropped everything the new connection sent, for its whole life, and that gateway never
    routed to it (seen in tests/e2e/test_migration.py after an engine was killed twice)."""
    from engine_worker.server import bind_engine_socket

    async def scenario() -> None:
        ctx = zmq.asyncio.Context.instance()
        router = bind_engine_socket(ctx, endpoint)
        hello = EngineHello(0, MODEL, 8, 64, 100, (2,), 1, "cpu", "float32")

        async def engine() -> None:  # answers every greeting, as an engine does
            while True:
                ident, *frames = await router.recv_multipart()
                if isinstance(decode(frames), ClientHello):
                    await router.send_multipart([ident, *encode(hello)])

        answering = asyncio.create_task(engine())
        client = EngineClient([])
        old = ctx.socket(zmq.DEALER)  # the gateway's old connection, still open at the engine
        old.setsockopt(zmq.LINGER, 0)
        old.setsockopt(zmq.IDENTITY, client.client_id.encode())
        old.connect(endpoint)
        await old.send_multipart(encode(ClientHello(client.client_id)))
        assert isinstance(decode(await asyncio.wait_for(old.recv_multipart(), 10)), EngineHello)
        await client.apply_cluster(ready_at(endpoint))  # the new connection, same identity
        for _ in range(300):
            if client.engines[endpoint].routable:
                break
            await asyncio.sleep(0.01)
        assert client.engines[endpoint].routable, "the new connection's greeting was not answered"
        old.close()
        answering.cancel()
        router.close()
        await client.close()

    asyncio.run(scenario())
