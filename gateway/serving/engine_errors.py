"""Engine failures as the API errors a client reads: a full queue is a 429, no engine a 503, a request's own
grammar that cannot be followed a 400, a LoRA adapter the engine has not loaded a 404, anything else a 500."""

from __future__ import annotations

from protocol.constants import ERR_LORA_NOT_LOADED, ERR_STRUCTURED_OUTPUT

from ..engine_client import EngineRequestError, EnginesBusy, NoEngineAvailable
from ..errors import APIError, bad_request

# What a route catches around running a request on the engines, to answer with ``engine_error``.
ENGINE_ERRORS = (EngineRequestError, NoEngineAvailable)


def engine_error(e: Exception) -> APIError:
    if isinstance(e, EnginesBusy):
        return APIError(429, "every engine of the model has a full queue (--max-waiting); retry shortly",
                        code="too_many_requests", headers={"Retry-After": "1"})
    if isinstance(e, NoEngineAvailable):
        return APIError(503, "no engine is available to serve the request; retry shortly", headers={"Retry-After": "1"})
    if isinstance(e, EngineRequestError) and e.code == ERR_STRUCTURED_OUTPUT:
        return bad_request(str(e), code=ERR_STRUCTURED_OUTPUT)  # the request's grammar, not the server, failed
    if isinstance(e, EngineRequestError) and e.code == ERR_LORA_NOT_LOADED:  # as a model name nothing serves
        return APIError(404, str(e), param="model", code="model_not_found")
    return APIError(500, f"generation failed: {e}")
