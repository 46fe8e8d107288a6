"""Tenants: who is behind an API key, and what they may do (``--tenants FILE``, docs/tenants.md).

A tenants file is TOML, one ``[[tenant]]`` table each::

    [[tenant]]
    name = "team-a"
    key_sha256 = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
    requests_per_minute = 600
    tokens_per_minute = 200000
    max_concurrent = 32
    weight = 2
    priority = 0
    models = ["SmolLM2-135M-Instruct", "support-bot-lora"]
    admin = false

Keys are stored only as SHA-256 digests (``launch keys hash`` prints one): a file that holds anything else where a
digest belongs is refused, so a plaintext key never sits in a config file, a ConfigMap or a log. A limit left out is
no limit. Every error names the file and the line, because an operator fixes it in an editor; a malformed file is
refused at start (exit 2) and on reload (the tenants in force stay).

The supervisor parses the file and hands the parsed tenants to its gateways inside the key file (``to_json``), so a
gateway never reads the operator's file and a reload is one atomic rename.
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from dataclasses import asdict, dataclass

from protocol.messages import MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT, valid_tenant_name

BURST_SECONDS = 10.0
"""A limit's bucket holds at most this many seconds of its rate: a tenant cannot spend a whole minute at once."""

_FIELDS = {"name", "key_sha256", "requests_per_minute", "tokens_per_minute", "max_concurrent", "weight", "priority",
           "models", "admin"}
_DIGEST = re.compile(r"[0-9a-f]{64}")
_TABLE = re.compile(r"^\s*\[\[\s*tenant\s*\]\]")


class TenantsError(ValueError):
    """A tenants file that cannot be served: its message names the file and line."""


def key_digest(key: str) -> str:
    """The SHA-256 hex digest a tenants file stores for ``key`` (and ``launch keys hash`` prints)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: tuple[str, ...] = ()
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    weight: float = 1.0
    priority: int = 0  # the most urgent priority its requests may ask (lower runs sooner, vLLM's convention)
    models: tuple[str, ...] | None = None  # the served model names (adapters included) it may use; None: every one
    admin: bool = False  # it may call admin routes (pause, scale, reload, ...)

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None \
            or self.max_concurrent is not None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def request_priority(self, asked: int) -> int:
        """The priority its request runs at: what it asked, but never more urgent than the tenant's."""
        return max(asked, self.priority)


DEFAULT = Tenant("default", priority=-(1 << 31))
"""The tenant of a ``--api-key`` key, or of every request when no key is configured: no limits, and whatever
priority it asks for — today's behaviour."""


@dataclass(frozen=True)
class Tenants:
    tenants: tuple[Tenant, ...] = ()

    def by_digest(self) -> dict[bytes, Tenant]:
        return {bytes.fromhex(d): t for t in self.tenants for d in t.key_sha256}

    def named(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)

    def to_json(self) -> list[dict]:
        return [asdict(t) for t in self.tenants]

    @classmethod
    def from_json(cls, items: list[dict]) -> Tenants:
        """What the supervisor wrote (already checked): back into tenants."""
        return cls(tuple(Tenant(**{**d, "key_sha256": tuple(d["key_sha256"]),
                                   "models": None if d["models"] is None else tuple(d["models"])}) for d in items))


