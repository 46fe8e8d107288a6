"""The shared-prefix workloads of ``launch bench``: what a prefix cache, and routing that keeps a prefix on the
engine that holds it, can save.

``prefix_repetition`` is vLLM's dataset of that name: a few random prefixes, each shared by an even share of the
prompts, each prompt its prefix and a random suffix, the prompts shuffled. ``multi_turn`` is chats whose every turn
carries the whole conversation so far. Lengths are token-exact where the server can count (``PromptMaker``); each
request names its prefix or conversation (``group``), so the report can tell how often one group stayed on one
engine.
"""

from __future__ import annotations

import random

from .load import Conversation, PromptMaker, RequestSpec


def spread(num_prompts: int, num_groups: int) -> list[int]:
    """How many of ``num_prompts`` each of ``num_groups`` gets: as even as can be, the first ones one more."""
    per, extra = divmod(num_prompts, num_groups)
    return [per + (g < extra) for g in range(num_groups)]


async def prefix_repetition(maker: PromptMaker, rng: random.Random, num_prompts: int, prefix_len: int,
                            suffix_len: int, num_prefixes: int, output_len: int) -> list[RequestSpec]:
    """``num_prompts`` prompts of ``prefix_len + suffix_len`` tokens over ``num_prefixes`` random prefixes, spread
    evenly over them and shuffled; each asks for ``output_len`` tokens. A prompt's ``group`` is its prefix's index."""
    prefixes = await maker.texts([prefix_len] * num_prefixes)
    specs = []
    for group, ((prefix, got), count) in enumerate(zip(prefixes, spread(num_prompts, num_prefixes))):
        for text, n in await maker.texts([got + suffix_len] * count, head=prefix, head_len=got):
            specs.append(RequestSpec(prompt=text, messages=None, prompt_len=n, max_tokens=output_len, group=group))
    rng.shuffle(specs)
    return specs


async def multi_turn(maker: PromptMaker, num_conversations: int, turns: int, user_len: int,
                     output_len: int) -> list[Conversation]:
    """``num_conversations`` chats of ``turns`` user turns of ``user_len`` tokens each, every answer at most
    ``output_len`` tokens; a conversation's ``group`` is its index."""
    texts = await maker.texts([user_len] * (num_conversations * turns))
    return [Conversation(turns=[text for text, _ in texts[c * turns:(c + 1) * turns]], max_tokens=output_len,
                         group=c) for c in range(num_conversations)]
