"""Codes every zserve process agrees on: exit codes the supervisor acts on, error codes on the wire,
and limits both the HTTP schemas and the engine protocol enforce. Defined once, here."""

from __future__ import annotations

# -- exit codes: what a child's exit tells the supervisor ---------------------------------------
EXIT_CUT_OFF = 3
"""A gateway's exit code when the shutdown timeout cut in-flight requests off (it drained, but not cleanly)."""

EXIT_BOOT_ERROR = 4
"""A child's exit code for a configuration that can never work (a KV cache too small for one request):
restarting it would only fail again, so the supervisor stops at once instead of backing off."""

LISTEN_BACKLOG = 2048
"""Connections the shared listening socket queues before any process accepts them: the supervisor's listen() and
every gateway's (aiohttp calls listen() again on the inherited socket, with its own default of 128 otherwise)."""

# -- error codes in ErrorMessage.code ------------------------------------------------------------
ERR_ENGINE_DRAINING = "engine_draining"
"""An engine refused a request because it is draining, or handed back one it had not finished when its drain timeout
came; the gateway sends it to another engine (one that had produced tokens continues there: a migration)."""
ERR_GROUP_LOST = "group_lost"
"""An expert-parallel engine's group lost a member while the request ran there; the gateway re-submits it, with the
tokens it had produced, once an engine of its model is ready again (the group re-formed)."""
ERR_ENGINE_BUSY = "engine_busy"
"""An engine refused a request because its queue holds ``max_waiting`` requests already; the gateway tries
another engine of the model, and answers 429 when every one is full."""
ERR_BAD_FRAME = "bad_frame"
"""An engine could not decode a frame that named no request."""

# -- why a gateway moved a running request to another engine (the label of zserve_migrations_total) --------------
MIGRATION_CAUSES = ("engine_lost", "drain_timeout", "group_lost")
"""engine_lost: its connection dropped (the engine died, hung and was killed, or its host was cut off);
drain_timeout: a draining engine handed it back at its --shutdown-timeout (ERR_ENGINE_DRAINING);
group_lost: its expert-parallel group lost a member (ERR_GROUP_LOST)."""

# -- error codes in RequestOutput.error_code (with finish_reason "error") -------------------------
ERR_STRUCTURED_OUTPUT = "structured_output"
"""The request's structured-output grammar failed in the engine: it does not compile for the model's vocabulary,
or it reached a point that no token of the vocabulary continues (it needs a byte no token holds). The request's
grammar is at fault, not the server: the gateway answers 400 (in a stream, an error event of that status)."""

ERR_LORA_NOT_LOADED = "lora_not_loaded"
"""The request names a LoRA adapter (``AddRequest.lora``) that the engine has not loaded (or the engine serves no
adapters): the gateway answers 404 ``model_not_found``, as for a model name it does not know."""

# -- limits shared by the HTTP schemas and the engine protocol -----------------------------------
MAX_LOGIT_BIAS = 1024

MAX_GRAMMAR_CHARS = 1 << 18
"""The longest structured-output spec (a JSON schema, regex or grammar text) a request may carry."""

MAX_JSON_DEPTH = 64
"""The deepest a request's JSON may nest (containers in containers, the body itself the first), in its body and in
the strings that hold JSON (``function.arguments``, a schema as text). Far past what clients send (OpenAI's strict
schemas nest 10 levels at most) and short of every limit downstream: llguidance reads 128 levels, orjson writes 254."""
