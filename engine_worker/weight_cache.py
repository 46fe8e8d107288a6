"""A per-user cache of the weights a GGUF file converts to, so engines restart in seconds.

Loading a GGUF file costs seconds that have nothing to do with the weights' size on disk:
``GGUFReader`` parses the whole header (including ~50k tokenizer strings) and
``gguf.quants.dequantize`` unpacks Q4_1/Q8_0 blocks in numpy. The result — every tensor under its
Hugging Face name, Q/K un-permuted, cast to the engine's dtype — is written once to
``<user cache>/weights/<name>.safetensors`` and memory-mapped by later loads.

- **File**: a plain safetensors file (readable by any safetensors tool). Tensors are laid out in
  the model's ``weight_names()`` order, so the layout is fully determined by the model's config and
  the dtype; ``__metadata__`` holds the key, the two config facts the GGUF tensor list gives
  (``tied``, ``vocab_size``) and a CRC-32 per tensor (fixed-width hex, so the header's size is
  known before the data is written).
- **Name**: a hash of the source's real path and the dtype: one file per (source, dtype), so a
  stale file is replaced rather than left behind.
- **Key** (must match exactly, else the file is stale and rebuilt): the source's real path, size,
  ``mtime_ns``, inode and device, the dtype, ``CACHE_VERSION`` (bump it when the conversion
  changes) and the gguf package's version (it does the dequantizing).
- **Verification** on read: the key, the header's tensor list against the model's expected names,
  shapes and dtype (exact, contiguous offsets), the file's size, and each tensor's CRC-32 as it is
  copied into the model (~0.15 s/GB). Anything wrong: the caller logs it, converts the GGUF again
  and replaces the file.
- **Writing**: into a ``mkstemp`` file in the same directory, streamed tensor by tensor while the
  model loads (no second copy of the weights in memory), then ``os.replace`` — engines starting
  together each write their own file and the last rename wins; a reader keeps the inode it mapped.
  Temporary files of writers that died are removed after 10 minutes without a write.
- **Privacy**: the directory is made by ``zserve.paths.private_dir`` (0700, refused when owned by
  someone else or writable by group/others), as the CPU kernel cache's is.
- **Small files** (under ``ZSERVE_WEIGHT_CACHE_MIN_BYTES``, 16 MiB) are not cached.
- **No cache**: ``ZSERVE_WEIGHT_CACHE=0``, no writable cache directory, a refused directory or a
  failed write only log why; the load itself proceeds as without a cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from zserve.paths import private_dir, user_cache_dir

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when what the loader writes (names, layout, conversion) changes
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
_MAX_HEADER = 64 << 20
DEFAULT_MIN_BYTES = 16 << 20

Layout = list[tuple[str, tuple[int, ...]]]


class CacheError(Exception):
    """The cache file is unusable (stale, truncated or corrupt); the message says why."""


def enabled() -> bool:
    return os.environ.get("ZSERVE_WEIGHT_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def min_bytes() -> int:
    """GGUF files smaller than this (``ZSERVE_WEIGHT_CACHE_MIN_BYTES``, default 16 MiB) convert in
    well under a second and are not cached (test fixtures would only pile up in the cache)."""
    try:
        return max(0, int(os.environ.get("ZSERVE_WEIGHT_CACHE_MIN_BYTES", DEFAULT_MIN_BYTES)))
    except ValueError:
        return DEFAULT_MIN_BYTES


def cache_dir() -> Path | None:
    """``<user cache>/weights``, private to this user; None (with the reason logged) when unusable."""
    base = user_cache_dir()
    if base is None:
        log.warning("weight cache off: no writable cache directory ($XDG_CACHE_HOME or ~/.cache)")
        return None
    try:
        return Path(private_dir(os.path.join(base, "weights")))
    except OSError as e:
        log.warning("weight cache off: %s", e)
        return None


def source_key(source_path: str | Path, dtype: torch.dtype) -> dict[str, str]:
    """What the cached conversion depends on; any change makes a cached file stale."""
    import gguf

    real = os.path.realpath(source_path)
    st = os.stat(real)
    return {
        "cache_version": str(CACHE_VERSION),
        "source": real,
        "size": str(st.st_size),
        "mtime_ns": str(st.st_mtime_ns),
        "inode": str(st.st_ino),
        "device": str(st.st_dev),
        "dtype": str(dtype).removeprefix("torch."),
        "gguf": getattr(gguf, "__version__", "?"),
    }


def cache_path(directory: Path, key: dict[str, str]) -> Path:
    name = hashlib.sha256(f"{key['source']}\0{key['dtype']}".encode()).hexdigest()[:32]
    return directory / f"{name}.safetensors"


def _layout_header(key: dict[str, str], info: dict[str, str], layout: Layout, dtype: torch.dtype,
                   crcs: dict[str, int]) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The safetensors header (padded to 8 bytes) and each tensor's (name, start, end) in the data."""
    st_dtype = _ST_DTYPES[dtype]
    size = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {}
    spans = []
    off = 0
    for name, shape in layout:
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        spans.append((name, off, off + n))
        off += n
    crc_text = json.dumps({name: f"{crcs.get(name, 0):08x}" for name, _ in layout}, separators=(",", ":"))
    header["__metadata__"] = {**key, **info, "crc32": crc_text}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, spans


