"""No pickle, marshal or eval anywhere in product code: the wire is typed and validated."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["protocol", "gateway", "engine_worker", "launch", "zserve"]
BANNED = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|cloudpickle|dill|marshal|shelve)\b|(^|[^.\w])(eval|exec)\(",
                    re.M)


def test_product_code_has_no_pickle_or_eval():
    hits = []
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            for m in BANNED.finditer(f.read_text()):
                hits.append(f"{f.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not hits, hits
