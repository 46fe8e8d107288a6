"""The GGUF weight cache (``engine_worker/weight_cache.py``): a second load reads the converted
weights back and computes exactly what the first computed; truncated, corrupt or stale files are
detected and rebuilt; concurrent loads leave a valid file; a directory that is not private is
refused (and the load still works)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_worker import weight_cache
from engine_worker.loader import load_model
from zserve.catalog import ModelNotFound, ModelSource, smollm2_gguf_path

from .hf_checkpoints import checkpoint_tensors

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_env(tmp_path, monkeypatch) -> Path:
    """A private cache home; small files cached too. Returns where the cache files go."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("ZSERVE_WEIGHT_CACHE_MIN_BYTES", "0")
    monkeypatch.delenv("ZSERVE_WEIGHT_CACHE", raising=False)
    return tmp_path / "xdg" / "zserve" / "weights"


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    from .test_loader_gguf import write_gguf

    return write_gguf(tmp_path / "tiny.gguf", "llama", checkpoint_tensors("llama"), quantize=True)


def _load(path: Path, dtype=torch.float32):
    return load_model(ModelSource(path.stem, "gguf", str(path), str(path)), dtype, torch.device("cpu"))


def _params(lm) -> list[torch.Tensor]:
    return [p.detach().clone() for p in lm.model.parameters()]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors")) if d.is_dir() else []


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("engine_worker"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_second_load_reads_the_cache_and_gives_the_same_weights(cache_env, tiny_gguf, caplog, dtype):
    caplog.set_level(logging.INFO, "engine_worker")
    first = _params(_load(tiny_gguf, dtype))
    assert "wrote" in _messages(caplog)
    (f,) = _files(cache_env)
    assert f.stat().st_mode & 0o777 == 0o600 and cache_env.stat().st_mode & 0o777 == 0o700
    assert not list(cache_env.glob("*.tmp"))
    caplog.clear()
    assert _same(_params(_load(tiny_gguf, dtype)), first)
    assert "weight cache: loaded" in _messages(caplog)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_cache_file_is_detected_and_rebuilt(cache_env, tiny_gguf, caplog, damage):
    first = _params(_load(tiny_gguf))
    (f,) = _files(cache_env)
    size = f.stat().st_size
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: size - 100]
    elif damage == "flip":
        data[-5] ^= 0xFF  # in the last tensor's data: only the checksum can tell
    else:
        data = bytearray()
    f.write_bytes(bytes(data))
    caplog.set_level(logging.INFO, "engine_worker")
    assert _same(_params(_load(tiny_gguf)), first)
    assert "unusable" in _messages(caplog) and "wrote" in _messages(caplog)
    assert f.stat().st_size == size
    caplog.clear()
    assert _same(_params(_load(tiny_gguf)), first)
    assert "weight cache: loaded" in _messages(caplog)


def test_a_changed_source_makes_the_cache_stale(cache_env, tiny_gguf, caplog):
    _load(tiny_gguf)
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # `touch`
    caplog.set_level(logging.INFO, "engine_worker")
    _load(tiny_gguf)
    assert "stale (mtime_ns" in _messages(caplog) and "wrote" in _messages(caplog)
    (f,) = _files(cache_env)  # replaced, not added
    key = weight_cache.source_key(tiny_gguf, torch.float32)
    assert weight_cache.read_info(f, key)["mtime_ns"] == key["mtime_ns"]


def test_each_dtype_has_its_own_file(cache_env, tiny_gguf, caplog):
    f32 = _params(_load(tiny_gguf, torch.float32))
    bf16 = _params(_load(tiny_gguf, torch.bfloat16))
    assert len(_files(cache_env)) == 2 and all(p.dtype == torch.bfloat16 for p in bf16)
    caplog.set_level(logging.INFO, "engine_worker")
    assert _same(_params(_load(tiny_gguf, torch.float32)), f32)
    assert _same(_params(_load(tiny_gguf, torch.bfloat16)), bf16)
    assert _messages(caplog).count("weight cache: loaded") == 2
    # A file under the other dtype's name (or an older conversion) is stale, not used.
    f = weight_cache.cache_path(cache_env, weight_cache.source_key(tiny_gguf, torch.float32))
    with pytest.raises(weight_cache.CacheError, match="stale"):
        weight_cache.read_info(f, weight_cache.source_key(tiny_gguf, torch.bfloat16))


