"""The forward floor and the per-step breakdown.

The **floor** is the backend's own forward+sample loop on the batch shapes the engine runs,
with no scheduler and no output processing: requests go in groups of ``batch_size``; each group
is prefilled (packed into steps of at most ``max_num_batched_tokens`` tokens, like the engine's
first step) and then decoded one token per live request per step. KV blocks are handed out
sequentially, since nothing else uses the cache meanwhile. Its throughput is computed from the
time spent inside ``forward``/``sample``/``to_host`` only.

The **breakdown** splits an engine run's wall time into the engine's step phases
(``engine.stats.times``) and adds two measured totals: the time inside the backend's
``forward``/``sample``/``to_host`` (the device time) and inside
``OutputProcessor.finalize`` (the deferred host work). See docs/benchmarks.md for the formulas.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from cadence.backend import ModelInput
from cadence.input_builder import build_sampling_metadata
from cadence.request import Request


class _Clock:
    """A wrapper that adds the wall time of every call to a shared total."""

    def __init__(self, fn: Any, owner: StepTimer, kind: str) -> None:
        self.fn, self.owner, self.kind = fn, owner, kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.owner.totals[self.kind] += time.perf_counter() - t
            self.owner.calls[self.kind] += 1


class StepTimer:
    """Times ``backend.forward/sample/to_host`` and ``output_processor.finalize`` of an engine.

    It shadows the bound methods with instance attributes (one ``perf_counter`` pair per call)
    and puts them back on ``restore()``. A backend that runs the forward in another process
    never calls them here: then the device time comes from ``SamplerOutput.device_seconds``
    (``device_source: "reported"``) or, failing that, is estimated.
    """

    def __init__(self, engine: Any) -> None:
        self.totals = {"device": 0.0, "finalize": 0.0, "reported": 0.0, "hidden": 0.0}
        self.calls = {"device": 0, "finalize": 0, "reported": 0, "hidden": 0}
        self._patched: list[tuple[Any, str]] = []
        # (start, end) of each step on the device, where the backend reports both: the gaps
        # between consecutive steps are the host time the device waited for (exposed).
        self.spans: list[tuple[float, float]] = []
        execute = engine.backend.execute
        # Only backends that support async scheduling have collect().
        collect = getattr(engine.backend, "collect", None)

        # Launch latency: from handing a step to the backend (``time.monotonic``, the clock
        # of ``device_done_at``) to the device starting it. Where the forward and the engine
        # share the CPUs, a step can wait there for a core the engine's own work holds.
        self.launches: list[float] = []
        handed: deque[float] = deque()
        submit = getattr(engine.backend, "submit", None)

        def record(out: Any, handed_at: float | None) -> None:
            seconds = getattr(out, "device_seconds", 0.0)
            if seconds:
                self.totals["reported"] += seconds
                self.calls["reported"] += 1
            done_at = getattr(out, "device_done_at", 0.0)
            if seconds and done_at:
                start = done_at - seconds
                if handed_at is not None:
                    # A step handed over while the one before it still ran (async
                    # scheduling) could not start before that one ended.
                    ready = max(handed_at, self.spans[-1][1]) if self.spans else handed_at
                    self.launches.append(max(0.0, start - ready))
                self.spans.append((start, done_at))

        # An executor's execute() is its own submit() then collect(): a step is recorded by
        # the outermost of the calls only.
        inside = [False]

        def reporting_submit(model_input: Any) -> None:
            if not inside[0]:
                handed.append(time.monotonic())
            try:
                submit(model_input)
            except BaseException:
                if not inside[0]:
                    handed.pop()
                raise

        def reporting_collect() -> Any:  # async scheduling: post-sample work is the engine's
            handed_at = handed.popleft() if handed and not inside[0] else None
            try:
                out = collect()
            except BaseException:
                # A failed step may take the other one in flight with it uncollected: start
                # the pairing afresh rather than give later steps older hand-overs.
                handed.clear()
                raise
            if not inside[0]:
                record(out, handed_at)
            return out

        def reporting_execute(model_input: Any, post_sample: Any) -> Any:
            handed_at = time.monotonic()
            inside[0] = True
            try:
                out = execute(model_input, post_sample)
            finally:
                inside[0] = False
            record(out, handed_at)
            done_at = getattr(out, "device_done_at", 0.0)
            if done_at and post_sample.called:
                # The part of post_sample that ran before the device's results were ready.
                self.totals["hidden"] += max(
                    0.0, min(post_sample.ended_at, done_at) - post_sample.started_at)
                self.calls["hidden"] += 1
            return out

        engine.backend.execute = reporting_execute
        self._patched.append((engine.backend, "execute"))
        if collect is not None and submit is not None:
            engine.backend.collect = reporting_collect
            engine.backend.submit = reporting_submit
            self._patched += [(engine.backend, "collect"), (engine.backend, "submit")]
        for obj, attr, kind in ((engine.backend, "forward", "device"),
                                (engine.backend, "sample", "device"),
                                (engine.backend, "to_host", "device"),
                                (engine.output_processor, "finalize", "finalize")):
            try:
                setattr(obj, attr, _Clock(getattr(obj, attr), self, kind))
                self._patched.append((obj, attr))
            except AttributeError:  # __slots__ objects: leave them alone
                pass

    def restore(self) -> None:
        for obj, attr in self._patched:
            try:
                delattr(obj, attr)
            except AttributeError:
                pass
        self._patched.clear()


def breakdown_from(phases: dict[str, float], num_steps: int, wall_s: float,
                   timer: StepTimer, finalize_in_execute: bool = True) -> dict[str, Any]:
    """The ``breakdown`` JSON object of one run (documented in docs/benchmarks.md).
    ``finalize_in_execute``: the engine's own step, whose ``post_sample`` and grammar
    bitmask ran inside ``execute``'s clock (the step loops of async scheduling and the
    pipeline time them apart)."""
    execute, post = phases.get("execute", 0.0), phases.get("post_sample", 0.0)
    if timer.calls["device"]:
        device, source = timer.totals["device"], "measured"
    elif timer.calls["reported"]:
        device, source = timer.totals["reported"], "reported"
    else:
        device, source = max(0.0, execute - post), "estimated"
    finalize = timer.totals["finalize"] if timer.calls["finalize"] else post + phases["drain"]
    if timer.calls["hidden"]:
        # The backend said when each step's results were ready: exact, and blind to the
        # transfer overheads that the estimate below charges to the overlap.
        hidden, hidden_source = min(post, timer.totals["hidden"]), "timestamps"
    else:
        # Inside execute the forward and post_sample either ran one after the other
        # (execute ~ device + post) or side by side (execute ~ max(device, post)): what
        # execute saved against running them in a row is the finalize time that was hidden.
        hidden, hidden_source = min(post, max(0.0, device + post - execute)), "estimated"
    # post_sample's clock also holds what it does beside finalizing (the grammar bitmask,
    # the call itself): on a busy host that made more finalize "hidden" than there was.
    hidden = min(hidden, finalize)
    steps = max(num_steps, 1)
    host = phases["schedule"] + phases["prepare"] + phases["commit"] + phases["drain"]
    spans = sorted(timer.spans)
    gaps = [max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
    launches = sorted(timer.launches)
    return {
        "num_steps": num_steps,
        "wall_s": wall_s,
        "phases_s": dict(phases),
        "per_step_ms": {k: 1000 * v / steps for k, v in phases.items()},
        "device_s": device,
        "device_source": source,
        "device_per_step_ms": 1000 * device / steps,
        "finalize_s": finalize,
        "finalize_in_execute_s": post,
        "hidden_finalize_s": hidden,
        "hidden_source": hidden_source,
        "exposed_finalize_s": max(0.0, finalize - hidden),
        "hidden_fraction": hidden / finalize if finalize > 0 else 0.0,
        "host_critical_s": host,
        "exposed_host_s": sum(gaps) if gaps else None,
        "exposed_host_per_step_ms": 1000 * sum(gaps) / len(gaps) if gaps else None,
        "launch_per_step_ms": 1000 * sum(launches) / len(launches) if launches else None,
        "launch_p50_ms": 1000 * launches[(len(launches) - 1) // 2] if launches else None,
        "launch_p90_ms": 1000 * launches[int(0.9 * (len(launches) - 1))] if launches else None,
        # What no phase timed; phases timed inside execute are not taken twice.
        "other_s": max(0.0, wall_s - sum(phases.values()) + (
            post + phases.get("bitmask", 0.0) if finalize_in_execute else 0.0)),
        "device_idle_fraction": max(0.0, 1.0 - device / wall_s) if wall_s > 0 else 0.0,
    }


def run_floor_of(engine: Any, workload: Any, prompts: list[list[int]], out_lens: list[int],
                 batch_size: int, progress: bool = False) -> dict[str, Any]:
    """``run_floor`` on an engine's backend, with the engine's block and token budgets and
    the workload's sampling parameters."""
    cfg = engine.config
    return run_floor(engine.backend, prompts, out_lens,
                     [workload.sampling_params(n) for n in out_lens], batch_size,
                     cfg.cache_config.block_size, engine.num_blocks,
                     cfg.scheduler_config.max_num_batched_tokens, progress)


