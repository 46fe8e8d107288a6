"""Endpoint plugins in process (gateway/plugins.py): loading from entry points, route collisions, opted-in
replacements, the context hooks and handlers see, broken plugins and disabled route families.

Plugins are installed for one test by writing a module and its ``*.dist-info`` (METADATA + entry_points.txt)
into a temporary directory put on sys.path: the same metadata a ``pip install`` writes.
"""

from __future__ import annotations

import asyncio
import logging
import textwrap
import uuid
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import ROUTE_FAMILIES, build_app
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient, ModelEngines
from gateway.plugins import (
    ENTRY_POINT_GROUP,
    PLUGIN_CONTEXT,
    EndpointPlugin,
    PluginContext,
    PluginError,
    installed_plugin_names,
    load_plugins,
    mount_routes,
)
from gateway.state import GatewayState, ServedModel
from zserve.catalog import resolve


class _Words:
    """A stand-in tokenizer: one token per word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def _state(index: int = 0) -> GatewayState:
    engines = EngineClient([])
    model = ServedModel(resolve("tiny-random"), ["tiny-random", "tiny"], _Words(), None,  # type: ignore[arg-type]
                        ModelEngines(engines, "tiny-random"))
    return GatewayState(index, [model], engines)


def _install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str,
             attr: str = "plugin") -> str:
    """Install a plugin named ``name`` whose module is ``source``; return the module's (unique) name."""
    module = f"plugin_{name.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    dist = tmp_path / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {module}:{attr}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


def _plugin_source(name: str, path: str = "/hello", method: str = "get", extra: str = "") -> str:
    return f"""
        from aiohttp import web
        from gateway.plugins import PLUGIN_CONTEXT, EndpointPlugin

        routes = web.RouteTableDef()

        @routes.{method}("{path}")
        async def hello(request):
            return web.json_response({{"plugin": "{name}", "gateway": request.app[PLUGIN_CONTEXT].gateway_index}})

        {extra}
        plugin = EndpointPlugin("{name}", routes)
    """


def _mine(plugins: list[EndpointPlugin], *names: str) -> list[str]:
    return [p.name for p in plugins if p.name in names]


async def _hello(request: web.Request) -> web.Response:
    return web.json_response({"from": "plugin"})


def _routes(method: str, path: str) -> web.RouteTableDef:
    routes = web.RouteTableDef()
    routes.route(method, path)(_hello)
    return routes


def _serve(app: web.Application, check) -> None:
    async def run() -> None:
        async with TestClient(TestServer(app)) as client:
            await check(client)
    asyncio.run(run())


# -- loading ---------------------------------------------------------------------------------------


def test_installed_plugins_load_in_the_order_of_their_names(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "zeta", _plugin_source("zeta", "/zeta"))
    _install(tmp_path, monkeypatch, "alpha", _plugin_source("alpha", "/alpha"))
    plugins = load_plugins()
    assert _mine(plugins, "zeta", "alpha") == ["alpha", "zeta"]
    assert [p.name for p in plugins] == sorted(p.name for p in plugins)
    assert {"alpha", "zeta"} <= set(installed_plugin_names())


def test_a_disabled_plugin_is_not_even_imported(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "broken", "raise RuntimeError('boom')")
    assert "broken" not in [p.name for p in load_plugins(skip={"broken"})]


def test_a_plugin_route_works_and_its_handler_reaches_the_context(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "greeter", _plugin_source("greeter", "/greeter/v1/hello"))
    plugins = [p for p in load_plugins() if p.name == "greeter"]
    state = _state(index=3)
    app = build_app(state, plugins=plugins, context=PluginContext(state, GatewayConfig()))

    async def check(client: TestClient) -> None:
        r = await client.get("/greeter/v1/hello")
        assert (r.status, await r.json()) == (200, {"plugin": "greeter", "gateway": 3})
        assert (await client.get("/health")).status in (200, 503)  # the core families are still there

    _serve(app, check)


