"""OpenAI's speech-to-text routes, the audio family: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``.

A multipart upload, as OpenAI takes it: ``file`` (any container FFmpeg reads: wav, mp3, flac, ogg, m4a, webm...),
``model``, ``language`` (transcriptions), ``prompt``, ``temperature``, ``response_format`` (``json``, ``text``,
``srt``, ``vtt``, ``verbose_json``), ``timestamp_granularities[]`` (``segment``, ``word``: verbose_json only) and
``stream``. The gateway decodes the audio to 16 kHz mono (``gateway.audio``, in a worker thread: decoding a long mp3
takes longer than the event loop may be held), sends it to a speech engine of the model whole (``protocol.speech``),
and turns the segments the engine sends back, one 30-second window at a time, into the format asked
(``gateway.transcripts``). With ``stream=true`` the text goes out as ``transcript.text.delta`` events as each window
is decoded, then one ``transcript.text.done`` with the whole text and the usage.

The limits: ``--max-audio-mb`` on the upload (413) and ``--max-audio-seconds`` on the recording (400).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from aiohttp import BodyPartReader, MultipartReader, StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import MultiDict

from protocol import TranscribeRequest, TranscriptSegment
from protocol.speech import MAX_PROMPT_TOKENS

from ..audio import AudioError, decode_audio
from ..errors import APIError, bad_request
from ..ids import random_hex
from ..openapi import JSON, SSE, request_body, response
from ..serving.admission import admit
from ..serving.engine_errors import ENGINE_ERRORS, engine_error
from ..serving.shapes import json_body
from ..sse import encode_event, open_stream
from ..state import STATE, ModelState
from ..transcripts import (
    StreamText,
    as_json,
    as_srt,
    as_text,
    as_verbose_json,
    as_vtt,
    full_text,
    usage,
)

routes = web.RouteTableDef()

FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
MULTIPART = "multipart/form-data"
TEXT_TYPES = {"text": "text/plain", "srt": "application/x-subrip", "vtt": "text/vtt"}

_FIELDS = {
    "file": {"type": "string", "format": "binary", "description": "The recording: wav, mp3, flac, ogg, m4a, webm..."},
    "model": {"type": "string", "description": "A speech model served here (e.g. whisper-base)."},
    "prompt": {"type": "string", "description": "Text to go on from: names, spelling, the previous part."},
    "response_format": {"type": "string", "enum": list(FORMATS), "default": "json"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1, "default": 0,
                    "description": "0: greedy, decoded again hotter where a window fails (Whisper's fallback)."},
    "stream": {"type": "boolean", "default": False,
               "description": "Server-sent transcript.text.delta events, then transcript.text.done."},
}
TRANSCRIPTION_FORM = {"type": "object", "required": ["file"], "properties": {
    **_FIELDS,
    "language": {"type": "string", "description": "ISO-639-1 code of the speech (default: detected)."},
    "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": list(GRANULARITIES)},
                                  "description": "verbose_json only: segment (default) and/or word timestamps."},
}}
TRANSLATION_FORM = {"type": "object", "required": ["file"], "properties": _FIELDS}


@routes.post("/v1/audio/transcriptions")
@request_body(TRANSCRIPTION_FORM, MULTIPART)
@response(200, JSON, "text/plain", "text/vtt", "application/x-subrip", SSE)
async def transcriptions(request: web.Request) -> web.StreamResponse:
    """Transcribe speech into text in its own language (OpenAI's ``audio.transcriptions``)."""
    return await _serve(request, "transcribe")


@routes.post("/v1/audio/translations")
@request_body(TRANSLATION_FORM, MULTIPART)
@response(200, JSON, "text/plain", "text/vtt", "application/x-subrip", SSE)
async def translations(request: web.Request) -> web.StreamResponse:
    """Translate speech into English text (OpenAI's ``audio.translations``): a multilingual model's."""
    return await _serve(request, "translate")


@dataclass(frozen=True)
class _Upload:
    filename: str
    data: bytes


async def read_form(request: web.Request) -> MultiDict:
    """The multipart form's fields: text as str, files as ``_Upload``. The gateway's middleware has read the body
    already (within its deadline), and aiohttp's own ``post()`` reads the socket again: so the form is parsed from
    the bytes read, through aiohttp's multipart reader."""
    body = await request.read()
    stream = StreamReader(request.protocol, limit=max(len(body), 1 << 16), loop=asyncio.get_running_loop())
    stream.feed_data(body)
    stream.feed_eof()
    fields: MultiDict = MultiDict()
    try:
        async for part in MultipartReader(request.headers, stream):
            if not isinstance(part, BodyPartReader):
                raise bad_request("a nested multipart part is not a form field")
            data = await part.read(decode=True)
            if part.filename is not None:
                fields.add(part.name or "", _Upload(part.filename, bytes(data)))
            else:
                fields.add(part.name or "", data.decode(part.get_charset("utf-8"), errors="replace"))
    except (ValueError, LookupError, AssertionError, HttpProcessingError) as e:  # (aiohttp: a malformed body)
        raise bad_request(f"the multipart body cannot be read: {e}") from None
    return fields


class _Form:
    """The upload's fields, checked."""

    def __init__(self, fields, task: str, max_bytes: int):
        upload = fields.get("file")
        if upload is None:
            raise bad_request("the form has no `file` field: upload the recording as multipart form field `file`",
                              param="file", code="missing_required_parameter")
        if not isinstance(upload, _Upload):
            raise bad_request("`file` must be an uploaded file (multipart with a filename), not a text field",
                              param="file")
        self.filename = upload.filename or "audio"
        self.data = upload.data
        if len(self.data) > max_bytes:
            raise APIError(413, f"the file is larger than the {max_bytes / (1 << 20):g} MB this server takes "
                                "(--max-audio-mb)", param="file", code="file_too_large")
        self.model = _text(fields, "model")
        self.prompt = _text(fields, "prompt") or ""
        self.language = _text(fields, "language") if task == "transcribe" else None
        if self.language is not None:
            self.language = self.language.strip().lower()
            if not (0 < len(self.language) <= 8 and self.language.isascii() and self.language.isalpha()):
                raise bad_request(f"language {self.language!r} is not a language code such as `en`",
                                  param="language")
        self.format = _text(fields, "response_format") or "json"
        if self.format not in FORMATS:
            raise bad_request(f"response_format {self.format!r} is not one of {', '.join(FORMATS)}",
                              param="response_format")
        temperature = _text(fields, "temperature")
        try:
            self.temperature = float(temperature) if temperature not in (None, "") else 0.0
        except ValueError:
            raise bad_request(f"temperature {temperature!r} is not a number", param="temperature") from None
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 1.0):
            raise bad_request("temperature must be between 0 and 1", param="temperature")
        stream = (_text(fields, "stream") or "false").strip().lower()
        if stream not in ("true", "false", "1", "0"):
            raise bad_request(f"stream {stream!r} is not true or false", param="stream")
        self.stream = stream in ("true", "1")
        grains = [str(v) for key in ("timestamp_granularities[]", "timestamp_granularities")
                  for v in fields.getall(key, ())]
        for g in grains:
            if g not in GRANULARITIES:
                raise bad_request(f"timestamp_granularities {g!r} is not one of {', '.join(GRANULARITIES)}",
                                  param="timestamp_granularities")
        if grains and self.format != "verbose_json":
            raise bad_request("timestamp_granularities needs response_format verbose_json",
                              param="timestamp_granularities")
        self.words = "word" in grains
        self.segments = not grains or "segment" in grains