def run_floor(backend: Any, prompts: list[list[int]], out_lens: list[int], params: list[Any],
              batch_size: int, block_size: int, num_blocks: int, max_batched_tokens: int,
              progress: bool = False) -> dict[str, Any]:
    """Forward+sample on the engine's batch shapes; returns a run record named ``floor``."""
    totals = {"prefill": 0.0, "decode": 0.0}
    num_out, num_steps = 0, 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc="floor", dynamic_ncols=True)
    start = time.perf_counter()
    for g0 in range(0, len(prompts), batch_size):
        idx = list(range(g0, min(g0 + batch_size, len(prompts))))
        reqs = [Request(f"floor-{i}", prompts[i], params[i]) for i in idx]
        tables = _allocate(reqs, [out_lens[i] for i in idx], block_size, num_blocks)
        for mi, live in _prefill_inputs(reqs, tables, block_size, max_batched_tokens):
            totals["prefill"] += _step(backend, mi, live)
            num_steps += 1
        limits = {id(r): out_lens[i] for r, i in zip(reqs, idx)}
        while live := [r for r in reqs if len(r.output_token_ids) < limits[id(r)]]:
            totals["decode"] += _step(backend, _decode_input(live, tables, block_size), live)
            num_steps += 1
        num_out += sum(len(r.output_token_ids) for r in reqs)
        if bar is not None:
            bar.update(len(idx))
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    device = totals["prefill"] + totals["decode"]
    num_in = sum(len(p) for p in prompts)
    return {
        "name": "floor", "batch_size": batch_size, "num_prompts": len(prompts),
        "num_input_tokens": num_in, "num_output_tokens": num_out, "num_steps": num_steps,
        "elapsed_s": elapsed, "device_s": device, "prefill_s": totals["prefill"],
        "decode_s": totals["decode"],
        "requests_per_s": len(prompts) / device,
        "total_tokens_per_s": (num_in + num_out) / device,
        "output_tokens_per_s": num_out / device,
    }


