"""A speech engine's segments, as the bodies of OpenAI's ``/v1/audio/transcriptions`` and ``/translations``.

The engine sends token ids, never text (``protocol.speech``): this module turns a request's ``TranscriptSegment``s
into each ``response_format`` OpenAI has (``json``, ``text``, ``srt``, ``vtt``, ``verbose_json`` with segments and
words) and into the text deltas of a streamed transcript. Everything here is pure: the model's tokenizer
(``zserve.tokenizer.Tokenizer``, from its Whisper ``tokenizer.json``: byte-level BPE) and the segments in, a str or a
JSON-ready dict out.

Text follows Whisper's own: a segment's text is the decode of its tokens and keeps the leading space Whisper writes
(as OpenAI's ``segments[].text`` does); the transcript is the segments' texts joined and stripped.

Words: a word is the tokens from one that starts with a space up to the next such token, decoded together (a
UTF-8 character can span tokens, and decoding one token alone gives U+FFFD). Punctuation stays on the word it
follows ("Hello," "world."), as Whisper's ``word_timestamps`` have it: a client highlighting words as they are
spoken wants the comma with its word, not as a word of its own with a time. A run of closing punctuation written
after a space (French "vous ?") joins the word before it, and opening punctuation written before a spaced word
joins the word after it. Languages written without spaces split wherever the text so far is whole characters
instead (each CJK character a word), keeping runs of Latin letters and digits together.

Times never go backwards from one segment, cue or word to the next, and none ends before it starts: a model's
timestamps can disagree by a frame across windows, and subtitle players misbehave on such cues.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Iterable, Sequence

from protocol.speech import TranscriptSegment
from zserve.tokenizer import Tokenizer

# Whisper's languages (its tokenizer's language tokens, in their order) with the English names OpenAI's
# verbose_json gives, in lower case.
LANGUAGES: dict[str, str] = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian", "ko": "korean",
    "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish", "pl": "polish", "ca": "catalan",
    "nl": "dutch", "ar": "arabic", "sv": "swedish", "it": "italian", "id": "indonesian", "hi": "hindi",
    "fi": "finnish", "vi": "vietnamese", "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay",
    "cs": "czech", "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian", "la": "latin",
    "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak", "te": "telugu", "fa": "persian",
    "lv": "latvian", "bn": "bengali", "sr": "serbian", "az": "azerbaijani", "sl": "slovenian", "kn": "kannada",
    "et": "estonian", "mk": "macedonian", "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian",
    "ne": "nepali", "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian", "sw": "swahili",
    "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala", "km": "khmer", "sn": "shona",
    "yo": "yoruba", "so": "somali", "af": "afrikaans", "oc": "occitan", "ka": "georgian", "be": "belarusian",
    "tg": "tajik", "sd": "sindhi", "gu": "gujarati", "am": "amharic", "yi": "yiddish", "lo": "lao",
    "uz": "uzbek", "fo": "faroese", "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "nynorsk",
    "mt": "maltese", "sa": "sanskrit", "lb": "luxembourgish", "my": "myanmar", "bo": "tibetan", "tl": "tagalog",
    "mg": "malagasy", "as": "assamese", "tt": "tatar", "haw": "hawaiian", "ln": "lingala", "ha": "hausa",
    "ba": "bashkir", "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}

# Written without spaces between words: split words at character boundaries instead (as Whisper does).
SPACELESS_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})

_CLOSING = frozenset(".,!?:;…)]}»”’、。，！？：；）」』】〕〉》")
_OPENING = frozenset("([{«“‘¿¡「『【〔〈《（")
_SPACES = frozenset(b" \t\n\r")
_UTF8 = codecs.getincrementaldecoder("utf-8")


def language_name(code: str) -> str:
    """OpenAI's name for a language code ("en" -> "english"); an unknown code is returned as it is."""
    return LANGUAGES.get(code.lower(), code)


