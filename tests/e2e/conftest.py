"""Real servers for end-to-end tests: `launch api-server` as a subprocess on a free port.

Servers are shared per session (one SmolLM2, one tiny-random) because starting one costs seconds;
tests that kill or reconfigure a server start their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import Server


@pytest.fixture(scope="session")
def smollm_server():
    """SmolLM2 as a user serves it for tools (``--tool-call-parser hermes``): forced calls depend on what it writes."""
    s = Server("--count", "2", "--dtype", "float32", "--max-model-len", "2048", "--tool-call-parser", "hermes",
               log_name="smollm")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tiny_server():
    s = Server("--count", "2", "--model", "tiny-random", "--dtype", "float32", "--max-num-seqs", "16",
               log_name="tiny")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def rag_server():
    """A chat model, an embedding model and a speech model behind one endpoint, as `make run` serves them
    (tiny-random in SmolLM2's place: the same tokenizer and template, random weights), and the English-only speech
    model beside them: the pooling, multi-model, speech-to-text and documentation tests."""
    from zserve.catalog import DEFAULT_EMBEDDING_MODEL, DEFAULT_SPEECH_MODEL, WHISPER_TINY_EN, ModelNotFound, resolve

    try:
        for model in (DEFAULT_EMBEDDING_MODEL, DEFAULT_SPEECH_MODEL, WHISPER_TINY_EN):
            resolve(model)
    except ModelNotFound as e:
        pytest.skip(str(e))
    s = Server("--count", "2", "--model", "tiny-random", "--model", DEFAULT_EMBEDDING_MODEL, "--model",
               DEFAULT_SPEECH_MODEL, "--model", WHISPER_TINY_EN, "--dtype", "float32", "--max-num-seqs", "16",
               log_name="rag")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory) -> Path:
    """The scripted test model (tests/e2e/scripted_model.py): its output is chosen by the prompt's last token."""
    from .scripted_model import build_scripted_model

    return build_scripted_model(tmp_path_factory.mktemp("scripted") / "scripted")


@pytest.fixture(scope="session")
def scripted_server(scripted_model):
    """Two gateways with the hermes tool-call parser and the think reasoning parser, on the scripted model;
    shared by the tool-calling, Anthropic, Responses and native-route tests."""
    s = Server("--model", str(scripted_model), "--count", "2", "--dtype", "float32", "--max-model-len", "1024",
               "--tool-call-parser", "hermes", "--reasoning-parser", "think", log_name="scripted")
    yield s
    s.stop()
