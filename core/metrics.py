"""Engine statistics and their Prometheus text rendering. No torch here.

Token counters are incremented in finalize only, after stop-string truncation, so
``num_generation_tokens`` always equals the sum of the output lengths (vLLM #8219).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cadence.request import Request

STEP_PHASES = ("schedule", "prepare", "execute", "post_sample", "commit", "drain")


@dataclass(slots=True)
class StepTimes:
    """Seconds spent per phase, summed over steps (the per-step breakdown)."""

    num_steps: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] += seconds


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

    def on_request_finished(self, req: Request) -> None:
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
        for phase, secs in self.times.phases.items():
            metric(f"step_{phase}_seconds_total", "counter", round(secs, 6),
                   f"Time spent in the {phase} phase of engine steps.")
        return "\n".join(lines) + "\n"