def segment_text(tokenizer: Tokenizer, seg: TranscriptSegment) -> str:
    """A segment's text, with the leading space Whisper writes before a word."""
    return tokenizer.decode(list(seg.token_ids))


def full_text(tokenizer: Tokenizer, segments: Iterable[TranscriptSegment]) -> str:
    """The transcript (OpenAI's ``text``): the segments' texts joined, without leading or trailing space."""
    return "".join(segment_text(tokenizer, s) for s in segments).strip()


def usage(duration: float) -> dict:
    """What a transcription costs, as OpenAI bills whisper-1: the recording's whole seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(round(max(0.0, duration), 3))}


def as_json(text: str, usage: dict) -> dict:
    """``response_format=json``."""
    return {"text": text, "usage": usage}


def as_text(text: str) -> str:
    """``response_format=text``."""
    return text + "\n"


def as_srt(tokenizer: Tokenizer, segments: Sequence[TranscriptSegment]) -> str:
    """``response_format=srt``: numbered cues ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, a blank line after each."""
    cues = _cues(tokenizer, segments)
    return "".join(f"{n}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{text}\n\n"
                   for n, (a, b, text) in enumerate(cues, start=1))


def as_vtt(tokenizer: Tokenizer, segments: Sequence[TranscriptSegment]) -> str:
    """``response_format=vtt``: ``WEBVTT``, then cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm``, a blank line after each.
    Cue text is written as Whisper and OpenAI write it (no ``&``/``<`` escapes)."""
    cues = _cues(tokenizer, segments)
    return "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{text}\n\n" for a, b, text in cues)


def as_verbose_json(tokenizer: Tokenizer, task: str, language_code: str, duration: float,
                    segments: Sequence[TranscriptSegment], want_segments: bool = True,
                    want_words: bool = False) -> dict:
    """``response_format=verbose_json``. ``want_segments``/``want_words`` follow ``timestamp_granularities``
    (OpenAI leaves ``segments`` out when only words are asked for). A segment's ``tokens`` are its text tokens."""
    body: dict = {"task": task, "language": language_name(language_code), "duration": round(duration, 2),
                  "text": full_text(tokenizer, segments)}
    if want_segments:
        spans = _monotone((s.start, s.end) for s in segments)
        body["segments"] = [
            {"id": i, "seek": s.seek, "start": start, "end": end, "text": segment_text(tokenizer, s),
             "tokens": list(s.token_ids), "temperature": float(s.temperature), "avg_logprob": float(s.avg_logprob),
             "compression_ratio": float(s.compression_ratio), "no_speech_prob": float(s.no_speech_prob)}
            for i, (s, (start, end)) in enumerate(zip(segments, spans))]
    if want_words:
        body["words"] = words(tokenizer, segments, language_code)
    body["usage"] = usage(duration)
    return body


def words(tokenizer: Tokenizer, segments: Iterable[TranscriptSegment], language: str | None = None) -> list[dict]:
    """OpenAI's ``words``: ``[{"word": "Hello,", "start": 0.0, "end": 0.42}, ...]``, times rounded to 10 ms.
    Words carry no leading space, and punctuation stays on the word before it (see the module's docstring).
    ``language`` (a code) picks character splitting for languages written without spaces. Segments without
    ``word_times`` give no words."""
    spaceless = (language or "").lower() in SPACELESS_LANGUAGES
    found: list[tuple[str, float, float]] = []
    for seg in segments:
        if not seg.word_times or not seg.token_ids:
            continue
        pieces = [_piece_bytes(tokenizer, t) for t in seg.token_ids]
        for lo, hi in _word_spans(pieces, spaceless):
            text = tokenizer.decode(list(seg.token_ids[lo:hi])).strip()
            if text:
                found.append((text, seg.word_times[lo], seg.word_times[hi]))
    spans = _monotone((start, end) for _, start, end in found)
    return [{"word": text, "start": start, "end": end} for (text, _, _), (start, end) in zip(found, spans)]


