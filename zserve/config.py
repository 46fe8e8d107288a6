"""The engine tier's configuration, written once.

``launch`` fills an ``EngineConfig`` from its command line, the supervisor hands every engine the
same value inside its launch value (``zserve.launch_spec.EngineLaunch``, one JSON argument, beside its
``ModelSource``), and the engine reads it back. A new
engine option is a field here (with its default and check), a click option in ``launch/cli.py``
and the code that uses it — nothing in between repeats it. Torch-free: the supervisor imports it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from protocol.messages import MAX_LORA_NAME_LEN, valid_lora_name

DTYPES = ("auto", "float32", "bfloat16", "float16")
_MEMORY = re.compile(r"^(\d+(\.\d+)?)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib)?$", re.I)


def check_memory(value: str) -> str:
    """A KV cache size: bytes with an optional unit (2GiB, 512MB, 1073741824) or a fraction of free
    device memory (0.3). Checked where it is typed, so a typo fails at once, not in every engine."""
    m = _MEMORY.match(value.strip())
    if not m or float(m.group(1)) <= 0 or (m.group(3) is None and "." in m.group(1) and float(m.group(1)) > 1):
        raise ValueError(f"{value!r}: expected bytes (2GiB, 512MB, 1073741824) or a fraction like 0.3")
    return value.strip()


SCHEDULING = ("fair", "fifo")
# auto: a GGUF file's quantized weights stay quantized in the engines (engine_worker.gguf_quant); none: dequantized.
QUANTIZATIONS = ("auto", "none")


@dataclass(frozen=True)
class EngineConfig:
    """What every engine worker of a tier is started with (besides its rank, endpoint and device)."""

    dtype: str = "auto"  # auto: bf16 on CUDA and on CPUs with native bf16, else fp32 (and fp32 for a CPU's quantized)
    quantization: str = "auto"  # one of QUANTIZATIONS
    max_num_seqs: int = 32  # sequences an engine runs at once
    # Context (prompt + output) per sequence. None: the model's own (vLLM's default), lowered to what the KV cache
    # holds (logged at start); a given value is capped to the model's own.
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prompt chunks)
    block_size: int = 16  # tokens per KV cache block
    kv_cache_memory: str | None = None  # None: max_num_seqs full-length requests, at most 25% of free memory
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    threads: int | None = None  # CPU threads per engine; None: the supervisor divides the cores
    seed: int | None = None  # unseeded requests' generator: seed + rank; None: from the OS (engines differ)
    # Queued requests beyond which an engine refuses more (429); None: unbounded. Each choice or pooled input of a
    # request queues as one, and a request with more than this is a 400: 4096 holds the largest pooling request
    # (a score of 2,048 distinct texts against 2,048 others).
    max_waiting: int | None = 4096
    # How a contended queue is admitted when requests carry tenants (--tenants): "fair", weighted fairness of tokens
    # served between tenants (engine_worker.fairness), or "fifo", priority then arrival only (as without tenants).
    scheduling: str = "fair"
    # A mixture-of-experts model's engines form one expert-parallel group: each holds a share of the experts,
    # attention stays data parallel (engine_worker.expert_parallel); resized with /scale_elastic_ep.
    expert_parallel: bool = False
    # LoRA adapters served in the batch (engine_worker.lora), as vLLM's options: up to max_loras adapters in one
    # step, each of rank up to max_lora_rank, max_cpu_loras of them (None: max_loras) kept read in host memory.
    # lora_modules, (name, path) pairs, are loaded before the engine says ready (a bad one is a boot error); giving
    # any turns enable_lora on. Each name is a model name requests may use (the gateways serve it).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}"),
            (self.quantization in QUANTIZATIONS, f"quantization must be one of {', '.join(QUANTIZATIONS)}"),
            (_int(self.max_num_seqs, 1, 4096), "max_num_seqs must be an integer in 1..4096"),
            (self.max_model_len is None or _int(self.max_model_len, 16, 1 << 20),
             "max_model_len must be an integer in 16..1048576"),
            (_int(self.max_num_batched_tokens, 1, 1 << 20), "max_num_batched_tokens must be an integer in 1..1048576"),
            (_int(self.block_size, 1, 1024), "block_size must be an integer in 1..1024"),
            (isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching must be true or false"),
            (isinstance(self.enforce_eager, bool), "enforce_eager must be true or false"),
            (isinstance(self.expert_parallel, bool), "expert_parallel must be true or false"),
            (self.threads is None or _int(self.threads, 1, 1024), "threads must be an integer in 1..1024"),
            (self.seed is None or _int(self.seed, 0, (1 << 63) - 1), "seed must be a non-negative integer"),
            (self.max_waiting is None or _int(self.max_waiting, 1, 1 << 20), "max_waiting must be an integer in "
                                                                                 "1..1048576"),
            (self.scheduling in SCHEDULING, f"scheduling must be one of {', '.join(SCHEDULING)}"),
            (isinstance(self.enable_lora, bool), "enable_lora must be true or false"),
            (_int(self.max_loras, 1, 256), "max_loras must be an integer in 1..256"),
            (_int(self.max_lora_rank, 1, 1024), "max_lora_rank must be an integer in 1..1024"),
            (self.max_cpu_loras is None or _int(self.max_cpu_loras, self.max_loras, 1 << 16),
             f"max_cpu_loras must be an integer in max_loras..65536 (max_loras is {self.max_loras})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        object.__setattr__(self, "lora_modules", _lora_modules(self.lora_modules))
        if self.lora_modules and not self.enable_lora:  # adapters given at start imply --enable-lora, as in vLLM
            object.__setattr__(self, "enable_lora", True)
        if self.kv_cache_memory is not None:
            if not isinstance(self.kv_cache_memory, str):
                raise ValueError("kv_cache_memory must be a string such as 2GiB or 0.3")
            try:
                object.__setattr__(self, "kv_cache_memory", check_memory(self.kv_cache_memory))
            except ValueError as e:
                raise ValueError(f"kv_cache_memory {e}") from None

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return orjson.dumps(dataclasses.asdict(self)).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> EngineConfig:
        return config_from_json(cls, text, "engine")


C = TypeVar("C")


def config_from_json(cls: type[C], text: str | bytes, tier: str) -> C:
    """A tier's configuration from the JSON its ``to_json`` wrote, checked by its constructor;
    unknown fields are an error (a supervisor newer than the child it started)."""
    return config_from_dict(cls, orjson.loads(text), tier)


def config_from_dict(cls: type[C], data: Any, tier: str) -> C:
    """A tier's configuration from a JSON object already parsed (one nested in a launch value)."""
    if not isinstance(data, dict):
        raise ValueError(f"a {tier} configuration is a JSON object")
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"unknown {tier} configuration field(s): {', '.join(sorted(unknown))}")
    return cls(**data)


