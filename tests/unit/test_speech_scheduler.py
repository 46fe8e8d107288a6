"""The speech scheduler's rules, on a scripted runner (no model): Whisper's seek over timestamps, silence skipped,
the temperature fallback, windows of different recordings in one decoder call with their prompts aligned."""

from __future__ import annotations

import numpy as np
import torch

from engine_worker.speech import Decoded, SpecialTokens
from engine_worker.speech_scheduler import FALLBACK_TEMPERATURES, SpeechScheduler
from protocol import TranscribeRequest

SPECIAL = SpecialTokens(eot=50256, sot=50257, sot_prev=50360, transcribe=50358, translate=None, no_timestamps=50362,
                        no_speech=50361, languages={"en": 50258})
TS = SPECIAL.timestamp_begin


def ts(seconds: float) -> int:
    return TS + round(seconds / 0.02)


class ScriptedRunner:
    """Answers each decoder call from ``script``: a function of (prompt, temperature) to the window's tokens."""

    multilingual = False
    tasks = ("transcribe",)
    vocab_size = 51864
    special = SPECIAL

    def __init__(self, script, logprob: float = -0.2):
        self.script = script
        self.logprob = logprob
        self.calls: list[tuple[list[list[int]], float]] = []

    def features(self, pcm: torch.Tensor) -> torch.Tensor:
        return torch.zeros(80, len(pcm) // 160 + 3000)

    def encode(self, windows):
        return list(range(len(windows)))

    def select(self, encoded, rows):
        return [encoded[r] for r in rows]

    def detect_language(self, encoded):
        return [("en", 1.0)] * len(encoded)

    def generate(self, encoded, prompts, temperature, timestamps):
        self.calls.append((prompts, temperature))
        return [Decoded(list(self.script(p, temperature)), self.logprob, 0.01) for p in prompts]

    def token_bytes(self, ids):
        return b"".join(t.to_bytes(2, "little") for t in ids)

    def token_times(self, encoded_one, start, text_tokens, frames):
        return [0.1 * i for i in range(len(text_tokens) + 1)]


def speech(seconds: float) -> bytes:
    """Loud enough not to be silence: a square wave."""
    return np.where((np.arange(int(16000 * seconds)) // 40) % 2 == 1, 3000, -3000).astype("<i2").tobytes()


def run(sched: SpeechScheduler) -> dict[str, list]:
    outs: dict[str, list] = {}
    while sched.has_work:
        for o in sched.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_the_next_window_starts_at_the_last_timestamp_and_goes_on_from_the_text():
    # window 1: two segments, the second closed by two timestamps at 5 s: the next window starts at 5 s
    def script(prompt, temperature):
        if SPECIAL.sot_prev not in prompt:
            return [ts(0), 11, 12, ts(1), ts(2), 13, ts(5), ts(5)]
        return [ts(0), 14, ts(3)]  # window 2 (from 5 s), with the first window's text as context

    runner = ScriptedRunner(script)
    sched = SpeechScheduler(runner, 4)
    assert sched.add_transcribe(TranscribeRequest("r", speech(35))) is None
    outs = run(sched)["r"]
    assert [o.done for o in outs] == [False, True]
    first, second = outs[0].segments, outs[1].segments
    assert [(s.start, s.end, s.token_ids) for s in first] == [(0.0, 1.0, (11, 12)), (2.0, 5.0, (13,))]
    assert [(s.seek, s.start, s.end, s.token_ids) for s in second] == [(500, 5.0, 8.0, (14,))]
    prompt2 = runner.calls[1][0][0]  # the first window's segments, with their timestamps, as Whisper's context
    assert prompt2 == [SPECIAL.sot_prev, ts(0), 11, 12, ts(1), ts(2), 13, ts(5), SPECIAL.sot]


def test_a_window_ending_in_one_timestamp_moves_a_whole_window():
    runner = ScriptedRunner(lambda p, t: [ts(0), 21, ts(4)])
    sched = SpeechScheduler(runner, 4)
    sched.add_transcribe(TranscribeRequest("r", speech(45)))
    outs = run(sched)["r"]
    assert [o.segments[0].seek for o in outs] == [0, 3000]
    assert outs[-1].segments[0].end == 34.0 and outs[-1].duration == 45.0


def test_silence_is_not_decoded():
    runner = ScriptedRunner(lambda p, t: [ts(0), 99, ts(1)])
    sched = SpeechScheduler(runner, 4)
    sched.add_transcribe(TranscribeRequest("quiet", b"\x00\x00" * 16000 * 65))
    outs = run(sched)["quiet"]
    assert len(outs) == 1 and outs[0].done and outs[0].segments == () and runner.calls == []
    assert sched.stats_fields()["audio_seconds"] == 65.0


def test_a_repetition_loop_is_decoded_again_hotter():
    def script(prompt, temperature):
        return [ts(0), *([7, 8] * 60), ts(10)] if temperature == 0 else [ts(0), 31, 32, ts(3)]

    runner = ScriptedRunner(script)
    sched = SpeechScheduler(runner, 4)
    sched.add_transcribe(TranscribeRequest("r", speech(10)))
    (out,) = run(sched)["r"]
    assert [t for _, t in runner.calls] == [0.0, FALLBACK_TEMPERATURES[1]]
    assert out.segments[0].token_ids == (31, 32) and out.segments[0].temperature == 0.2
    # a request that asks for a temperature of its own is decoded once, at it
    runner.calls.clear()
    sched.add_transcribe(TranscribeRequest("hot", speech(10), temperature=0.7))
    run(sched)
    assert [t for _, t in runner.calls] == [0.7]


def test_windows_of_several_recordings_share_a_call_with_aligned_prompts():
    runner = ScriptedRunner(lambda p, t: [ts(0), 41, ts(2)])
    sched = SpeechScheduler(runner, 8)
    sched.add_transcribe(TranscribeRequest("a", speech(5), prompt_token_ids=(1, 2, 3, 4)))
    sched.add_transcribe(TranscribeRequest("b", speech(5), prompt_token_ids=(9, 8)))
    sched.add_transcribe(TranscribeRequest("c", speech(5)))
    outs = run(sched)
    assert set(outs) == {"a", "b", "c"} and sched.steps == 1
    calls = [prompts for prompts, _ in runner.calls]
    assert sorted(len(p) for p in calls) == [1, 2]  # with context (a, b) and without (c)
    with_context = next(p for p in calls if len(p) == 2)
    assert with_context == [[SPECIAL.sot_prev, 3, 4, SPECIAL.sot], [SPECIAL.sot_prev, 9, 8, SPECIAL.sot]]


def test_the_context_keeps_the_timestamps_and_only_what_the_segments_came_from():
    # window 1 ends in a sentence cut by the window's edge (after the last pair of timestamps): read again next time
    def script(prompt, temperature):
        return [ts(0), 11, ts(2), ts(2), 12, 13] if SPECIAL.sot_prev not in prompt else [ts(0), 14, ts(1)]

    runner = ScriptedRunner(script)
    sched = SpeechScheduler(runner, 4)
    sched.add_transcribe(TranscribeRequest("r", speech(31)))
    outs = run(sched)["r"]
    assert [s.token_ids for o in outs for s in o.segments] == [(11,), (14,)]
    assert outs[1].segments[0].start == 2.0  # the unfinished sentence is read again from 2 s
    assert sched.stats_fields()["audio_seconds"] == 31.0  # (the recording's length, though 2 s were read twice)
    assert runner.calls[1][0][0] == [SPECIAL.sot_prev, ts(0), 11, ts(2), SPECIAL.sot]


def test_refusals():
    sched = SpeechScheduler(ScriptedRunner(lambda p, t: []), 4)
    assert "does not translate" in sched.add_transcribe(TranscribeRequest("t", speech(1), task="translate"))
    assert "English-only" in sched.add_transcribe(TranscribeRequest("f", speech(1), language="fr"))
    assert "outside the vocabulary" in sched.add_transcribe(TranscribeRequest("v", speech(1),
                                                                              prompt_token_ids=(60000,)))
    assert sched.add_transcribe(TranscribeRequest("ok", speech(1))) is None
    assert "already queued" in sched.add_transcribe(TranscribeRequest("ok", speech(1)))
    assert sched.abort("ok") is not None and not sched.has_work
