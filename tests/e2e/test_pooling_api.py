"""The pooling family over real HTTP: all-MiniLM-L6-v2 behind `launch api-server` (embeddings through
the openai SDK, /pooling, /score, rerank in Jina's and Cohere's shapes, SageMaker's /invocations),
and tiny random BERT checkpoints written by the test for /classify and a cross-encoder's /score,
checked against transformers."""

from __future__ import annotations

import base64
import json
import math
import shutil
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Server
from zserve.catalog import ModelNotFound, resolve

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
         "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
         "Someone in a gorilla costume is playing a set of drums.", "hi"]


def _minilm_dir() -> Path:
    try:
        return Path(resolve(MODEL).path)
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def embed_server(rag_server):
    """MiniLM beside tiny-random (the session's two-model server): every request names MiniLM."""
    return rag_server


@pytest.fixture(scope="module")
def client(embed_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=embed_server.url + "/v1", api_key="x", max_retries=0)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def reference_embeddings(texts: list[str]) -> list[list[float]]:
    """The sentence-transformers recipe, computed with transformers: mean over the attention mask, L2."""
    import torch
    import transformers

    d = _minilm_dir()
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    model = transformers.AutoModel.from_pretrained(str(d)).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"][..., None].float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).tolist()


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_embeddings_equal_the_sentence_transformers_recipe_in_float_and_base64(client):
    want = reference_embeddings(TEXTS)
    got = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    assert got.model == MODEL and got.usage.prompt_tokens > len(TEXTS)
    for d, w in zip(got.data, want):
        assert len(d.embedding) == 384 and close(d.embedding, w, 1e-4)
    # The SDK asks for base64 by default when numpy is around; ask explicitly and decode by hand too.
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS[:2], encoding_format="base64")
    body = json.loads(raw.text)
    for d, w in zip(body["data"], want):
        vec = array("f")
        vec.frombytes(base64.b64decode(d["embedding"]))
        assert close(list(vec), w, 1e-4)


def test_a_batch_of_64_and_16_concurrent_requests_give_the_vectors_of_one_at_a_time(client):
    texts = [f"{TEXTS[i % len(TEXTS)]} (variant {i})" for i in range(64)]
    alone = [client.embeddings.create(model=MODEL, input=t).data[0].embedding for t in texts[:16]]
    batch = client.embeddings.create(model=MODEL, input=texts).data
    assert len(batch) == 64
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=t).data[0].embedding,
                                   texts[:16]))
    for i in range(16):
        assert close(batch[i].embedding, alone[i], 1e-5) and close(concurrent[i], alone[i], 1e-5)


def test_the_largest_documented_batches_are_served_on_an_idle_server(embed_server, client):
    # Each input waits in the engine's queue as a request: 2,048 inputs (the documented limit) fit the default
    # --max-waiting, and so do 2,048 documents beside their query (each counted once).
    texts = [f"text number {i}" for i in range(2048)]
    got = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in got.data] == list(range(2048))
    r = post(embed_server, "/v1/rerank", {"model": MODEL, "query": "text number 7", "documents": texts, "top_n": 1})
    assert r.status_code == 200 and r.json()["results"][0]["index"] == 7


