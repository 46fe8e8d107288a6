"""Speech to text end to end: the session's `make run`-like server (``rag_server``: whisper-base and whisper-tiny.en,
CTranslate2 engines under the supervisor, beside a chat and an embedding model), spoken to by the official openai SDK
with speech espeak-ng makes (``tests/speech.py``): every response format, every container, a 3-minute recording,
concurrent requests batched, streaming, translation, the bad inputs, and a killed speech engine coming back.
whisper-tiny.en (English only, about twice as fast) reads where the model does not matter to what is tested."""

from __future__ import annotations

import os
import re
import signal
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Server, procs, wait_until
from tests.speech import (
    CONTAINERS,
    SCRIPT,
    SENTENCES,
    concat_wavs,
    duration,
    flac_claiming,
    require_espeak,
    speak,
    transcode,
    wer,
    words,
)
from zserve.catalog import DEFAULT_SPEECH_MODEL, WHISPER_TINY_EN

MAX_WER = 0.15
MAX_AUDIO_MB = 25  # the defaults: --max-audio-mb, --max-audio-seconds
MAX_AUDIO_SECONDS = 1800


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory) -> Path:
    require_espeak()
    d = tmp_path_factory.mktemp("speech")
    speak(SCRIPT, d / "script.wav")
    return d


@pytest.fixture(scope="module")
def speech_server(rag_server):
    return rag_server