def _int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def parse_lora_module(text: str) -> tuple[str, str]:
    """One adapter as ``--lora-modules`` or a model's ``lora=`` key gives it: ``NAME=PATH``, or vLLM's JSON
    ``{"name": NAME, "path": PATH}``; the path made absolute (engines may start in another directory)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"{text!r} is not JSON: {e}") from None
        if not isinstance(data, dict) or set(data) != {"name", "path"}:
            raise ValueError(f"{text!r}: a JSON adapter is {{\"name\": NAME, \"path\": PATH}} (its parent is the "
                             "model it is given to)")
        name, path = data["name"], data["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{text!r}: expected NAME=PATH (or JSON {{\"name\": NAME, \"path\": PATH}})")
    if not valid_lora_name(name):
        raise ValueError(f"{text!r}: an adapter's name is 1..{MAX_LORA_NAME_LEN} printable characters")
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{text!r}: the adapter's path is missing")
    return name, os.path.abspath(os.path.expanduser(path))


def _lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """``lora_modules`` as (name, path) pairs (JSON gives lists), each name once."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(m, (list, tuple)) and len(m) == 2 and valid_lora_name(m[0]) and isinstance(m[1], str) and m[1]
            for m in value):
        raise ValueError("lora_modules must be a list of [name, path] pairs")
    modules = tuple((m[0], m[1]) for m in value)
    names = [name for name, _ in modules]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ValueError(f"lora_modules names adapter {twice!r} twice")
    return modules


