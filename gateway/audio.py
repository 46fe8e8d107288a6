"""Decode an uploaded recording to what Whisper hears: 16 kHz mono signed 16-bit little-endian PCM.

Clients send whatever their recorder wrote (OpenAI takes flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav and webm). The
decoding is PyAV's: a maintained binding of FFmpeg's own libraries (libavformat, libavcodec, libswresample) whose
wheels bundle them, so wav, mp3, flac, ogg (opus, vorbis), m4a/mp4 (aac), webm/mkv (opus) and the audio track of a
video file all decode with no ffmpeg on the host and no subprocess per request. The container is found from the
bytes themselves (ffmpeg's probe), never from the client's file name, which only appears in error messages.

``decode_audio`` is pure and thread-safe (each call has its own container, decoder and resampler, and touches no
event loop): the gateway runs it in a thread-pool executor. Every way an upload can be unusable is an
``AudioError`` whose message tells the client what is wrong with its file (the gateway answers it as a 400).

Length is bounded twice: a container whose header states its length (wav, flac, ogg, mp4, webm, ...) is refused
before anything is decoded when that length is over the limit, and any stream stops decoding as soon as what it gave
passes the limit, so neither a 10-hour upload nor a small file that decodes to hours costs more than the limit.
"""

from __future__ import annotations

import io
import sys
from array import array
from dataclasses import dataclass

import av

from protocol.speech import SAMPLE_RATE

_BYTES_PER_SECOND = 2 * SAMPLE_RATE  # 16-bit mono

# Containers whose header states the recording's exact length (sample counts, the last page's granule position,
# a movie header). Elsewhere (mp3 without a Xing header, raw AAC, MPEG) ffmpeg guesses the length from the first
# frame's bit rate, which for variable bit rates can be several times too long: those are only refused as they
# decode, never on a guess. Matched against each of the names in ``container.format.name``.
_EXACT_LENGTH_FORMATS = frozenset({"wav", "w64", "flac", "ogg", "mov", "mp4", "m4a", "matroska", "webm", "aiff",
                                   "caf"})
# Codec padding and rounding: a declared length this far over the limit may still decode within it.
_DECLARED_SLACK_S = 1.0
# A file that decodes to less than its header states by more than this (seconds, or share of the length) was cut
# short. (Encoder delay and padding differ from the header by milliseconds.)
_CUT_SHORT_S, _CUT_SHORT = 1.0, 0.1

# The demuxers that could open further inputs named inside the upload (HLS playlists, concat lists, QuickTime
# references) must not: an upload is one file, and a name inside it must never reach the host's files or network.
# No protocol is called "none", so this whitelist allows none (the upload itself is read through a Python file
# object, not a protocol).
_OPEN_OPTIONS = {"protocol_whitelist": "none"}

_FORMATS_HINT = "send wav, mp3, flac, ogg, m4a, mp4 or webm"


class AudioError(ValueError):
    """The upload cannot be used as audio. The message is shown to the API client (a 400)."""


@dataclass(frozen=True)
class DecodedAudio:
    """``pcm``: signed 16-bit little-endian mono samples at ``protocol.speech.SAMPLE_RATE``; ``seconds`` their
    length; ``format`` the container ffmpeg found (``"wav"``, ``"mp3"``, ``"mov,mp4,m4a,3gp,3g2,mj2"``, ...)."""

    pcm: bytes
    seconds: float
    format: str


