"""Engine statistics. No torch here, and no prometheus_client: the server's collector
(core/server/metrics.py) turns a snapshot of these into Prometheus metrics at scrape time,
so the engine thread only ever adds to plain ints and lists.

Token counters are incremented in finalize only, after stop-string truncation, so
``num_generation_tokens`` always equals the sum of the output lengths (vLLM #8219).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field, replace

from cadence.request import Request

# "bitmask": structured output's grammar bitmasks, computed inside post_sample (docs/structured_output.md).
STEP_PHASES = ("schedule", "prepare", "execute", "post_sample", "commit", "drain", "bitmask")


@dataclass(slots=True)
class StepTimes:
    """Seconds spent per phase, summed over steps (the per-step breakdown)."""

    num_steps: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] += seconds


# Seconds; vLLM's bucket edges for the same histograms, so dashboards carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram: per-bucket counts (the last one +Inf), made cumulative by the
    server's collector when scraped."""

    edges: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.edges) + 1)  # the last one is +Inf

    def copy(self) -> Histogram:
        return Histogram(self.edges, list(self.counts), self.total, self.count)

    def observe(self, value: float) -> None:
        # bisect_left: the first edge >= value, Prometheus' "le"; it runs once per output
        # token for the inter-token latency, so no Python loop over the edges.
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value
        self.count += 1


@dataclass(slots=True)
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_added: int = 0
    num_requests_finished: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    # Speculative decoding: draft tokens computed, and those kept (vLLM's
    # spec_decode_num_draft_tokens and spec_decode_num_accepted_tokens).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    speculative: bool = False  # whether the engine speculates (the counters above apply)
    times: StepTimes = field(default_factory=StepTimes)
    started: float = field(default_factory=time.monotonic)
    # Gauges, refreshed every step by the engine.
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # LoRA adapters (vLLM's lora_requests_info): the most per step (0: the engine serves
    # none), and the names of those the running and the waiting requests ask for.
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # Arrival to first scheduled (Request.first_scheduled_time, set by the scheduler).
    request_queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # Per finished request with two or more tokens: its mean gap between output tokens.
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    # Every gap between a request's consecutive output tokens, observed at commit
    # (LLMEngine.step), where the token's time is known without a per-token list.
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))

    @classmethod
    def merged(cls, parts: list[EngineStats]) -> EngineStats:
        """Several engines' stats as one (data-parallel replicas): counts, gauges and
        histograms summed, KV cache usage averaged, the earliest start."""
        out = cls()
        for p in parts:
            for name in ("num_prompt_tokens", "num_generation_tokens", "num_requests_added",
                         "num_requests_finished", "num_preemptions", "num_steps",
                         "num_scheduled_tokens", "num_running", "num_waiting",
                         "num_draft_tokens", "num_accepted_tokens"):
                setattr(out, name, getattr(out, name) + getattr(p, name))
            for reason, n in p.finish_reasons.items():
                out.finish_reasons[reason] = out.finish_reasons.get(reason, 0) + n
            out.times.num_steps += p.times.num_steps
            for phase, secs in p.times.phases.items():
                out.times.phases[phase] = out.times.phases.get(phase, 0.0) + secs
            for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                         "time_per_output_token", "inter_token_latency"):
                mine, theirs = getattr(out, name), getattr(p, name)
                mine.counts = [a + b for a, b in zip(mine.counts, theirs.counts)]
                mine.total += theirs.total
                mine.count += theirs.count
            out.started = min(out.started, p.started)
            out.speculative = out.speculative or p.speculative
        if parts:
            out.kv_cache_usage = sum(p.kv_cache_usage for p in parts) / len(parts)
        return out

    def snapshot(self) -> EngineStats:
        """A copy another thread may read while this one keeps counting (~5x cheaper than
        ``copy.deepcopy``, which matters once per engine step)."""
        return replace(
            self, finish_reasons=dict(self.finish_reasons),
            times=StepTimes(self.times.num_steps, dict(self.times.phases)),
            time_to_first_token=self.time_to_first_token.copy(),
            e2e_request_latency=self.e2e_request_latency.copy(),
            request_queue_time=self.request_queue_time.copy(),
            time_per_output_token=self.time_per_output_token.copy(),
            inter_token_latency=self.inter_token_latency.copy())

    def on_request_finished(self, req: Request) -> None:
        now = time.monotonic()
        if req.first_token_time is not None and req.pooling is None:
            # An embedding request's one token is dropped: it has no first token to time.
            self.time_to_first_token.observe(req.first_token_time - req.arrival_time)
        self.e2e_request_latency.observe(now - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.request_queue_time.observe(req.first_scheduled_time - req.arrival_time)
        n_out = len(req.output_token_ids)
        if n_out > 1 and req.first_token_time is not None and req.last_token_time is not None:
            self.time_per_output_token.observe(
                (req.last_token_time - req.first_token_time) / (n_out - 1))
        self.num_requests_finished += 1
        reason = req.status.finish_reason or "unknown"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        self.num_preemptions += req.num_preemptions
