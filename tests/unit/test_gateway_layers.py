"""The gateway's layers stay layers: route families (``gateway/routers``) are thin and share code only through the
serving layer (``gateway/serving``), never by importing one another; the serving layer knows no router; only the
app assembly (``gateway.app``) imports routers; and a model's view of the gateway (``ModelState``) names its
attributes instead of forwarding any attribute it is asked for. Read from the source (``import_graph``): an import
inside a function counts too."""

from __future__ import annotations

from gateway.state import GatewayState, ModelState
from tests.unit.import_graph import import_graph, within

ROUTERS = "gateway.routers"


def _is_router(module: str) -> bool:
    return module == ROUTERS or module.startswith(ROUTERS + ".")


def test_no_router_imports_another_router() -> None:
    graph = within(import_graph(), ROUTERS)
    crossing = [str(imp) for imps in graph.values() for imp in imps]
    assert not crossing, "a router imports another; move what they share into gateway/serving:\n" + \
        "\n".join(crossing)


def test_only_the_app_assembly_imports_routers() -> None:
    importers = sorted({str(imp) for module, imps in import_graph().items() if not _is_router(module)
                        for imp in imps if _is_router(imp.imported) and module != "gateway.app"})
    assert not importers, "routers are mounted by gateway.app only; shared code belongs in gateway/serving:\n" + \
        "\n".join(importers)


def test_the_serving_layer_imports_no_router() -> None:
    graph = import_graph()
    upward = [str(imp) for module, imps in graph.items() if module.startswith("gateway.serving")
              for imp in imps if _is_router(imp.imported)]
    assert not upward, "gateway/serving is below the routers:\n" + "\n".join(upward)
    assert any(module.startswith("gateway.serving.") for module in graph)  # the check looked at something


def test_model_state_forwards_nothing_and_names_only_gateway_settings_that_exist() -> None:
    assert "__getattr__" not in vars(ModelState) and "__getattribute__" not in vars(ModelState)
    forwarded = {"render_only", "tool_parser", "reasoning_parser", "stream_interval", "responses"}
    assert "hold" in vars(ModelState)  # not forwarded: the gateway's hold on this model (GatewayState.hold_for)
    fields = set(GatewayState.__dataclass_fields__) | {n for n, v in vars(GatewayState).items()
                                                         if isinstance(v, property)}
    assert forwarded <= set(vars(ModelState)) and forwarded <= fields
