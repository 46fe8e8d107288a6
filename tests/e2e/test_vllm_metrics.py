"""vLLM's metrics, as tools written for vLLM read them (the Inference Extension's endpoint picker, llm-d, KEDA,
vLLM's Grafana dashboard): a real server's /metrics, scraped after real requests, has every one of them under
vLLM's name, kind, labels and buckets, with values that follow the requests (gateway/vllm_metrics.py)."""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until

MODEL = "tiny-random"
# vLLM's (vllm/v1/metrics/loggers.py): name -> kind; the parser names a counter's family without its _total
ENGINE_SIDE = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
               "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
               "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter"}
REQUEST_SIDE = {"vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
                "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
                "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram"}
BUCKETS = {  # vLLM's bucket boundaries, which its dashboards' quantiles assume
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several KV blocks: the second request hits the cache
MAX_TOKENS = 6


def scrape(url: str) -> dict:
    """{family name: family} of the vllm: metrics on /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def total(families: dict, sample: str, **labels: str) -> float:
    """The sum of ``sample``'s values over the series with ``labels`` (of model MODEL)."""
    name = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    fam = families.get(name)
    want = {"model_name": MODEL, **labels}
    return sum(s.value for s in (fam.samples if fam else ()) if s.name == sample
               and all(s.labels.get(k) == v for k, v in want.items()))


def quiet(url: str) -> dict:
    """A scrape once earlier requests have all been counted (two in a row, a flush interval apart, agree)."""
    last: list[float] = []

    def settled() -> dict | None:
        fams = scrape(url)
        now = [total(fams, "vllm:request_success_total"), total(fams, "vllm:prefix_cache_queries_total")]
        if now == last:
            return fams
        last[:] = now
        return None

    return wait_until(settled, 30, 0.6, "the earlier requests to be counted")


def test_every_vllm_metric_is_exported_with_vllms_labels_and_follows_the_requests(tiny_server):
    url = tiny_server.url
    before = quiet(url)
    usages = []
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        usages.append(r.json()["usage"])
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)

    def counted() -> dict | None:  # every gateway's numbers once flushed, the engines' with their next stats
        fams = scrape(url)
        ended = total(fams, "vllm:request_success_total", finished_reason="length") \
            - total(before, "vllm:request_success_total", finished_reason="length")
        looked_up = total(fams, "vllm:prefix_cache_queries_total") - total(before, "vllm:prefix_cache_queries_total")
        return fams if ended >= 2 and looked_up >= prompt_tokens else None

    after = wait_until(counted, 15, 0.1, "both requests in vLLM's metrics")

    for name, kind in {**ENGINE_SIDE, **REQUEST_SIDE, "vllm:lora_requests_info": "gauge"}.items():
        assert name in after, f"{name} is not exported"
        assert after[name].type == kind, (name, after[name].type)
    for name in {**ENGINE_SIDE, **REQUEST_SIDE}:
        series = [s for s in after[name].samples if s.labels.get("model_name") == MODEL]
        assert series, f"{name} has no series of model_name={MODEL}"
        for s in series:
            assert s.labels["engine"].isdigit(), s  # vLLM v1's engine="<index>": the engine's rank
            assert s.value >= 0 and math.isfinite(s.value), s
    # (vllm:lora_requests_info has series only on a server with --max-loras: tests/e2e/test_lora.py)

    def grew(sample: str, **labels: str) -> float:
        return total(after, sample, **labels) - total(before, sample, **labels)

    # Request side: counted by the gateways, under vLLM's semantics.
    assert grew("vllm:prompt_tokens_total") == prompt_tokens
    assert grew("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 2 * MAX_TOKENS
    assert grew("vllm:request_success_total", finished_reason="length") == 2
    assert grew("vllm:request_success_total") == 2  # no other finish reason counted
    assert grew("vllm:time_to_first_token_seconds_count") == 2
    assert grew("vllm:e2e_request_latency_seconds_count") == 2
    assert 2 <= grew("vllm:inter_token_latency_seconds_count") <= 2 * (MAX_TOKENS - 1)
    assert 0 < grew("vllm:time_to_first_token_seconds_sum") <= grew("vllm:e2e_request_latency_seconds_sum")
    for name, bounds in BUCKETS.items():
        les = sorted({float(s.labels["le"]) for s in after[name].samples if s.name == name + "_bucket"})
        assert les == [*bounds, math.inf], name
    # Engine side: from the engines' stats. The prompt was looked up in the prefix cache whole, once per request,
    # and the second request found the first one's blocks there.
    assert grew("vllm:prefix_cache_queries_total") == prompt_tokens
    assert 0 < grew("vllm:prefix_cache_hits_total") < prompt_tokens
    assert all(0.0 <= s.value <= 1.0 for s in after["vllm:kv_cache_usage_perc"].samples)
