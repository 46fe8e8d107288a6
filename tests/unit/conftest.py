"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from zserve.catalog import ModelNotFound, smollm2_gguf_path
from zserve.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """SmolLM2's tokenizer, built once per session from the GGUF (cached like a gateway does)."""
    try:
        path = smollm2_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    return Tokenizer.from_gguf(path, cache_dir=str(tmp_path_factory.getbasetemp() / "tokenizer-cache"))
