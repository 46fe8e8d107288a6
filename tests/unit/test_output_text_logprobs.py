"""Responses' output-text logprobs are those of the tokens that wrote the output text, however the tokens are
grouped into deltas: the real pipeline (``TextPipeline`` → ``Choice.pieces`` with the ``think`` reasoning parser →
``OutputBuilder``) fed one delta that holds reasoning, ``</think>`` and the answer, as a consumer that fell behind
gets it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.generation import Delta, TextOptions, TextPipeline
from gateway.routers.responses import OutputBuilder
from gateway.serving.choices import Choice
from gateway.text.message import MessageParser
from gateway.text.reasoning import ThinkReasoningParser
from gateway.text.token_text import TokenText
from protocol import RequestOutput, SamplingParams
from zserve.tokenizer import Tokenizer

EOS = 2  # SmolLM2's <|im_end|>
REASONING = "<think>The user wants the capital.</think>"
ANSWER = "\n\nThe capital is Paris 😀."  # the emoji is two byte-level tokens: one writes nothing, one all of it


@pytest.fixture(params=["bytewise", "windows"])
def tok(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, smollm2_tokenizer: Tokenizer) -> Tokenizer:
    """Both ways of detokenizing: through token bytes, and through decode windows (other tokenizers')."""
    monkeypatch.setattr(Tokenizer, "decodes_bytewise", property(lambda self: request.param == "bytewise"))
    return smollm2_tokenizer


def respond(tok: Tokenizer, ids: list[int], sizes: list[int], merge_deltas: bool = False,
            stop: list[str] | None = None) -> tuple[dict, list[dict]]:
    """Generate ``ids`` (the last one EOS) as engine outputs of ``sizes`` tokens (merged by the engine client), or,
    with ``merge_deltas``, one token per output and the deltas merged (``run_choices``, ``--stream-interval``);
    return the message item and the streamed ``output_text.delta`` events."""
    state = SimpleNamespace(tokenizer=tok, eos_token_ids=frozenset({EOS}), stream_interval=1, lora=None,
                            model=SimpleNamespace(model_id="m"))
    sampling = SamplingParams(max_tokens=100, logprobs=0)
    pipe = TextPipeline(state, [1], sampling, TextOptions(stop=stop or []))  # type: ignore[arg-type]
    choice = Choice(0, [1], sampling, msg=MessageParser(ThinkReasoningParser(), None))
    tt = TokenText(tok)
    events: list[tuple[str, dict]] = []

    async def emit(kind: str, fields: dict) -> None:
        events.append((kind, fields))

    def outputs():
        at = 0
        for size in sizes:
            part = ids[at:at + size]
            at += size
            for group in ([[i] for i in part] if merge_deltas else [part]):
                yield RequestOutput("r", tuple(group), "stop" if group[-1] == EOS else None,
                                   logprobs=tuple(-0.25 for _ in group))

    async def run() -> list[dict]:
        builder = OutputBuilder(emit)
        deltas = [d for out in outputs() if (d := pipe.push(out)) is not None]
        if merge_deltas:
            merged: list[Delta] = []
            at = 0
            for size in sizes:
                group = deltas[at:at + size]
                at += size
                d = group[0]
                for later in group[1:]:
                    d = d.then(later)
                merged.append(d)
            deltas = merged
        for d in deltas:
            choice.take(d)
            await builder.push([(p, tt.entries(lps) if lps else None) for p, lps in choice.pieces(d)])
        return await builder.finish("completed")

    items = asyncio.run(run())
    streamed = [f for kind, f in events if kind == "response.output_text.delta"]
    return items[-1], streamed


def tokens(entries: list[dict]) -> list[str]:
    return [e["token"] for e in entries]


def expected(tok: Tokenizer, answer_ids: list[int]) -> list[str]:
    """The answer's tokens but its leading whitespace (stripped from the content, so no output text), then EOS."""
    tt = TokenText(tok)
    text = [tt(i)[0] for i in answer_ids]
    while text[0].isspace():
        text.pop(0)
    return text + [tt(EOS)[0]]


def test_one_delta_of_reasoning_and_answer_gives_the_output_text_only_the_answers_logprobs(tok):
    r_ids, a_ids = tok.encode(REASONING), tok.encode(ANSWER)
    ids = r_ids + a_ids + [EOS]
    message, streamed = respond(tok, ids, [len(ids)])
    part = message["content"][0]
    assert part["text"] == ANSWER.strip()
    assert tokens(part["logprobs"]) == expected(tok, a_ids)
    # Streamed: one event for the delta's answer, then the EOS token's at the close; the same entries in all.
    assert [lp for f in streamed for lp in f["logprobs"]] == part["logprobs"]
    assert "".join(f["delta"] for f in streamed) == ANSWER.strip()


@pytest.mark.parametrize("merge_deltas", [False, True], ids=["engine-merged", "delta-merged"])
def test_output_text_logprobs_do_not_depend_on_how_tokens_are_grouped(tok, merge_deltas):
    r_ids, a_ids = tok.encode(REASONING), tok.encode(ANSWER)
    ids = r_ids + a_ids + [EOS]
    n_r = len(r_ids)
    one_by_one, _ = respond(tok, ids, [1] * len(ids))
    want = expected(tok, a_ids)
    assert tokens(one_by_one["content"][0]["logprobs"]) == want
    groupings = [[len(ids)], [3, len(ids) - 3], [n_r - 2, 4, len(ids) - n_r - 2], [n_r + 1, len(ids) - n_r - 1],
                 [len(ids) - 3, 3], [len(ids) - 1, 1]]
    for sizes in groupings:
        message, streamed = respond(tok, ids, sizes, merge_deltas)
        part = message["content"][0]
        assert part["text"] == ANSWER.strip(), sizes
        assert tokens(part["logprobs"]) == want, sizes
        assert [lp for f in streamed for lp in f["logprobs"]] == part["logprobs"], sizes


def test_a_stop_string_held_back_across_deltas_leaves_the_attribution_per_token(tok):
    """Text a stop-string check held back comes out with a later delta; it is still its own token's."""
    r_ids, a_ids = tok.encode(REASONING), tok.encode(ANSWER)
    ids = r_ids + a_ids + [EOS]
    # "</think" could begin the stop string "</thinking>": held back until ">" rules it out.
    message, _ = respond(tok, ids, [len(r_ids) - 1, len(ids) - len(r_ids) + 1], stop=["</thinking>"])
    assert tokens(message["content"][0]["logprobs"]) == expected(tok, a_ids)


def test_each_tokens_share_of_a_merged_delta_is_the_text_it_wrote(tok):
    ids = tok.encode("Hi 😀 there") + [EOS]  # "Hi", " " + the emoji's first 3 bytes, its last byte, " there"
    assert len(ids) == 5
    state = SimpleNamespace(tokenizer=tok, eos_token_ids=frozenset({EOS}), stream_interval=1, lora=None,
                            model=SimpleNamespace(model_id="m"))
    pipe = TextPipeline(state, [1], SamplingParams(max_tokens=100, logprobs=0),  # type: ignore[arg-type]
                        TextOptions(stop=[]))
    d = pipe.push(RequestOutput("r", tuple(ids), "stop", logprobs=tuple(0.0 for _ in ids)))
    assert d is not None and d.texts is not None
    assert "".join(d.texts) == d.text == "Hi 😀 there"
    assert d.texts[-1] == ""  # EOS writes nothing
    # The token that completes the character writes all of it; the one that began it, none of it (its space at
    # once, through token bytes; with it, through decode windows, which hold the whole unfinished text back).
    assert d.texts[0] == "Hi" and d.texts[3] == " there"
    assert d.texts[1:3] in ([" ", "😀"], ["", " 😀"])
