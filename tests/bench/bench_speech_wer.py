"""Word error rate of zserve's speech models in every response format (issue 34), on the tests' espeak-ng speech.

Usage:
    .venv/bin/python tests/bench/bench_speech_wer.py

Serves whisper-base and whisper-tiny.en (`launch api-server --count 1`) and transcribes, through the openai SDK, a
short recording (``tests.speech.SCRIPT``, 3 sentences) and a long one (all 36 sentences of ``tests.speech``, 3.6
minutes, 8 windows) in each response format (json, text, srt, vtt, verbose_json), streamed, and as verbose_json's
words. Prints one markdown row per model and recording: the word error rate of each against the script.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.e2e.test_audio import cues  # noqa: E402
from tests.helpers import Server  # noqa: E402
from tests.speech import SCRIPT, SENTENCES, concat_wavs, speak, transcode, wer  # noqa: E402

FORMATS = ("json", "text", "srt", "vtt", "verbose_json", "stream", "words")


def text_of(client, model: str, path: Path, fmt: str) -> str:
    with open(path, "rb") as f:
        if fmt == "stream":
            return list(client.audio.transcriptions.create(model=model, file=f, stream=True))[-1].text
        if fmt == "words":
            v = client.audio.transcriptions.create(model=model, file=f, response_format="verbose_json",
                                                   timestamp_granularities=["word"])
            return " ".join(w.word for w in v.words)
        r = client.audio.transcriptions.create(model=model, file=f, response_format=fmt)
    if fmt == "text":
        return r
    if fmt in ("srt", "vtt"):
        return " ".join(t for _, _, t in cues(r))
    return r.text


def main() -> None:
    import openai

    work = Path(tempfile.mkdtemp(prefix="bench-speech-wer-"))
    short = speak(SCRIPT, work / "script.wav")
    parts = [speak(s, work / f"s{i}.wav") for i, s in enumerate(SENTENCES)]
    long = transcode(concat_wavs(parts, work / "long.wav"), work / "long.ogg", "ogg", stereo=False)
    server = Server("--count", "1", "--model", "whisper-base", "--model", "whisper-tiny.en", log_name="bench-wer")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600)
        print("| model | recording | " + " | ".join(FORMATS) + " |")
        print("|---|---|" + "---|" * len(FORMATS))
        for model in ("whisper-base", "whisper-tiny.en"):
            for name, path, script in (("3 sentences (19 s)", short, SCRIPT),
                                       ("36 sentences (3.6 min)", long, " ".join(SENTENCES))):
                row = [f"{wer(script, text_of(client, model, path, fmt)):.1%}" for fmt in FORMATS]
                print(f"| {model} | {name} | " + " | ".join(row) + " |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