def decode_audio(data: bytes, max_seconds: float, filename: str | None = None) -> DecodedAudio:
    """Decode ``data`` (a whole audio or video file) to 16 kHz mono 16-bit PCM from its first audio stream.

    Refused with an ``AudioError``: an empty file; bytes no demuxer recognises (not audio, a truncated header); a
    container with no audio stream (a picture, a silent video); a codec this build cannot decode; a recording
    longer than ``max_seconds``; one that yields no samples at all (a header-only wav).

    Damaged data: a packet the decoder rejects is skipped, as the ffmpeg command line does, and decoding goes on
    with the next one; a read error in the container ends decoding there. If nothing decoded at all the file is
    refused as damaged. A file cut short is refused where its header states the exact length it should have
    (wav, flac, ogg, mp4, webm...: ``_EXACT_LENGTH_FORMATS``) and it decodes to clearly less (``_CUT_SHORT``): an
    upload that broke off should be sent again, not half transcribed without a word. Where the length is only a
    guess (an mp3 without a Xing header), what decoded is kept. Digital silence is valid audio.
    """
    name = _shown_name(filename)
    if not data:
        raise AudioError(f"the file{name} is empty")
    _check_riff_size(data, name)
    max_bytes = int(max_seconds * SAMPLE_RATE) * 2
    try:
        container = av.open(io.BytesIO(data), mode="r", options=_OPEN_OPTIONS, metadata_errors="replace")
    except (av.FFmpegError, OSError, ValueError, EOFError) as e:
        raise AudioError(f"could not read the file{name} as audio: it is not in an audio or video format this "
                         f"server knows, or it is damaged or cut short ({_FORMATS_HINT})") from e
    with container:
        fmt = container.format.name
        if not container.streams.audio:
            raise AudioError(f"the file{name} holds no audio stream (ffmpeg read it as {fmt!r})")
        stream = container.streams.audio[0]
        if stream.codec_context is None:
            raise AudioError(f"the file{name} holds audio in a codec this server cannot decode")
        codec = stream.codec_context.name
        declared = _declared_seconds(container, stream)
        exact = bool(set(fmt.split(",")) & _EXACT_LENGTH_FORMATS)
        if declared and declared > max_seconds + _DECLARED_SLACK_S and exact:
            raise _too_long(max_seconds)
        pcm = bytearray()
        errors = 0
        resampler: av.AudioResampler | None = None
        source: tuple | None = None  # the (format, layout, rate) the resampler was set up for
        try:
            for packet in container.demux(stream):
                try:
                    frames = packet.decode()
                except (av.FFmpegError, ValueError):
                    errors += 1  # a damaged packet: skip it and decode the next
                    continue
                for frame in frames:
                    key = (frame.format.name, frame.layout.name, frame.sample_rate)
                    if key != source:  # a chained stream changed its rate or channels: a resampler for the new one
                        if resampler is not None:
                            _append(pcm, resampler.resample(None))
                        resampler, source = _resampler(), key
                    frame.pts = None  # the resampler needs no timeline; a damaged one could only confuse it
                    _append(pcm, resampler.resample(frame))
                    if len(pcm) > max_bytes:
                        raise _too_long(max_seconds)
        except AudioError:
            raise
        except (av.FFmpegError, OSError, ValueError, EOFError) as e:
            if not pcm:
                raise _damaged(name, codec) from e
            # keep what decoded before the damage (see the docstring)
        if resampler is not None:
            try:
                _append(pcm, resampler.resample(None))
            except (av.FFmpegError, ValueError) as e:
                if not pcm:
                    raise _damaged(name, codec) from e
    if len(pcm) > max_bytes:
        raise _too_long(max_seconds)
    if not pcm:
        if errors or declared:  # packets that would not decode, or none at all where the header promised some
            raise _damaged(name, codec)
        raise AudioError("the file holds no audio samples")
    got = len(pcm) / _BYTES_PER_SECOND
    if declared and exact and declared - got > max(_CUT_SHORT_S, _CUT_SHORT * declared):
        raise AudioError(f"the file{name} is cut short: its header says {declared:.1f} s of audio, but only "
                         f"{got:.1f} s could be decoded; send the whole file")
    if sys.byteorder == "big":  # "s16" is the host's order; the wire's is little-endian
        samples = array("h", pcm)
        samples.byteswap()
        pcm = bytearray(samples.tobytes())
    return DecodedAudio(bytes(pcm), len(pcm) / _BYTES_PER_SECOND, fmt)


def _check_riff_size(data: bytes, name: str) -> None:
    """A wav whose RIFF header states more bytes than arrived was cut short. (ffmpeg takes the length of a wav
    from what is there, so its duration cannot tell; a recorder streaming its output writes 0 or 0xFFFFFFFF.)"""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        stated = int.from_bytes(data[4:8], "little")
        if stated not in (0, 0xFFFFFFFF) and stated + 8 > len(data) + 1:  # (+1: a pad byte may be left off)
            raise AudioError(f"the file{name} is cut short: its header says {stated + 8} bytes, but {len(data)} "
                             "arrived; send the whole file")


def _damaged(name: str, codec: str) -> AudioError:
    return AudioError(f"could not decode the file{name}: its {codec} audio is damaged or cut short")


def _too_long(max_seconds: float) -> AudioError:
    return AudioError(f"the audio is longer than the {max_seconds:g} s this server takes (--max-audio-seconds)")


def _resampler() -> av.AudioResampler:
    return av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)


def _append(pcm: bytearray, frames: list) -> None:
    for frame in frames:
        # a plane's buffer may be padded past the samples: take exactly samples x 2 bytes
        pcm += memoryview(frame.planes[0])[: frame.samples * 2]


def _declared_seconds(container: av.container.InputContainer, stream: av.audio.AudioStream) -> float | None:
    """The length the header states (the audio stream's, else the container's), or None when it states none."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / av.time_base
    return None


def _shown_name(filename: str | None) -> str:
    """`` 'name'`` for messages: the client's own file name, printable and short, or nothing."""
    if not filename:
        return ""
    clean = "".join(c for c in filename if c.isprintable())[:100]
    return f" {clean!r}" if clean else ""
