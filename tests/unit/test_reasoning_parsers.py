"""Reasoning parsers split thinking from the answer, and stream exactly what they split."""

from __future__ import annotations

import random

import pytest

from gateway.text.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ThinkReasoningParser,
    get_reasoning_parser,
)

CHUNK_SIZES = [1, 2, 3, 7]


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def run_stream(parser: ReasoningParser, text: str, size: int) -> tuple[str, str]:
    stream = parser.stream()
    reasoning: list[str] = []
    content: list[str] = []
    for piece in pieces(text, size):
        r, c = stream.push(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return "".join(reasoning) + r, "".join(content) + c


def check(parser: str | ReasoningParser, text: str) -> tuple[str | None, str]:
    """split(text), after checking that every way of streaming text gives the same answer."""
    if isinstance(parser, str):
        parser = get_reasoning_parser(parser)
    reasoning, content = parser.split(text)
    assert reasoning is None or (reasoning and reasoning == reasoning.strip())
    assert content == content.strip()
    for size in CHUNK_SIZES + [len(text) or 1]:
        assert run_stream(parser, text, size) == (reasoning or "", content), f"chunk size {size}"
    return reasoning, content


# --- think: the model opens the tag -----------------------------------------------------------------


def test_think_block_then_answer() -> None:
    text = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?"
    assert check("think", text) == ("The user greets me. I should greet back.", "Hello! How can I help?")


def test_think_whitespace_before_the_block() -> None:
    assert check("think", "\n\n<think>hmm</think>\n\nAnswer.") == ("hmm", "Answer.")


def test_think_text_before_the_block_is_content() -> None:
    assert check("think", "Let me think. <think>a\nb</think>\nOK") == ("a\nb", "Let me think. \nOK")


def test_think_no_tags_is_all_content() -> None:
    assert check("think", "  Just an answer, no thinking.\n") == (None, "Just an answer, no thinking.")
    assert check("think", "") == (None, "")


def test_think_unclosed_block_is_all_reasoning() -> None:
    text = "<think>\nStep 1: add the numbers. Step 2: carry the"
    assert check("think", text) == ("Step 1: add the numbers. Step 2: carry the", "")


def test_think_empty_block_has_no_reasoning() -> None:
    # Qwen3 with enable_thinking=False still writes an empty block.
    assert check("think", "<think>\n\n</think>\n\nThe answer is 4.") == (None, "The answer is 4.")


def test_think_unicode_and_look_alikes() -> None:
    thought = "Is 3 < 4? Yes; <thin is not a tag, nor </thinking>. 日本語 🤔"
    text = "<think>" + thought + "</think>\n\n答えは「はい」です。<think>"
    reasoning, content = check("think", text)
    assert reasoning == thought
    assert content == "答えは「はい」です。<think>"  # one block only: a later tag is plain text


def test_think_stray_close_tag_stays_content() -> None:
    # Without starts_in_reasoning, text before any <think> is content (it has already been streamed).
    assert check("think", "I reasoned here.</think>\n\nAnswer.") == (None, "I reasoned here.</think>\n\nAnswer.")


def test_think_template_opened_is_handled_with_the_flag() -> None:
    parser = ThinkReasoningParser(starts_in_reasoning=True)
    assert check(parser, "I reasoned here.\n</think>\n\nAnswer.") == ("I reasoned here.", "Answer.")


# --- deepseek_r1: the chat template opened the tag --------------------------------------------------


def test_deepseek_r1_starts_in_reasoning() -> None:
    text = "Okay, the user asks for 2+2. That is 4.\n</think>\n\nThe answer is **4**."
    assert check("deepseek_r1", text) == ("Okay, the user asks for 2+2. That is 4.", "The answer is **4**.")


def test_deepseek_r1_model_writes_the_open_tag_too() -> None:
    assert check("deepseek_r1", "<think>\nthinking\n</think>\n\nanswer") == ("thinking", "answer")
    assert check("deepseek_r1", "\n <think>x</think>y") == ("x", "y")
    # Only a leading tag is the opening one; later it is part of the reasoning.
    assert check("deepseek_r1", "a <think> b</think>c") == ("a <think> b", "c")


def test_deepseek_r1_no_close_is_all_reasoning() -> None:
    assert check("deepseek_r1", "Let me count: 1, 2, 3") == ("Let me count: 1, 2, 3", "")
    assert check("deepseek_r1", "<thi") == ("<thi", "")
    assert check("deepseek_r1", "") == (None, "")


def test_deepseek_r1_empty_reasoning() -> None:
    assert check("deepseek_r1", "\n</think>\n\nHi.") == (None, "Hi.")
    assert check("deepseek_r1", "</think>Hi.") == (None, "Hi.")


def test_deepseek_r1_content_after_close_is_literal() -> None:
    assert check("deepseek_r1", "r</think>\n\nuse </think> and <think> tags") == ("r", "use </think> and <think> tags")


# --- streaming specifics ----------------------------------------------------------------------------


def test_stream_emits_eagerly_and_holds_partial_tags() -> None:
    stream = get_reasoning_parser("think").stream()
    assert stream.push("<th") == ("", "")
    assert stream.push("ink>\nStep one") == ("Step one", "")
    assert stream.push(". </thi") == (".", "")  # " " may be trailing, "</thi" may close
    assert stream.push("nk>\n\nDone") == ("", "Done")
    assert stream.finish() == ("", "")


def test_stream_unclosed_partial_tag_is_flushed() -> None:
    stream = get_reasoning_parser("think").stream()
    assert stream.push("<think>abc</th") == ("abc", "")
    assert stream.finish() == ("</th", "")


def test_long_reasoning_streams_without_rescanning() -> None:
    text = "<think>" + "word " * 40000 + "</think>answer"
    reasoning, content = run_stream(get_reasoning_parser("think"), text, 1)
    assert len(reasoning) == len("word " * 40000) - 1 and content == "answer"


# --- registry ---------------------------------------------------------------------------------------


def test_registry_names_match() -> None:
    assert {"think", "deepseek_r1"} <= set(REASONING_PARSERS)
    for name, cls in REASONING_PARSERS.items():
        assert cls.name == name
        assert get_reasoning_parser(name).name == name


def test_unknown_parser_lists_the_valid_names() -> None:
    with pytest.raises(ValueError) as excinfo:
        get_reasoning_parser("o1")
    message = str(excinfo.value)
    assert message.startswith("unknown reasoning parser 'o1'; choose one of: ")
    assert "think" in message and "deepseek_r1" in message


@pytest.mark.parametrize("parser_name", ["think", "deepseek_r1"])
def test_random_outputs_stream_like_they_split(parser_name: str) -> None:
    # Outputs glued from tag pieces and text, streamed in random cuts: always the same answer.
    rng = random.Random(7)
    atoms = ["<think>", "</think>", "<th", "</thi", "think>", "\n", " ", "a", "<", ">", "é"]
    parser = get_reasoning_parser(parser_name)
    for _ in range(2000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 8)))
        reasoning, content = parser.split(text)
        stream = parser.stream()
        got_r: list[str] = []
        got_c: list[str] = []
        i = 0
        while i < len(text):
            size = rng.randint(1, 6)
            r, c = stream.push(text[i : i + size])
            got_r.append(r)
            got_c.append(c)
            i += size
        r, c = stream.finish()
        assert ("".join(got_r) + r, "".join(got_c) + c) == (reasoning or "", content), text
