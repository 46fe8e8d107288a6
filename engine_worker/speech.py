"""Whisper on CTranslate2: what a speech engine runs (``speech_scheduler`` decides which windows, this runs them).

Why CTranslate2 and not a torch port. The Whisper checkpoints that install from the package index without a model
hub (``zserve.catalog``: tiny.en, base) ship in CTranslate2's format, as faster-whisper publishes them, and
faster-whisper itself (the reference this engine is measured against, ``tests/bench/bench_speech.py``) runs on
CTranslate2: int8 GEMMs and a fused decoder on the CPU, float16 on CUDA, with batched ``encode``/``generate``/
``align``. A torch port would have to read CTranslate2's own weight format back into torch and would run the float
weights, where CTranslate2 quantizes them to int8 at load on the CPU. The torch side here is the log-mel
spectrogram (``log_mel``), which is cheap and runs where the engine's torch runs.

Device choice stays in ``engine_worker.device``: the torch device it picked becomes CTranslate2's device and index.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import torch

from protocol.speech import SAMPLE_RATE
from zserve.tokenizer import Tokenizer

log = logging.getLogger("zserve.engine")

N_FFT, HOP = 400, 160  # 25 ms windows every 10 ms
WINDOW_FRAMES = 3000  # 30 s of 10 ms frames: what the encoder takes
FRAMES_PER_SECOND = SAMPLE_RATE // HOP  # 100
TIME_PRECISION = 0.02  # seconds per timestamp token (and per encoder position)
MAX_LENGTH = 448  # the decoder's context


def mel_filters(n_mels: int) -> torch.Tensor:
    """The Slaney-style mel filter bank Whisper was trained with (librosa's ``mel(sr=16000, n_fft=400)``:
    a linear scale to 1 kHz, logarithmic above, each triangle normalised to unit area), ``[n_mels, 201]``."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, log_step = min_log_hz / f_sp, math.log(6.4) / 27.0

    def to_mel(hz: np.ndarray) -> np.ndarray:
        return np.where(hz >= min_log_hz, min_log_mel + np.log(np.maximum(hz, 1e-10) / min_log_hz) / log_step,
                        hz / f_sp)

    def to_hz(mel: np.ndarray) -> np.ndarray:
        return np.where(mel >= min_log_mel, min_log_hz * np.exp(log_step * (mel - min_log_mel)), f_sp * mel)

    fft_hz = np.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    edges = to_hz(np.linspace(to_mel(np.array(0.0)), to_mel(np.array(SAMPLE_RATE / 2)), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_hz[None, :]
    rising, falling = -ramps[:-2] / widths[:-1, None], ramps[2:] / widths[1:, None]
    bank = np.maximum(0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(bank.astype(np.float32))


def log_mel(pcm: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """The log-mel spectrogram of 16 kHz 16-bit samples followed by 30 s of silence (so that the last window is
    whole), ``[n_mels, frames]``, scaled as Whisper's encoder expects (log10, floored 8 below the peak, then
    (x+4)/4).

    The peak is the whole recording's, as Whisper computes it once per file."""
    samples = torch.nn.functional.pad(pcm.to(torch.float32) / 32768.0, (0, SAMPLE_RATE * 30))
    spec = torch.stft(samples, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
    power = spec[..., :-1].abs() ** 2
    mel = torch.clamp(filters @ power, min=1e-10).log10()
    mel = torch.maximum(mel, mel.max() - 8.0)
    return (mel + 4.0) / 4.0


@dataclass(frozen=True)
class SpecialTokens:
    """Whisper's control tokens, read from the model's ``tokenizer.json`` and ``config.json``."""

    eot: int
    sot: int
    sot_prev: int
    transcribe: int
    translate: int | None
    no_timestamps: int
    no_speech: int | None
    languages: dict[str, int]  # code -> token id (multilingual models)

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @classmethod
    def read(cls, model_dir: Path) -> SpecialTokens:
        tok = orjson.loads((model_dir / "tokenizer.json").read_bytes())
        ids = {t["content"]: t["id"] for t in tok.get("added_tokens", ())}
        cfg = orjson.loads((model_dir / "config.json").read_bytes())
        lang_ids = set(cfg.get("lang_ids") or ())
        languages = {c[2:-2]: i for c, i in ids.items() if i in lang_ids and c.startswith("<|") and c.endswith("|>")}

        def need(name: str) -> int:
            if name not in ids:
                raise ValueError(f"{model_dir}/tokenizer.json has no {name} token: not a Whisper tokenizer")
            return ids[name]

        return cls(eot=need("<|endoftext|>"), sot=need("<|startoftranscript|>"), sot_prev=need("<|startofprev|>"),
                   transcribe=need("<|transcribe|>"), translate=ids.get("<|translate|>"),
                   no_timestamps=need("<|notimestamps|>"),
                   no_speech=ids.get("<|nospeech|>", ids.get("<|nocaptions|>")), languages=languages)


@dataclass
class Decoded:
    """One window's decoding: the generated ids (text and timestamp tokens, no end token), the mean log
    probability per token, and the probability that the window holds no speech."""

    tokens: list[int]
    avg_logprob: float
    no_speech_prob: float


class WhisperRunner:
    """One Whisper model on one device: features in, tokens (and token times) out, a batch of windows at a time."""

    tasks: tuple[str, ...]

    def __init__(self, model_dir: str | Path, device: torch.device, threads: int):
        import ctranslate2  # (only speech engines import it)

        self.model_dir = Path(model_dir)
        self.device = device
        ct_device = "cuda" if device.type == "cuda" else "cpu"
        # int8 weights with float activations on the CPU (faster-whisper's default there); float16 on a GPU.
        self.compute_type = "float16" if ct_device == "cuda" else "int8"
        self.model = ctranslate2.models.Whisper(str(self.model_dir), device=ct_device, device_index=device.index or 0,
                                                compute_type=self.compute_type, intra_threads=threads,
                                                inter_threads=1)
        self._ct2 = ctranslate2
        self.special = SpecialTokens.read(self.model_dir)
        self.multilingual = bool(self.model.is_multilingual)
        self.tasks = ("transcribe", "translate") if self.multilingual and self.special.translate is not None \
            else ("transcribe",)
        self.filters = mel_filters(self.model.n_mels)
        tokenizer = Tokenizer.from_dir(self.model_dir)
        self.vocab_size = tokenizer.vocab_size
        # The bytes of each token, for the compression ratio of a window's text (a repetition loop compresses well)
        # without turning tokens into text here.
        self._token_bytes = tokenizer.id_to_bytes
        cfg = orjson.loads((self.model_dir / "config.json").read_bytes())
        self.suppress_ids = list(cfg.get("suppress_ids") or [-1])

    def token_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self._token_bytes(t) for t in ids)

    def features(self, pcm: torch.Tensor) -> torch.Tensor:
        """The log-mel spectrogram of a recording's int16 samples."""
        return log_mel(pcm, self.filters)

    def _storage(self, windows: list[torch.Tensor]):
        batch = torch.stack(windows).contiguous().numpy()
        return self._ct2.StorageView.from_array(batch)

    def encode(self, windows: list[torch.Tensor]):
        """The encoder's output for a batch of 30 s windows (``[n_mels, 3000]`` each), on the model's device."""
        return self.model.encode(self._storage(windows), to_cpu=False)

    def detect_language(self, encoded) -> list[tuple[str, float]]:
        """Each window's most likely language code and its probability."""
        out = []
        for ranked in self.model.detect_language(encoded):
            token, p = ranked[0]
            out.append((token[2:-2], float(p)))
        return out

    def generate(self, encoded, prompts: list[list[int]], temperature: float, timestamps: bool) -> list[Decoded]:
        """Decode every window after its prompt (every prompt has its start-of-transcript token at one position:
        CTranslate2 needs it so): greedy at temperature 0, else sampling over the whole vocabulary."""
        sampling = {"sampling_temperature": temperature, "sampling_topk": 0} if temperature > 0 else {}
        results = self.model.generate(
            encoded, prompts, beam_size=1, return_scores=True, return_no_speech_prob=True,
            max_length=MAX_LENGTH, suppress_blank=True, suppress_tokens=self.suppress_ids,
            max_initial_timestamp_index=50 if timestamps else 0, **sampling)
        out = []
        for r in results:
            tokens = [t for t in r.sequences_ids[0] if t != self.special.eot]
            # ``scores`` is the sum of the log probabilities divided by the length; Whisper's mean counts one more.
            n = len(tokens)
            total = r.scores[0] * max(n, 1) if r.scores else 0.0
            out.append(Decoded(tokens, total / (n + 1), float(r.no_speech_prob)))
        return out

    def token_times(self, encoded_one, start: list[int], text_tokens: list[int], frames: int) -> list[float] | None:
        """When each text token of one window is spoken, from the cross-attention of the alignment heads (dynamic time
        warping in CTranslate2): ``len(text_tokens) + 1`` times in seconds from the window's start (the last one the
        end of the last token), or None when the alignment does not cover the tokens."""
        if not text_tokens:
            return None
        result = self.model.align(encoded_one, start, [text_tokens], [frames], median_filter_width=7)[0]
        pairs = result.alignments
        if not pairs:
            return None
        text_index = np.array([p[0] for p in pairs])
        time_index = np.array([p[1] for p in pairs])
        jumps = np.concatenate([[True], np.diff(text_index) != 0])
        times = (time_index[jumps] * TIME_PRECISION).tolist()
        if len(times) < len(text_tokens) + 1:
            return None
        return [float(t) for t in times[: len(text_tokens) + 1]]

    def select(self, encoded, rows: list[int]):
        """The encoder output of some windows of a batch (a StorageView sliced through torch or numpy)."""
        if len(rows) == encoded.shape[0]:
            return encoded
        if self.device.type == "cuda":
            t = torch.as_tensor(encoded, device=self.device)[rows].contiguous()
            return self._ct2.StorageView.from_array(t)
        return self._ct2.StorageView.from_array(np.ascontiguousarray(np.asarray(encoded)[rows]))
