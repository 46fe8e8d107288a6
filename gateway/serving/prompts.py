"""A request's prompt made ready for the engine: its length checked against the model's context
(``check_prompt_ids``), cut as the request asks (``truncate_prompt``), and a chat rendered with the model's
chat template and tokenized (``chat_prompt``), with the opening of a forced tool call when one is forced."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import bad_request
from ..state import ModelState
from ..structured import StructuredSpec, sized
from ..text.chat_template import ChatTemplateError, content_text
from .tools import NO_TOOLS, ToolUse


def check_prompt_ids(state: ModelState, ids: list[int], max_tokens: int | None, param: str = "prompt",
                     max_tokens_param: str = "max_tokens") -> int:
    """Validate prompt length against the context; return the max_tokens to use."""
    if not ids:
        raise bad_request("the prompt is empty", param=param)
    vocab = state.tokenizer.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:  # in C: a long prompt costs no Python loop
        bad = next(t for t in ids if t < 0 or t >= vocab)
        raise bad_request(f"token id {bad} is out of range [0, {vocab})", param=param)
    limit = state.max_model_len
    room = limit - len(ids)
    if room <= 0:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                          f"{len(ids)} tokens.", param=param, code="context_length_exceeded")
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                          f"completion). Please reduce the prompt or {max_tokens_param}.", param=max_tokens_param,
                          code="context_length_exceeded")
    return max_tokens


def truncate_prompt(state: ModelState, ids: list[int], keep: int | None, side: str | None,
                    max_tokens: int | None, max_tokens_param: str = "max_tokens") -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` prompt ids (the first ones with ``truncation_side``
    "right"); -1 keeps as many as the context holds beside ``max_tokens`` (beside one token when it is not given).
    A ``keep`` past that room is a 400, as in vLLM: the prompt would be cut and still refused. ``ids`` itself comes
    back when nothing is cut."""
    if keep is None:
        return ids
    reserved = max_tokens or 1
    room = state.max_model_len - reserved
    if keep == -1:
        keep = max(room, 0)
    elif keep > room:
        raise bad_request(f"truncate_prompt_tokens={keep} cannot be greater than the model's maximum context length "
                          f"minus {max_tokens_param}: {state.max_model_len} - {reserved} = {room}. Please request a "
                          "smaller truncation size.", param="truncate_prompt_tokens")
    if keep >= len(ids):
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep:]



def wants_generation_prompt(add_generation_prompt: bool, continue_final_message: bool, fields_set: set[str]) -> bool:
    """vLLM's rule: continue_final_message turns the generation prompt off unless it was asked for
    explicitly (then ``chat_prompt`` refuses the pair)."""
    return add_generation_prompt and not (continue_final_message and "add_generation_prompt" not in fields_set)


@dataclass
class ChatPrompt:
    ids: list[int]
    text: str
    prefill: str = ""  # opening of a forced tool call, appended after the generation prompt
    forced: StructuredSpec | None = None  # the grammar of the rest of a forced tool call (not yet checked)


def chat_prompt(state: ModelState, messages: list[dict], *, tools: list[dict] | None = None,
                use: ToolUse = NO_TOOLS, add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None, param: str = "messages") -> ChatPrompt:
    """Render messages with the model's chat template and tokenize them.

    ``continue_final_message`` renders the conversation up to the end of the last (assistant)
    message's text, without closing it, so the model continues that text (as vLLM does; Anthropic's
    assistant prefill). A forced tool call appends the parser's opening of a call, and ``forced``
    holds the grammar that makes the rest of the output a call whose arguments follow the tool's
    schema (``structured.check`` compiles it; it names ``tools`` when a schema cannot be compiled).
    """
    if state.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", param=param)
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          param="continue_final_message")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise bad_request("continue_final_message needs an assistant message last", param="continue_final_message")
    try:
        final = content_text(messages[-1].get("content")) or "" if continue_final_message else ""
    except ChatTemplateError as e:
        raise bad_request(str(e), param=param) from None
    if continue_final_message and not final:
        # Nothing to continue: the same prompt as a new assistant turn.
        messages, add_generation_prompt, continue_final_message = messages[:-1], True, False
    try:
        if not continue_final_message and not use.forced:  # the text as rendered is the prompt: ids cached too
            text, ids = state.chat_template.render_ids(messages, state.tokenizer.encode,
                                                       add_generation_prompt=add_generation_prompt, tools=tools,
                                                       **(template_kwargs or {}))
            return ChatPrompt(ids, text)
        text = state.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                          **(template_kwargs or {}))
    except ChatTemplateError as e:
        raise bad_request(str(e), param=param) from None
    if continue_final_message:
        cut = text.rfind(final)
        if cut < 0:
            raise bad_request("the chat template does not render the final message's text, so it cannot be "
                              "continued", param="continue_final_message")
        text = text[: cut + len(final)]
    prefill, forced = "", None
    if use.forced:
        assert state.tool_parser is not None
        prefill = state.tool_parser.forced_prefill(tools or [], use.function)
        text += prefill
        grammar = state.tool_parser.forced_grammar(tools or [], use.function, parallel=use.parallel)
        forced = sized("lark", grammar, "tools")
    return ChatPrompt(state.tokenizer.encode(text), text, prefill, forced)
