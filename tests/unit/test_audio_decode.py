"""Uploads decode to 16 kHz mono PCM, whatever the container; unusable ones are refused with a message that says why.

Every recording here is made by PyAV itself (the same FFmpeg libraries the gateway decodes with), so the tests need
no sample files and no ffmpeg on the host.
"""

from __future__ import annotations

import io
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import numpy as np
import pytest

from gateway.audio import AudioError, decode_audio
from protocol.speech import SAMPLE_RATE


def _encode(fmt: str, codec: str, seconds: float = 1.0, rate: int = 44100, layout: str = "stereo",
            freq: float = 440.0, silent: bool = False) -> bytes:
    """A sine (or silence) of ``seconds``, encoded with ``codec`` into container ``fmt``, in memory."""
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV build has no {codec} encoder")
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        if codec == "vorbis":  # FFmpeg's own vorbis encoder is marked experimental
            stream.codec_context.options = {"strict": "experimental"}
        sample_fmt = stream.codec_context.codec.audio_formats[0].name
        channels = 2 if layout == "stereo" else 1
        block = stream.codec_context.frame_size or 1024
        n = int(seconds * rate)
        signal = np.zeros(n) if silent else 0.5 * np.sin(2 * math.pi * freq * np.arange(n) / rate)
        for at in range(0, n, block):
            chunk = signal[at:at + block]
            planes = np.tile(chunk, (channels, 1)) if sample_fmt.endswith("p") else np.repeat(chunk, channels)[None]
            if sample_fmt.startswith("s16"):
                planes = (planes * 32767).astype(np.int16)
            elif sample_fmt.startswith("s32"):
                planes = (planes * 2_000_000_000).astype(np.int32)
            else:
                planes = planes.astype(np.float32)
            frame = av.AudioFrame.from_ndarray(planes, format=sample_fmt, layout=layout)
            frame.sample_rate, frame.pts = rate, at
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float64)


def _peak_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum)) * SAMPLE_RATE / len(x)


FORMATS = [  # (container to write, encoder, sample rate, the format name ffmpeg reads back)
    ("wav", "pcm_s16le", 44100, "wav"),
    ("mp3", "libmp3lame", 44100, "mp3"),
    ("flac", "flac", 44100, "flac"),
    ("ogg", "libopus", 48000, "ogg"),
    ("ogg", "vorbis", 44100, "ogg"),
    ("ipod", "aac", 44100, "mov,mp4,m4a,3gp,3g2,mj2"),  # .m4a
    ("mp4", "aac", 22050, "mov,mp4,m4a,3gp,3g2,mj2"),
    ("webm", "libopus", 48000, "matroska,webm"),
    ("adts", "aac", 44100, "aac"),  # a bare .aac stream
]


@pytest.mark.parametrize(("fmt", "codec", "rate", "found"), FORMATS, ids=[f"{f[0]}-{f[1]}" for f in FORMATS])
def test_each_container_decodes_to_16k_mono(fmt: str, codec: str, rate: int, found: str) -> None:
    audio = decode_audio(_encode(fmt, codec, rate=rate), max_seconds=30, filename=f"clip.{fmt}")
    assert audio.format == found
    assert len(audio.pcm) % 2 == 0 and audio.seconds == len(audio.pcm) / (2 * SAMPLE_RATE)
    assert abs(audio.seconds - 1.0) < 0.1  # codec priming and padding: a frame or two
    x = _samples(audio.pcm)
    assert np.sqrt(np.mean(x ** 2)) > 5000  # a sine at half scale, not silence
    assert abs(_peak_hz(x) - 440.0) < 5  # the pitch survives: the rate really is 16 kHz


def test_16k_mono_wav_passes_through_sample_exact() -> None:
    data = _encode("wav", "pcm_s16le", rate=SAMPLE_RATE, layout="mono")
    audio = decode_audio(data, max_seconds=30)
    expected = (0.5 * np.sin(2 * math.pi * 440.0 * np.arange(SAMPLE_RATE) / SAMPLE_RATE) * 32767).astype("<i2")
    assert audio.pcm == expected.tobytes()


def test_stereo_is_mixed_to_mono_at_the_same_level() -> None:
    mono = _samples(decode_audio(_encode("wav", "pcm_s16le", layout="mono"), 30).pcm)
    stereo = _samples(decode_audio(_encode("wav", "pcm_s16le", layout="stereo"), 30).pcm)
    assert len(mono) == len(stereo) == SAMPLE_RATE
    assert np.max(np.abs(mono - stereo)) <= 2


