"""Anthropic Messages requests made ready for the engine, before anything is generated.

The request schema, and its translation into chat messages (system prompt, text / tool_use / tool_result blocks)
and OpenAI-style tools rendered with the model's chat template (``messages_prompt``); ``plan_messages`` makes a
``/v1/messages`` body the ``Plan`` the engine gets, which ``POST /v1/messages`` runs (``routers.anthropic``) and
``POST /v1/messages/render`` shows (``routers.render``), so both answer a body with the same 400s.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

from .. import structured
from ..errors import bad_request
from ..ids import random_hex
from ..openai_schemas import MAX_STOP, MAX_STOP_LEN, MAX_TOOLS, MAX_TOP_K, RequestBody, SamplingFields
from ..state import GatewayState, ModelState
from .choices import Choice
from .plans import Plan
from .prompts import ChatPrompt, chat_prompt, check_prompt_ids
from .sampling import build_sampling, text_options
from .tools import NO_TOOLS, ToolUse, message_parser, tool_use

# -- request schema -------------------------------------------------------------------------------

class _Block(RequestBody):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(RequestBody):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(RequestBody):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[Annotated[str, Field(max_length=MAX_STOP_LEN)]] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def sampling_fields(self) -> SamplingFields:
        stops = [s for s in self.stop_sequences or [] if s]
        return SamplingFields.model_construct(temperature=self.temperature, top_p=self.top_p,
                                              top_k=self.top_k or None, stop=stops)


# -- request → chat ------------------------------------------------------------------------------

def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """Anthropic's conversation as chat-template messages: tool_use blocks become an assistant's
    tool_calls, tool_result blocks become tool messages (before the user's text of that turn)."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts = [b.text for b in m.content if isinstance(b, TextBlock)]
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            msg: dict = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
            elif isinstance(b, ToolUseBlock):
                raise bad_request("tool_use blocks belong to assistant messages", param="messages")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(req: CountTokensRequest) -> list[dict] | None:
    if not req.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in req.tools]


def _tool_use(state: ModelState, req: CountTokensRequest, tools: list[dict] | None) -> ToolUse:
    tc = req.tool_choice
    if tc is None:
        return tool_use(state, tools, "auto")
    mode = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[tc.type]
    if mode in ("required", "function") and not tools:  # named as the client wrote it, not as ToolUse names it
        raise bad_request(f'tool_choice of type "{tc.type}" needs tools', param="tool_choice")
    if mode == "function" and not tc.name:
        raise bad_request('tool_choice of type "tool" needs a name', param="tool_choice")
    return tool_use(state, tools, mode, tc.name, parallel=not tc.disable_parallel_tool_use)


def messages_prompt(state: ModelState, req: CountTokensRequest, counting: bool = False) -> tuple[ChatPrompt, ToolUse]:
    tools = _tools(req)
    # Counting renders the tools whether or not this server can parse calls (nothing is generated).
    use = NO_TOOLS if counting and state.tool_parser is None else _tool_use(state, req, tools)
    messages = chat_messages(req)
    prefill = req.messages[-1].role == "assistant"  # Anthropic's prefill: continue the assistant's text
    if prefill and messages[-1].get("tool_calls"):
        raise bad_request("the final assistant message cannot hold tool_use blocks", param="messages")
    prompt = chat_prompt(state, messages, tools=tools, use=use, add_generation_prompt=not prefill,
                         continue_final_message=prefill)
    return prompt, use


async def plan_messages(state: GatewayState, req: MessagesRequest) -> Plan:
    """A Messages request as the engine gets it: one choice, its prompt (an assistant message last is a prefill
    the model continues) and sampling; a forced tool call's grammar checked against the vocabulary."""
    state = state.for_model(req.model, "generate")
    prompt, use = messages_prompt(state, req)
    max_tokens = check_prompt_ids(state, prompt.ids, req.max_tokens, param="messages")
    fields = req.sampling_fields()
    constraint = await structured.check(prompt.forced, state.tokenizer)  # a forced call follows the input_schema
    c = Choice(0, prompt.ids, build_sampling(state, fields, max_tokens, None, 0, structured=constraint),
               msg=message_parser(state, use, prompt.prefill))
    return Plan(state, f"msg_{random_hex()}", req.model, [(prompt.text, prompt.ids)], 1, [c], text_options(fields),
                use)
