"""The gateway tokenizer built from SmolLM2's GGUF reproduces the reference tokenizer.

The oracle is transformers' tokenizer loaded from the same GGUF (test-only import). One known
difference is checked on its own: transformers' GGUF loader leaves out SmolLM2's individual-digit
pre-split, which only shows for a whitespace run right before a digit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zserve import tokenizer as tokenizer_module
from zserve.catalog import ModelNotFound, smollm2_gguf_path
from zserve.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]

CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
CHATML_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
              19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14159",
    "In 2024, 1,000,000 people paid $9.99 (or 10%) each.",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12))",
    'for (int i = 0; i < n; ++i) { s += a[i]; }\n\tif (s != 0) return "ok";',
    "Emoji: 😀🎉👍🏽 and flags 🇫🇷",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "Café naïve résumé Ångström façade Zürich",
    "tabs\tand   spaces    and\n\n\nnewlines\r\nwindows",
    "   leading and trailing   ",
    "",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "I'm sure they'll say it's fine, won't they?",
    "ŁÓDŹ ünïcödé ß ∑ ∫ √ π ≈ ∞",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return smollm2_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gguf_meta(gguf_path: Path) -> dict:
    # Reading the GGUF costs ~2 s: read it once and hand it to every build in this module.
    return tokenizer_module._read_gguf_tokenizer(str(gguf_path))


@pytest.fixture()
def gguf_reads(gguf_meta: dict, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Serve GGUF reads from ``gguf_meta``; the list records each read's path."""
    reads: list[str] = []

    def read(path: str) -> dict:
        reads.append(path)
        return gguf_meta

    monkeypatch.setattr(tokenizer_module, "_read_gguf_tokenizer", read)
    return reads


