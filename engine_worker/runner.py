"""The model runner: one forward pass over every scheduled sequence, then sampling.

This is the boundary between the scheduler (which decides *which* sequences run and owns their
token lists) and the tensors. Each ``execute`` call flattens all sequences of the step (prefill
chunks and decodes mixed) into one token batch, runs the model once, computes logits only for
the rows that sample, and samples them all together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine_worker.kv_cache import SlotKVCache
from engine_worker.loader import LoadedModel
from engine_worker.sampler import SampleOut, Sampler
from protocol.messages import SamplingParams

__all__ = ["ModelRunner", "SampleOut", "SeqInput"]

log = logging.getLogger(__name__)


@dataclass
class SeqInput:
    slot: int  # KV slot the sequence owns
    new_token_ids: list[int]  # whole prompt / a chunk of it on prefill, [last] on decode
    start_pos: int  # tokens of this sequence already in the KV cache
    sampling: SamplingParams
    past_output_ids: list[int] = field(default_factory=list)  # generated so far (penalties, min_tokens)
    prompt_ids: list[int] = field(default_factory=list)  # full prompt (repetition penalty)
    sample: bool = True  # False for a non-final prefill chunk: fill the cache, sample nothing
    generator: torch.Generator | None = None  # seeded requests; filled in by the runner if None


class ModelRunner:
    """Owns the model, its KV cache and the sampler for one engine; the scheduler drives it.

    Slots come from ``allocate_slot`` (None when full) and go back with ``free_slot``. Every
    ``execute`` is one forward pass over all given sequences; it returns, per sequence, the token
    sampled after its last new token (or None when ``sample`` is False).
    """

    def __init__(self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, max_num_seqs: int, max_model_len: int):
        cfg = loaded.config
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {cfg.max_position_embeddings}")
        if max_num_seqs < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs and max_model_len must be positive")
        model = loaded.model
        if not model.packed:
            model.to(device=device, dtype=dtype)  # a no-op when the loader already used these
            model.dtype = dtype
        elif model.dtype != dtype or model.embed_weight.device != device:
            raise ValueError("this model's weights were packed for another runner's device/dtype; load it again")
        # On a CPU, oneDNN-prepacked weights make every linear layer 2-4x faster.
        self.packed = device.type == "cpu" and model.pack_for_cpu()
        if device.type == "cpu" and not self.packed:
            log.warning("model %s: oneDNN weight packing is unavailable in this torch build; "
                        "running plain F.linear (about 2x slower decode)", loaded.model_id)
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = list(loaded.eos_token_ids)
        self.model_id = loaded.model_id
        self.kv = SlotKVCache(cfg.num_layers, max_num_seqs, cfg.num_kv_heads, max_model_len, cfg.head_dim, dtype, device)
        self.sampler = Sampler(cfg.vocab_size, self.eos_token_ids, device)
        # Generators of seeded requests whose SeqInput came without one, kept per slot.
        self._slot_generators: dict[int, torch.Generator] = {}

    # -- slots ---------------------------------------------------------------------------------

    def allocate_slot(self) -> int | None:
        return self.kv.allocate()

    def free_slot(self, slot: int) -> None:
        self.kv.free(slot)
        self._slot_generators.pop(slot, None)

    @property
    def kv_used(self) -> float:
        """Fraction of KV capacity in use (for EngineStats)."""
        return self.kv.num_used / self.max_num_seqs

    def make_generator(self, seed: int) -> torch.Generator:
        return self.sampler.make_generator(seed)

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> list[SampleOut | None]:
        """Run every sequence through the model in one forward pass; None where ``sample`` is False."""
        if not seqs:
            return []
        for s in seqs:
            if not s.new_token_ids:
                raise ValueError(f"slot {s.slot}: no new tokens to run")
        layout = self.kv.plan([(s.slot, s.start_pos, len(s.new_token_ids)) for s in seqs])
        flat: list[int] = []
        for i in layout.order:
            flat.extend(seqs[i].new_token_ids)
        ids = torch.tensor(flat, dtype=torch.long)
        if min(flat) < 0 or max(flat) >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        hidden = self.model(ids.to(self.device), layout, self.kv)

        sampled = [i for i, s in enumerate(seqs) if s.sample]
        results: list[SampleOut | None] = [None] * len(seqs)
        if not sampled:
            return results
        rows = torch.tensor([layout.last_token_index[i] for i in sampled], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        for i in sampled:
            self._ensure_generator(seqs[i])
        for i, out in zip(sampled, self.sampler.sample(logits, [seqs[i] for i in sampled])):
            results[i] = out
        return results

    def _ensure_generator(self, seq: SeqInput) -> None:
        """Give a seeded sequence its generator, created from the seed on its first sampled token."""
        if seq.generator is not None or seq.sampling.seed is None:
            return
        gen = self._slot_generators.get(seq.slot)
        if gen is None or not seq.past_output_ids:  # a new request in this slot starts afresh
            gen = self.make_generator(seq.sampling.seed)
            self._slot_generators[seq.slot] = gen
        seq.generator = gen
