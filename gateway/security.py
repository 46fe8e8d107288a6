"""Who may call the gateway: API keys, the admin key, and browsers on other origins (CORS).

Keys never reach a gateway's command line or log: the supervisor writes their SHA-256 digests to a
file in its private run directory (``write_key_file``) and each gateway compares the digest of what a
client presents against every stored digest with ``hmac.compare_digest`` (constant time, and every
digest is compared, so timing says nothing about which key nearly matched).

- No keys configured: every route is open, as before.
- ``--api-key``: every route needs one (``Authorization: Bearer KEY`` or Anthropic's ``x-api-key``),
  except liveness and readiness (``/health``, ``/ping``, ``/ready``, ``/readyz``: probes send no key), CORS
  preflights, the API's description (``/openapi.json``, ``/docs``, ``/redoc``), and ``/metrics`` unless
  ``--metrics-auth``.
- ``--admin-key``: routes marked ``@admin_route`` (pause, resume, and any later admin route) need it; an
  API key is refused there (403), and the admin key is not an API key. Without an admin key, admin
  routes are refused whenever API keys are set (an API key must not pause the cluster).
- ``--tenants FILE`` (``zserve.tenants``): each tenant's keys are API keys that name the tenant (its limits,
  models, weight); a tenant marked ``admin`` may call admin routes too. ``authorize`` answers which tenant a request
  is served for: ``DEFAULT`` for an ``--api-key`` key or when no key is configured, None for the admin key and the
  routes that take no key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

import orjson
from aiohttp import web

from zserve.tenants import DEFAULT, Tenant, Tenants

from .console import PATHS as CONSOLE_PATHS
from .errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/ping", "/ready", "/readyz"})
# The API's description and its pages carry no data, and a browser cannot send a key when it opens a page.
DOCS_PATHS = frozenset({"/openapi.json", "/docs", "/redoc"})  # (and the web console's page and files)
API_KEY_ENV, ADMIN_KEY_ENV = "ZSERVE_API_KEY", "ZSERVE_ADMIN_KEY"
SECRET_ENV = (API_KEY_ENV, ADMIN_KEY_ENV)
"""Where keys may come from in the environment; the supervisor's children never inherit these."""
_ADMIN_ATTR = "__zserve_admin_route__"


def admin_route(handler):
    """Decorator: this handler is an admin route (it needs the admin key once any key is configured)."""
    setattr(handler, _ADMIN_ATTR, True)
    return handler


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def write_key_file(path: str, api_keys: tuple[str, ...], admin_keys: tuple[str, ...],
                   tenants: Tenants | None = None) -> None:
    """The digests of the keys and the tenants (whose keys are digests already), readable by this user only (the
    supervisor writes it; gateways read it). Written whole and renamed into place, so a gateway that reads it
    while the tenants are reloaded reads the old file or the new one."""
    body = orjson.dumps({"api": [_digest(k).hex() for k in api_keys], "admin": [_digest(k).hex() for k in admin_keys],
                         "tenants": tenants.to_json() if tenants is not None else []})
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(body)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Keys:
    api: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()
    tenants: Tenants = Tenants()

    @classmethod
    def load(cls, path: str | None) -> Keys:
        if not path:
            return cls()
        with open(path, "rb") as f:
            d = orjson.loads(f.read())
        return cls(tuple(bytes.fromhex(h) for h in d["api"]), tuple(bytes.fromhex(h) for h in d["admin"]),
                   Tenants.from_json(d.get("tenants", [])))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_tenant_keys", tuple(self.tenants.by_digest().items()))

    @property
    def enabled(self) -> bool:
        return bool(self.api or self.admin or self.tenants.tenants)

    def tenant_of(self, presented: str | None) -> Tenant | None:
        """The tenant whose key was presented (every stored digest compared, in constant time each)."""
        if presented is None:
            return None
        d = _digest(presented)
        found = None
        for stored, tenant in self._tenant_keys:  # type: ignore[attr-defined]
            if hmac.compare_digest(d, stored):
                found = tenant
        return found

    @staticmethod
    def matches(presented: str | None, digests: tuple[bytes, ...]) -> bool:
        if presented is None:
            return False
        d = _digest(presented)
        found = False
        for stored in digests:  # all of them, whatever matched first
            found |= hmac.compare_digest(d, stored)
        return found


def presented_key(request: web.Request) -> str | None:
    """The key a client sent: OpenAI's ``Authorization: Bearer KEY`` or Anthropic's ``x-api-key: KEY``."""
    auth = request.headers.get("Authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return request.headers.get("x-api-key")


def authorize(request: web.Request, keys: Keys, metrics_auth: bool) -> Tenant | None:
    """Raise the 401/403 ``APIError`` a request without the right key gets; if it may go on, the tenant it is served
    for (None: the admin key, or a route that takes no key)."""
    if not keys.enabled:
        return DEFAULT
    if request.method == "OPTIONS" or request.path in PUBLIC_PATHS or request.path in DOCS_PATHS \
            or request.path.startswith("/docs/assets/") or request.path in CONSOLE_PATHS:
        return None
    if request.path == "/metrics" and not metrics_auth:
        return None
    handler = request.match_info.handler
    key = presented_key(request)
    tenant = keys.tenant_of(key)
    if getattr(handler, _ADMIN_ATTR, False):
        if Keys.matches(key, keys.admin):
            return None
        if tenant is not None and tenant.admin:
            return tenant
        if tenant is not None:
            raise APIError(403, f"this is an admin route, and tenant {tenant.name!r} may not call admin routes",
                           code="admin_key_required")
        if not keys.admin:
            raise APIError(403, "admin routes need the admin key, and this server has none (--admin-key)",
                           code="admin_key_required")
        if Keys.matches(key, keys.api):
            raise APIError(403, "this is an admin route: it takes the admin key, not an API key",
                           code="admin_key_required")
        raise APIError(401, "a valid admin key is required (Authorization: Bearer ADMIN_KEY)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if tenant is not None:
        return tenant
    if (not keys.api and not keys.tenants.tenants) or Keys.matches(key, keys.api):
        return DEFAULT
    said = "no API key was given" if key is None else "the API key is not valid"
    raise APIError(401, f"{said}: send it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


# -- CORS -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CorsPolicy:
    """vLLM's CORS options. No origins: no cross-origin access (preflights are answered, without CORS headers,
    so the browser refuses the call)."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allows(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.origins or origin in self.origins)

    def allow_origin(self, origin: str) -> str:
        # "*" cannot carry credentials: with them the origin itself is echoed
        return "*" if "*" in self.origins and not self.credentials else origin

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method", "")
        resp = web.Response(status=204, headers={"Vary": "Origin"})
        if self.allows(origin) and ("*" in self.methods or method.upper() in self.methods):
            asked = request.headers.get("Access-Control-Request-Headers", "")
            resp.headers.update({
                "Access-Control-Allow-Origin": self.allow_origin(origin),  # type: ignore[arg-type]
                "Access-Control-Allow-Methods": method.upper() if "*" in self.methods else ", ".join(self.methods),
                "Access-Control-Allow-Headers": asked if "*" in self.headers else ", ".join(self.headers),
                "Access-Control-Max-Age": "600",
            })
            if self.credentials:
                resp.headers["Access-Control-Allow-Credentials"] = "true"
        return resp

    def decorate(self, request: web.Request, response: web.StreamResponse) -> None:
        """CORS headers on an actual (non-preflight) response to an allowed origin."""
        origin = request.headers.get("Origin")
        if not self.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = self.allow_origin(origin)  # type: ignore[arg-type]
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
        response.headers.add("Vary", "Origin")
        if self.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