def _allocate(reqs: list[Request], out_lens: list[int], block_size: int,
              num_blocks: int) -> dict[int, list[int]]:
    tables, next_block = {}, 0
    for r, n in zip(reqs, out_lens):
        need = -(-(len(r.prompt_token_ids) + n) // block_size)
        tables[id(r)] = list(range(next_block, next_block + need))
        next_block += need
    if next_block > num_blocks:
        raise ValueError(f"the floor needs {next_block} KV blocks for a batch of {len(reqs)} "
                         f"but the cache has {num_blocks}; lower the batch size or give the "
                         "KV cache more memory (--cpu-kv-cache-gb)")
    return tables


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _prefill_inputs(reqs: list[Request], tables: dict[int, list[int]], block_size: int,
                    budget: int):
    """Pack prompt chunks into steps of at most ``budget`` tokens (chunking long prompts)."""
    pending = [(r, 0) for r in reqs]
    while pending:
        chunks, used, rest = [], 0, []
        for r, done in pending:
            n = len(r.prompt_token_ids) - done
            take = min(n, budget - used)
            if take <= 0:
                rest.append((r, done))
                continue
            chunks.append((r, done, done + take))
            used += take
            if done + take < len(r.prompt_token_ids):
                rest.append((r, done + take))
        pending = rest
        ids, pos, slots, qlens, slens, tabs, sample_idx, live = [], [], [], [], [], [], [], []
        for k, (r, s, e) in enumerate(chunks):
            t = tables[id(r)]
            ids += r.prompt_token_ids[s:e]
            pos += range(s, e)
            slots += _slots(t, s, e, block_size)
            qlens.append(e - s)
            slens.append(e)
            tabs.append(t)
            if e == len(r.prompt_token_ids):
                sample_idx.append(k)
                live.append(r)
        yield ModelInput(ids, pos, slots, qlens, slens, tabs, 0, sample_idx,
                         build_sampling_metadata(live)), live


def _decode_input(live: list[Request], tables: dict[int, list[int]],
                  block_size: int) -> ModelInput:
    ids, pos, slots, tabs = [], [], [], []
    for r in live:
        p = r.num_tokens - 1
        t = tables[id(r)]
        ids.append(r.output_token_ids[-1])
        pos.append(p)
        slots.append(t[p // block_size] * block_size + p % block_size)
        tabs.append(t)
    n = len(live)
    return ModelInput(ids, pos, slots, [1] * n, [p + 1 for p in pos], tabs, n,
                      list(range(n)), build_sampling_metadata(live))


def _step(backend: Any, mi: ModelInput, live: list[Request]) -> float:
    t = time.perf_counter()
    out = backend.to_host(backend.sample(backend.forward(mi), mi.sampling))
    dt = time.perf_counter() - t
    for r, tok in zip(live, out.sampled_token_ids):
        r.output_token_ids.append(tok)
    return dt
