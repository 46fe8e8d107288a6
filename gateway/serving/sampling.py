"""What a request asks of the engine's sampler (``build_sampling``: the engine's ``SamplingParams``, checked
against the model's vocabulary) and of the gateway's text handling (``text_options``: stop strings, special
tokens)."""

from __future__ import annotations

from protocol import SamplingParams

from ..errors import bad_request
from ..generation import TextOptions
from ..openai_schemas import SEED_END, SamplingFields
from ..state import ModelState


def build_sampling(state: ModelState, req: SamplingFields, max_tokens: int, logprobs: int | None,
                   choice: int, prompt_logprobs: int | None = None, where: str = "",
                   structured: tuple[str, str] | None = None) -> SamplingParams:
    """The engine's SamplingParams; ``where`` prefixes the field named in errors (e.g. ``sampling_params.``).
    ``structured`` is the checked constraint (``structured.check``) the output must follow."""
    vocab = state.tokenizer.vocab_size
    bias = []
    for k, v in (req.logit_bias or {}).items():
        if int(k) >= vocab:
            raise bad_request(f"logit_bias token id {k} is out of range", param=f"{where}logit_bias")
        bias.append((int(k), float(v)))
    stop_ids = tuple(req.stop_token_ids or ())
    if any(t >= vocab for t in stop_ids):
        raise bad_request("stop_token_ids holds an id outside the vocabulary", param=f"{where}stop_token_ids")
    if req.min_tokens > max_tokens:
        raise bad_request("min_tokens must not exceed max_tokens", param=f"{where}min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        min_p=req.min_p,
        seed=None if req.seed is None else choice_seed(req.seed, choice),
        min_tokens=req.min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=tuple(bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        priority=req.priority,
        structured=structured,
    )


def choice_seed(seed: int, choice: int) -> int:
    """Choice j of n samples with seed + j, wrapped as 64-bit seeds wrap, so the wire's range holds any j."""
    s = seed + choice
    return s % (1 << 64) if s >= SEED_END else s


def text_options(req: SamplingFields) -> TextOptions:
    return TextOptions(stop=req.stop or [], include_stop_str_in_output=req.include_stop_str_in_output,
                       skip_special_tokens=req.skip_special_tokens)
