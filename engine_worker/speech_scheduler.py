"""Batching for speech engines: every step decodes the next 30-second window of up to ``max_batch`` recordings at
once, and each of them gets that window's segments back.

A recording is read window by window, as Whisper reads it: where the next window starts depends on the last
timestamp the model wrote in this one (a sentence cut at a window's edge is read again whole in the next), and the
text so far is the next window's context (``<|startofprev|>``). So one request cannot be cut up front into windows
that run side by side; what runs side by side is the current window of different requests. The windows of a step
share one encoder pass and one decoder batch (``WhisperRunner``). Recordings take turns: after a step, the ones
with more to read go to the back of the queue, so a long file shares the engine with short ones rather than holding
it for its whole length.

Per window, as Whisper and faster-whisper decode: greedy at temperature 0; a window whose text is a repetition loop
(its bytes compress more than 2.4:1) or whose mean log probability is under -1 is decoded again at 0.2, 0.4, ... 1.0
(only when the request asked for temperature 0); a window the model deems silent (no-speech probability over 0.6 and
a low log probability) gives no text. CTranslate2 decodes a batch only when every prompt has its start-of-transcript
token at one position, so the windows of one decoder call keep the same number of context tokens (the most recent
ones: the shortest context in the call); windows without context run in a call of their own.

It offers the engine server what ``scheduler.Scheduler`` does (``abort``, ``abort_all``, ``step``, ``has_work``,
``stats_fields``, ``waiting``), and ``add_transcribe`` for ``TranscribeRequest``.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from dataclasses import dataclass, field

import torch

from protocol.speech import MAX_PROMPT_TOKENS, TranscribeOutput, TranscribeRequest, TranscriptSegment

from .speech import FRAMES_PER_SECOND, HOP, TIME_PRECISION, WINDOW_FRAMES, Decoded, WhisperRunner

log = logging.getLogger("zserve.engine")

FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
COMPRESSION_RATIO_LIMIT = 2.4
LOGPROB_LIMIT = -1.0
NO_SPEECH_LIMIT = 0.6
FRAMES_PER_TOKEN = 2  # a timestamp token every 0.02 s: two 10 ms frames
RTF_WINDOW_S = 30.0
# A window whose loudest sample is under -60 dBFS is digital silence: it is not decoded (Whisper writes "you" or
# "Thank you." over silence often enough, at a no-speech probability that does not always give it away).
SILENCE_PEAK = 32768 // 1000  # the real-time factor gauge covers the steps of the last 30 s


def compression_ratio(data: bytes) -> float:
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass
class _Job:
    req: TranscribeRequest
    mel: torch.Tensor  # [n_mels, frames + 30 s of silence]
    samples: torch.Tensor  # int16
    frames: int  # the recording's 10 ms frames
    language: str | None
    context: list[int]  # the text so far (after the client's prompt): the next window's previous text
    seek: int = 0
    arrival: float = field(default_factory=time.monotonic)
    output_ids: tuple = ()  # (what a drain's hand-back counts: a recording's windows are no generated tokens)

    @property
    def request_id(self) -> str:
        return self.req.request_id


@dataclass
class _Window:
    job: _Job
    row: int  # in the step's encoder batch
    size: int  # frames of the recording in it
    attempt: int = 0
    result: Decoded | None = None
    temperature: float = 0.0
    ratio: float = 0.0


class SpeechScheduler:
    def __init__(self, runner: WhisperRunner, max_batch: int):
        if max_batch < 1:
            raise ValueError("max_batch must be positive")
        self.runner = runner
        self.max_batch = max_batch
        self.waiting: deque[_Job] = deque()
        self.running: list = []  # nothing runs between steps
        self.hold_new = False  # (operations' holds: new requests wait; a speech engine runs no operations)
        self.steps = 0
        self.audio_seconds = 0.0  # of recordings read so far
        self.windows = 0
        self._recent: deque[tuple[float, float, float]] = deque()  # (end, audio s, busy s) of recent steps
        # Seconds of the recordings the current step moved past (a window read again from its last timestamp counts
        # once): summed over a request, its duration.
        self._step_audio = 0.0

    # -- admission ------------------------------------------------------------------------------
    def add_transcribe(self, req: TranscribeRequest) -> str | None:
        """Queue a request; return an error message instead when it can never run."""
        special = self.runner.special
        if req.task not in self.runner.tasks:
            return f"this model does not {req.task} (it serves: {', '.join(self.runner.tasks)})"
        language = req.language
        if language is not None and self.runner.multilingual and language not in special.languages:
            return f"language {language!r} is not one this model knows"
        if language is not None and not self.runner.multilingual and language != "en":
            return f"this model is English-only; it cannot transcribe language {language!r}"
        if not self.runner.multilingual:
            language = "en"
        if any(j.request_id == req.request_id for j in self.waiting):
            return f"request id {req.request_id!r} is already queued on this engine"
        if any(t >= self.runner.vocab_size for t in req.prompt_token_ids):
            return f"a prompt token id is outside the vocabulary ({self.runner.vocab_size})"
        # (one copy of the audio, which the message's bytes are not: frombuffer needs a writable buffer)
        samples = torch.frombuffer(bytearray(req.audio), dtype=torch.int16) if req.audio else \
            torch.zeros(0, dtype=torch.int16)
        mel = self.runner.features(samples)
        frames = len(samples) // HOP
        prompt = [t for t in req.prompt_token_ids if t < special.eot]
        self.waiting.append(_Job(req, mel, samples, frames, language, prompt))
        return None

    def abort(self, request_id: str) -> _Job | None:
        for j in self.waiting:
            if j.request_id == request_id:
                self.waiting.remove(j)
                return j
        return None

    def abort_all(self, reason: str) -> list[_Job]:
        gone = list(self.waiting)
        self.waiting.clear()
        return gone

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) and not self.hold_new

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[TranscribeOutput]:
        jobs = [self.waiting.popleft() for _ in range(min(self.max_batch, len(self.waiting)))]
        if not jobs:
            return []
        started = time.monotonic()
        self.steps += 1
        self._step_audio = 0.0
        outs: list[TranscribeOutput] = []
        live = []
        for job in jobs:
            while job.seek < job.frames and self._silent(job):
                size = min(WINDOW_FRAMES, job.frames - job.seek)
                job.seek += size
                self._step_audio += size / FRAMES_PER_SECOND
            if job.seek >= job.frames:  # (an empty or silent recording, or a silent end: done now)
                outs.append(self._output(job, [], done=True))
            else:
                live.append(job)
        if live:
            try:
                outs.extend(self._run(live))
            except Exception as e:  # noqa: BLE001 - a failed batch fails its requests, not the engine
                log.exception("speech step failed; failing the %d requests in it", len(live))
                outs.extend(TranscribeOutput(j.request_id, (), j.language or "", j.frames / FRAMES_PER_SECOND,
                                             True, f"engine error: {e}"[:4000]) for j in live)
                live = []
        for job in live:
            if job.seek < job.frames:
                self.waiting.append(job)  # its next window waits its turn
        self.audio_seconds += self._step_audio
        self._recent.append((time.monotonic(), self._step_audio, time.monotonic() - started))
        return outs

    def _run(self, jobs: list[_Job]) -> list[TranscribeOutput]:
        runner, special = self.runner, self.runner.special
        windows = [_Window(j, i, min(WINDOW_FRAMES, j.frames - j.seek)) for i, j in enumerate(jobs)]
        encoded = runner.encode([j.mel[:, j.seek: j.seek + WINDOW_FRAMES] for j in jobs])
        unknown = [w for w in windows if w.job.language is None]
        if unknown:
            found = runner.detect_language(runner.select(encoded, [w.row for w in unknown]))
            for w, (code, _) in zip(unknown, found):
                w.job.language = code
        pending = windows
        while pending:
            self._decode(encoded, pending)
            retry = []
            for w in pending:
                res = w.result
                assert res is not None
                text = [t for t in res.tokens if t < special.eot]
                w.ratio = compression_ratio(runner.token_bytes(text))
                silent = res.no_speech_prob > NO_SPEECH_LIMIT and res.avg_logprob < LOGPROB_LIMIT
                failed = w.ratio > COMPRESSION_RATIO_LIMIT or res.avg_logprob < LOGPROB_LIMIT
                if failed and not silent and w.job.req.temperature == 0 and w.attempt + 1 < len(FALLBACK_TEMPERATURES):
                    w.attempt += 1
                    retry.append(w)
            pending = retry
        self.windows += len(windows)
        return [self._finish(encoded, w) for w in windows]

    @staticmethod
    def _silent(job: _Job) -> bool:
        window = job.samples[job.seek * HOP: (job.seek + WINDOW_FRAMES) * HOP]
        return not len(window) or int(window.to(torch.int32).abs().max()) < SILENCE_PEAK

    def _start(self, job: _Job) -> list[int]:
        """The start-of-transcript sequence of ``job``'s windows: with a multilingual model, its language and task."""
        special = self.runner.special
        if not self.runner.multilingual:
            return [special.sot]
        task = special.translate if job.req.task == "translate" else special.transcribe
        return [special.sot, special.languages[job.language or "en"], task]  # type: ignore[list-item]

    def _prompt(self, w: _Window, context: list[int]) -> list[int]:
        special = self.runner.special
        start = self._start(w.job) + ([] if w.job.req.timestamps else [special.no_timestamps])
        return ([special.sot_prev, *context] if context else []) + start

    def _decode(self, encoded, windows: list[_Window]) -> None:
        """Decode ``windows`` at their attempt's temperature, grouped into calls whose prompts line up."""
        groups: dict[tuple[float, bool, bool], list[_Window]] = {}
        for w in windows:
            req = w.job.req
            w.temperature = req.temperature if req.temperature > 0 else FALLBACK_TEMPERATURES[w.attempt]
            groups.setdefault((w.temperature, bool(w.job.context), req.timestamps), []).append(w)
        for (temperature, with_context, timestamps), group in groups.items():
            keep = min(min(len(w.job.context) for w in group), MAX_PROMPT_TOKENS) if with_context else 0
            prompts = [self._prompt(w, w.job.context[len(w.job.context) - keep:] if keep else []) for w in group]
            results = self.runner.generate(self.runner.select(encoded, [w.row for w in group]), prompts,
                                           temperature, timestamps)
            for w, r in zip(group, results):
                w.result = r

    def _finish(self, encoded, w: _Window) -> TranscribeOutput:
        """The segments of a decoded window; moves its recording's cursor past what it read."""
        job, res, special = w.job, w.result, self.runner.special
        assert res is not None
        seek, offset = job.seek, job.seek / FRAMES_PER_SECOND
        silent = res.no_speech_prob > NO_SPEECH_LIMIT and res.avg_logprob < LOGPROB_LIMIT
        pieces: list[tuple[float, float, list[int]]] = []  # (start, end, text tokens) within the window
        advance = w.size
        tokens, ts = res.tokens, special.timestamp_begin
        consumed = tokens  # what the next window goes on from: the tokens its segments came from, timestamps too
        if silent:
            tokens = consumed = []
        elif job.req.timestamps:
            ends_single = len(tokens) >= 2 and tokens[-2] < ts <= tokens[-1]
            cuts = [i for i in range(1, len(tokens)) if tokens[i] >= ts and tokens[i - 1] >= ts]
            if cuts:
                if ends_single:
                    cuts.append(len(tokens))
                last = 0
                for cut in cuts:
                    part = tokens[last:cut]
                    pieces.append(((part[0] - ts) * TIME_PRECISION if part[0] >= ts else 0.0,
                                   (part[-1] - ts) * TIME_PRECISION if part[-1] >= ts else w.size / FRAMES_PER_SECOND,
                                   [t for t in part if t < special.eot]))
                    last = cut
                consumed = tokens[:last]
                if not ends_single:
                    advance = (tokens[last - 1] - ts) * FRAMES_PER_TOKEN
                    if advance <= 0:
                        advance = w.size
            else:
                stamps = [t for t in tokens if t >= ts]
                end = (stamps[-1] - ts) * TIME_PRECISION if stamps and stamps[-1] != ts else w.size / FRAMES_PER_SECOND
                pieces.append((0.0, end, [t for t in tokens if t < special.eot]))
        else:
            pieces.append((0.0, w.size / FRAMES_PER_SECOND, [t for t in tokens if t < special.eot]))
        advance = min(advance, w.size)
        pieces = [p for p in pieces if p[2]]
        times = None
        if job.req.words and pieces:
            text = [t for p in pieces for t in p[2]]
            times = self.runner.token_times(self.runner.select(encoded, [w.row]), self._start(job), text, w.size)
        duration = job.frames / FRAMES_PER_SECOND
        segments, at = [], 0
        for begin, end, text in pieces:
            s = min(offset + begin, duration)
            e = min(max(offset + end, s), duration)
            word_times: tuple[float, ...] = ()
            if times is not None:
                mine = times[at: at + len(text) + 1]
                word_times = tuple(round(min(max(offset + t, s), e), 3) for t in mine)
                word_times = tuple(max(word_times[: i + 1]) for i in range(len(word_times)))  # never backwards
            at += len(text)
            segments.append(TranscriptSegment(seek, round(s, 3), round(e, 3), tuple(text), w.temperature,
                                              round(res.avg_logprob, 6), round(w.ratio, 6),
                                              round(res.no_speech_prob, 6), word_times))
        job.seek += advance
        self._step_audio += advance / FRAMES_PER_SECOND
        if w.temperature > 0.5:  # a window that needed a high temperature is no context to go on from
            job.context = []
        else:
            # With its timestamp tokens, as Whisper's context is: given text alone, the model goes on writing text
            # alone, without the timestamps that cut the next window at a sentence's end.
            job.context += [t for t in consumed if t < special.eot or t >= ts]
            job.context = job.context[-MAX_PROMPT_TOKENS:]
        return self._output(job, segments, done=job.seek >= job.frames)

    def _output(self, job: _Job, segments: list[TranscriptSegment], done: bool) -> TranscribeOutput:
        return TranscribeOutput(job.request_id, tuple(segments), job.language or "", job.frames / FRAMES_PER_SECOND,
                                done)

    def real_time_factor(self) -> float:
        """Seconds of audio read per second of engine time over the steps of the last ``RTF_WINDOW_S``."""
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > RTF_WINDOW_S:
            self._recent.popleft()
        busy = sum(b for _, _, b in self._recent)
        return sum(a for _, a, _ in self._recent) / busy if busy > 0 else 0.0

    def stats_fields(self) -> dict:
        """The EngineStats fields this engine reports (no KV cache, no tokens generated from a prompt)."""
        return {"running": 0, "waiting": len(self.waiting), "kv_used": 0.0, "generated_tokens": 0,
                "steps": self.steps, "audio_seconds": round(self.audio_seconds, 3),
                "audio_real_time_factor": round(self.real_time_factor(), 3)}
