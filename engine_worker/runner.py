"""The model runner: one forward pass over every scheduled sequence, then sampling.

This is the boundary between the scheduler (which decides *which* sequences run, owns their
token lists and their KV blocks) and the tensors. Each ``execute`` call flattens all sequences
of the step (prefill chunks and decodes mixed) into one token batch, runs the model once,
computes logits only for the rows that are sampled (or asked for prompt logprobs), and samples
them all together.

The runner owns the paged KV cache and sizes it (``kv_cache_bytes`` or enough for
``max_num_seqs`` full-length requests); ``num_blocks`` and ``block_size`` tell the scheduler, whose
``BlockManager`` hands the blocks out, how big the pool is. The runner itself only reads the block
tables each step's ``SeqInput``s carry. The attention backend that reads the cache is chosen once,
here (``attention.select_backend``).

With ``max_loras`` the runner serves LoRA adapters (``engine_worker.lora``): ``loras`` holds them, and each
step hands it the token rows of every adapter among the step's sequences. A step with adapters runs eagerly
(the decode graphs were captured without them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine_worker.attention import AttentionBackend, SeqLayout, select_backend
from engine_worker.cuda_graphs import DecodeGraphs
from engine_worker.grammar import GrammarHandle, start_masks
from engine_worker.kv_cache import PagedKVCache
from engine_worker.loader import LoadedModel
from engine_worker.lora import LoraError, LoraManager, LoraStep
from engine_worker.sampler import PromptLogprobs, SampleOut, Sampler
from protocol.messages import SamplingParams

__all__ = ["ModelRunner", "PromptLogprobs", "SampleOut", "SeqInput"]

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
# Without --kv-cache-memory the pool holds max_num_seqs full-length requests, but never more
# than this share of the free memory (several engines may share a host).
DEFAULT_MAX_MEMORY_FRACTION = 0.25


@dataclass
class SeqInput:
    block_table: list[int]  # KV blocks of the sequence, covering start_pos + len(new_token_ids)
    new_token_ids: list[int]  # a prompt chunk on prefill (or recompute), [last] on decode
    start_pos: int  # tokens of this sequence already in the KV cache
    sampling: SamplingParams
    past_output_ids: list[int] = field(default_factory=list)  # generated so far (penalties, min_tokens)
    prompt_ids: list[int] = field(default_factory=list)  # full prompt (repetition penalty, prompt logprobs)
    sample: bool = True  # False for a non-final prefill chunk: fill the cache, sample nothing
    grammar: GrammarHandle | None = None  # structured output: the tokens it allows are the only candidates
    # Prompt logprobs of the tokens following the first ``prompt_logprobs_rows`` new tokens.
    prompt_logprobs_rows: int = 0
    pool: bool = False  # an embedding request: at its last token, return the hidden state, sample nothing
    lora: str | None = None  # the LoRA adapter its tokens run through; None: the base model


class ModelRunner:
    """Owns the model, its paged KV cache and the sampler for one engine."""

    def __init__(self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, max_num_seqs: int,
                 max_model_len: int, *, block_size: int = DEFAULT_BLOCK_SIZE, kv_cache_bytes: int | None = None,
                 num_blocks: int | None = None, cuda_graphs: bool | None = None,
                 attention: str | None = None, expert_parallel: bool = False, fit_context: bool = False,
                 max_loras: int = 0, max_lora_rank: int = 16, max_cpu_loras: int | None = None):
        """``cuda_graphs``: capture decode steps (default: on CUDA when the attention backend reads
        the pool through block tables, i.e. Triton). ``True`` on a CPU runs the graph path in
        emulation, for tests. ``attention``: a backend name of ``attention.BACKENDS`` instead of
        the best available one (tests, benchmarks). ``expert_parallel``: the model's experts are split
        across a group (``set_group``); every step is then a group step, and no decode graphs are captured
        (the MoE collectives run between the graph's kernels). ``fit_context``: a KV cache that holds fewer tokens
        than ``max_model_len`` lowers it to what the cache holds (the server's default context, vLLM's rule)
        instead of refusing to start. ``max_loras``: serve LoRA adapters, up to this many in one step, of rank up to
        ``max_lora_rank``, with ``max_cpu_loras`` kept read in host memory (``LoraManager``; 0: none)."""
        cfg = loaded.config
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of "
                             f"{cfg.max_position_embeddings}")
        if max_num_seqs < 1 or max_model_len < 1 or block_size < 1:
            raise ValueError("max_num_seqs, max_model_len and block_size must be positive")
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
        self.quantization = loaded.quantization  # (a reload of the weights asks for the same)
        self.block_size = block_size

        per_block = PagedKVCache.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        if num_blocks is None:
            if kv_cache_bytes is None:
                from engine_worker.device import free_memory_bytes

                want = max_num_seqs * -(-max_model_len // block_size)
                cap = int(DEFAULT_MAX_MEMORY_FRACTION * free_memory_bytes(device)) // per_block
                num_blocks = max(1, min(want, cap))
            else:
                num_blocks = kv_cache_bytes // per_block
        if fit_context and 0 < num_blocks * block_size < max_model_len:
            max_model_len = self.max_model_len = num_blocks * block_size
        if num_blocks * block_size < max_model_len:
            need = -(-max_model_len // block_size) * per_block
            raise ValueError(f"the KV cache holds {num_blocks} blocks of {block_size} tokens, less than one "
                             f"max_model_len={max_model_len} request; give --kv-cache-memory at least {need} bytes")
        want_graphs = (device.type == "cuda" if cuda_graphs is None else cuda_graphs) and not expert_parallel
        self.group = None  # the ExpertGroup of an expert-parallel engine, once formed
        # With graphs, one block more than the block manager knows: padding rows write there.
        self.kv = PagedKVCache(cfg.num_layers, num_blocks + int(want_graphs), block_size, cfg.num_kv_heads,
                               cfg.head_dim, dtype, device)
        self.attention: AttentionBackend = select_backend(self.kv, cfg.num_heads, cfg.sliding_window, attention)
        # Native CPU kernels (norms, RoPE, SwiGLU) go with the native decode attention.
        model.use_native_kernels(self.attention.native_kernels)
        self.num_blocks = num_blocks  # the pool the scheduler's block manager hands out
        self.kv_cache_bytes = num_blocks * per_block
        self.sampler = Sampler(cfg.vocab_size, self.eos_token_ids, device)
        self.loras = LoraManager(model, max_loras, max_lora_rank, max_cpu_loras) if max_loras else None
        self.graphs: DecodeGraphs | None = None
        if want_graphs and self.attention.paged:
            self.graphs = self._capture_graphs(-(-max_model_len // block_size), scratch_block=num_blocks)

    def _capture_graphs(self, max_blocks: int, scratch_block: int) -> DecodeGraphs | None:
        """Capture decode graphs, then replay one step against the eager forward pass; None (and
        eager decoding) on any error or difference."""
        graphs = DecodeGraphs(self.model, self.attention, self.max_num_seqs, max_blocks, scratch_block)
        try:
            graphs.capture()
            # Rows 0..n-1 at positions 0..n-1 of the scratch block: a real decode step, with no
            # padding rows, that touches no block the block manager can hand out.
            n = max(s for s in graphs.sizes if s <= self.block_size)
            ids = [(17 * i + 5) % self.vocab_size for i in range(n)]
            seqs = [SeqLayout([scratch_block], i, 1) for i in range(n)]
            with torch.inference_mode():
                layout = self.attention.plan(seqs)
                got = graphs.run(ids, layout.positions, layout.slot_mapping, layout.decode_tables,
                                 layout.decode_lens).clone()
                want = self.model(torch.tensor(ids, device=self.device), layout, self.attention)
            err = (got.float() - want.float()).abs().max().item()
            if not err <= 1e-3 * max(1.0, want.float().abs().max().item()):
                raise RuntimeError(f"graph replay differs from eager by {err:.3g}")
        except Exception as e:
            log.warning("CUDA graphs disabled, decoding eagerly: %s", e)
            graphs.release()
            return None
        log.info("decode CUDA graphs %s for batch sizes %s", "emulated" if graphs.emulated else "captured",
                 graphs.sizes)
        return graphs

    @property
    def attention_backend(self) -> str:
        """How decode attention runs here, for logs: native CPU kernels, Triton, FlexAttention, or torch."""
        graphs = self.graphs is not None and not self.graphs.emulated
        return self.attention.description + (", CUDA graphs" if graphs else "")

    def use_attention(self, name: str) -> None:
        """Switch to the attention backend ``name`` (benchmarks comparing paths on one runner). The
        decode graphs were captured with the old one: they are dropped."""
        if name == self.attention.name:
            return
        cfg = self.model.config
        self.attention = select_backend(self.kv, cfg.num_heads, cfg.sliding_window, name)
        self.model.use_native_kernels(self.attention.native_kernels)
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def set_group(self, group) -> None:
        """Run the MoE layers across ``group`` (an ``ExpertGroup``, or None while the engine is in none)."""
        self.group = group
        self.model.set_expert_group(group)

    def idle_step(self) -> int:
        """An expert-parallel engine's step without work of its own (``ExpertGroup.idle_step``)."""
        return self.group.idle_step(self.model)

    # -- one step ------------------------------------------------------------------------------

    def _lora_step(self, seqs: list[SeqInput], order: list[int], first: list[int]) -> LoraStep | None:
        """The step's adapters and their token rows (sequences in flat-batch ``order``); None without any."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for i in order:
            s = seqs[i]
            if s.lora is not None:
                spans.setdefault(s.lora, []).append((first[i], first[i] + len(s.new_token_ids)))
        if not spans:
            return None
        if self.loras is None:
            raise LoraError("this engine serves no LoRA adapters")
        return self.loras.step(spans)

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> list[SampleOut | None]:
        """Run every sequence through the model in one forward pass.

        Per sequence: its sampled token (``sample``) and/or its prompt logprobs
        (``prompt_logprobs_rows``), or None when neither was asked for.
        """
        if not seqs:
            return []
        for s in seqs:
            if not s.new_token_ids:
                raise ValueError("a scheduled sequence has no new tokens to run")
            if s.start_pos + len(s.new_token_ids) > self.max_model_len:
                raise ValueError(f"{s.start_pos} cached + {len(s.new_token_ids)} new tokens exceed "
                                 f"max_model_len={self.max_model_len}")
        layout = self.attention.plan([SeqLayout(s.block_table, s.start_pos, len(s.new_token_ids)) for s in seqs])
        flat: list[int] = []
        for i in layout.order:
            flat.extend(seqs[i].new_token_ids)
        if min(flat) < 0 or max(flat) >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        ids = torch.tensor(flat, dtype=torch.long)
        if self.group is not None:
            self.group.begin_step(len(flat))
        pooled = [i for i, s in enumerate(seqs) if s.sample and s.pool]
        sampled = [i for i, s in enumerate(seqs) if s.sample and not s.pool]
        lora = self._lora_step(seqs, layout.order, layout.first_token_index)
        constrained = [seqs[i].grammar for i in sampled if seqs[i].grammar is not None]
        masks = start_masks(constrained, self.vocab_size) if constrained else None  # during the forward pass
        if (lora is None and self.graphs is not None and layout.num_decode == len(seqs)
                and self.graphs.fits(len(seqs), layout.decode_tables.shape[1])):
            hidden = self.graphs.run(flat, layout.positions, layout.slot_mapping, layout.decode_tables,
                                     layout.decode_lens)
        else:
            hidden = self.model(ids.to(self.device), layout, self.attention, lora)

        with_prompt = [i for i, s in enumerate(seqs) if s.prompt_logprobs_rows > 0]
        results: list[SampleOut | None] = [None] * len(seqs)
        if pooled:  # last-token pooling: the hidden state the LM head would read, after the final norm
            vectors = self.model.norm(hidden[torch.tensor([layout.last_token_index[i] for i in pooled],
                                                          device=self.device)]).float().cpu()
            for i, v in zip(pooled, vectors.unbind(0)):
                results[i] = SampleOut(None, None, None, None, pooled=v)
        if not sampled and not with_prompt:
            return results
        rows = [layout.last_token_index[i] for i in sampled]
        for i in with_prompt:
            first = layout.first_token_index[i]
            rows.extend(range(first, first + seqs[i].prompt_logprobs_rows))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

        if sampled:
            outs = self.sampler.sample(logits[: len(sampled)], [seqs[i] for i in sampled],
                                       allowed=masks.result() if masks is not None else None)
            for i, out in zip(sampled, outs):
                results[i] = out
        at = len(sampled)
        for i in with_prompt:
            s = seqs[i]
            n = s.prompt_logprobs_rows
            # Row j predicts the prompt token after new token j.
            pos = s.start_pos
            targets = s.prompt_ids[pos + 1 : pos + 1 + n]
            plp = self.sampler.prompt_logprobs(logits[at : at + n], targets, s.sampling.prompt_logprobs or 0)
            at += n
            if results[i] is None:
                results[i] = SampleOut(None, None, None, None)
            results[i].prompt = plp  # type: ignore[union-attr]
        return results
