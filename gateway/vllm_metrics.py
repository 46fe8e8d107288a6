"""vLLM's metrics, under vLLM's names, labels and buckets, beside zserve's own: what external routers and
autoscalers read from a vLLM server's /metrics (the Gateway API Inference Extension's endpoint picker, llm-d's
scheduler, KEDA scalers, vLLM's Grafana dashboard) then works against zserve unchanged.

Every series has vLLM's labels ``model_name`` (the served model) and ``engine`` (the engine's rank, as vLLM v1
labels each engine core by its index). As in vLLM, where the API server measures requests from the outputs it
streams and the engine core reports its scheduler, the split is:

- request side (``VllmRequestMetrics``): recorded by gateways through ``gateway.metrics.TokenTimer``, buffered
  like zserve's own request metrics; ``engine`` is the engine a request was sent to (a request moved to another
  engine mid-stream stays counted under the first);
- engine side (``engine_families``): read from the ``EngineStats`` every engine publishes to every gateway.

prometheus_client adds ``_total`` to a counter's samples, as it does for vLLM's: ``vllm:prompt_tokens`` is
scraped as ``vllm:prompt_tokens_total``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from protocol import EngineStats

from .metric_buffers import BufferedCounter, BufferedHistogram

LABELS = ("model_name", "engine")  # vLLM's, in its order
FINISHED_REASON = "finished_reason"  # request_success's own label: stop, length or abort (ended without a finish)

# vLLM's bucket boundaries, so that its dashboards' histogram_quantile() read the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class VllmRequestMetrics:
    """The request-side vLLM metrics of one process (in ``registry``), buffered until ``flush``."""

    def __init__(self, registry: CollectorRegistry | None):
        self.ttft = BufferedHistogram("vllm:time_to_first_token_seconds", "Time to first token, in seconds.",
                                      LABELS, TTFT_BUCKETS, registry)
        self.inter_token = BufferedHistogram("vllm:inter_token_latency_seconds",
                                             "Time between consecutive output tokens, in seconds.", LABELS,
                                             ITL_BUCKETS, registry)
        self.e2e = BufferedHistogram("vllm:e2e_request_latency_seconds",
                                     "Time from a request's arrival to its end, in seconds.", LABELS, E2E_BUCKETS,
                                     registry)
        self.prompt_tokens = BufferedCounter(Counter(
            "vllm:prompt_tokens", "Prompt tokens of the requests that started generating.", LABELS,
            registry=registry))
        self.generation_tokens = BufferedCounter(Counter(
            "vllm:generation_tokens", "Tokens generated.", LABELS, registry=registry))
        self.request_success = BufferedCounter(Counter(
            "vllm:request_success", "Requests that ended, by finish reason.", (*LABELS, FINISHED_REASON),
            registry=registry))
        self._all = (self.ttft, self.inter_token, self.e2e, self.prompt_tokens, self.generation_tokens,
                     self.request_success)

    def flush(self) -> None:
        for metric in self._all:
            metric.flush()


# EngineStats field -> (kind, vLLM's name, help): the engine-side metrics, one series per engine.
ENGINE_FIELDS = {
    "running": ("gauge", "vllm:num_requests_running", "Requests in the engine's running batch."),
    "waiting": ("gauge", "vllm:num_requests_waiting", "Requests waiting to be scheduled (preempted ones included)."),
    "kv_used": ("gauge", "vllm:kv_cache_usage_perc", "Share of the KV cache in use (1 = full)."),
    "prefix_cache_queries": ("counter", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("counter", "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "preemptions": ("counter", "vllm:num_preemptions", "Requests preempted for lack of KV cache."),
}
_FAMILY = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


def engine_families(engines: Iterable[tuple[str, str, EngineStats]]) -> Iterator[Metric]:
    """The engine-side vLLM metrics of ``engines`` (model name, rank as a string, latest stats)."""
    families = {key: _FAMILY[kind](name, doc, labels=LABELS) for key, (kind, name, doc) in ENGINE_FIELDS.items()}
    # vLLM's adapter gauge: per engine that serves adapters, which adapters its running and waiting requests use
    # (comma-separated) and its max_lora; the value is the time of the stats, as vLLM sets it to the current time.
    lora_info = GaugeMetricFamily(
        "vllm:lora_requests_info", "The LoRA adapters of the running and waiting requests, and max_lora.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", *LABELS])
    for model, engine, st in engines:
        for key, fam in families.items():
            fam.add_metric([model, engine], float(getattr(st, key)))
        if st.max_loras:
            lora_info.add_metric([str(st.max_loras), ",".join(st.waiting_loras), ",".join(st.running_loras), model,
                                  engine], st.timestamp)
    yield from families.values()
    yield lora_info
