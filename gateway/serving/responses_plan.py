"""OpenAI Responses requests made ready for the engine, before anything is generated.

The request schema; its ``input`` items (messages, function calls and their outputs) as chat messages after the
conversation of ``previous_response_id`` (``conversation``: read from the store every gateway shares); and
``plan_response``: the turn as the engine gets it, which ``POST /v1/responses`` runs (``routers.responses``)
and ``POST /v1/responses/render`` shows (``routers.render``), so both answer a body with the same 400s.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from .. import structured
from ..errors import APIError, bad_request
from ..ids import random_hex
from ..openai_schemas import MAX_TOOLS, RequestBody, SamplingFields
from ..state import GatewayState, ModelState
from ..store import StoreUnavailable
from .choices import Choice
from .plans import Plan
from .prompts import chat_prompt, check_prompt_ids
from .sampling import build_sampling, text_options
from .tools import ToolUse, message_parser, tool_use

# -- request schema -------------------------------------------------------------------------------

class MessageItem(RequestBody):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(RequestBody):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: str


class FunctionCallOutputItem(RequestBody):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[dict[str, Any]]


class ReasoningItem(RequestBody):
    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    # Items without "type" are messages (the SDK's EasyInputMessage).
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(RequestBody):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value this server can honour


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")
    # OpenAI's fields this server does not implement (``openai_schemas.validate`` refuses them): the Conversations
    # API and stored prompts are not served, and input is never cut to fit (truncation "auto").
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"conversation": (None,), "prompt": (None,),
                                              "truncation": (None, "disabled")}

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"}: the effort reaches the chat template (vLLM's)

    def wants_logprobs(self) -> bool:
        """Whether the output text's logprobs were asked for (``include``); any other ``include`` is a 400."""
        for value in self.include or ():
            if value != OUTPUT_LOGPROBS:
                raise bad_request(f"include {value!r} is not supported: the only value this server serves is "
                                  f"{OUTPUT_LOGPROBS!r}", param="include")
        wants = OUTPUT_LOGPROBS in (self.include or ())
        if self.top_logprobs and not wants:
            raise bad_request(f"top_logprobs needs include [{OUTPUT_LOGPROBS!r}]", param="top_logprobs")
        return wants

    def template_kwargs(self) -> dict[str, Any] | None:
        effort = (self.reasoning or {}).get("effort")
        return None if effort is None else {"reasoning_effort": effort}


# -- input → chat ---------------------------------------------------------------------------------

def _output_text(output: str | list[dict[str, Any]]) -> str:
    if isinstance(output, str):
        return output
    return "\n".join(p.get("text", "") for p in output if isinstance(p, dict))


def chat_messages(items: str | list) -> list[dict]:
    """Input items as chat-template messages; consecutive function calls join the assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _output_text(item.output)})
    return out


def check_call_outputs(items: str | list, history: list[dict]) -> None:
    """A ``function_call_output`` answers a call made before it, in this input or in the chained conversation;
    OpenAI refuses one whose ``call_id`` no call has (400), and so does this server."""
    if isinstance(items, str):
        return
    known = {call.get("id") for message in history for call in message.get("tool_calls") or ()}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            known.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in known:
            raise bad_request(f"input.{i}.call_id: no tool call found for function call output with call_id "
                              f"{item.call_id!r}", param=f"input.{i}.call_id")


def _tool_use(state: ModelState, req: ResponsesRequest, tools: list[dict] | None) -> ToolUse:
    tc = req.tool_choice
    if tc is None or tc in ("none", "auto", "required"):
        return tool_use(state, tools, tc or "auto", parallel=req.parallel_tool_calls)
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return tool_use(state, tools, "function", tc["name"], req.parallel_tool_calls)
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                      param="tool_choice")


# -- store access ---------------------------------------------------------------------------------

async def store_call(coro: Awaitable) -> Any:
    try:
        return await coro
    except StoreUnavailable as e:
        raise APIError(503, f"the response store is unavailable: {e}", headers={"Retry-After": "1"}) from None
    except ValueError as e:  # a record over the store's size limit
        raise bad_request(str(e)) from None


async def load_response(state: GatewayState, rid: str, param: str | None = None) -> dict:
    record = await store_call(state.responses.get(rid))
    if record is None:
        raise APIError(404, f"Response with id '{rid}' not found.", param=param, code="response_not_found")
    return record


async def conversation(state: GatewayState, req: ResponsesRequest) -> list[dict]:
    """The chat messages of ``previous_response_id``'s conversation (none without one): a 404 for an unknown id,
    a 400 for a response that has not finished."""
    if not req.previous_response_id:
        return []
    prev = await load_response(state, req.previous_response_id, param="previous_response_id")
    if prev.get("messages") is None:
        raise bad_request(f"previous response {req.previous_response_id} is {prev.get('status')}; only a "
                          "finished response can be continued", param="previous_response_id")
    return prev["messages"]


@dataclass
class ResponsePlan:
    """A Responses turn made ready for the engine: its ``Plan`` (one choice), the conversation with this turn's
    input (what a chained response continues), the logprobs asked for, and the output's constraint, still to be
    checked (``structured.check`` may await) before the choice runs."""

    plan: Plan
    messages: list[dict]
    logprobs: int | None
    constraint: structured.StructuredSpec | None


def plan_response(state: ModelState, req: ResponsesRequest, history: list[dict]) -> ResponsePlan:
    check_call_outputs(req.input, history)
    messages = history + chat_messages(req.input)
    tools = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
             for t in req.tools or []] or None
    use = _tool_use(state, req, tools)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    logprobs = (req.top_logprobs or 0) if req.wants_logprobs() else None
    prompt = chat_prompt(state, system + messages, tools=tools, use=use, param="input",
                         template_kwargs=req.template_kwargs())
    max_tokens = check_prompt_ids(state, prompt.ids, req.max_output_tokens, param="input",
                                  max_tokens_param="max_output_tokens")
    fields = SamplingFields.model_construct(temperature=req.temperature, top_p=req.top_p)
    constraint = structured.with_forced_call(structured.from_text_format((req.text or {}).get("format")),
                                             prompt.forced)
    choice = Choice(0, prompt.ids, build_sampling(state, fields, max_tokens, logprobs, 0,
                                                  structured=None if constraint is None else constraint.pair),
                    msg=message_parser(state, use, prompt.prefill))
    plan = Plan(state, f"resp_{random_hex()}", state.name, [(prompt.text, prompt.ids)], 1, [choice],
                text_options(fields), use)
    return ResponsePlan(plan, messages, logprobs, constraint)
