"""Speech to text on the wire: a gateway sends a ``TranscribeRequest`` (the decoded audio), a speech engine answers
with one ``TranscribeOutput`` per 30-second window it decoded, the last one ``done``.

The gateway decodes the upload (any container, any rate) to 16 kHz mono 16-bit PCM and sends it whole: the engine
cuts it into Whisper's 30 s windows itself, because where the next window starts depends on the timestamps the model
wrote in the previous one, and the previous window's tokens are the next one's context. Windows of different
requests run in one batch (``engine_worker.speech_scheduler``).

As elsewhere, token ids travel and text stays at the edge: a segment carries its text's token ids (no special or
timestamp tokens) and the gateway's tokenizer turns them into text, words and subtitles (``gateway.transcripts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .messages import MAX_ERROR_CHARS, Message, valid_trace_id
from .validate import check, is_int, is_num

SAMPLE_RATE = 16000  # what Whisper hears, and what a TranscribeRequest's audio is in
SPEECH_TASKS = ("transcribe", "translate")  # translate: into English
MAX_PROMPT_TOKENS = 223  # Whisper's context for the previous text: half its 448-token window, less the marker
MAX_LANGUAGE_LEN = 8  # a language code ("en", "haw", "yue")
MAX_SEGMENTS = 4096  # in one output (one 30 s window holds a few dozen at most)


def _request_id_ok(rid: object) -> bool:
    return isinstance(rid, str) and 0 < len(rid) <= 128


@dataclass(frozen=True)
class TranscribeRequest(Message):
    """Transcribe (or translate into English) one recording. ``audio`` is 16 kHz mono signed 16-bit little-endian
    PCM (a binary frame). ``language`` is a code such as ``en`` (None: the engine detects it on the first window).
    ``prompt_token_ids``: the client's prompt, as the previous text of the first window. ``temperature`` 0 decodes
    greedily and, as Whisper does, decodes a window that fails its checks (repetition, low confidence) again at
    higher temperatures; above 0 it samples at that temperature. ``timestamps``: segments with times (otherwise one
    segment per window); ``words``: each text token's time too (word timestamps)."""

    TYPE: ClassVar[str] = "transcribe"
    request_id: str
    audio: bytes
    task: str = "transcribe"
    language: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    timestamps: bool = True
    words: bool = False
    trace_id: str | None = None

    def __post_init__(self) -> None:
        check(_request_id_ok(self.request_id), "request_id must be a non-empty str of at most 128 chars")
        check(isinstance(self.audio, bytes) and len(self.audio) % 2 == 0, "audio must be 16-bit PCM bytes")
        check(self.task in SPEECH_TASKS, f"task must be one of {SPEECH_TASKS}")
        check(self.language is None or (isinstance(self.language, str) and 0 < len(self.language) <= MAX_LANGUAGE_LEN
                                        and self.language.isascii() and self.language.isalpha()),
              "language must be a short code")
        check(isinstance(self.prompt_token_ids, tuple) and len(self.prompt_token_ids) <= MAX_PROMPT_TOKENS * 8
              and all(is_int(t) and t >= 0 for t in self.prompt_token_ids), "prompt_token_ids must be token ids")
        check(is_num(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]")
        check(isinstance(self.timestamps, bool) and isinstance(self.words, bool), "timestamps and words are bools")
        check(self.trace_id is None or valid_trace_id(self.trace_id), "trace_id must be printable, at most 128 chars")

    @property
    def seconds(self) -> float:
        return len(self.audio) / (2 * SAMPLE_RATE)


@dataclass(frozen=True)
class TranscriptSegment:
    """A stretch of speech as the model wrote it: ``start``/``end`` in seconds from the start of the recording,
    ``seek`` the 10 ms frame its window began at (OpenAI's verbose_json field), the text's token ids, and the
    decoding's figures. ``word_times`` (with word timestamps): ``len(token_ids) + 1`` times, token i spoken from
    ``word_times[i]`` to ``word_times[i + 1]``."""

    seek: int
    start: float
    end: float
    token_ids: tuple[int, ...]
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    word_times: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        check(is_int(self.seek) and self.seek >= 0, "seek must be a frame index")
        check(is_num(self.start) and is_num(self.end) and 0.0 <= self.start <= self.end, "start/end out of order")
        check(isinstance(self.token_ids, tuple) and all(is_int(t) and t >= 0 for t in self.token_ids),
              "token_ids must be token ids")
        for name in ("temperature", "avg_logprob", "compression_ratio", "no_speech_prob"):
            check(is_num(getattr(self, name)), f"{name} must be a number")
        check(isinstance(self.word_times, tuple) and all(is_num(t) for t in self.word_times)
              and (not self.word_times or len(self.word_times) == len(self.token_ids) + 1),
              "word_times must hold one time per token and one more")

    def to_wire(self) -> dict:
        d = {"seek": self.seek, "start": self.start, "end": self.end, "tokens": list(self.token_ids),
             "t": self.temperature, "lp": self.avg_logprob, "cr": self.compression_ratio, "ns": self.no_speech_prob}
        if self.word_times:
            d["wt"] = list(self.word_times)
        return d

    @classmethod
    def from_wire(cls, d: object) -> TranscriptSegment:
        check(isinstance(d, dict) and set(d) <= _SEGMENT_KEYS and _SEGMENT_KEYS - {"wt"} <= set(d),  # type: ignore
              "malformed transcript segment")
        return cls(d["seek"], d["start"], d["end"], tuple(d["tokens"]), d["t"], d["lp"], d["cr"], d["ns"],  # type: ignore
                   tuple(d.get("wt", ())))  # type: ignore


_SEGMENT_KEYS = frozenset({"seek", "start", "end", "tokens", "t", "lp", "cr", "ns", "wt"})


@dataclass(frozen=True)
class TranscribeOutput:
    """What one window of a request gave: its segments (none for silence), the language (given or detected),
    the recording's length; ``done`` on the request's last output, ``error`` instead of segments when it failed."""

    request_id: str
    segments: tuple[TranscriptSegment, ...] = ()
    language: str = ""
    duration: float = 0.0
    done: bool = False
    error: str | None = None

    def __post_init__(self) -> None:
        check(_request_id_ok(self.request_id), "request_id must be a non-empty str of at most 128 chars")
        check(isinstance(self.segments, tuple) and len(self.segments) <= MAX_SEGMENTS
              and all(isinstance(s, TranscriptSegment) for s in self.segments), "segments must be segments")
        check(isinstance(self.language, str) and len(self.language) <= MAX_LANGUAGE_LEN, "language must be a code")
        check(is_num(self.duration) and self.duration >= 0, "duration out of range")
        check(isinstance(self.done, bool), "done must be a bool")
        check(self.error is None or (isinstance(self.error, str) and len(self.error) <= MAX_ERROR_CHARS),
              "error must be a short str")
        check(self.error is None or self.done, "an error ends the request")


@dataclass(frozen=True)
class TranscribeOutputs(Message):
    """The windows one engine step finished for the requests of one client."""

    TYPE: ClassVar[str] = "transcribed"
    rank: int
    outputs: tuple[TranscribeOutput, ...]

    def __post_init__(self) -> None:
        check(is_int(self.rank) and 0 <= self.rank < 1 << 16, "rank out of range")
        check(isinstance(self.outputs, tuple) and len(self.outputs) <= 65536
              and all(isinstance(o, TranscribeOutput) for o in self.outputs), "outputs must be transcribe outputs")
