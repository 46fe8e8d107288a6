"""Speech the tests and benchmarks make themselves: espeak-ng reads a script (Debian's package, installed by
`.ci/run`), PyAV re-encodes it into the containers users upload, and ``wer`` scores a transcript against the script.

espeak-ng's voice is a formant synthesizer, harder for Whisper than a person: at 120 words a minute with a short
gap between words, whisper-base reads these sentences at a few percent word error rate.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import pytest

# Plain sentences without digits or names (a number may come back as "9" for "nine": not an error, but a mismatch).
SENTENCES = [
    "Open the window and let the fresh air into the room.",
    "Please send me the report before lunch.",
    "We will travel to the coast next summer with our friends.",
    "The children played in the garden until the sun went down.",
    "She bought a new coat because the winter was very cold.",
    "My brother likes to read books about the history of the sea.",
    "The train was late, so we waited on the platform for a long time.",
    "Turn off the lights when you leave the office tonight.",
    "The old man walked slowly across the bridge with his dog.",
    "We need more paper for the printer in the kitchen.",
    "The doctor told him to drink more water every day.",
    "It is going to rain this afternoon, so take an umbrella.",
    "The teacher asked the students to write a short story.",
    "They planted tomatoes and beans behind the small house.",
    "Could you help me carry these boxes up the stairs?",
    "The music was so loud that nobody could hear the phone.",
    "He forgot his keys at home and had to call his sister.",
    "The market opens early in the morning on the weekend.",
    "A little bird was singing on the roof of the barn.",
    "Please remember to close the door when you go out.",
    "The coffee in this small shop is very good.",
    "We watched a film about a family who lived on a farm.",
    "The river flows through the valley and into the lake.",
    "She painted the walls of her bedroom a light blue colour.",
    "The bus stops in front of the library every hour.",
    "Our neighbours are building a new fence around their yard.",
    "The cat slept all day on the warm window seat.",
    "He cooked dinner for the whole family on Sunday evening.",
    "The wind was strong, and the trees were bending in the storm.",
    "Let us meet at the station before the concert begins.",
    "The farmer sold fresh milk and eggs at the village market.",
    "I would like a cup of tea with a slice of lemon.",
    "The museum was full of paintings from many different countries.",
    "They walked along the beach and collected shells in a bag.",
    "The baker makes bread and cakes before the sun comes up.",
    "Remember to water the flowers while I am away on holiday.",
]
SCRIPT = " ".join(SENTENCES[:3])


def require_espeak() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        pytest.skip("espeak-ng is not installed (`.ci/run` installs Debian's espeak-ng): no speech to test with")
    return path


def speak(text: str, path: Path, voice: str = "en-us", speed: int = 120, gap: int = 3) -> Path:
    """A 22.05 kHz mono wav of espeak-ng reading ``text``."""
    subprocess.run([require_espeak(), "-v", voice, "-s", str(speed), "-g", str(gap), "-w", str(path), text],
                   check=True, capture_output=True, timeout=120)
    return path


def concat_wavs(parts: list[Path], path: Path, pause_s: float = 0.6) -> Path:
    """One wav of ``parts`` (same rate, 16-bit mono, as espeak-ng writes them) with ``pause_s`` of silence between."""
    import wave

    with wave.open(str(parts[0])) as w:
        params = w.getparams()
    silence = b"\x00\x00" * int(params.framerate * pause_s)
    with wave.open(str(path), "wb") as out:
        out.setparams(params)
        for p in parts:
            with wave.open(str(p)) as w:
                out.writeframes(w.readframes(w.getnframes()))
            out.writeframes(silence)
    return path


# container -> (PyAV format, codec, sample rate)
CONTAINERS = {
    "mp3": ("mp3", "libmp3lame", 44100),
    "flac": ("flac", "flac", 44100),
    "ogg": ("ogg", "libopus", 48000),
    "m4a": ("ipod", "aac", 44100),
    "webm": ("webm", "libopus", 48000),
    "wav": ("wav", "pcm_s16le", 44100),
}


def transcode(src: Path, dst: Path, kind: str, stereo: bool = True) -> Path:
    """``src`` re-encoded as ``kind`` (a key of CONTAINERS), resampled to that container's usual rate, in stereo."""
    import av

    fmt, codec, rate = CONTAINERS[kind]
    layout = "stereo" if stereo else "mono"
    with av.open(str(src)) as inp, av.open(str(dst), "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        fmt_name = stream.codec_context.codec.audio_formats[0].name if stream.codec_context.codec.audio_formats \
            else "s16"
        resampler = av.AudioResampler(format=fmt_name, layout=layout, rate=rate)
        pts = 0
        for frame in inp.decode(audio=0):
            for f in resampler.resample(frame):
                f.pts, f.time_base = pts, Fraction(1, rate)
                pts += f.samples
                for packet in stream.encode(f):
                    out.mux(packet)
        for f in resampler.resample(None):
            f.pts, f.time_base = pts, Fraction(1, rate)
            pts += f.samples
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return dst


def flac_claiming(path: Path, seconds: int) -> bytes:
    """A flac file's bytes with its header (STREAMINFO's total samples) claiming ``seconds`` of audio, as a long
    recording's would: the file stays small."""
    import av

    data = bytearray(path.read_bytes())
    assert data[:4] == b"fLaC"
    with av.open(str(path)) as c:
        rate = c.streams.audio[0].rate
    at = 8 + 10  # after the block sizes and frame sizes: rate (20 bits), channels (3), bits (5), total samples (36)
    bits = int.from_bytes(data[at:at + 8], "big")
    data[at:at + 8] = ((bits & ~((1 << 36) - 1)) | (seconds * rate)).to_bytes(8, "big")
    return bytes(data)


def duration(path: Path) -> float:
    import av

    with av.open(str(path)) as c:
        s = c.streams.audio[0]
        n = sum(f.samples for f in c.decode(s))
        return n / s.rate


def words(text: str) -> str:
    """Lower case, no punctuation, one space between words: what the word error rate compares."""
    return " ".join(re.sub(r"[^a-z' ]+", " ", text.lower().replace("-", " ")).split())


def wer(reference: str, hypothesis: str) -> float:
    """The word error rate of ``hypothesis`` against ``reference`` (jiwer), both normalised by ``words``."""
    import jiwer

    return jiwer.wer(words(reference), words(hypothesis) or "<empty>")