@pytest.fixture(scope="module")
def tok(gguf_path: Path, gguf_meta: dict, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    # The cache dir is shared with the other test modules of this session (they reuse this build).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer_module, "_read_gguf_tokenizer", lambda path: gguf_meta)
        return Tokenizer.from_gguf(gguf_path, cache_dir=str(tmp_path_factory.getbasetemp() / "tokenizer-cache"))


@pytest.fixture(scope="module")
def hf_tok(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def test_chatml_prompt_encodes_to_reference_ids(tok: Tokenizer) -> None:
    assert tok.encode(CHATML_PROMPT) == CHATML_IDS
    assert tok.decode(CHATML_IDS, skip_special_tokens=False) == CHATML_PROMPT


def test_special_tokens_come_from_the_gguf(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.bos_token) == (1, "<|im_start|>")
    assert (tok.eos_token_id, tok.eos_token) == (2, "<|im_end|>")
    assert tok.vocab_size == 49152
    assert tok.all_special_ids == set(range(17))  # the 17 control tokens, <|endoftext|> .. <empty_output>
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_add_special_tokens_adds_no_bos_because_the_gguf_says_so(tok: Tokenizer) -> None:
    assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello")


def test_decode_skips_special_tokens_by_default(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


def test_whitespace_run_before_a_digit_uses_smollm_digit_split(tok: Tokenizer) -> None:
    # SmolLM2's tokenizer.json and llama.cpp's "smollm" pre-tokenizer split digits off first, so the
    # spaces stay one run: "ĠĠ" "1", where a plain GPT-2 split would give "Ġ" "Ġ1" -> "Ġ" "Ġ" "1".
    assert tok.convert_ids_to_tokens(tok.encode("  1")) == ["ĠĠ", "1"]
    assert tok.convert_ids_to_tokens(tok.encode("   42 apples")) == ["ĠĠĠ", "4", "2", "Ġapples"]
    assert tok.convert_ids_to_tokens(tok.encode("a\n\n3")) == ["a", "ĊĊ", "3"]


def test_id_to_bytes_are_the_raw_bytes_of_each_token(tok: Tokenizer) -> None:
    ids = tok.encode("é😀<|im_end|>")
    assert [tok.id_to_bytes(i) for i in ids] == [b"\xc3\xa9", b"\xf0\x9f", b"\x98", b"\x80", b"<|im_end|>"]
    for text in CORPUS:
        assert b"".join(tok.id_to_bytes(i) for i in tok.encode(text)) == text.encode("utf-8")


def test_out_of_range_id_is_a_clear_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="out of range"):
        tok.convert_ids_to_tokens([10**6])


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_ids_and_decode_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_every_token_spells_as_in_transformers(tok: Tokenizer, hf_tok) -> None:
    everything = list(range(tok.vocab_size))
    assert tok.convert_ids_to_tokens(everything) == hf_tok.convert_ids_to_tokens(everything)
    assert tok.all_special_ids == {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    assert tok.chat_template == hf_tok.chat_template


@pytest.mark.slow
def test_merges_match_transformers_given_smollm2_pre_tokenizer(tok: Tokenizer, hf_tok) -> None:
    # Where transformers' GGUF loader splits text differently (see module docstring), giving its
    # independently built vocabulary/merges SmolLM2's pre-tokenizer must give our ids.
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    oracle = Backend.from_str(hf_tok.backend_tokenizer.to_str())
    oracle.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in ["  1", "   42 apples", "a\n\n3", "x  12", "\t\t7 days", *CORPUS]:
        assert tok.encode(text) == oracle.encode(text, add_special_tokens=False).ids, text


def test_cached_build_skips_the_gguf_and_encodes_the_same(
    gguf_path: Path, tok: Tokenizer, tmp_path: Path, gguf_reads: list[str]
) -> None:
    Tokenizer.from_gguf(gguf_path, cache_dir=str(tmp_path))
    assert len(gguf_reads) == 1
    cached = Tokenizer.from_gguf(gguf_path, cache_dir=str(tmp_path))
    assert len(gguf_reads) == 1, "the cache should have been used"
    assert cached.encode(CHATML_PROMPT) == CHATML_IDS
    assert (cached.bos_token_id, cached.eos_token_id, cached.chat_template) == (1, 2, tok.chat_template)
    assert cached.all_special_ids == tok.all_special_ids
    assert cached.model_max_length == tok.model_max_length == 8192  # llama.context_length: a render server's limit


def test_stale_or_corrupt_cache_is_rebuilt(gguf_path: Path, tmp_path: Path, gguf_reads: list[str]) -> None:
    Tokenizer.from_gguf(gguf_path, cache_dir=str(tmp_path))
    (cache_file,) = tmp_path.iterdir()

    entry = json.loads(cache_file.read_text())
    entry["key"]["mtime_ns"] -= 1  # as if the GGUF had changed since
    entry["config"]["bos_token_id"] = 99
    cache_file.write_text(json.dumps(entry))
    assert Tokenizer.from_gguf(gguf_path, cache_dir=str(tmp_path)).bos_token_id == 1
    assert len(gguf_reads) == 2

    cache_file.write_text("{not json")
    assert Tokenizer.from_gguf(gguf_path, cache_dir=str(tmp_path)).encode(CHATML_PROMPT) == CHATML_IDS
    assert len(gguf_reads) == 3
    assert json.loads(cache_file.read_text())["config"]["bos_token_id"] == 1  # rewritten


def test_unwritable_cache_dir_still_builds(gguf_path: Path, tmp_path: Path, gguf_reads: list[str]) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    assert Tokenizer.from_gguf(gguf_path, cache_dir=str(blocker)).encode(CHATML_PROMPT) == CHATML_IDS


def test_from_dir_loads_a_hugging_face_directory(tok: Tokenizer, tmp_path: Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>",
        "chat_template": tok.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.encode(CHATML_PROMPT) == CHATML_IDS
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    assert loaded.chat_template == tok.chat_template
    assert loaded.id_to_bytes(loaded.encode("😀")[0]) == b"\xf0\x9f"
    assert loaded.model_max_length is None  # neither config.json nor model_max_length says
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 1e30}))
    assert Tokenizer.from_dir(tmp_path).model_max_length is None  # HF's placeholder for "unset"
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert Tokenizer.from_dir(tmp_path).model_max_length == 2048


def test_gateway_text_never_imports_torch(gguf_path: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        import gateway.text
        from gateway.text import ChatTemplate, IncrementalDetokenizer, StopChecker, Tokenizer
        tok = Tokenizer.from_gguf({str(gguf_path)!r}, cache_dir={str(tmp_path)!r})  # cold: reads the GGUF
        tok = Tokenizer.from_gguf({str(gguf_path)!r}, cache_dir={str(tmp_path)!r})  # from the cache
        prompt = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token).render(
            [{{"role": "user", "content": "hi"}}])
        detok = IncrementalDetokenizer(tok)
        StopChecker(["x"]).push(detok.push(tok.encode(prompt)) + detok.flush())
        leaked = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        print("LEAKED", leaked)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "LEAKED []" in result.stdout