class StreamText:
    """The transcript's text as segments arrive, for a streamed response: ``push`` returns the text to send now,
    ``text`` the whole transcript so far. The deltas concatenated equal ``full_text`` of all segments pushed: the
    first delta has no leading space, and trailing space is held back until more text follows it (a transcript
    never ends in space)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text = ""
        self._held = ""  # trailing whitespace not sent yet

    def push(self, segments: Iterable[TranscriptSegment]) -> str:
        new = "".join(segment_text(self._tokenizer, s) for s in segments)
        if not self._text:
            new = new.lstrip()
        body = self._held + new
        delta = body.rstrip()
        self._held = body[len(delta):]
        self._text += delta
        return delta

    @property
    def text(self) -> str:
        return self._text


def _piece_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes a token writes (nothing for a special token, which decodes to nothing)."""
    return b"" if token_id in tokenizer.all_special_ids else tokenizer.id_to_bytes(token_id)


def _word_spans(pieces: list[bytes], spaceless: bool) -> list[tuple[int, int]]:
    """Token index ranges ``[lo, hi)`` of a segment's words, from its tokens' bytes."""
    utf8 = _UTF8("replace")
    groups: list[list[int]] = []  # [lo, hi]
    texts: list[str] = []  # each group's text so far
    for i, piece in enumerate(pieces):
        pending = bool(utf8.getstate()[0])  # the previous token ended inside a character
        text = utf8.decode(piece)
        if not groups or pending:
            new = not groups
        elif spaceless:
            prev = texts[-1]
            new = bool(piece) and not (prev[-1:].isascii() and prev[-1:].isalnum()
                                       and text[:1].isascii() and text[:1].isalnum())
        else:
            new = bool(piece) and piece[0] in _SPACES
        if new:
            groups.append([i, i + 1])
            texts.append(text)
        else:
            groups[-1][1] = i + 1
            texts[-1] += text
    # Punctuation and space that stand alone join a neighbour: closing marks the word before, opening marks and
    # bare space the word after.
    spans: list[list[int]] = []
    carried: int | None = None  # where groups waiting to join the next word begin
    for (lo, hi), text in zip(groups, texts):
        core = text.strip()
        if carried is not None:
            lo, carried = carried, None
        if core and spans and all(c in _CLOSING for c in core):
            spans[-1][1] = hi
        elif not core or all(c in _OPENING for c in core):
            carried = lo
        else:
            spans.append([lo, hi])
    if carried is not None:  # nothing followed: the last word takes them, or they stand alone
        if spans:
            spans[-1][1] = len(pieces)
        else:
            spans.append([carried, len(pieces)])
    return [(lo, hi) for lo, hi in spans]


def _monotone(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Times rounded to 10 ms, starts never earlier than the one before, ends never before their start."""
    out: list[tuple[float, float]] = []
    floor = 0.0
    for start, end in spans:
        start = max(round(float(start), 2), floor)
        end = max(round(float(end), 2), start)
        out.append((start, end))
        floor = start
    return out


def _cues(tokenizer: Tokenizer, segments: Sequence[TranscriptSegment]) -> list[tuple[int, int, str]]:
    """Subtitle cues: (start ms, end ms, text), empty segments left out, times made monotone in whole ms.
    ``-->`` in a text would end its cue's timing line early and a blank line would end the cue: both go."""
    cues: list[tuple[int, int, str]] = []
    floor = 0
    for seg in segments:
        text = "\n".join(line.strip() for line in segment_text(tokenizer, seg).splitlines() if line.strip())
        if not text:
            continue
        start = max(_ms(seg.start), floor)
        end = max(_ms(seg.end), start)
        cues.append((start, end, text.replace("-->", "->")))
        floor = start
    return cues


def _ms(seconds: float) -> int:
    return max(0, round(float(seconds) * 1000))


def _clock(ms: int, sep: str) -> str:
    """``HH:MM:SS,mmm`` (srt, ``sep=","``) or ``HH:MM:SS.mmm`` (vtt); hours grow past two digits if they must."""
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    seconds, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{sep}{ms:03d}"