def test_the_example_plugin_is_installed_and_answers(monkeypatch):
    assert "example" in installed_plugin_names(), "make install-test installs examples/zserve-example-plugin"
    plugins = [p for p in load_plugins() if p.name == "example"]
    state = _state(index=1)
    app = build_app(state, plugins=plugins, context=PluginContext(state, GatewayConfig()))

    async def check(client: TestClient) -> None:
        r = await client.post("/example/v1/reverse", json={"text": "hello plugin world"})
        assert (r.status, await r.json()) == (200, {"model": "tiny-random", "text": "dlrow nigulp olleh",
                                                    "tokens": 3, "gateway": 1})
        r = await client.post("/example/v1/reverse", json={"text": "x", "model": "nope"})
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        r = await client.post("/example/v1/reverse", json={"txt": "x"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "text"
        info = await (await client.get("/example/v1/info")).json()
        assert info["plugin"] == "example" and info["gateway"] == 1 and info["started_at"] is not None
        assert info["models"] == [{"name": "tiny-random", "names": ["tiny-random", "tiny"], "tasks": []}]

    _serve(app, check)


def test_hooks_get_the_context_at_start_up_and_shutdown_in_reverse_order():
    calls: list[tuple[str, str, int]] = []

    def plugin(name: str) -> EndpointPlugin:
        async def up(ctx: PluginContext) -> None:
            calls.append(("up", name, ctx.gateway_index))
            assert [m.name for m in ctx.models] == ["tiny-random"] and ctx.config.render_only is False

        async def down(ctx: PluginContext) -> None:
            calls.append(("down", name, ctx.gateway_index))
        return EndpointPlugin(name, _routes("GET", f"/{name}"), on_startup=up, on_shutdown=down)

    state = _state(index=2)
    app = build_app(state, plugins=[plugin("a"), plugin("b")], context=PluginContext(state, GatewayConfig()))
    assert app[PLUGIN_CONTEXT].gateway_index == 2

    async def check(client: TestClient) -> None:
        assert calls == [("up", "a", 2), ("up", "b", 2)]

    _serve(app, check)
    assert calls[2:] == [("down", "b", 2), ("down", "a", 2)]


# -- collisions --------------------------------------------------------------------------------------


def test_a_plugin_that_takes_a_core_route_without_saying_so_is_refused_naming_both():
    bad = EndpointPlugin("hijack", _routes("POST", "/v1/chat/completions"))
    with pytest.raises(PluginError) as e:
        build_app(_state(), plugins=[bad])
    msg = str(e.value)
    assert msg.startswith("plugin 'hijack': POST /v1/chat/completions is a route of the 'openai' family")
    assert "EndpointPlugin.replaces" in msg


def test_without_plugins_every_core_route_is_mounted_once():
    families = {name: module.routes for name, module in ROUTE_FAMILIES.items()}
    assert len(mount_routes(families, [])) == sum(len(routes) for routes in families.values())


def test_path_variables_collide_whatever_their_names():
    with pytest.raises(PluginError, match=r"GET /v1/responses/\{rid\} is a route of the 'responses' family"):
        build_app(_state(), plugins=[EndpointPlugin("p", _routes("GET", "/v1/responses/{rid}"))])


def test_two_plugins_that_claim_one_route_are_refused():
    with pytest.raises(PluginError, match="plugin 'b': GET /same is a route of plugin 'a' too"):
        build_app(_state(), plugins=[EndpointPlugin("a", _routes("GET", "/same")),
                                     EndpointPlugin("b", _routes("GET", "/same"))])


def test_a_route_of_a_disabled_family_is_free_to_take():
    families = [f for f in ROUTE_FAMILIES if f != "openai"]
    build_app(_state(), families, plugins=[EndpointPlugin("p", _routes("POST", "/v1/chat/completions"))])


def test_an_opted_in_replacement_serves_the_route_with_a_warning(caplog):
    plugin = EndpointPlugin("chat", _routes("POST", "/v1/chat/completions"),
                            replaces={("post", "/v1/chat/completions")})
    with caplog.at_level(logging.WARNING, logger="zserve.gateway"):
        app = build_app(_state(), plugins=[plugin])
    assert "plugin 'chat' replaces POST /v1/chat/completions of the 'openai' route family" in caplog.text

    async def check(client: TestClient) -> None:
        r = await client.post("/v1/chat/completions", json={})
        assert (r.status, await r.json()) == (200, {"from": "plugin"})

    _serve(app, check)


def test_a_replacement_of_a_route_no_family_serves_is_only_a_warning(caplog):
    plugin = EndpointPlugin("p", _routes("GET", "/mine"), replaces={("GET", "/not/a/route")})
    with caplog.at_level(logging.WARNING, logger="zserve.gateway"):
        build_app(_state(), plugins=[plugin])
    assert "plugin 'p' replaces GET /not/a/route, which no enabled route family serves" in caplog.text


# -- broken plugins ----------------------------------------------------------------------------------


def test_a_plugin_that_fails_to_import_is_named_with_its_error(tmp_path, monkeypatch):
    module = _install(tmp_path, monkeypatch, "broken", "raise RuntimeError('no licence key')")
    with pytest.raises(PluginError) as e:
        load_plugins()
    assert str(e.value) == f"plugin 'broken': cannot load {module}:plugin: RuntimeError: no licence key"


def test_an_entry_point_that_is_no_endpoint_plugin_is_refused(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "wrong", "plugin = {'routes': []}")
    with pytest.raises(PluginError, match=r"plugin 'wrong': \S+:plugin is a dict, not a gateway.plugins.EndpointPl"):
        load_plugins()


def test_a_plugin_named_unlike_its_entry_point_is_refused(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "one", _plugin_source("other"))
    with pytest.raises(PluginError, match="plugin 'one': .* is named 'other'"):
        load_plugins()


def test_a_plugin_may_not_take_a_family_name(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "openai", _plugin_source("openai", "/mine"))
    with pytest.raises(PluginError, match="plugin 'openai': a core route family has that name"):
        load_plugins(reserved=ROUTE_FAMILIES)


def test_a_badly_built_endpoint_plugin_fails_at_import():
    with pytest.raises(TypeError, match="EndpointPlugin.name"):
        EndpointPlugin("Has Spaces", [])
    with pytest.raises(TypeError, match="not an aiohttp route definition"):
        EndpointPlugin("p", ["/path"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"not a \(METHOD, PATH\) pair"):
        EndpointPlugin("p", [], replaces={"/v1/chat/completions"})  # type: ignore[arg-type]


def test_a_start_up_hook_that_raises_fails_start_up_naming_the_plugin():
    async def up(ctx: PluginContext) -> None:
        raise ConnectionError("cannot reach the feature store")

    state = _state()
    app = build_app(state, plugins=[EndpointPlugin("features", [], on_startup=up)],
                    context=PluginContext(state, GatewayConfig()))

    async def run() -> None:
        runner = web.AppRunner(app)
        try:
            with pytest.raises(PluginError) as e:
                await runner.setup()
        finally:
            await runner.cleanup()
        assert str(e.value) == ("plugin 'features': its start-up hook failed: ConnectionError: "
                                "cannot reach the feature store")
        assert isinstance(e.value, ValueError)  # what zserve.proc.boot_phase turns into a boot error

    asyncio.run(run())


# -- route families ----------------------------------------------------------------------------------


def test_a_disabled_family_answers_404_and_the_others_still_serve():
    app = build_app(_state(), [f for f in ROUTE_FAMILIES if f != "anthropic"])

    async def check(client: TestClient) -> None:
        assert (await client.post("/v1/messages", json={})).status == 404
        assert (await client.get("/version")).status == 200
        assert (await client.post("/v1/chat/completions", data=b"{")).status == 400  # mounted: refuses the body

    _serve(app, check)


def test_core_cannot_be_disabled_and_unknown_families_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="'core' cannot be disabled: /health and /metrics"):
        GatewayConfig(disabled_families=("core",))
    with pytest.raises(ValueError) as e:
        GatewayConfig(disabled_families=("antropic",))
    msg = str(e.value)
    assert msg.startswith("disabled_families: unknown route family 'antropic'; known: core, control, operations, ")
    assert "anthropic" in msg and "plugins: " in msg and "example" in msg
    with pytest.raises(ValueError, match="list of route family or plugin names"):
        GatewayConfig(disabled_families="anthropic")  # type: ignore[arg-type]


def test_installed_plugins_and_families_can_be_disabled_and_the_choice_survives_json(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "extra", _plugin_source("extra"))
    cfg = GatewayConfig(disabled_families=("anthropic", "extra", "anthropic"))
    assert cfg.disabled_families == ("anthropic", "extra")
    assert GatewayConfig.from_json(cfg.to_json()) == cfg