# -- several models behind one endpoint --------------------------------------------------------------

MAX_ENGINES_PER_MODEL = 64
"""Engine ranks are unique across models: model m's engines are ranks m * 64 .. m * 64 + 63."""

_SPEC_OPTIONS = re.compile(r"^[a-z_]+=[^,]*(,[a-z_]+=[^,]*)*$")


@dataclass(frozen=True)
class ModelSpec:
    """One model a server serves, as ``--model ID[:key=value,...]`` wrote it: the model (a catalog id, a
    .gguf file or an HF directory), its engine count, its engines' configuration and the names clients use.

    ``launch api-server --model SmolLM2-135M-Instruct:engines=2 --model all-MiniLM-L6-v2:max_num_seqs=64``
    runs one engine tier per model; each key is ``engines``, ``name`` (repeatable: every name clients may
    use), ``lora`` (repeatable: ``lora=NAME=PATH``, an adapter loaded at start, its name served too) or a field
    of ``EngineConfig``, and a key not given takes the command line's value."""

    model: str
    engines: int = 1  # 0: no engines (a render server)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    names: tuple[str, ...] = ()  # () = the model id

    @classmethod
    def parse(cls, text: str, engine: EngineConfig, engines: int) -> ModelSpec:
        """``ID`` or ``ID:key=value,...``; ``engine`` and ``engines`` are the defaults of keys not given.
        A path that contains ':' is taken whole when what follows its last ':' is not options."""
        model, sep, options = text.rpartition(":")
        if not sep or not _SPEC_OPTIONS.match(options):
            model, options = text, ""
        if not model:
            raise ValueError(f"{text!r}: the model id is missing before ':'")
        changes: dict[str, Any] = {}
        names: list[str] = []
        loras: list[tuple[str, str]] = []
        types = {f.name: f.type for f in dataclasses.fields(EngineConfig) if f.name != "lora_modules"}  # (lora=)
        for item in filter(None, options.split(",")):
            key, _, value = item.partition("=")
            if key == "engines":
                if engines == 0:
                    raise ValueError(f"{text!r}: a render server runs no engines")
                if not value.isdigit() or not 1 <= int(value) <= MAX_ENGINES_PER_MODEL:
                    raise ValueError(f"{text!r}: engines must be an integer in 1..{MAX_ENGINES_PER_MODEL}")
                engines = int(value)
            elif key == "name":
                if not value:
                    raise ValueError(f"{text!r}: name must not be empty")
                names.append(value)
            elif key == "lora":
                try:
                    loras.append(parse_lora_module(value))
                except ValueError as e:
                    raise ValueError(f"{text!r}: lora {e}") from None
            elif key in types:
                changes[key] = _typed(value, str(types[key]), f"{text!r}: {key}")
            else:
                raise ValueError(f"{text!r}: unknown key {key!r}; keys are engines, name, lora and the engine "
                                 f"options ({', '.join(sorted(types))})")
        if loras:  # the model's own adapters replace the command line's --lora-modules
            changes["lora_modules"] = tuple(loras)
        try:
            config = engine.replace(**changes)
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None
        return cls(model, engines, config, tuple(names))


def _typed(value: str, annotation: str, what: str) -> Any:
    """A spec value as its EngineConfig field's type (``int``, ``bool``, ``str``, each maybe ``| None``)."""
    if "None" in annotation and value.lower() in ("", "none"):
        return None
    if annotation.startswith("bool"):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{what} must be true or false")
        return value.lower() in ("true", "1", "yes")
    if annotation.startswith("int"):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{what} must be an integer") from None
    return value
