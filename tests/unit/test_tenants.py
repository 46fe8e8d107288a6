"""The tenants file (zserve.tenants): what it accepts, what it refuses and with which line, and which tenant a key
opens which route for (gateway.security.authorize)."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.errors import APIError
from gateway.security import Keys, admin_route, authorize, write_key_file
from zserve.tenants import DEFAULT, TenantsError, key_digest, load_tenants

A, B, OPS = key_digest("sk-team-a"), key_digest("sk-team-b"), key_digest("sk-ops")

GOOD = f"""# two teams and an operator
[[tenant]]
name = "team-a"
key_sha256 = ["{A}"]
requests_per_minute = 600
tokens_per_minute = 200000
max_concurrent = 32
weight = 2
priority = 0
models = ["SmolLM2-135M-Instruct", "support-bot-lora"]

[[tenant]]
name = "team-b"
key_sha256 = "{B.upper()}"

[[tenant]]
name = "ops"
key_sha256 = ["{OPS}"]
admin = true
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return str(path)


def test_a_tenants_file_reads_every_setting_and_leaves_out_limits_it_does_not_set(tmp_path):
    tenants = load_tenants(write(tmp_path, GOOD))
    a, b, ops = tenants.tenants
    assert (a.name, a.key_sha256, a.requests_per_minute, a.tokens_per_minute, a.max_concurrent, a.weight,
            a.priority, a.admin) == ("team-a", (A,), 600, 200000, 32, 2.0, 0, False)
    assert a.may_use("support-bot-lora") and not a.may_use("other") and a.limited
    assert b.key_sha256 == (B,) and b.models is None and b.may_use("anything") and not b.limited  # (digest lowered)
    assert ops.admin and tenants.named("ops") is ops and tenants.named("nobody") is None
    assert a.request_priority(-5) == 0 and a.request_priority(7) == 7  # never more urgent than its tenant's
    assert DEFAULT.request_priority(-5) == -5  # --api-key keys: as before
    from zserve.tenants import Tenants

    assert Tenants.from_json(tenants.to_json()) == tenants  # what the key file carries to the gateways


@pytest.mark.parametrize("text, line, words", [
    ('[[tenant]]\nname = "a"\nkey_sha256 = ["sk-plaintext-key"]\n', 3, "plaintext keys are refused"),
    (f'[[tenant]]\nname = "a"\nkeys = ["{A}"]\n', 3, "keys are stored hashed"),
    ('[[tenant]]\nname = "a"\n', 1, "needs key_sha256"),
    (f'[[tenant]]\nkey_sha256 = ["{A}"]\n', 1, "needs a name"),
    (f'[[tenant]]\nname = "a b"\nkey_sha256 = ["{A}"]\n', 2, "needs a name"),
    (f'[[tenant]]\nname = "a"\nkey_sha256 = ["{A}"]\nrequests_per_minute = -1\n', 4, "positive number"),
    (f'[[tenant]]\nname = "a"\nkey_sha256 = ["{A}"]\nmax_concurrent = 2.5\n', 4, "positive integer"),
    (f'[[tenant]]\nname = "a"\nkey_sha256 = ["{A}"]\nweight = 0\n', 4, "weight must be"),
    (f'[[tenant]]\nname = "a"\nkey_sha256 = ["{A}"]\npriority = "high"\n', 4, "priority must be"),
    (f'[[tenant]]\nname = "a"\nkey_sha256 = ["{A}"]\nmodels = "m"\n', 4, "models must be a list"),
    (f'[[tenant]]\nname = "a"\nkey_sha256 = ["{A}"]\nadmin = "yes"\n', 4, "admin must be"),
    (f'[[tenant]]\nname = "a"\nkey_sha256 = ["{A}"]\n\n[[tenant]]\nname = "a"\nkey_sha256 = ["{B}"]\n', 6,
     "defined twice"),
    (f'[[tenant]]\nname = "a"\nkey_sha256 = ["{A}"]\n\n[[tenant]]\nname = "b"\nkey_sha256 = ["{A}"]\n', 7,
     "belongs to one tenant"),
    ('[[tenant]]\nname = "a"\nkey_sha256 = [\n', 3, "not valid TOML"),
    ('[[tenant]]\nname = "a"\nkey_sha256 = ["x"\nweight = 2\n', 4, "not valid TOML"),
    ('limits = 3\n', 1, "unknown top-level key"),
])
def test_a_malformed_tenants_file_is_refused_naming_its_line(tmp_path, text, line, words):
    path = write(tmp_path, text)
    with pytest.raises(TenantsError, match=words) as e:
        load_tenants(path)
    assert str(e.value).startswith(f"{path}:{line}: "), str(e.value)
    assert "sk-plaintext-key" not in str(e.value)  # (a refused key is not echoed into a log)


def test_a_missing_file_is_refused_with_its_path(tmp_path):
    with pytest.raises(TenantsError, match="cannot read"):
        load_tenants(str(tmp_path / "nope.toml"))


async def _plain(request):  # pragma: no cover - never called
    return web.Response()


@admin_route
async def _admin(request):  # pragma: no cover - never called
    return web.Response()


def request(path: str, key: str | None, handler=_plain) -> web.Request:
    req = make_mocked_request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    req._match_info = web.UrlMappingMatchInfo({}, web.ResourceRoute("GET", handler, web.PlainResource(path)))
    return req


def outcome(req: web.Request, keys: Keys):
    try:
        tenant = authorize(req, keys, False)
    except APIError as e:
        return e.status, e.code
    return tenant.name if tenant is not None else None


def test_a_tenants_key_serves_its_tenant_and_only_an_admin_tenant_reaches_admin_routes(tmp_path):
    path = str(tmp_path / "keys.json")
    write_key_file(path, ("sk-plain",), ("sk-admin",), load_tenants(write(tmp_path, GOOD)))
    keys = Keys.load(path)
    assert outcome(request("/v1/models", "sk-team-a"), keys) == "team-a"
    assert outcome(request("/v1/models", "sk-team-b"), keys) == "team-b"
    assert outcome(request("/v1/models", "sk-plain"), keys) == "default"  # an --api-key key: the default tenant
    assert outcome(request("/v1/models", "sk-nobody"), keys) == (401, "invalid_api_key")
    assert outcome(request("/v1/models", None), keys) == (401, "invalid_api_key")
    assert outcome(request("/health", None), keys) is None
    assert outcome(request("/pause", "sk-ops", _admin), keys) == "ops"
    assert outcome(request("/pause", "sk-admin", _admin), keys) is None  # the admin key: no tenant
    assert outcome(request("/pause", "sk-team-a", _admin), keys) == (403, "admin_key_required")


def test_tenants_alone_require_a_key_and_no_keys_at_all_serve_the_default_tenant(tmp_path):
    path = str(tmp_path / "keys.json")
    write_key_file(path, (), (), load_tenants(write(tmp_path, GOOD)))
    keys = Keys.load(path)
    assert outcome(request("/v1/models", None), keys) == (401, "invalid_api_key")
    assert outcome(request("/v1/models", "sk-team-b"), keys) == "team-b"
    assert outcome(request("/pause", "sk-team-b", _admin), keys) == (403, "admin_key_required")
    assert outcome(request("/v1/models", None), Keys()) == "default"
