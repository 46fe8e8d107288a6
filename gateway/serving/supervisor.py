"""Asking the supervisor: a control route of any family sends its command over the control socket and waits for the
one answer (``zserve.control``), the supervisor's refusals and silences mapped to HTTP statuses in one place."""

from __future__ import annotations

from typing import TypeVar

from protocol import ProtocolError
from protocol.control import ControlMessage, ErrorReply
from zserve import control

from ..errors import APIError
from ..state import GatewayState

R = TypeVar("R", bound=ControlMessage)

CONTROL_TIMEOUT = 10.0  # seconds the supervisor has to answer pause and resume (every gateway acknowledges)


async def forward(state: GatewayState, cmd: ControlMessage, answer: type[R], timeout: float = CONTROL_TIMEOUT,
                   refused: int = 500, goes_on: bool = False) -> R | None:
    """Send ``cmd`` to the supervisor and return its ``answer``. ``refused`` is the status of an ``ErrorReply``
    (a request the supervisor cannot carry out); no supervisor, or none answering, is a 503. With ``goes_on``, a
    command that outlasts ``timeout`` (the supervisor carries it on alone: a rolling restart) returns None."""
    if not state.control_socket:
        raise APIError(503, "this gateway runs without a supervisor; cluster control is unavailable")
    try:
        reply = await control.request_async(state.control_socket, cmd, timeout=timeout)
    except TimeoutError as e:
        if goes_on:
            return None
        raise APIError(503, f"the supervisor did not answer: {e}", headers={"Retry-After": "1"}) from None
    except (OSError, ConnectionError) as e:
        raise APIError(503, f"the supervisor did not answer: {e}", headers={"Retry-After": "1"}) from None
    except ProtocolError as e:
        raise APIError(500, f"the supervisor's reply was malformed: {e}") from None
    if isinstance(reply, ErrorReply):
        raise APIError(refused, reply.error)
    if not isinstance(reply, answer):
        raise APIError(500, f"the supervisor answered {reply.TYPE} to {cmd.TYPE}")
    return reply
