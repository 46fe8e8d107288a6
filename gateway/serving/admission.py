"""Whether a request may start now (``admit``), and the refusals it raises.

Every generation and pooling route calls ``admit`` after validating its body and before any side effect,
so a refusal costs nothing to serve again: the gateway's middleware (``gateway.admission``) holds a
request that ``ScalingPaused`` refused and serves it again from the top once its model's hold is over. What a
hold does (wait or refuse, the 503's code and message) is ``protocol.holds.HOLD_REASONS``; only the holds on the
request's own model count, so a resize or a reload of one model never holds another's requests.
"""

from __future__ import annotations

from protocol.holds import HOLD_REASONS, Hold

from ..engine_client import NoEngineAvailable
from ..errors import APIError, bad_request
from ..state import ModelState
from .engine_errors import engine_error


class ScalingPaused(APIError):
    """A request refused because a hold that waits covers its model (a resize, a rolling restart of its only
    engine; ``admit``): the middleware holds it for the hold to end rather than sending this 503 at once."""

    def __init__(self, hold: Hold, model_id: str):
        reason = HOLD_REASONS[hold.reason]
        super().__init__(503, hold.message(), code=reason.code, headers={"Retry-After": reason.retry_after})
        self.model_id = model_id  # the request's model: the middleware waits for its holds only


def refusal(hold: Hold, model_id: str) -> APIError:
    """The 503 of a hold on ``model_id``: raised as ``ScalingPaused`` (held by the middleware) when the hold
    waits."""
    if hold.waits:
        return ScalingPaused(hold, model_id)
    reason = HOLD_REASONS[hold.reason]
    return APIError(503, hold.message(), code=reason.code, headers={"Retry-After": reason.retry_after})


RENDER_ONLY = ("this is a render-only server (launch render): it has no engine to run requests on; "
               "the render routes (/v1/chat/completions/render, /v1/completions/render, /v1/messages/render, "
               "/v1/responses/render) take the same bodies and answer what the engine would get")


def admit(state: ModelState, task: str = "generate", parts: int = 1, param: str = "n", what: str = "choices") -> None:
    """Refuse new work before any byte is sent: a render-only server, a hold on the model (one that waits is
    held by the middleware, ``ScalingPaused``), no engine, a model that does not do ``task`` (generate, embed,
    classify), or a request of more ``parts`` than an engine queues (a 400 naming ``param``).

    Every generation and pooling route comes through here after validating its body, so a render
    server answers a valid request with this clear 400 in the route's own error shape (not retried by
    SDKs: retrying cannot help), and an invalid one with the same 400 the api-server gives.

    Each part of a request (a choice, a pooled input) waits in an engine's queue as a request of its own, and a
    request is served whole or refused whole (``choices.ChoiceRun``, ``routers.pooling``: the first part every
    engine refuses ends it, and its other parts are aborted, so it is one 429). One with more parts than an engine
    queues (``--max-waiting``, which engines announce) could only ever be refused, so it is a 400 that says the
    limit."""
    if state.render_only:
        raise bad_request(RENDER_ONLY, code="render_only")
    hold = state.hold
    if hold is not None:
        raise refusal(hold, state.model.model_id)
    if not state.engines.has_ready and not state.engines.coming:
        raise engine_error(NoEngineAvailable("no engine is ready"))
    state.check_task(task)
    limit = state.engines.max_waiting
    if limit is not None and parts > limit:
        raise bad_request(f"this request makes {parts} {what}, each of which waits in an engine's queue; the engines "
                          f"of this model queue at most {limit} (--max-waiting) and a request is admitted whole, so "
                          f"it may make at most {limit}", param=param)