def test_silence_is_valid_audio() -> None:
    audio = decode_audio(_encode("wav", "pcm_s16le", silent=True), max_seconds=30)
    assert audio.seconds == 1.0 and audio.pcm == bytes(len(audio.pcm))


def test_a_rate_change_inside_a_stream_keeps_both_parts() -> None:
    # two mp3s back to back (44.1 then 22.05 kHz): the decoder's frames change rate midway
    data = _encode("mp3", "libmp3lame", rate=44100) + _encode("mp3", "libmp3lame", rate=22050, freq=880.0)
    x = _samples(decode_audio(data, max_seconds=30).pcm)
    assert abs(len(x) / SAMPLE_RATE - 2.0) < 0.2
    assert abs(_peak_hz(x[:SAMPLE_RATE // 2]) - 440.0) < 5
    assert abs(_peak_hz(x[-SAMPLE_RATE // 2:]) - 880.0) < 5


def test_the_audio_track_of_a_video_file_decodes() -> None:
    if "mpeg4" not in av.codecs_available:
        pytest.skip("this PyAV build has no mpeg4 encoder")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        audio = out.add_stream("aac", rate=16000, layout="mono")
        for i in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 20, np.uint8), format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
        n, block = SAMPLE_RATE, audio.codec_context.frame_size
        tone = (0.5 * np.sin(2 * math.pi * 440.0 * np.arange(n) / SAMPLE_RATE)).astype(np.float32)
        for at in range(0, n, block):
            frame = av.AudioFrame.from_ndarray(tone[None, at:at + block], format="fltp", layout="mono")
            frame.sample_rate, frame.pts = SAMPLE_RATE, at
            out.mux(audio.encode(frame))
        out.mux(video.encode(None))
        out.mux(audio.encode(None))
    decoded = decode_audio(buf.getvalue(), max_seconds=30)
    assert abs(decoded.seconds - 1.0) < 0.1
    assert abs(_peak_hz(_samples(decoded.pcm)) - 440.0) < 5


def test_decodes_run_side_by_side_in_threads() -> None:
    files = [_encode("flac", "flac", freq=f) for f in (220.0, 330.0, 440.0, 550.0)]
    alone = [decode_audio(f, 30).pcm for f in files]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda f: decode_audio(f, 30).pcm, files * 3))
    assert together == alone * 3


# ---- refusals ----


def _refused(data: bytes, max_seconds: float = 30, filename: str | None = None) -> str:
    with pytest.raises(AudioError) as e:
        decode_audio(data, max_seconds, filename)
    return str(e.value)


NOT_AUDIO = "as audio: it is not in an audio or video format this server knows"


def test_an_empty_file_is_refused() -> None:
    assert _refused(b"", filename="a.wav") == "the file 'a.wav' is empty"
    assert _refused(b"") == "the file is empty"


@pytest.mark.parametrize("data", [
    pytest.param(os.urandom(4096), id="random-bytes"),
    pytest.param(b"Dear client,\nthis is a plain text file, not a recording.\n" * 40, id="text"),
    pytest.param(b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n" * 20, id="pdf"),
])
def test_bytes_that_are_no_format_are_refused(data: bytes) -> None:
    message = _refused(data, filename="upload.mp3")
    assert message.startswith(f"could not read the file 'upload.mp3' {NOT_AUDIO}")
    assert "wav, mp3, flac" in message


@pytest.mark.parametrize(("fmt", "codec"), [("wav", "pcm_s16le"), ("mp3", "libmp3lame"), ("ipod", "aac")])
def test_a_file_cut_inside_its_header_is_refused(fmt: str, codec: str) -> None:
    message = _refused(_encode(fmt, codec)[:60])
    # (a wav's RIFF header states its size: that it was cut is known before ffmpeg reads it)
    assert ("is cut short: its header says" if fmt == "wav" else NOT_AUDIO) in message


def test_a_picture_has_no_audio_stream() -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(200)
    message = _refused(png, filename="cat.png")
    assert message == "the file 'cat.png' holds no audio stream (ffmpeg read it as 'png_pipe')"


def test_a_header_without_samples_is_refused() -> None:
    data = _encode("wav", "pcm_s16le", rate=SAMPLE_RATE, layout="mono")
    at = data.index(b"data") + 8
    header = bytearray(data[:at])  # the wav header, its data chunk empty, as its sizes say
    header[4:8] = (len(header) - 8).to_bytes(4, "little")
    header[at - 4:at] = bytes(4)
    assert _refused(bytes(header)) == "the file holds no audio samples"


def test_damaged_audio_with_nothing_decodable_is_refused() -> None:
    data = bytearray(_encode("flac", "flac"))
    rng = np.random.default_rng(0)
    data[len(data) // 4:] = rng.integers(0, 256, len(data) - len(data) // 4, dtype=np.uint8).tobytes()
    assert _refused(bytes(data)) == "could not decode the file: its flac audio is damaged or cut short"


def test_a_truncated_upload_of_unstated_length_keeps_what_decoded() -> None:
    for fmt, codec in (("mp3", "libmp3lame"), ("ogg", "libopus")):  # (an ogg's length is its last page's)
        data = _encode(fmt, codec, seconds=2.0, rate=48000 if codec == "libopus" else 44100)
        audio = decode_audio(data[:int(len(data) * 0.7)], max_seconds=30)
        assert 0.5 < audio.seconds < 1.9, fmt
        assert abs(_peak_hz(_samples(audio.pcm)) - 440.0) < 5


@pytest.mark.parametrize(("fmt", "codec"), [("wav", "pcm_s16le"), ("flac", "flac"), ("webm", "libopus")])
def test_a_truncated_upload_whose_header_states_its_length_is_refused(fmt: str, codec: str) -> None:
    data = _encode(fmt, codec, seconds=4.0, rate=48000 if codec == "libopus" else 44100)
    assert "is cut short: its header says" in _refused(data[:int(len(data) * 0.6)])


def test_a_playlist_naming_host_files_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "secret.mp3"
    target.write_bytes(_encode("mp3", "libmp3lame"))
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile://{target}\n#EXT-X-ENDLIST\n".encode()
    assert NOT_AUDIO in _refused(playlist, filename="list.m3u8")
    concat = f"ffconcat version 1.0\nfile '{target}'\n".encode()
    assert NOT_AUDIO in _refused(concat)


def test_a_client_file_name_is_shown_printable_and_short() -> None:
    message = _refused(b"", filename="evil\x1b[31m\nname" + "x" * 500 + ".wav")
    assert "\x1b" not in message and "\n" not in message and len(message) < 140


# ---- length ----

TOO_LONG = "the audio is longer than the {:g} s this server takes (--max-audio-seconds)"


@pytest.mark.parametrize(("fmt", "codec"), [("wav", "pcm_s16le"), ("mp3", "libmp3lame"), ("adts", "aac")])
def test_audio_over_the_limit_is_refused(fmt: str, codec: str) -> None:
    # wav states its length (refused before decoding); mp3 and raw aac are refused as they decode
    assert _refused(_encode(fmt, codec, seconds=3.0), max_seconds=2) == TOO_LONG.format(2)
    assert _refused(_encode(fmt, codec, seconds=3.0), max_seconds=2.5) == TOO_LONG.format(2.5)
    assert abs(decode_audio(_encode(fmt, codec, seconds=3.0), max_seconds=3.2).seconds - 3.0) < 0.1


def test_audio_at_the_limit_is_taken() -> None:
    audio = decode_audio(_encode("wav", "pcm_s16le", seconds=2.0), max_seconds=2)
    assert audio.seconds == 2.0


def _flac_declaring(seconds: int) -> bytes:
    """A real 1 s flac whose STREAMINFO claims ``seconds`` of audio (as a 10-hour recording's header would)."""
    data = bytearray(_encode("flac", "flac", rate=SAMPLE_RATE, layout="mono"))
    assert data[:4] == b"fLaC"
    at = 8 + 10  # STREAMINFO's rate (20 bits), channels (3), bits per sample (5), total samples (36)
    bits = int.from_bytes(data[at:at + 8], "big")
    bits = (bits & ~((1 << 36) - 1)) | (seconds * SAMPLE_RATE)
    data[at:at + 8] = bits.to_bytes(8, "big")
    return bytes(data)


def test_a_long_recording_is_refused_from_its_header_without_decoding() -> None:
    ten_hours = _flac_declaring(36000)
    assert _refused(ten_hours, max_seconds=600) == TOO_LONG.format(600)
    # the samples behind the header are only 1 s: it was the header that refused it, not the decoding (under a
    # higher limit, the same header says the file was cut short)
    assert _refused(ten_hours, max_seconds=40000).startswith("the file is cut short: its header says 36000.0 s")
