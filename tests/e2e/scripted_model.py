"""A tiny "scripted" Llama whose output is fixed in advance: chosen by the prompt's last token.

End-to-end tests of tool calling and reasoning need a real model that deterministically writes,
say, ``<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>``.
``build_scripted_model(root)`` writes one as an ordinary Hugging Face directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) that ``launch api-server
--model DIR`` serves through the real loader, engine and gateway.

The model is an exact bigram table: the next token depends on the current token only.

* One decoder layer whose attention ``o_proj`` and MLP ``down_proj`` are all zeros, so the
  residual stream at every position is exactly the token's embedding (attention and MLP add 0).
* Hidden dimension 0 is a constant "bias": every embedding row, including those of ordinary text
  tokens, holds ``BIAS`` there. Every other dimension stands for one *successor* token: a script
  token whose successor is ``s`` holds ``1.0`` in ``s``'s dimension (tokens with the same
  successor share it). All other entries are zero.
* The final RMSNorm (weight ones, eps 1e-5) scales a row to root-mean-square 1: an ordinary token
  (``BIAS`` alone) becomes ``sqrt(64) = 8`` on dimension 0; a script token (``BIAS`` and ``1.0``,
  both 1) becomes ``8 / sqrt(2) = 5.66`` on both. The eps changes these by < 0.1%.
* The untied ``lm_head`` maps dimension 0 to EOS with weight ``EOS_WEIGHT`` (8) and a successor
  dimension to its successor with weight ``SUCCESSOR_WEIGHT`` (20); everything else is zero. So
  after an ordinary token EOS scores 64 and every other token 0; after a script token its
  successor scores 113, EOS 45 and every other token 0. The winner leads by about 64 nats or
  more: sampled at temperature 1.0, all other tokens together have probability < 49173 * e^-64
  (~1e-23); even at temperature 2.0, < 1e-9.

Hence: the last prompt token selects a script; a script runs token by token to EOS
(``<|im_end|>``, id 2); any token outside the scripts predicts EOS at once.

Tokenizer: SmolLM2's byte-level BPE plus non-special added tokens (``AddedToken(...,
normalized=False, special=False)``), one per whole script fragment, e.g. the entire
``{"name": "get_weather", "arguments": {"city": "Paris"}}``. ``tokenizers`` matches added tokens
leftmost-longest in raw text, so ``<tool_call>\\n{"name": ...`` in a prompt becomes the single
long token, not ``<tool_call>\\n`` plus the rest. Within the scripts every token is distinct
unless it has the same successor wherever it occurs (``</tool_call>`` and ``\\n</tool_call>``
are always followed by EOS). The story script uses ordinary vocabulary tokens (`` Once``,
`` upon`` ...) so that byte-level decoding is exercised too; those few tokens therefore have
successors whenever they end a prompt.

Chat template (in ``tokenizer_config.json``, ChatML-like)::

    [<|im_start|>system\\n<tools>\\n{tool | tojson}\\n...</tools><|im_end|>\\n]      (when tools)
    <|im_start|>{role}\\n{content}[<tool_call>{"name": N, "arguments": A}</tool_call>...]<|im_end|>\\n
    ...
    <|im_start|>{role}\\n{content of the LAST message}                    <- the prompt ends here

Every message but the last is closed with ``<|im_end|>\\n``; the last message is left open and no
assistant header follows, with or without ``add_generation_prompt``. The prompt's last token is
therefore the last token of the last message: a user (or tool) message ending in a trigger
(``"What is the weather? [weather?]"``) selects that trigger's script, and with
``continue_final_message`` (whether the server renders it as is or cuts the text after the final
message's content, as transformers does) the model continues the final assistant message from
its last token. Assistant messages render their ``tool_calls`` (``content`` may be null or
absent) as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks, with OpenAI's
string ``arguments`` written verbatim and dict arguments through ``tojson``; ``tool`` messages
render like any other role.

Forced tool calls: a server appends a parser's prefill to the prompt. The hermes prefill for
``tool_choice="required"`` is ``<tool_call>\\n`` (``REQUIRED_PREFILL``), whose successor is the
Berlin call of the two-calls script; the prefill for a named function,
``<tool_call>\\n{"name": "get_weather", "arguments": `` (``NAMED_PREFILL``), is one token too
and continues with ``{"city": "Paris"}}`` and ``\\n</tool_call>``. One consequence of the longest
match: re-encoding the two-calls script's *text* does not give back the ids the model wrote
(``NAMED_PREFILL`` swallows the start of the Berlin call), though it decodes to the same text and
ends in the same token; only generated ids are ever decoded, and only a prompt's last token
matters, so this is harmless.

This module imports no torch at import time: tests import the constants cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path

# -- the scripts ---------------------------------------------------------------------------------

EOS_TOKEN = "<|im_end|>"  # SmolLM2's id 2; every script ends in it
BOS_TOKEN = "<|im_start|>"  # id 1

WEATHER_TRIGGER = "[weather?]"
TWO_CALLS_TRIGGER = "[weather x2?]"
THINK_TRIGGER = "[think?]"
TOOL_RESULT_TRIGGER = "[sunny]"
STORY_TRIGGER = "[story]"

# Prefills a server appends to the prompt for forced tool calls (hermes format).
REQUIRED_PREFILL = "<tool_call>\n"
NAMED_PREFILL = '<tool_call>\n{"name": "get_weather", "arguments": '

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

PARIS_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
BERLIN_CALL = '{"name": "get_weather", "arguments": {"city": "Berlin"}}'
ROME_CALL = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
PARIS_ARGUMENTS = '{"city": "Paris"}'

TWO_CALLS_CONTENT = "Checking both."  # the two-calls script's text outside its calls
REASONING = "The user wants the capital."
ANSWER = "The capital is Paris."
TOOL_RESULT_ANSWER = "It is sunny in Paris."

# Ordinary SmolLM2 vocabulary tokens (each one id), all distinct.
STORY_TOKENS = (" Once", " upon", " a", " time", " there", " was", " one", " small", " robot", ".")

# Each script: the token that selects it, then the tokens the model writes (EOS follows the last).
SCRIPTS: dict[str, tuple[str, ...]] = {
    WEATHER_TRIGGER: ("<tool_call>", PARIS_CALL, "</tool_call>"),
    TWO_CALLS_TRIGGER: (TWO_CALLS_CONTENT, REQUIRED_PREFILL, BERLIN_CALL, "\n</tool_call>\n<tool_call>\n", ROME_CALL,
                        "\n</tool_call>"),
    THINK_TRIGGER: ("<think>", REASONING, "</think>", ANSWER),
    TOOL_RESULT_TRIGGER: (TOOL_RESULT_ANSWER,),
    STORY_TRIGGER: STORY_TOKENS,
    NAMED_PREFILL: (PARIS_ARGUMENTS + "}", "\n</tool_call>"),
}


def _expected() -> dict[str, str]:
    out: dict[str, str] = {}
    for start, chain in SCRIPTS.items():
        out[start] = "".join(chain)
        for i, tok in enumerate(chain[:-1]):  # every script token continues its script
            out.setdefault(tok, "".join(chain[i + 1:]))
    return out


# The exact text each prompt-ending token makes the model write (then it stops with EOS): the
# scripts' starts and every script token that has a successor other than EOS.
EXPECTED: dict[str, str] = _expected()

EXPECTED_WEATHER = EXPECTED[WEATHER_TRIGGER]
# '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
EXPECTED_TWO_CALLS = EXPECTED[TWO_CALLS_TRIGGER]
# 'Checking both.<tool_call>\n{..Berlin..}\n</tool_call>\n<tool_call>\n{..Rome..}\n</tool_call>'
EXPECTED_THINK = EXPECTED[THINK_TRIGGER]
# '<think>The user wants the capital.</think>The capital is Paris.'
EXPECTED_TOOL_RESULT = EXPECTED[TOOL_RESULT_TRIGGER]  # 'It is sunny in Paris.'
EXPECTED_STORY = EXPECTED[STORY_TRIGGER]  # ' Once upon a time there was one small robot.'
EXPECTED_AFTER_REQUIRED_PREFILL = EXPECTED[REQUIRED_PREFILL]
# '{..Berlin..}\n</tool_call>\n<tool_call>\n{..Rome..}\n</tool_call>'
EXPECTED_AFTER_NAMED_PREFILL = EXPECTED[NAMED_PREFILL]  # '{"city": "Paris"}}\n</tool_call>'

# What a hermes tool-call parser should make of each output ({"name": ..., "arguments": {...}}
# per call, in order); for the forced-call prefills, of the prefill followed by the output.
EXPECTED_CALLS: dict[str, list[dict]] = {
    WEATHER_TRIGGER: [json.loads(PARIS_CALL)],
    TWO_CALLS_TRIGGER: [json.loads(BERLIN_CALL), json.loads(ROME_CALL)],
    REQUIRED_PREFILL: [json.loads(BERLIN_CALL), json.loads(ROME_CALL)],
    NAMED_PREFILL: [json.loads(PARIS_CALL)],
}

TRIGGERS = (WEATHER_TRIGGER, TWO_CALLS_TRIGGER, THINK_TRIGGER, TOOL_RESULT_TRIGGER, STORY_TRIGGER)

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- if not loop.last %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)

# -- the weights ---------------------------------------------------------------------------------

HIDDEN = 64
INTERMEDIATE = 128
BIAS = 1.0  # embedding value on dimension 0 for every token
EOS_WEIGHT = 8.0  # lm_head[EOS, 0]
SUCCESSOR_WEIGHT = 20.0  # lm_head[successor, its dimension]
RMS_NORM_EPS = 1e-5


def added_tokens() -> list[str]:
    """Every script string that becomes an added token (all but the story's vocabulary tokens)."""
    out: list[str] = []
    for start, chain in SCRIPTS.items():
        for s in (start, *chain):
            if s not in STORY_TOKENS and s not in out:
                out.append(s)
    return out


def successor_table(token_id) -> dict[int, int]:
    """Token id -> the id the model writes after it, for every script token (``token_id(str)``)."""
    eos = token_id(EOS_TOKEN)
    table: dict[int, int] = {}
    for start, chain in SCRIPTS.items():
        seq = [token_id(s) for s in (start, *chain)] + [eos]
        for a, b in zip(seq, seq[1:]):
            if table.setdefault(a, b) != b:
                raise ValueError(f"token {a} has two successors ({table[a]} and {b}): scripts must not share it")
    return table


def build_tokenizer():
    """SmolLM2's tokenizer with the scripts' added tokens (a ``zserve.tokenizer.Tokenizer``)."""
    from tokenizers import AddedToken

    from zserve.catalog import smollm2_gguf_path
    from zserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(str(smollm2_gguf_path()))
    if tok.eos_token != EOS_TOKEN or tok.bos_token != BOS_TOKEN:
        raise ValueError(f"unexpected SmolLM2 special tokens {tok.bos_token!r}/{tok.eos_token!r}")
    for s in STORY_TOKENS:
        if len(tok.encode(s)) != 1:
            raise ValueError(f"story token {s!r} is not one SmolLM2 token")
    base = tok.vocab_size
    new = added_tokens()
    tok.backend.add_tokens([AddedToken(s, normalized=False, special=False) for s in new])
    # (``tok`` knows the vocabulary it was built with; the Tokenizer returned below knows the new one.)
    if tok.backend.get_vocab_size(with_added_tokens=True) != base + len(new):
        raise ValueError("some script strings were already tokens")
    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     chat_template=CHAT_TEMPLATE)


