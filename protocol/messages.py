"""The messages that cross between gateways and engines over ZeroMQ.

(The supervisor talks to its children over pipes, with the lines of ``protocol.control``.)

Each message is a frozen dataclass. Scalar fields travel in an orjson header; token-id and float
arrays travel as raw little-endian binary frames (see ``codec``). Every field is validated when a
message is decoded (and when one is built), so a process never acts on a malformed value.

Bump ``PROTOCOL_VERSION`` on any incompatible change; peers reject other versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .constants import MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS
from .validate import ProtocolError, check, is_int, is_num

PROTOCOL_VERSION = 13

MAX_REQUEST_ID_LEN = 128
MAX_LORA_NAME_LEN = 256
MAX_TENANT_NAME_LEN = 64
# A tenant's scheduling weight: its share of a contended engine's tokens (``engine_worker.fairness``).
MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 0.01, 1000.0
MAX_TOKENS_LIMIT = 1 << 20
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_LOGPROBS = 20
MAX_BATCH_ITEMS = 65536
MAX_ERROR_CHARS = 4096

FINISH_REASONS = ("stop", "length", "abort", "error")

# What ``SamplingParams.structured`` constrains the output to: (kind, spec) with kind one of
#   json  - spec is a JSON schema (JSON text); the output is one JSON value it accepts
#   regex - spec is a regular expression (Rust ``regex`` syntax) the whole output matches
#   lark  - spec is a Lark grammar (llguidance's dialect: ``%json{...}`` embeds a schema)
# The gateway turns OpenAI's response_format, vLLM's structured_outputs (json, regex, choice,
# grammar) and forced tool calls into one of these; the engine compiles it into token masks.
STRUCTURED_KINDS = ("json", "regex", "lark")

# What a model can be asked to do (EngineHello.tasks): generate tokens, or pool its hidden states
# into one vector per input (embed), or score an input with a classification head (classify: one
# logit per label; a single-label head is a cross-encoder's relevance score), or turn speech into text
# (transcribe) or into English text (translate: ``protocol.speech``).
MODEL_TASKS = ("generate", "embed", "classify", "transcribe", "translate")
POOLING_TASKS = ("embed", "classify")
MAX_LABELS = 4096
MAX_POOLED_SIZE = 1 << 16  # floats in one pooled output


def _metric(kind: str, name: str, doc: str, **default: Any) -> Any:
    """A message field that gateways export as a Prometheus metric: ``kind`` is gauge or counter."""
    assert kind in ("gauge", "counter")
    return field(metadata={"metric": (kind, name, doc)}, **default)


_EXACT_NUM = (int, float)


def valid_trace_id(value: object) -> bool:
    """A client's request id as logs may carry it: 1..128 printable ASCII characters, no spaces."""
    return isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID_LEN and value.isascii() and value.isprintable() \
        and " " not in value


def valid_lora_name(value: object) -> bool:
    """A LoRA adapter's name as requests and the command line give it (it is also a served model name):
    1..256 printable characters."""
    return isinstance(value, str) and 0 < len(value) <= MAX_LORA_NAME_LEN and value.isprintable()


def valid_tenant_name(value: object) -> bool:
    """A tenant's name (``zserve.tenants``): 1..64 characters of letters, digits and ``-_.:@``; it labels metrics,
    so nothing that needs quoting."""
    return isinstance(value, str) and 0 < len(value) <= MAX_TENANT_NAME_LEN and value.isascii() \
        and all(c.isalnum() or c in "-_.:@" for c in value)


def _check_request_id(rid: object) -> None:
    check(isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_LEN,
          "request_id must be a non-empty str of at most 128 chars")