def test_token_id_inputs_limits_and_truncation(embed_server, client):
    ids = post(embed_server, "/tokenize", {"model": MODEL, "prompt": TEXTS[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids]).data[0].embedding
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    assert close(by_ids, by_text, 1e-5)
    long = "word " * 600
    r = post(embed_server, "/v1/embeddings", {"model": MODEL, "input": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "truncate_prompt_tokens" in r.json()["error"]["message"]
    r = post(embed_server, "/v1/embeddings", {"model": MODEL, "input": long, "truncate_prompt_tokens": 32})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 32
    r = post(embed_server, "/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"  # not a Matryoshka model
    r = post(embed_server, "/v1/embeddings", {"model": MODEL, "input": []})
    assert r.status_code == 400
    r = post(embed_server, "/v1/embeddings", {"model": MODEL, "input": ["x"] * 3000})
    assert r.status_code == 400 and "at most" in r.json()["error"]["message"]
    r = post(embed_server, "/classify", {"model": MODEL, "input": "x"})
    assert r.status_code == 400 and "does not classify" in r.json()["error"]["message"]
    r = post(embed_server, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert r.status_code == 400 and "does not generate: it serves embed" in r.json()["error"]["message"]


def test_pooling_gives_the_raw_vector_and_score_is_the_cosine(embed_server, client):
    raw = post(embed_server, "/pooling", {"model": MODEL, "input": TEXTS[0]}).json()["data"][0]["data"]
    norm = math.sqrt(sum(x * x for x in raw))
    assert abs(norm - 1.0) > 1e-3
    unit = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    assert close([x / norm for x in raw], unit, 1e-5)
    a, b = (client.embeddings.create(model=MODEL, input=t).data[0].embedding for t in TEXTS[:2])
    cosine = sum(x * y for x, y in zip(a, b))
    for path in ("/score", "/v1/score"):
        body = post(embed_server, path, {"model": MODEL, "text_1": TEXTS[0], "text_2": [TEXTS[1], TEXTS[2]]}).json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
        assert abs(body["data"][0]["score"] - cosine) < 1e-4
        assert body["data"][0]["score"] > body["data"][1]["score"]


RERANK_SETS = [
    ("What is the capital of France?", ["Bananas are yellow.", "Paris is the capital of France.",
                                        "The stock market fell today."]),
    ("How do I bake bread?", ["Football is played with a ball.", "Cats sleep most of the day.",
                              "Mix flour, water and yeast, let the dough rise, then bake it in a hot oven."]),
    ("Which planet is known as the red planet?", ["Mars is often called the red planet.",
                                                  "Whales are mammals.", "Python is a programming language."]),
]


@pytest.mark.parametrize("query,docs", RERANK_SETS)
def test_rerank_puts_the_relevant_document_first_in_both_shapes(embed_server, query, docs):
    relevant = next(i for i, d in enumerate(docs) if any(w in d for w in ("Paris", "flour", "Mars")))
    jina = post(embed_server, "/v1/rerank", {"model": MODEL, "query": query, "documents": docs, "top_n": 2}).json()
    assert jina["model"] == MODEL and jina["usage"]["total_tokens"] > 0
    assert len(jina["results"]) == 2 and jina["results"][0]["index"] == relevant
    assert jina["results"][0]["document"]["text"] == docs[relevant]
    assert jina["results"][0]["relevance_score"] >= jina["results"][1]["relevance_score"]
    assert post(embed_server, "/rerank", {"query": query, "documents": docs}).json()["results"][0]["index"] == relevant
    cohere = post(embed_server, "/v2/rerank", {"model": MODEL, "query": query, "documents": [{"text": d} for d in docs],
                                               "return_documents": False}).json()
    assert [r["index"] for r in cohere["results"]][0] == relevant and "document" not in cohere["results"][0]
    assert cohere["meta"]["api_version"]["version"] == "2" and len(cohere["results"]) == 3


def test_sagemaker_invocations_reach_embeddings_and_rerank(embed_server, client):
    emb = post(embed_server, "/invocations", {"input": TEXTS[0]}).json()
    assert close(emb["data"][0]["embedding"], client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding,
                 1e-5)
    query, docs = RERANK_SETS[0]
    rr = post(embed_server, "/invocations", {"query": query, "documents": docs}).json()
    assert rr["results"][0]["index"] == 1


# -- classification heads: tiny random checkpoints, against transformers ---------------------------

def _write_tiny(tmp: Path, num_labels: int) -> Path:
    import torch
    import transformers

    torch.manual_seed(num_labels)
    d = tmp / f"tiny-bert-{num_labels}"
    labels = {0: "LABEL_0"} if num_labels == 1 else {i: f"class-{i}" for i in range(num_labels)}
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128, num_labels=num_labels,
                                  id2label=labels, label2id={v: k for k, v in labels.items()})
    model = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # make the segment ids matter, so a pair read without them scores differently
        model.bert.embeddings.token_type_embeddings.weight.mul_(50)
        model.classifier.weight.mul_(100)  # and logits far from 0, where differences show
    model.save_pretrained(str(d), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (_minilm_dir() / name).is_file():
            shutil.copy(_minilm_dir() / name, d / name)
    return d


@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("heads")
    dirs = {n: _write_tiny(tmp, n) for n in (3, 1)}
    # Both heads behind one endpoint, in float32 like the transformers oracle (auto is bf16 on CPUs with AVX512_BF16).
    s = Server("--model", str(dirs[3]), "--model", str(dirs[1]), "--dtype", "float32", log_name="heads")
    yield dirs, {n: d.name for n, d in dirs.items()}, s
    s.stop()


def _hf_logits(d: Path, first: str, second: str | None = None, segments: bool = True) -> list[float]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(d)).eval()
    enc = tok(first, second, return_tensors="pt")
    if not segments:
        enc["token_type_ids"] = torch.zeros_like(enc["token_type_ids"])
    with torch.inference_mode():
        return model(**enc).logits[0].tolist()


def test_classify_gives_the_labels_and_probabilities_of_transformers(tiny_heads):
    dirs, names, server = tiny_heads
    texts = ["I loved it", "terrible service, would not come back", "meh"]
    body = post(server, "/classify", {"model": names[3], "input": texts}).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["usage"]["prompt_tokens"] > 3
    for d, text in zip(body["data"], texts):
        logits = _hf_logits(dirs[3], text)
        m = max(logits)
        probs = [math.exp(x - m) / sum(math.exp(y - m) for y in logits) for x in logits]
        assert d["num_classes"] == 3 and close(d["probs"], probs, 1e-4)
        assert d["label"] == f"class-{max(range(3), key=probs.__getitem__)}"


def test_a_cross_encoder_scores_the_pair_with_its_head(tiny_heads):
    dirs, names, server = tiny_heads
    query, docs = "what is a cat?", ["A cat is a small animal.", "Stocks fell."]
    body = post(server, "/score", {"model": names[1], "text_1": query, "text_2": docs}).json()
    for d, doc in zip(body["data"], docs):
        (logit,) = _hf_logits(dirs[1], query, doc)
        (flat,) = _hf_logits(dirs[1], query, doc, segments=False)
        assert abs(logit - flat) > 1e-3  # the pair's segment ids change the score...
        assert abs(d["score"] - 1 / (1 + math.exp(-logit))) < 1e-5  # ...and the server reads them
    ranked = post(server, "/v1/rerank", {"model": names[1], "query": query, "documents": docs}).json()["results"]
    assert sorted(r["index"] for r in ranked) == [0, 1]
    assert ranked[0]["relevance_score"] >= ranked[1]["relevance_score"]


def test_a_generating_model_embeds_too_by_last_token_pooling(tiny_server):
    """The tiny random decoder answers /v1/embeddings beside generation: its last token's final-norm
    hidden state, normalised; /pooling gives it raw, and /classify is refused with what it serves."""
    r = post(tiny_server, "/v1/embeddings", {"model": "tiny-random", "input": ["hello there", "hello there"]})
    assert r.status_code == 200, r.text
    a, b = (d["embedding"] for d in r.json()["data"])
    assert a == b and abs(sum(x * x for x in a) - 1.0) < 1e-5
    raw = post(tiny_server, "/pooling", {"model": "tiny-random", "input": "hello there"}).json()["data"][0]["data"]
    norm = math.sqrt(sum(x * x for x in raw))
    assert close([x / norm for x in raw], a, 1e-5)
    r = post(tiny_server, "/classify", {"model": "tiny-random", "input": "x"})
    assert r.status_code == 400 and "it serves embed, generate" in r.json()["error"]["message"]
    gen = post(tiny_server, "/v1/completions", {"model": "tiny-random", "prompt": "hi", "max_tokens": 2})
    assert gen.status_code == 200
