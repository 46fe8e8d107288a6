"""OpenAI completions and chat-completions requests made ready for the engine, before anything is generated.

``plan_completion`` and ``plan_chat`` take a validated body and run every check that comes before the engine
(model, prompt length, tools, chat template, structured output, sampling) into a ``Plan``: each prompt's text
and ids, and one ``Choice`` per generation. The generation routes (``routers.openai``) run a plan on the
engines; the render routes (``routers.render``) show it instead, so both answer a body with the same 400s.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import structured
from ..errors import bad_request
from ..generation import TextOptions
from ..ids import random_hex
from ..openai_schemas import ChatCompletionRequest, CompletionRequest
from ..state import GatewayState, ModelState
from ..text.chat_template import ChatTemplateError, content_text
from .choices import Choice
from .prompts import chat_prompt, check_prompt_ids, truncate_prompt, wants_generation_prompt
from .sampling import build_sampling, text_options
from .tools import NO_TOOLS, ToolUse, chat_tool_use, message_parser


@dataclass
class Plan:
    """A request made ready for the engine, before anything is generated: each prompt (its text and the ids the
    engine gets) and one ``Choice`` per generation, ``n`` to a prompt (prompt i's are ``choices[i*n:(i+1)*n]``).
    The generation routes (``routers.openai``) run it; the render routes (``routers.render``) show it."""

    state: ModelState  # the gateway as the request's model sees it
    request_id: str
    model: str
    prompts: list[tuple[str | None, list[int]]]  # (text, ids); text None for a prompt given as ids
    n: int
    choices: list[Choice]
    opts: TextOptions
    use: ToolUse = NO_TOOLS

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)

    def render(self, i: int) -> dict:
        """Prompt ``i`` of a plan as the engine would get it.

        ``sampling_params`` is the engine's ``SamplingParams`` of the prompt's first choice, exactly as it
        travels (max_tokens resolved against the context); choice j of ``n`` differs only in its seed (seed + j).
        ``text_options`` is what the gateway applies to the engine's tokens on the way back."""
        text, ids = self.prompts[i]
        first = self.choices[i * self.n]
        return {
            "request_id": self.request_id,
            "model": self.model,
            "prompt": text if text is not None else self.state.tokenizer.decode(ids, skip_special_tokens=False),
            "token_ids": ids,
            "n": self.n,
            "sampling_params": first.sampling.to_wire(),
            "text_options": {"stop": self.opts.stop, "include_stop_str_in_output": self.opts.include_stop_str_in_output,
                             "skip_special_tokens": self.opts.skip_special_tokens},
        }


def check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The request's ``prompt_logprobs``: a streamed answer has no place for them (vLLM refuses them too)."""
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    return req.prompt_logprobs


def chat_echo(req: ChatCompletionRequest, messages: list[dict], add_generation_prompt: bool) -> str:
    """vLLM's chat ``echo``: the last message's text, when its role is the answer's (the assistant's with a
    generation prompt, else the last message's own), starts the answer."""
    if not req.echo:
        return ""
    role = "assistant" if add_generation_prompt else messages[-1]["role"]
    if messages[-1]["role"] != role:
        return ""
    try:
        return content_text(messages[-1].get("content")) or ""
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None


async def plan_completion(state: GatewayState, req: CompletionRequest) -> Plan:
    state = state.for_model(req.model, "generate")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    # vLLM's: echo with logprobs scores the prompt too (its entries lead the choice's logprobs).
    prompt_logprobs = check_prompt_logprobs(req)
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    p = req.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if not prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    constraint = await structured.check(structured.from_request(req), state.tokenizer)
    choices: list[Choice] = []
    rendered: list[tuple[str | None, list[int]]] = []
    for i, pr in enumerate(prompts):
        given = state.tokenizer.encode(pr) if isinstance(pr, str) else list(pr)
        ids = truncate_prompt(state, given, req.truncate_prompt_tokens, req.truncation_side, req.max_tokens or None)
        max_tokens = check_prompt_ids(state, ids, req.max_tokens if req.max_tokens else None)
        if req.max_tokens == 0:
            raise bad_request("max_tokens must be at least 1", param="max_tokens")
        text = pr if isinstance(pr, str) and ids is given else None  # the text of what the engine gets, if given
        rendered.append((text, ids))
        # The echoed prompt is what the engine got: the text as given, or its ids' text (special tokens kept, as
        # their logprob entries are).
        prefix = (text if text is not None else state.tokenizer.decode(ids, skip_special_tokens=False)) \
            if req.echo else ""
        for j in range(req.n):
            sp = build_sampling(state, req, max_tokens, req.logprobs, j, prompt_logprobs, structured=constraint)
            choices.append(Choice(i * req.n + j, ids, sp, prefix))
    return Plan(state, f"cmpl-{random_hex()}", state.name, rendered, req.n, choices, text_options(req))


async def plan_chat(state: GatewayState, req: ChatCompletionRequest) -> Plan:
    state = state.for_model(req.model, "generate")
    requested = structured.from_request(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    use = chat_tool_use(state, tools, req.tool_choice, req.parallel_tool_calls)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    add_generation_prompt = wants_generation_prompt(req.add_generation_prompt, req.continue_final_message,
                                                    req.model_fields_set)
    prompt = chat_prompt(state, messages, tools=tools, use=use, add_generation_prompt=add_generation_prompt,
                         continue_final_message=req.continue_final_message, template_kwargs=req.template_kwargs())
    asked = req.max_completion_tokens or req.max_tokens
    ids = truncate_prompt(state, prompt.ids, req.truncate_prompt_tokens, req.truncation_side, asked,
                          "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    max_tokens = check_prompt_ids(state, ids, asked, param="messages")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prompt_logprobs = check_prompt_logprobs(req)
    echo = chat_echo(req, messages, add_generation_prompt)
    constraint = await structured.check(structured.with_forced_call(requested, prompt.forced), state.tokenizer)
    choices = [Choice(j, ids, build_sampling(state, req, max_tokens, logprobs, j, prompt_logprobs,
                                             structured=constraint),
                      echo, msg=message_parser(state, use, prompt.prefill)) for j in range(req.n)]
    return Plan(state, f"chatcmpl-{random_hex()}", state.name, [(prompt.text if ids is prompt.ids else None, ids)],
                req.n, choices, text_options(req), use)