def _check_token_ids(ids: object, what: str, vocab_limit: int = 1 << 31) -> None:
    if not isinstance(ids, tuple):
        raise ProtocolError(f"{what} must be a tuple of ints")
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_limit):
        return  # the common case, checked in C; below, the first bad id is named
    for t in ids:
        if not (is_int(t) and 0 <= t < vocab_limit):
            raise ProtocolError(f"{what} holds an invalid token id {t!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Defaults are greedy-free plain sampling at T=1."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None = none; k = the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None = none; k = each prompt token's logprob and the top k
    priority: int = 0  # lower runs sooner; ties are first come, first served (vLLM's convention)
    structured: tuple[str, str] | None = None  # (kind, spec): see STRUCTURED_KINDS

    def __post_init__(self) -> None:
        if self._plain_and_valid():
            return
        check(is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT, "max_tokens out of range")
        check(is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature out of range")
        check(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p out of range")
        check(is_int(self.top_k) and 0 <= self.top_k <= 1 << 20, "top_k out of range")
        check(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p out of range")
        check(self.seed is None or (is_int(self.seed) and -(1 << 63) <= self.seed < (1 << 64)), "seed out of range")
        check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens out of range")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "too many stop_token_ids")
        _check_token_ids(self.stop_token_ids, "stop_token_ids")
        check(isinstance(self.ignore_eos, bool), "ignore_eos must be a bool")
        check(is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
              "presence_penalty out of range")
        check(is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
              "frequency_penalty out of range")
        check(is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
              "repetition_penalty out of range")
        check(isinstance(self.logit_bias, tuple) and len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias too large")
        for pair in self.logit_bias:
            check(
                isinstance(pair, tuple) and len(pair) == 2 and is_int(pair[0]) and pair[0] >= 0
                and is_num(pair[1]) and -100.0 <= pair[1] <= 100.0,
                "logit_bias entries must be (token id, bias in [-100, 100])",
            )
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
              "logprobs out of range")
        check(self.prompt_logprobs is None
              or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
              "prompt_logprobs out of range")
        check(is_int(self.priority) and -(1 << 31) <= self.priority < (1 << 31), "priority out of range")
        if self.structured is not None:
            check(isinstance(self.structured, tuple) and len(self.structured) == 2
                  and self.structured[0] in STRUCTURED_KINDS and isinstance(self.structured[1], str),
                  f"structured must be (kind, spec) with kind one of {STRUCTURED_KINDS}")
            check(0 < len(self.structured[1]) <= MAX_GRAMMAR_CHARS, "structured spec empty or too long")

    def _plain_and_valid(self) -> bool:
        """The checks below in one expression, for parameters of exactly int / float / bool types and without stop
        ids, biases, logprobs or a structure (what almost every request sends); anything else, valid or not, is
        left to them (they name what is wrong)."""
        num = _EXACT_NUM
        return (type(self.max_tokens) is int and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT
                and type(self.temperature) in num and 0.0 <= self.temperature <= 100.0
                and type(self.top_p) in num and 0.0 < self.top_p <= 1.0
                and type(self.top_k) is int and 0 <= self.top_k <= 1 << 20
                and type(self.min_p) in num and 0.0 <= self.min_p <= 1.0
                and (self.seed is None or (type(self.seed) is int and -(1 << 63) <= self.seed < (1 << 64)))
                and type(self.min_tokens) is int and 0 <= self.min_tokens <= self.max_tokens
                and self.stop_token_ids == () and type(self.ignore_eos) is bool
                and type(self.presence_penalty) in num and -2.0 <= self.presence_penalty <= 2.0
                and type(self.frequency_penalty) in num and -2.0 <= self.frequency_penalty <= 2.0
                and type(self.repetition_penalty) in num and 0.0 < self.repetition_penalty <= 10.0
                and self.logit_bias == () and self.logprobs is None and self.prompt_logprobs is None
                and type(self.priority) is int and -(1 << 31) <= self.priority < (1 << 31)
                and self.structured is None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_wire(self) -> dict:
        d = dict(self.__dict__)  # every field (a frozen dataclass without slots keeps them there)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(p) for p in self.logit_bias]
        d["structured"] = None if self.structured is None else list(self.structured)
        return d

    @classmethod
    def from_wire(cls, d: object) -> SamplingParams:
        check(isinstance(d, dict), "sampling must be an object")
        unknown = set(d) - set(cls.__dataclass_fields__)  # type: ignore[arg-type]
        check(not unknown, f"unknown sampling fields {sorted(unknown)}")
        kw = dict(d)  # type: ignore[arg-type]
        if "stop_token_ids" in kw:
            check(isinstance(kw["stop_token_ids"], list), "stop_token_ids must be a list")
            kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
        if "logit_bias" in kw:
            check(isinstance(kw["logit_bias"], list), "logit_bias must be a list of pairs")
            check(all(isinstance(p, list) for p in kw["logit_bias"]), "logit_bias must be a list of pairs")
            kw["logit_bias"] = tuple(tuple(p) for p in kw["logit_bias"])
        if kw.get("structured") is not None:
            check(isinstance(kw["structured"], list), "structured must be a [kind, spec] pair")
            kw["structured"] = tuple(kw["structured"])
        return cls(**kw)


class Message:
    """Base of every wire message; ``TYPE`` is its tag in the header."""

    TYPE: ClassVar[str] = ""


@dataclass(frozen=True)
class ClientHello(Message):
    """A gateway introduces itself to an engine; the engine answers EngineHello."""

    TYPE: ClassVar[str] = "client_hello"
    client_id: str

    def __post_init__(self) -> None:
        check(isinstance(self.client_id, str) and 0 < len(self.client_id) <= 128, "client_id must be a short str")


@dataclass(frozen=True)
class EngineHello(Message):
    """An engine's announcement: who it is and what it can take. Sent when ready and on ClientHello."""

    TYPE: ClassVar[str] = "engine_hello"
    rank: int
    model_id: str
    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    pid: int
    device: str
    dtype: str
    protocol_version: int = PROTOCOL_VERSION
    tasks: tuple[str, ...] = ("generate",)
    embed_size: int = 0  # length of an "embed" vector (0: the model does not embed)
    matryoshka: bool = False  # trained so that the first n of its embedding's values embed too
    labels: tuple[str, ...] = ()  # a "classify" head's labels, by index
    # Requests it queues before refusing more (None: unbounded): a gateway refuses a request with more parts
    # than that (each choice or pooled input waits as one) before sending any of them.
    max_waiting: int | None = None
    # Tokens per KV block of the prefix cache it publishes events of (``protocol.kv_events``; 0: it publishes
    # none): gateways hash a request's prompt in blocks of this size to find how much each engine holds.
    kv_block_size: int = 0

    def __post_init__(self) -> None:
        check(is_int(self.rank) and 0 <= self.rank < 1 << 16, "rank out of range")
        check(is_int(self.kv_block_size) and 0 <= self.kv_block_size <= 1024, "kv_block_size out of range")
        check(isinstance(self.model_id, str) and 0 < len(self.model_id) <= 256, "model_id must be a short str")
        for name in ("max_num_seqs", "max_model_len", "vocab_size", "pid"):
            v = getattr(self, name)
            check(is_int(v) and 0 < v < 1 << 31, f"{name} out of range")
        _check_token_ids(self.eos_token_ids, "eos_token_ids")
        check(isinstance(self.device, str) and len(self.device) <= 64, "device must be a short str")
        check(isinstance(self.dtype, str) and len(self.dtype) <= 32, "dtype must be a short str")
        check(self.protocol_version == PROTOCOL_VERSION,
              f"protocol version {self.protocol_version} is not {PROTOCOL_VERSION}")
        check(isinstance(self.tasks, tuple) and 0 < len(self.tasks) <= len(MODEL_TASKS)
              and all(t in MODEL_TASKS for t in self.tasks), f"tasks must be a tuple of {MODEL_TASKS}")
        check(is_int(self.embed_size) and 0 <= self.embed_size <= MAX_POOLED_SIZE, "embed_size out of range")
        check(isinstance(self.matryoshka, bool), "matryoshka must be a bool")
        check(isinstance(self.labels, tuple) and len(self.labels) <= MAX_LABELS
              and all(isinstance(x, str) and len(x) <= 256 for x in self.labels), "labels must be short strs")
        check(self.max_waiting is None or (is_int(self.max_waiting) and 0 < self.max_waiting < 1 << 31),
              "max_waiting out of range")


@dataclass(frozen=True)
class AddRequest(Message):
    """Start generating for one request. Prompt ids travel as a binary int32 frame."""

    TYPE: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trace_id: str | None = None  # the HTTP request's X-Request-Id, for the engine's log lines about it
    # A migrated request (its engine was lost, drained past its timeout, or left its expert-parallel group): the
    # tokens it already generated there. The engine computes prompt + these and goes on after them as if it had
    # generated them itself: they count against max_tokens and min_tokens, feed the penalties, replay into a fresh
    # grammar matcher, and a seeded request's next draw is the one for the position after them.
    output_token_ids: tuple[int, ...] = ()
    # The LoRA adapter (loaded on the engine by this name) the request runs through; None: the base model.
    lora: str | None = None
    # Who sent it (``zserve.tenants``) and that tenant's scheduling weight: an engine whose queue is contended admits
    # by weighted fairness of tokens served between tenants (``engine_worker.fairness``). "": no tenants file.
    tenant: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        check(isinstance(self.prompt_token_ids, tuple) and len(self.prompt_token_ids) > 0,
              "prompt_token_ids must not be empty")
        check(self.tenant == "" or valid_tenant_name(self.tenant), "tenant must be a tenant's name, or empty")
        check(is_num(self.weight) and MIN_TENANT_WEIGHT <= self.weight <= MAX_TENANT_WEIGHT,
              f"weight must be a number in [{MIN_TENANT_WEIGHT}, {MAX_TENANT_WEIGHT}]")
        check(isinstance(self.sampling, SamplingParams), "sampling must be SamplingParams")
        check(self.trace_id is None or valid_trace_id(self.trace_id), "trace_id must be printable, at most 128 chars")
        _check_token_ids(self.output_token_ids, "output_token_ids")
        check(len(self.output_token_ids) < self.sampling.max_tokens,
              "output_token_ids must leave at least one token of max_tokens to generate")
        check(self.lora is None or valid_lora_name(self.lora),
              f"lora must be an adapter name of 1..{MAX_LORA_NAME_LEN} printable characters, or null")


@dataclass(frozen=True)
class PoolRequest(Message):
    """Run one input through a pooling model: ``task`` embed (``normalize``: None = the model's
    default; ``dimensions``: keep the first n, renormalised when normalised) or classify (the head's
    logits; a text pair gives ``pair_start``, from which BERT's segment ids follow). Token ids travel
    as a binary int32 frame; the answer is one PoolOutput."""

    TYPE: ClassVar[str] = "pool"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    pair_start: int = 0  # a text pair (cross-encoders): where the second text's tokens begin; 0: one text
    trace_id: str | None = None  # the HTTP request's X-Request-Id

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        check(self.trace_id is None or valid_trace_id(self.trace_id), "trace_id must be printable, at most 128 chars")
        check(isinstance(self.prompt_token_ids, tuple) and len(self.prompt_token_ids) > 0,
              "prompt_token_ids must not be empty")
        check(is_int(self.pair_start) and 0 <= self.pair_start < len(self.prompt_token_ids),
              "pair_start out of range")
        check(self.task in POOLING_TASKS, f"task must be one of {POOLING_TASKS}")
        check(self.normalize is None or isinstance(self.normalize, bool), "normalize must be a bool or null")
        check(self.dimensions is None or (is_int(self.dimensions) and 0 < self.dimensions <= MAX_POOLED_SIZE),
              "dimensions out of range")


@dataclass(frozen=True)
class PoolOutput:
    """A pooling request's result: the vector (embed) or logits (classify), or an error."""

    request_id: str
    data: tuple[float, ...] = ()
    num_prompt_tokens: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        check(isinstance(self.data, tuple) and len(self.data) <= MAX_POOLED_SIZE, "data too long")
        check(is_int(self.num_prompt_tokens) and self.num_prompt_tokens >= 0, "num_prompt_tokens out of range")
        check(self.error is None or (isinstance(self.error, str) and len(self.error) <= MAX_ERROR_CHARS),
              "error must be a short str")
        check((self.error is None) == bool(self.data), "a pool output holds data or an error")


@dataclass(frozen=True)
class PoolOutputs(Message):
    """The pooling results one engine step produced for the requests of one client."""

    TYPE: ClassVar[str] = "pooled"
    rank: int
    outputs: tuple[PoolOutput, ...]

    def __post_init__(self) -> None:
        check(is_int(self.rank) and 0 <= self.rank < 1 << 16, "rank out of range")
        check(isinstance(self.outputs, tuple) and len(self.outputs) <= MAX_BATCH_ITEMS, "too many outputs")


@dataclass(frozen=True)
class AbortRequest(Message):
    """Stop these requests and free what they hold. Unknown ids are ignored."""

    TYPE: ClassVar[str] = "abort"
    request_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        check(isinstance(self.request_ids, tuple) and 0 < len(self.request_ids) <= MAX_BATCH_ITEMS,
              "request_ids must be a non-empty tuple")
        for rid in self.request_ids:
            _check_request_id(rid)


@dataclass(frozen=True)
class TopLogprobs:
    """For each new token, the ``k`` most likely token ids and their logprobs (row-major)."""

    k: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in one engine step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[float, ...] | None = None  # one per new token, when asked for
    top_logprobs: TopLogprobs | None = None
    num_prompt_tokens: int = 0
    error: str | None = None
    # With the first token of a request that asked for prompt_logprobs: the logprob of every
    # prompt token after the first (given those before it), and optionally the top k per token.
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: TopLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (with the first token)
    prompt_ranks: tuple[int, ...] | None = None  # with prompt_logprobs: each token's rank (1 = most likely)
    error_code: str | None = None  # with error, what kind of failure it is (an ERR_* of protocol.constants)
    # With the first output: seconds it waited in the engine's queue before it was first scheduled (per-tenant
    # queue time in the gateway's metrics, ``gateway.tenancy``).
    queue_time: float | None = None

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        _check_token_ids(self.new_token_ids, "new_token_ids")
        check(self.queue_time is None or (is_num(self.queue_time) and 0 <= self.queue_time < 1e9),
              "queue_time must be seconds")
        if not (self.finish_reason is None or self.finish_reason in FINISH_REASONS):
            raise ProtocolError(f"unknown finish_reason {self.finish_reason!r}")
        if self.logprobs is not None:
            check(len(self.logprobs) == len(self.new_token_ids), "one logprob per new token")
        if self.top_logprobs is not None:
            t = self.top_logprobs
            check(is_int(t.k) and 0 <= t.k <= MAX_TOP_LOGPROBS, "top_logprobs k out of range")
            n = t.k * len(self.new_token_ids)
            check(len(t.token_ids) == n and len(t.logprobs) == n, "top_logprobs size mismatch")
        check(is_int(self.num_prompt_tokens) and self.num_prompt_tokens >= 0, "num_prompt_tokens out of range")
        check(is_int(self.num_cached_tokens) and self.num_cached_tokens >= 0, "num_cached_tokens out of range")
        if self.prompt_logprobs is not None:
            check(isinstance(self.prompt_logprobs, tuple) and all(is_num(v) for v in self.prompt_logprobs),
                  "prompt_logprobs must be a tuple of floats")
        if self.prompt_top_logprobs is not None:
            t = self.prompt_top_logprobs
            check(self.prompt_logprobs is not None, "prompt_top_logprobs needs prompt_logprobs")
            check(is_int(t.k) and 0 <= t.k <= MAX_TOP_LOGPROBS, "prompt_top_logprobs k out of range")
            n = t.k * len(self.prompt_logprobs)  # type: ignore[arg-type]
            check(len(t.token_ids) == n and len(t.logprobs) == n, "prompt_top_logprobs size mismatch")
        if self.prompt_ranks is not None:
            check(self.prompt_logprobs is not None and isinstance(self.prompt_ranks, tuple)
                  and len(self.prompt_ranks) == len(self.prompt_logprobs)
                  and all(is_int(r) and r >= 1 for r in self.prompt_ranks),
                  "prompt_ranks must be one rank (at least 1) per prompt logprob")
        check(self.error is None or (isinstance(self.error, str) and len(self.error) <= MAX_ERROR_CHARS),
              "error must be a short str")
        check(self.error_code is None or (self.error is not None and isinstance(self.error_code, str)
                                           and 0 < len(self.error_code) <= 64), "error_code must be a short str")

    @classmethod
    def checked(cls, request_id: str, new_token_ids: tuple[int, ...], finish_reason: str | None,
                num_prompt_tokens: int, error: str | None, num_cached_tokens: int) -> RequestOutput:
        """An output without logprobs whose fields the caller has checked as ``__post_init__`` would (the codec,
        decoding a frame), built without checking them again or paying the frozen dataclass's setattr per
        field: a gateway builds one for every streamed token."""
        obj = object.__new__(cls)
        obj.__dict__.update(request_id=request_id, new_token_ids=new_token_ids, finish_reason=finish_reason,
                            logprobs=None, top_logprobs=None, num_prompt_tokens=num_prompt_tokens, error=error,
                            prompt_logprobs=None, prompt_top_logprobs=None, num_cached_tokens=num_cached_tokens,
                            prompt_ranks=None, error_code=None)
        return obj


@dataclass(frozen=True)
class StepOutputs(Message):
    """Everything one engine step produced for the requests of one client."""

    TYPE: ClassVar[str] = "outputs"
    rank: int
    outputs: tuple[RequestOutput, ...]

    def __post_init__(self) -> None:
        check(is_int(self.rank) and 0 <= self.rank < 1 << 16, "rank out of range")
        check(isinstance(self.outputs, tuple) and len(self.outputs) <= MAX_BATCH_ITEMS, "too many outputs")


@dataclass(frozen=True)
class EngineStats(Message):
    """An engine's load, published often for least-loaded routing and metrics.

    A field with ``metric`` metadata (``_metric``) is exported by every gateway as that Prometheus
    gauge or counter (``gateway.metrics`` reads the metadata), so a new statistic is one field here
    and its value in the engine.
    """

    TYPE: ClassVar[str] = "stats"
    rank: int
    running: int = _metric("gauge", "zserve_engine_requests_running", "Requests in the engine's running batch.")
    waiting: int = _metric("gauge", "zserve_engine_requests_waiting", "Requests queued in the engine.")
    kv_used: float = _metric("gauge", "zserve_engine_kv_cache_usage_ratio",
                             "Fraction of KV cache in use.")  # 0..1
    generated_tokens: int = _metric("counter", "zserve_engine_generated_tokens",
                                    "Tokens the engine generated since it started.")
    steps: int = _metric("counter", "zserve_engine_steps", "Forward passes the engine ran since it started.")
    timestamp: float
    preempted: int = _metric("gauge", "zserve_engine_requests_preempted",
                             "Requests waiting to be recomputed after a preemption.", default=0)  # part of waiting
    preemptions: int = _metric("counter", "zserve_engine_preemptions",
                               "Requests preempted for lack of KV blocks since start.", default=0)
    kv_blocks_used: int = _metric("gauge", "zserve_engine_kv_cache_blocks_used", "KV blocks held by requests.",
                                  default=0)
    kv_blocks_total: int = _metric("gauge", "zserve_engine_kv_cache_blocks", "KV blocks in the cache.", default=0)
    kv_blocks_cached: int = _metric("gauge", "zserve_engine_kv_cache_blocks_cached",
                                    "KV blocks findable in the prefix cache (what its KV events describe).",
                                    default=0)
    prefix_cache_hit_rate: float = _metric("gauge", "zserve_engine_prefix_cache_hit_ratio",
                                           "Share of prompt tokens found in the prefix cache.", default=0.0)
    prefix_cache_hits: int = _metric("counter", "zserve_engine_prefix_cache_hit_tokens",
                                     "Prompt tokens served from the prefix cache since start.", default=0)
    # (the hits' denominator as a counter, so that a hit rate over any window is a ratio of rates: vLLM's
    # prefix_cache_queries)
    prefix_cache_queries: int = _metric("counter", "zserve_engine_prefix_cache_query_tokens",
                                        "Prompt tokens looked up in the prefix cache since start.", default=0)
    prompt_tokens: int = _metric("counter", "zserve_engine_prompt_tokens",
                                 "Prompt tokens computed (prefill) since start.", default=0)  # including recompute
    tokens_per_step: float = _metric("gauge", "zserve_engine_tokens_per_step",
                                     "Mean tokens per forward pass over recent steps.", default=0.0)
    # LoRA adapters (vLLM's lora_requests_info): the most one step runs, and those of the running and waiting
    # requests.
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    lora_slot_fills: int = _metric("counter", "zserve_engine_lora_slot_fills",
                                   "Times an adapter was copied into a compute slot (--max-loras) since start.",
                                   default=0)
    # Speech engines (``engine_worker.speech_scheduler``).
    audio_seconds: float = _metric("counter", "zserve_engine_audio_seconds",
                                   "Seconds of audio a speech engine transcribed or translated since start.",
                                   default=0.0)
    audio_real_time_factor: float = _metric("gauge", "zserve_engine_audio_real_time_factor",
                                            "Seconds of audio a speech engine reads per second of its time, over "
                                            "its steps of the last 30 s.", default=0.0)

    def __post_init__(self) -> None:
        check(is_int(self.rank) and 0 <= self.rank < 1 << 16, "rank out of range")
        for name in ("running", "waiting", "generated_tokens", "steps", "preempted", "preemptions",
                     "kv_blocks_used", "kv_blocks_total", "kv_blocks_cached", "prefix_cache_hits",
                     "prefix_cache_queries", "prompt_tokens"):
            v = getattr(self, name)
            check(is_int(v) and v >= 0, f"{name} out of range")
        check(self.kv_blocks_used <= self.kv_blocks_total or self.kv_blocks_total == 0,
              "kv_blocks_used exceeds the total")
        check(is_num(self.kv_used) and 0.0 <= self.kv_used <= 1.0, "kv_used out of range")
        check(is_num(self.prefix_cache_hit_rate) and 0.0 <= self.prefix_cache_hit_rate <= 1.0,
              "prefix_cache_hit_rate out of range")
        check(is_num(self.tokens_per_step) and 0.0 <= self.tokens_per_step < 1 << 31, "tokens_per_step out of range")
        check(is_num(self.timestamp) and self.timestamp >= 0, "timestamp out of range")
        check(is_num(self.audio_seconds) and self.audio_seconds >= 0 and is_num(self.audio_real_time_factor)
              and self.audio_real_time_factor >= 0, "audio_seconds or audio_real_time_factor out of range")
        check(is_int(self.max_loras) and 0 <= self.max_loras <= 1 << 16 and is_int(self.lora_slot_fills)
              and self.lora_slot_fills >= 0, "max_loras or lora_slot_fills out of range")
        for name in ("running_loras", "waiting_loras"):
            v = getattr(self, name)
            check(isinstance(v, tuple) and len(v) <= 1 << 12 and all(valid_lora_name(n) for n in v),
                  f"{name} must be adapter names")


@dataclass(frozen=True)
class ErrorMessage(Message):
    """A failure the peer should know of; ``request_id`` when it concerns one request."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    request_id: str | None = None

    def __post_init__(self) -> None:
        check(isinstance(self.code, str) and 0 < len(self.code) <= 64, "code must be a short str")
        check(isinstance(self.message, str) and len(self.message) <= 4096, "message must be at most 4096 chars")
        if self.request_id is not None:
            _check_request_id(self.request_id)


@dataclass(frozen=True)
class GroupWake(Message):
    """Engine → engine of one expert-parallel group: "I have work; step with me". Sent by a member that gets
    work while the group idles (``epoch`` counts the group's idle periods of ``generation``); a member that is
    idle in that epoch or an earlier one starts stepping (``engine_worker.ep_server``)."""

    TYPE: ClassVar[str] = "ep_wake"
    generation: int
    epoch: int

    def __post_init__(self) -> None:
        check(is_int(self.generation) and is_int(self.epoch), "generation and epoch are ints")


ALL_MESSAGES: tuple[type[Message], ...] = (
    ClientHello, EngineHello, AddRequest, PoolRequest, AbortRequest, StepOutputs, PoolOutputs, EngineStats,
    ErrorMessage, GroupWake,
)
