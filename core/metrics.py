"""Engine statistics and their Prometheus text rendering. No torch here.

Token counters are incremented in finalize only, after stop-string truncation, so
``num_generation_tokens`` always equals the sum of the output lengths (vLLM #8219).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from cadence.request import Request

STEP_PHASES = ("schedule", "prepare", "execute", "post_sample", "commit", "drain")


@dataclass(slots=True)
class StepTimes:
    """Seconds spent per phase, summed over steps (the per-step breakdown)."""

    num_steps: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] += seconds


# Seconds; vLLM's bucket edges for the same histograms, so dashboards carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram: cumulative bucket counts are computed when rendered."""

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
        i = next((k for k, edge in enumerate(self.edges) if value <= edge), len(self.edges))
        self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, labels: str) -> list[str]:
        lines, running = [], 0
        for edge, n in zip((*self.edges, "+Inf"), self.counts):
            running += n
            lines.append(f'{name}_bucket{{{labels},le="{edge}"}} {running}')
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return lines


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
    times: StepTimes = field(default_factory=StepTimes)
    started: float = field(default_factory=time.monotonic)
    # Gauges, refreshed every step by the engine.
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def snapshot(self) -> EngineStats:
        """A copy another thread may read while this one keeps counting (~5x cheaper than
        ``copy.deepcopy``, which matters once per engine step)."""
        return replace(
            self, finish_reasons=dict(self.finish_reasons),
            times=StepTimes(self.times.num_steps, dict(self.times.phases)),
            time_to_first_token=self.time_to_first_token.copy(),
            e2e_request_latency=self.e2e_request_latency.copy())

    def on_request_finished(self, req: Request) -> None:
        now = time.monotonic()
        if req.first_token_time is not None:
            self.time_to_first_token.observe(req.first_token_time - req.arrival_time)
        self.e2e_request_latency.observe(now - req.arrival_time)
        self.num_requests_finished += 1
        reason = req.status.finish_reason or "unknown"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        self.num_preemptions += req.num_preemptions

    def render_prometheus(self, model_name: str = "") -> str:
        """The stats in Prometheus' text exposition format (names follow vLLM's)."""
        label = f'{{model_name="{model_name}"}}'
        lines = []

        def metric(name: str, kind: str, value: float, help_: str, labels: str = label) -> None:
            lines.append(f"# HELP cadence:{name} {help_}")
            lines.append(f"# TYPE cadence:{name} {kind}")
            lines.append(f"cadence:{name}{labels} {value}")

        metric("prompt_tokens_total", "counter", self.num_prompt_tokens, "Prefill tokens.")
        metric("generation_tokens_total", "counter", self.num_generation_tokens,
               "Generated tokens.")
        metric("num_requests_running", "gauge", self.num_running, "Requests running.")
        metric("num_requests_waiting", "gauge", self.num_waiting, "Requests waiting.")
        metric("kv_cache_usage_perc", "gauge", self.kv_cache_usage, "KV cache usage (0-1).")
        metric("num_preemptions_total", "counter", self.num_preemptions, "Preemptions.")
        lines.append("# HELP cadence:request_success_total Finished requests by reason.")
        lines.append("# TYPE cadence:request_success_total counter")
        for reason, n in sorted(self.finish_reasons.items()):
            lines.append(
                f'cadence:request_success_total{{model_name="{model_name}",'
                f'finished_reason="{reason}"}} {n}')
        for name, hist, help_ in (
                ("time_to_first_token_seconds", self.time_to_first_token,
                 "Time from arrival to the first generated token."),
                ("e2e_request_latency_seconds", self.e2e_request_latency,
                 "Time from arrival to the end of the request.")):
            lines.append(f"# HELP cadence:{name} {help_}")
            lines.append(f"# TYPE cadence:{name} histogram")
            lines.extend(hist.render(f"cadence:{name}", f'model_name="{model_name}"'))
        for phase, secs in self.times.phases.items():
            metric(f"step_{phase}_seconds_total", "counter", round(secs, 6),
                   f"Time spent in the {phase} phase of engine steps.")
        return "\n".join(lines) + "\n"