_CHILD = """
import sys, torch
from engine_worker.loader import load_model
from zserve.catalog import ModelSource
p = sys.argv[1]
for _ in range(3):
    lm = load_model(ModelSource("t", "gguf", p, p), torch.float32, torch.device("cpu"))
print(float(sum(x.double().sum() for x in lm.model.parameters())))
"""


def test_concurrent_loads_both_succeed_and_leave_a_valid_file(cache_env, tiny_gguf, caplog):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(tiny_gguf)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]
    (f,) = _files(cache_env)
    assert not list(cache_env.glob("*.tmp"))
    caplog.set_level(logging.INFO, "engine_worker")
    lm = _load(tiny_gguf)
    assert "weight cache: loaded" in _messages(caplog) and "unusable" not in _messages(caplog)
    assert float(sum(x.double().sum() for x in lm.model.parameters())) == float(outs[0][0])


@pytest.mark.parametrize("how", ["world-writable", "other-owner"])
def test_a_cache_directory_that_is_not_private_is_refused(cache_env, tiny_gguf, caplog, how):
    first = _params(_load(tiny_gguf))
    (f,) = _files(cache_env)
    if how == "world-writable":
        cache_env.chmod(0o777)
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to give the directory to another user")
        os.chown(cache_env, 65534, 65534)
    caplog.set_level(logging.INFO, "engine_worker")
    assert _same(_params(_load(tiny_gguf)), first)  # loads as without a cache
    msgs = _messages(caplog)
    assert "not a private directory" in msgs and "weight cache: loaded" not in msgs and "wrote" not in msgs


def test_no_writable_cache_directory_or_disabled_loads_as_before(cache_env, tiny_gguf, tmp_path, monkeypatch,
                                                                  caplog):
    caplog.set_level(logging.INFO, "engine_worker")
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    first = _params(_load(tiny_gguf))
    assert "no writable cache directory" in _messages(caplog)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_env.parent.parent))
    monkeypatch.setenv("ZSERVE_WEIGHT_CACHE", "0")
    assert _same(_params(_load(tiny_gguf)), first)
    assert "disabled by ZSERVE_WEIGHT_CACHE" in _messages(caplog) and not _files(cache_env)


@pytest.mark.slow
def test_smollm2_from_the_cache_gives_the_same_logits_and_greedy_tokens(cache_env, monkeypatch, caplog):
    try:
        path = smollm2_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    monkeypatch.delenv("ZSERVE_WEIGHT_CACHE_MIN_BYTES")
    from engine_worker.attention import SeqLayout, select_backend
    from engine_worker.kv_cache import PagedKVCache

    def greedy(lm, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        cfg = lm.config
        attn = select_backend(PagedKVCache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                                           torch.device("cpu")))
        ids, first_logits = list(prompt), None
        with torch.inference_mode():
            for _ in range(steps):  # full recompute each step: simple, and exact
                x = lm.model(torch.tensor(ids), attn.plan([SeqLayout([0, 1, 2, 3], 0, len(ids))]), attn)
                logits = lm.model.compute_logits(x[-1:])
                first_logits = logits if first_logits is None else first_logits
                ids.append(int(logits.argmax()))
        return ids[len(prompt):], first_logits

    src = ModelSource("SmolLM2", "gguf", str(path), str(path))
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
    cold = greedy(load_model(src, torch.float32, torch.device("cpu")), prompt, 8)
    caplog.set_level(logging.INFO, "engine_worker")
    warm = greedy(load_model(src, torch.float32, torch.device("cpu")), prompt, 8)
    assert "weight cache: loaded" in _messages(caplog)
    assert warm[0] == cold[0] and torch.equal(warm[1], cold[1])


def test_temporary_files_of_dead_writers_are_removed(cache_env, tiny_gguf):
    _load(tiny_gguf)
    (f,) = _files(cache_env)
    old, fresh = cache_env / f"{f.stem}.dead.tmp", cache_env / f"{f.stem}.live.tmp"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (0, 0))
    f.unlink()
    _load(tiny_gguf)
    assert not old.exists() and fresh.exists() and f.exists()