def _text(fields, name: str) -> str | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, _Upload):
        raise bad_request(f"`{name}` must be a text field, not a file", param=name)
    return str(value)


async def _serve(request: web.Request, task: str) -> web.StreamResponse:
    if not request.content_type.startswith("multipart/"):
        raise bad_request(f"this route takes a multipart/form-data upload (the recording as field `file`), not "
                          f"{request.content_type or 'a body without a Content-Type'}")
    state = request.app[STATE]
    fields = await read_form(request)
    form = _Form(fields, task, int(state.max_audio_mb * (1 << 20)))
    view = state.for_model(form.model, task)
    admit(view, task)
    if form.language is not None:
        _check_language(view, form.language)
    loop = asyncio.get_running_loop()
    try:
        audio = await loop.run_in_executor(None, decode_audio, form.data, state.max_audio_seconds, form.filename)
    except AudioError as e:
        raise bad_request(str(e), param="file", code="invalid_audio") from None
    prompt = view.tokenizer.encode(" " + form.prompt.strip())[-MAX_PROMPT_TOKENS:] if form.prompt.strip() else []
    req = TranscribeRequest(f"audio-{random_hex()}", audio.pcm, task, form.language, tuple(prompt), form.temperature,
                            True, form.words, request.headers.get("X-Request-Id"))
    outputs = view.engines.transcribe(req)
    if form.stream:
        return await _stream(request, view, outputs, audio.seconds)
    segments: list[TranscriptSegment] = []
    language = form.language or ""
    try:
        async for out in outputs:
            segments.extend(out.segments)
            language = out.language or language
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    return _answer(view, form, task, language, audio.seconds, segments)


def _check_language(view: ModelState, code: str) -> None:
    """A 400 for a language the model cannot be told: Whisper knows each as a ``<|code|>`` token."""
    if view.tokenizer.backend.token_to_id(f"<|{code}|>") is None or (code != "en" and "translate" not in view.tasks):
        english_only = "translate" not in view.tasks
        why = "this model is English-only" if english_only else "this model does not know that language"
        raise bad_request(f"language {code!r}: {why}", param="language", code="unsupported_language")


def _answer(view: ModelState, form: _Form, task: str, language: str, seconds: float,
            segments: list[TranscriptSegment]) -> web.Response:
    tok = view.tokenizer
    if form.format == "json":
        return json_body(as_json(full_text(tok, segments), usage(seconds)))
    if form.format == "verbose_json":
        return json_body(as_verbose_json(tok, task, language, seconds, segments, want_segments=form.segments,
                                         want_words=form.words))
    body = {"text": lambda: as_text(full_text(tok, segments)), "srt": lambda: as_srt(tok, segments),
            "vtt": lambda: as_vtt(tok, segments)}[form.format]()
    return web.Response(text=body, content_type=TEXT_TYPES[form.format], charset="utf-8")


async def _stream(request: web.Request, view: ModelState, outputs, seconds: float) -> web.StreamResponse:
    """The text as it is decoded, as OpenAI streams a transcription: deltas, then the whole text with the usage. An
    engine failure after the first event ends the stream with an ``error`` event (the status line is sent)."""
    tok = view.tokenizer
    text = StreamText(tok)
    first = None
    try:  # the first window before any byte: a refusal or failure there is a plain error response
        first = await anext(outputs, None)
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    resp = await open_stream(request)
    try:
        out = first
        while out is not None:
            delta = text.push(out.segments)
            if delta:
                await resp.write(encode_event({"type": "transcript.text.delta", "delta": delta}))
            out = await anext(outputs, None)
        await resp.write(encode_event({"type": "transcript.text.done", "text": text.text, "usage": usage(seconds)}))
    except ENGINE_ERRORS as e:
        await resp.write(encode_event({"type": "error", "error": {"message": str(e), "type": "server_error",
                                                                  "code": "engine_error"}}))
    finally:
        await outputs.aclose()
    await resp.write_eof()
    return resp