@pytest.fixture(scope="module")
def client(speech_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=speech_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def transcribe(client: openai.OpenAI, path: Path, **kw):
    with open(path, "rb") as f:
        return client.audio.transcriptions.create(model=kw.pop("model", DEFAULT_SPEECH_MODEL), file=f, **kw)


CUE = re.compile(r"(\d\d):(\d\d):(\d\d)[,.](\d\d\d) --> (\d\d):(\d\d):(\d\d)[,.](\d\d\d)")


def cues(body: str) -> list[tuple[float, float, str]]:
    """(start, end, text) of each cue of an srt or vtt document."""
    out = []
    lines = body.splitlines()
    for i, line in enumerate(lines):
        m = CUE.fullmatch(line.strip())
        if m:
            g = [int(x) for x in m.groups()]
            start = g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000
            end = g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000
            text = []
            for t in lines[i + 1:]:
                if not t.strip():
                    break
                text.append(t)
            out.append((start, end, " ".join(text)))
    return out


def check_timeline(spans: list[tuple[float, float]], length: float) -> None:
    """Times that never go back, end after they start, and cover the recording (speech from its start to its end)."""
    assert spans, "no timed segments"
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert s0 <= s1 and e0 <= e1 + 0.01, spans
    assert all(s <= e for s, e in spans), spans
    assert spans[0][0] <= 1.0 and spans[-1][1] >= length - 2.0 and spans[-1][1] <= length + 0.05, (spans, length)


def test_every_response_format_through_the_openai_sdk(client, audio_dir):
    """(whisper-tiny.en: the formats are the gateway's; whisper-base's own words are checked below, and its WER in
    every format is in docs/benchmarks.md.)"""
    path = audio_dir / "script.wav"
    length = duration(path)
    formats = ("json", "text", "srt", "vtt", "verbose_json")
    with ThreadPoolExecutor(len(formats)) as pool:  # (at once: the engine reads them in one batch)
        answers = dict(zip(formats, pool.map(lambda fmt: transcribe(client, path, model=WHISPER_TINY_EN,
                                                                    response_format=fmt), formats)))
    assert wer(SCRIPT, answers["json"].text) < MAX_WER, answers["json"].text
    plain = answers["text"]
    assert isinstance(plain, str) and wer(SCRIPT, plain) < MAX_WER, plain
    for fmt in ("srt", "vtt"):
        body = answers[fmt]
        assert isinstance(body, str)
        if fmt == "vtt":
            assert body.startswith("WEBVTT")
        found = cues(body)
        assert wer(SCRIPT, " ".join(t for _, _, t in found)) < MAX_WER, body
        check_timeline([(s, e) for s, e, _ in found], length)
    verbose = answers["verbose_json"]
    assert verbose.language == "english" and verbose.duration == pytest.approx(length, abs=0.05)
    assert wer(SCRIPT, verbose.text) < MAX_WER
    assert wer(SCRIPT, " ".join(s.text for s in verbose.segments)) < MAX_WER
    check_timeline([(s.start, s.end) for s in verbose.segments], length)
    assert all(s.tokens and s.avg_logprob <= 0 and 0 <= s.no_speech_prob <= 1 for s in verbose.segments)
    assert verbose.usage.type == "duration" and verbose.usage.seconds >= int(length)


def test_word_timestamps(client, audio_dir):
    path = audio_dir / "script.wav"
    length = duration(path)
    v = transcribe(client, path, response_format="verbose_json", timestamp_granularities=["word", "segment"])
    assert v.words and v.segments
    assert wer(SCRIPT, " ".join(w.word for w in v.words)) < MAX_WER, v.words
    check_timeline([(w.start, w.end) for w in v.words], length)
    # each word lies inside the segment that holds it
    for w in v.words:
        assert any(s.start - 0.01 <= w.start and w.end <= s.end + 0.01 for s in v.segments), w


def engine_metric(url: str, name: str, model: str = DEFAULT_SPEECH_MODEL) -> float:
    """The sum of ``name`` over the engines of ``model`` in ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model="{model}"' in line)


def test_every_container_and_concurrent_requests_share_engine_steps(speech_server, client, audio_dir):
    paths = [audio_dir / "script.wav"] + [transcode(audio_dir / "script.wav", audio_dir / f"script.{kind}", kind)
                                          for kind in CONTAINERS if kind != "wav"]
    url = speech_server.url
    steps, seconds = "zserve_engine_steps_total", "zserve_engine_audio_seconds_total"
    model = WHISPER_TINY_EN  # (what is tested here is the decoding of the containers, and the batching)
    before, audio_before = engine_metric(url, steps, model), engine_metric(url, seconds, model)
    with ThreadPoolExecutor(len(paths)) as pool:
        texts = list(pool.map(lambda p: transcribe(client, p, model=model).text, paths))
    for path, text in zip(paths, texts):
        assert wer(SCRIPT, text) < MAX_WER, (path.suffix, text)
    # Six one-window recordings sent at once: the engine read them in fewer steps than windows (batched).
    total = sum(duration(p) for p in paths)
    wait_until(lambda: engine_metric(url, seconds, model) - audio_before >= total - 0.5, 10,
               what="the engine's audio seconds to count the six recordings")
    ran = engine_metric(url, steps, model) - before
    assert 1 <= ran <= 4, ran
    assert engine_metric(url, "zserve_engine_audio_real_time_factor", model) > 1  # faster than real time


def test_a_three_minute_recording_is_read_window_after_window(speech_server, client, audio_dir):
    """(whisper-tiny.en: the same windows, at half whisper-base's cost.)"""
    parts = [speak(s, audio_dir / f"s{i}.wav") for i, s in enumerate(SENTENCES)]
    path = transcode(concat_wavs(parts, audio_dir / "long.wav"), audio_dir / "long.ogg", "ogg", stereo=False)
    length = duration(path)
    assert 180 < length < 240, length
    script = " ".join(SENTENCES)
    v = transcribe(client, path, model=WHISPER_TINY_EN, response_format="verbose_json")
    assert wer(script, v.text) < MAX_WER, v.text
    check_timeline([(s.start, s.end) for s in v.segments], length)
    assert len({s.seek for s in v.segments}) >= 6  # at least six 30 s windows, each going on from the last


def test_streaming(client, audio_dir):
    with open(audio_dir / "script.wav", "rb") as f:
        stream = client.audio.transcriptions.create(model=DEFAULT_SPEECH_MODEL, file=f, stream=True)
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}, kinds
    deltas = "".join(e.delta for e in events[:-1])
    assert deltas == events[-1].text and wer(SCRIPT, deltas) < MAX_WER
    assert events[-1].usage.seconds >= 1


# The words an English rendering of the French sentence may use (and none of the French ones).
ENGLISH = set("good morning hello i would like to have a an one cup of coffee please if you it thank thanks".split())


def test_translation_into_english(client, audio_dir):
    path = speak("Bonjour. Je voudrais une tasse de café, s'il vous plaît.", audio_dir / "fr.wav", voice="fr")
    with open(path, "rb") as f:
        v = client.audio.translations.create(model=DEFAULT_SPEECH_MODEL, file=f, response_format="verbose_json")
    assert v.language == "french" and v.task == "translate"
    said = set(words(v.text).split())
    assert "coffee" in said and said <= ENGLISH, v.text  # ("Good morning. I would like to have a coffee...")
    with open(path, "rb") as f:
        same = client.audio.transcriptions.create(model=DEFAULT_SPEECH_MODEL, file=f, language="fr")
    assert "café" in same.text.lower() or "cafe" in same.text.lower(), same.text


def silence(path: Path, seconds: float) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x00" * int(16000 * seconds))
    return path


def test_silence_is_an_empty_transcript(client, audio_dir):
    path = silence(audio_dir / "silence.wav", 5)
    assert transcribe(client, path).text == ""
    v = transcribe(client, path, response_format="verbose_json")
    assert v.text == "" and v.segments == [] and v.duration == pytest.approx(5.0)


def post(server: Server, route: str = "/v1/audio/transcriptions", **kw) -> httpx.Response:
    return httpx.post(server.url + route, timeout=60, **kw)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return err


def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(speech_server, client, audio_dir):
    wav = transcode(audio_dir / "script.wav", audio_dir / "exact.wav", "wav", stereo=False).read_bytes()
    model = {"model": DEFAULT_SPEECH_MODEL}
    cases = {
        "not audio": b"This is a plain text file, not a recording.\n" * 20,
        "truncated": wav[: len(wav) // 2],  # (a wav's header states its length: what is missing was cut off)
        "truncated flac": transcode(audio_dir / "script.wav", audio_dir / "cut.flac", "flac").read_bytes()[:30000],
        "unknown format": os.urandom(4096),
        "an image": b"\x89PNG\r\n\x1a\n" + os.urandom(2000),
    }
    for what, data in cases.items():
        err = error_of(post(speech_server, files={"file": ("x.wav", data)}, data=model))
        assert err["param"] == "file" and err["code"] == "invalid_audio", (what, err)
    mp3 = transcode(audio_dir / "script.wav", audio_dir / "cut.mp3", "mp3").read_bytes()
    r = post(speech_server, files={"file": ("cut.mp3", mp3[: len(mp3) // 2])}, data={"model": WHISPER_TINY_EN})
    assert r.status_code == 200 and r.json()["text"]  # an mp3 states no length: half of one is half the speech
    err = error_of(post(speech_server, files={"file": ("big.wav", b"\0" * ((MAX_AUDIO_MB << 20) + 1))}, data=model),
                   413)
    assert err["code"] == "file_too_large"
    assert "--max-audio-mb" in err["message"]
    flac = transcode(audio_dir / "script.wav", audio_dir / "claims.flac", "flac", stereo=False)
    err = error_of(post(speech_server, files={"file": ("long.flac", flac_claiming(flac, MAX_AUDIO_SECONDS + 60))},
                        data=model))
    assert "--max-audio-seconds" in err["message"]
    err = error_of(post(speech_server, files={"file": ("a.wav", wav)}, data={"model": "tiny-random"}))
    assert err["code"] == "unsupported_task" and DEFAULT_SPEECH_MODEL in err["message"], err
    err = error_of(post(speech_server, "/v1/audio/translations", files={"file": ("a.wav", wav)},
                        data={"model": WHISPER_TINY_EN}))
    assert err["code"] == "unsupported_task" and DEFAULT_SPEECH_MODEL in err["message"], err
    err = error_of(post(speech_server, data=model, files={"other": ("a.wav", wav)}))
    assert err["param"] == "file"
    err = error_of(post(speech_server, json={"model": DEFAULT_SPEECH_MODEL, "file": "a.wav"}))
    assert "multipart" in err["message"]
    for field, value in (("response_format", "docx"), ("temperature", "hot"), ("temperature", "3"),
                         ("language", "klingon"), ("timestamp_granularities[]", "word"), ("stream", "maybe")):
        err = error_of(post(speech_server, files={"file": ("a.wav", wav)}, data={**model, field: value}))
        assert err["param"] in (field, field.rstrip("[]")), (field, err)
    err = error_of(post(speech_server, files={"file": ("a.wav", wav)}, data={"model": WHISPER_TINY_EN,
                                                                            "language": "fr"}))
    assert err["param"] == "language"
    with pytest.raises(openai.BadRequestError):
        with open(audio_dir / "script.wav", "rb") as f:
            client.audio.transcriptions.create(model="tiny-random", file=f)
    assert wer(SCRIPT, transcribe(client, audio_dir / "script.wav").text) < MAX_WER  # still serving


def test_english_only_model_and_prompt(client, audio_dir):
    text = transcribe(client, audio_dir / "script.wav", model=WHISPER_TINY_EN, prompt="Window, report, lunch.").text
    assert wer(SCRIPT, text) < MAX_WER, text


def test_a_killed_speech_engine_is_restarted_and_serves(speech_server, client, audio_dir):
    engines = [p for p in procs(speech_server, "engine") if p.get("model") == DEFAULT_SPEECH_MODEL]
    assert len(engines) == 1 and engines[0]["state"] == "ready"
    os.kill(engines[0]["pid"], signal.SIGKILL)
    wait_until(lambda: any(p["state"] == "ready" and p["pid"] != engines[0]["pid"]
                           for p in procs(speech_server, "engine") if p.get("model") == DEFAULT_SPEECH_MODEL), 60,
               what="a new whisper-base engine")
    wait_until(lambda: httpx.get(speech_server.url + "/v1/models", timeout=10).status_code == 200, 10)
    text = transcribe(client, audio_dir / "script.wav").text
    assert wer(SCRIPT, text) < MAX_WER