def load_tenants(path: str) -> Tenants:
    """Parse and check a tenants file; ``TenantsError`` names the file and line of the first problem."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TenantsError(f"{path}: cannot read the tenants file: {e.strerror or e}") from None
    try:
        text = raw.decode()
        doc = tomllib.loads(text)
    except UnicodeDecodeError:
        raise TenantsError(f"{path}: the tenants file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        found = re.search(r"line (\d+)", str(e))
        line = found.group(1) if found else max(1, len(raw.splitlines())) if "end of document" in str(e) else 1
        raise TenantsError(f"{path}:{line}: not valid TOML: {e}") from None
    starts = [i + 1 for i, ln in enumerate(text.splitlines()) if _TABLE.match(ln)]
    lines = text.splitlines()
    unknown = set(doc) - {"tenant"}
    if unknown:
        key = sorted(unknown)[0]
        raise TenantsError(f"{path}:{_line_of(lines, key, 1)}: unknown top-level key {key!r}: the file holds "
                           "[[tenant]] tables only")
    tables = doc.get("tenant", [])
    if not isinstance(tables, list):
        raise TenantsError(f"{path}:{_line_of(lines, 'tenant', 1)}: 'tenant' must be [[tenant]] tables")
    tenants: list[Tenant] = []
    seen_keys: dict[str, str] = {}
    for i, table in enumerate(tables):
        start = starts[i] if i < len(starts) else 1
        end = starts[i + 1] - 1 if i + 1 < len(starts) else len(lines)
        tenant = _tenant(table, lambda key, s=start, e=end: f"{path}:{_line_of(lines, key, s, e)}")
        if any(t.name == tenant.name for t in tenants):
            raise TenantsError(f"{path}:{_line_of(lines, 'name', start, end)}: tenant {tenant.name!r} is defined "
                               "twice")
        for d in tenant.key_sha256:
            if d in seen_keys:
                raise TenantsError(f"{path}:{_line_of(lines, 'key_sha256', start, end)}: a key of tenant "
                                   f"{tenant.name!r} is also tenant {seen_keys[d]!r}'s: a key belongs to one tenant")
            seen_keys[d] = tenant.name
        tenants.append(tenant)
    return Tenants(tuple(tenants))


def _line_of(lines: list[str], key: str, start: int, end: int | None = None) -> int:
    """The line (1-based) in ``start..end`` where ``key`` is set, else ``start``."""
    pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for n in range(start, (end or len(lines)) + 1):
        if n - 1 < len(lines) and pattern.match(lines[n - 1]):
            return n
    return start


def _tenant(table: object, where) -> Tenant:
    """One ``[[tenant]]`` table, checked; ``where(key)`` gives "file:line" for an error about ``key``."""
    if not isinstance(table, dict):
        raise TenantsError(f"{where('tenant')}: a tenant must be a [[tenant]] table")
    for key in table:
        if key not in _FIELDS:
            hint = " (keys are stored hashed: key_sha256, see `launch keys hash`)" if "key" in key else ""
            raise TenantsError(f"{where(key)}: unknown setting {key!r}{hint}; a tenant takes "
                               f"{', '.join(sorted(_FIELDS))}")
    name = table.get("name")
    if not valid_tenant_name(name):
        raise TenantsError(f"{where('name')}: every tenant needs a name of 1..64 letters, digits and -_.:@")
    digests = table.get("key_sha256", [])
    if isinstance(digests, str):
        digests = [digests]
    if not isinstance(digests, list) or not digests:
        raise TenantsError(f"{where('key_sha256')}: tenant {name!r} needs key_sha256, a list of at least one key's "
                           "SHA-256 digest (`launch keys hash` prints one)")
    for d in digests:
        if not isinstance(d, str) or not _DIGEST.fullmatch(d.lower()):
            raise TenantsError(f"{where('key_sha256')}: tenant {name!r}: key_sha256 holds something that is not a "
                               "SHA-256 digest (64 hex digits); plaintext keys are refused: `launch keys hash` "
                               "prints a key's digest")

    def limit(key: str, integer: bool = False):
        v = table.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0 \
                or (integer and not isinstance(v, int)):
            kind = "a positive integer" if integer else "a positive number"
            raise TenantsError(f"{where(key)}: tenant {name!r}: {key} must be {kind} (leave it out for no limit)")
        return v

    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) \
            or not MIN_TENANT_WEIGHT <= weight <= MAX_TENANT_WEIGHT:
        raise TenantsError(f"{where('weight')}: tenant {name!r}: weight must be a number in "
                           f"{MIN_TENANT_WEIGHT}..{MAX_TENANT_WEIGHT:g}")
    priority = table.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(1 << 31) <= priority < (1 << 31):
        raise TenantsError(f"{where('priority')}: tenant {name!r}: priority must be an integer (lower runs sooner)")
    models = table.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)):
        raise TenantsError(f"{where('models')}: tenant {name!r}: models must be a list of served model names")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise TenantsError(f"{where('admin')}: tenant {name!r}: admin must be true or false")
    return Tenant(name, tuple(dict.fromkeys(d.lower() for d in digests)), limit("requests_per_minute"),
                  limit("tokens_per_minute"), limit("max_concurrent", integer=True), float(weight), priority,
                  None if models is None else tuple(models), admin)
