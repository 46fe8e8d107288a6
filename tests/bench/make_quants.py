"""Write the default model's GGUF file in other quantization types, with llama.cpp's own quantizer (the benchmarks'
files: tests/bench/bench_llamacpp.py, tests/bench/bench_quant_accuracy.py).

Usage:
    .venv/bin/python tests/bench/make_quants.py [--out DIR] [--types Q8_0 Q4_0 Q4_K_M Q6_K]

Needs ``llama-cpp-python`` (``pip install -e '.[peers]'``: built from source, about 10 minutes on 2 cores). The
package ships only the Q4_1 file, so the others are requantized from it (``allow_requantize``): llama.cpp
dequantizes each tensor and quantizes it again, as ``llama-quantize --allow-requantize`` does. The weights differ
from a quantization of the original bf16 checkpoint, but the file layout, the types and the speed are the real ones.
Files already written are kept.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

from zserve.catalog import smollm2_gguf_path

# llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
DEFAULT_DIR = Path.home() / ".cache" / "zserve" / "quants"


def make(kind: str, out: Path, source: Path | None = None) -> Path:
    """The default model in ``kind`` under ``out`` (written when missing)."""
    source = source or smollm2_gguf_path()
    target = out / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if kind == "Q4_1" and "Q4_1" in source.name:
        return source
    if target.exists():
        return target
    import llama_cpp

    out.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.allow_requantize = True
    params.nthread = 2
    tmp = target.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({kind}) failed with {rc}")
    tmp.replace(target)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K_M", "Q6_K"], choices=sorted(FTYPES))
    args = ap.parse_args()
    for kind in args.types:
        print(make(kind, args.out))


if __name__ == "__main__":
    main()