def read_info(path: Path, key: dict[str, str]) -> dict[str, str]:
    """The cached file's ``__metadata__`` after checking its key; raises ``CacheError``/``OSError``."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CacheError("truncated header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise CacheError("bad header size")
        raw = f.read(n)
    if len(raw) != n:
        raise CacheError("truncated header")
    try:
        meta = json.loads(raw)["__metadata__"]
    except (ValueError, KeyError, TypeError) as e:
        raise CacheError(f"unreadable header ({e})") from None
    for k, v in key.items():
        if meta.get(k) != v:
            raise CacheError(f"stale ({k} was {meta.get(k)!r}, now {v!r})")
    return meta


def read_tensors(path: Path, key: dict[str, str], layout: Layout,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``layout`` from the file, memory-mapped, each checked against its CRC-32
    before it is yielded. Raises ``CacheError`` for anything that does not match exactly."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if len(mm) < 8:
        raise CacheError("truncated file")
    (n,) = struct.unpack_from("<Q", mm, 0)
    if n > min(_MAX_HEADER, len(mm) - 8):
        raise CacheError("bad header size")
    try:
        meta = json.loads(bytes(mm[8 : 8 + n]))["__metadata__"]
        crcs = {k: int(v, 16) for k, v in json.loads(meta["crc32"]).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CacheError(f"unreadable header ({e})") from None
    info = {k: v for k, v in meta.items() if k not in key and k != "crc32"}
    expected, spans = _layout_header(key, info, layout, dtype, crcs)
    if bytes(mm[8 : 8 + n]) != expected:
        raise CacheError("stale (key, tensor names, shapes or dtype differ from what the model expects)")
    base = 8 + n
    total = spans[-1][2] if spans else 0
    if len(mm) != base + total:
        raise CacheError(f"truncated or oversized ({len(mm)} bytes, expected {base + total})")
    view = memoryview(mm)
    shapes = dict(layout)
    import warnings

    for name, start, end in spans:
        if zlib.crc32(view[base + start : base + end]) != crcs[name]:
            raise CacheError(f"checksum mismatch in {name}")
        if end == start:
            yield name, torch.empty(shapes[name], dtype=dtype)
            continue
        with warnings.catch_warnings():  # the map is read-only; the tensor is only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(mm, dtype=dtype, count=(end - start) // torch.empty((), dtype=dtype).element_size(),
                                 offset=base + start)
        yield name, t.view(shapes[name])


def _remove_abandoned(path: Path, older_than_s: float = 600.0) -> None:
    """Delete temporary files of ``path`` left by writers that died (untouched for 10 minutes; a
    live writer touches its file with every tensor)."""
    import time

    for tmp in path.parent.glob(path.stem + ".*.tmp"):
        try:
            if time.time() - tmp.stat().st_mtime > older_than_s:
                tmp.unlink()
        except OSError:
            pass


class Writer:
    """Streams tensors into a temporary file laid out for ``layout``; ``commit`` renames it into
    place. Any failure turns the writer off (logged) without disturbing the load."""

    def __init__(self, path: Path, key: dict[str, str], info: dict[str, str], layout: Layout, dtype: torch.dtype):
        self.path, self.key, self.info, self.layout, self.dtype = path, key, info, layout, dtype
        self.crcs: dict[str, int] = {}
        self.header, spans = _layout_header(key, info, layout, dtype, {})
        self.base = 8 + len(self.header)
        self.spans = {name: (start, end) for name, start, end in spans}
        self.shapes = dict(layout)
        _remove_abandoned(path)
        fd, self.tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
        self.fd: int | None = fd
        try:
            os.ftruncate(fd, self.base + (spans[-1][2] if spans else 0))
        except OSError as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        log.warning("weight cache: not writing %s (%s)", self.path, e)
        self.abort()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.fd is None:
            return
        try:
            if name not in self.spans or tuple(tensor.shape) != self.shapes[name] or name in self.crcs:
                raise ValueError(f"unexpected tensor {name!r} {tuple(tensor.shape)}")
            data = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous().reshape(-1).view(torch.uint8)
            buf = data.numpy()
            start, end = self.spans[name]
            if buf.nbytes != end - start:
                raise ValueError(f"{name}: {buf.nbytes} bytes, expected {end - start}")
            self.crcs[name] = zlib.crc32(buf)
            mv = memoryview(buf)
            off = 0
            while off < len(mv):
                off += os.pwrite(self.fd, mv[off:], self.base + start + off)
        except (OSError, ValueError) as e:
            self._fail(e)

    def commit(self) -> bool:
        """Write the header and rename into place; True when the cache file now exists."""
        if self.fd is None:
            return False
        try:
            missing = [n for n in self.spans if n not in self.crcs]
            if missing:
                raise ValueError(f"{len(missing)} tensors never arrived, e.g. {missing[0]!r}")
            header, _ = _layout_header(self.key, self.info, self.layout, self.dtype, self.crcs)
            if len(header) != len(self.header):
                raise ValueError("header size changed")
            os.pwrite(self.fd, struct.pack("<Q", len(header)) + header, 0)
            os.close(self.fd)
            self.fd = None
            os.chmod(self.tmp, 0o600)
            os.replace(self.tmp, self.path)
            return True
        except (OSError, ValueError) as e:
            self._fail(e)
            return False

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        Path(self.tmp).unlink(missing_ok=True)
