"""An ``EngineClient`` with one ready engine whose socket is a list, for tests of what the gateway sends engines."""

from __future__ import annotations

from gateway.engine_client import EngineClient, EngineConnection
from protocol import EngineHello, decode


def fake_engine_client(model: str = "m") -> tuple[EngineClient, EngineConnection, list]:
    """The client, its one engine ("fake": feed it outputs with ``client._dispatch(eng, encode(...))``) and the
    list of decoded messages the client sent it."""
    client = EngineClient([])
    eng = EngineConnection("fake", None, None)  # type: ignore[arg-type]
    eng.hello = EngineHello(0, model, 8, 64, 100, (2,), 1, "cpu", "float32")
    eng.known_rank = eng.hello.rank  # (as the client's own handling of a hello sets it)
    client.engines["fake"] = eng
    client._update_ready()
    sent: list = []
    client._send_now = lambda e, frames: sent.append(decode(frames))  # type: ignore[method-assign]
    return client, eng, sent