def build_scripted_model(root: Path) -> Path:
    """Write the scripted model's Hugging Face directory into ``root`` (created); return ``root``."""
    import torch
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.vocab_size

    def token_id(s: str) -> int:
        ids = tok.encode(s)
        if len(ids) != 1:
            raise ValueError(f"script token {s!r} encodes to {len(ids)} tokens")
        return ids[0]

    table = successor_table(token_id)
    eos = token_id(EOS_TOKEN)
    dims = {succ: 1 + i for i, succ in enumerate(dict.fromkeys(table.values()))}
    if len(dims) >= HIDDEN:
        raise ValueError(f"{len(dims)} successors do not fit in {HIDDEN - 1} hidden dimensions")

    embed = torch.zeros(vocab, HIDDEN)
    embed[:, 0] = BIAS
    lm_head = torch.zeros(vocab, HIDDEN)
    lm_head[eos, 0] = EOS_WEIGHT
    for tid, succ in table.items():
        embed[tid, dims[succ]] = 1.0
    for succ, d in dims.items():
        lm_head[succ, d] = SUCCESSOR_WEIGHT

    heads, kv_heads, head_dim = 4, 2, HIDDEN // 4
    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": lm_head,
        "model.norm.weight": torch.ones(HIDDEN),
        p + "input_layernorm.weight": torch.ones(HIDDEN),
        p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        p + "self_attn.q_proj.weight": torch.zeros(heads * head_dim, HIDDEN),
        p + "self_attn.k_proj.weight": torch.zeros(kv_heads * head_dim, HIDDEN),
        p + "self_attn.v_proj.weight": torch.zeros(kv_heads * head_dim, HIDDEN),
        p + "self_attn.o_proj.weight": torch.zeros(HIDDEN, heads * head_dim),
        p + "mlp.gate_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": torch.zeros(HIDDEN, INTERMEDIATE),
    }
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": vocab,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": eos,
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    tok.backend.save(str(root / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return root
