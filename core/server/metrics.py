"""``/metrics``: the engine's stats as Prometheus metrics, through prometheus_client.

The collector reads ``AsyncLLM.stats()`` (the snapshot taken after each step) at scrape
time, so the engine thread never calls into prometheus_client. Each app gets its own
``CollectorRegistry``: several engines in one process (tests, embedding) never collide.

NOTE one process serves: the engine, its stats and the HTTP server share a process (the CPU
backend's worker process computes, it serves nothing), and ``engine serve`` runs one
uvicorn worker, so the one collector sees everything and no PROMETHEUS_MULTIPROC_DIR is
needed. Serving one engine from several processes would need it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from cadence.metrics import EngineStats, Histogram

# ``engine``: the replica's rank under data-parallel serving ("0" for one engine), vLLM's
# label for the same thing.
LABELS = ["model_name", "backend", "engine"]

#: Metric name prefixes: vLLM's own, so dashboards built for vLLM work unchanged, or
#: cadence's, for a deployment that scrapes both engines side by side.
METRIC_PREFIXES = ("vllm", "cadence")

# (name, help, the EngineStats field); names are vLLM's, after the prefix.
_COUNTERS = (
    ("prompt_tokens", "Prefill tokens.", "num_prompt_tokens"),
    ("generation_tokens", "Generated tokens.", "num_generation_tokens"),
    ("num_preemptions", "Preemptions, counted when the preempted request finishes.",
     "num_preemptions"),
)
# Only where the engine speculates (vLLM's spec_decode_* families).
_SPEC_COUNTERS = (
    ("spec_decode_num_draft_tokens", "Draft tokens computed (speculative decoding).",
     "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens kept (speculative decoding).",
     "num_accepted_tokens"),
)
_GAUGES = (
    ("num_requests_running", "Requests running.", "num_running"),
    ("num_requests_waiting", "Requests waiting.", "num_waiting"),
    ("kv_cache_usage_perc", "KV cache usage (0-1).", "kv_cache_usage"),
)
_HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time from arrival to the first generated token.",
     "time_to_first_token"),
    ("e2e_request_latency_seconds", "Time from arrival to the end of the request.",
     "e2e_request_latency"),
    ("request_queue_time_seconds", "Time from arrival to the first time it is scheduled.",
     "request_queue_time"),
    ("request_time_per_output_token_seconds",
     "Per finished request: mean time between its output tokens.", "time_per_output_token"),
    ("inter_token_latency_seconds", "Time between consecutive output tokens of a request.",
     "inter_token_latency"),
    # vLLM's older name for the same per-gap histogram, kept for the dashboards that read it
    # (vLLM fills it with every gap too; the per-request mean is the one above).
    ("time_per_output_token_seconds",
     ("Time between consecutive output tokens of a request (the older name of "
      "inter_token_latency_seconds)."), "inter_token_latency"),
)


class EngineStatsCollector(Collector):
    """Turns the latest ``EngineStats`` snapshot of each replica (``stats()`` lists them by
    rank) into metric families at scrape time, one sample per replica."""

    def __init__(self, stats: Callable[[], list[EngineStats]], model_name: str,
                 backend: Callable[[], str], prefix: str = "vllm") -> None:
        if prefix not in METRIC_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRIC_PREFIXES}, got {prefix!r}")
        self.prefix = prefix
        self.stats = stats
        self.model_name = model_name
        # Read at scrape time: an app may be built before its engine's backend is known.
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        replicas = self.stats()
        base = [self.model_name, self.backend()]
        rows = [([*base, str(rank)], s) for rank, s in enumerate(replicas)]
        speculates = any(s.speculative for _, s in rows)
        for name, help_, attr in _COUNTERS + (_SPEC_COUNTERS if speculates else ()):
            c = CounterMetricFamily(f"{self.prefix}:{name}", help_, labels=LABELS)
            for labels, s in rows:
                c.add_metric(labels, getattr(s, attr))
            yield c
        for name, help_, attr in _GAUGES:
            g = GaugeMetricFamily(f"{self.prefix}:{name}", help_, labels=LABELS)
            for labels, s in rows:
                g.add_metric(labels, getattr(s, attr))
            yield g
        if any(s.max_loras for _, s in rows):
            g = GaugeMetricFamily(
                f"{self.prefix}:lora_requests_info",
                "LoRA adapters of the running and the waiting requests (vLLM's labels; the "
                "value is the time of the scrape).",
                labels=[*LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            now = time.time()
            for labels, s in rows:
                g.add_metric([*labels, str(s.max_loras), ",".join(s.running_loras),
                              ",".join(s.waiting_loras)], now)
            yield g
        c = CounterMetricFamily(f"{self.prefix}:request_success", "Finished requests by reason.",
                                labels=[*LABELS, "finished_reason"])
        for labels, s in rows:
            for reason, n in sorted(s.finish_reasons.items()):
                c.add_metric([*labels, reason], n)
        yield c
        for name, help_, attr in _HISTOGRAMS:
            h = HistogramMetricFamily(f"{self.prefix}:{name}", help_, labels=LABELS)
            for labels, s in rows:
                hist: Histogram = getattr(s, attr)
                h.add_metric(labels, _cumulative(hist), hist.total)
            yield h
        phases = sorted({phase for _, s in rows for phase in s.times.phases})
        for phase in phases:
            c = CounterMetricFamily(f"{self.prefix}:step_{phase}_seconds",
                                    f"Time spent in the {phase} phase of engine steps.",
                                    labels=LABELS)
            for labels, s in rows:
                c.add_metric(labels, s.times.phases.get(phase, 0.0))
            yield c


def _cumulative(hist: Histogram) -> list[tuple[str, float]]:
    buckets, running = [], 0
    for edge, n in zip((*hist.edges, float("inf")), hist.counts):
        running += n
        buckets.append((floatToGoString(edge), running))
    return buckets


def make_registry(stats: Callable[[], list[EngineStats]], model_name: str,
                  backend: Callable[[], str], prefix: str = "vllm") -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) holding the collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(stats, model_name, backend, prefix))
    return registry
