"""``engine bench compare --rounds N``: the engine runs of one batch size interleaved.

Two strategies that differ by a few per cent cannot be told apart by one run of each on a
shared machine, where the same run varies by 10-30 % from one minute to the next. Here every
engine of the comparison is built and warmed up once and kept alive (an idle engine waits on
a pipe and costs nothing), then the runs go in rounds: each round generates a fresh set of
prompts (so the prefix cache of an earlier round gives nothing away) through every engine
in turn, the order rotating from round to round so that none always goes first. What the
machine does over minutes then touches both sides of a pair alike, and each round gives one
paired ratio. The summary is the geometric mean of those ratios with a 95 % interval from
their spread (Student's t over the log ratios), and how many rounds each side won.

``sync`` runs on the ``async`` engine, with async output processing off for its runs:
otherwise the pair would compare two worker processes as well as two strategies.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from typing import Any

from cadence.bench.floor import run_floor_of
from cadence.bench.report import format_table
from cadence.bench.throughput import (
    Workload,
    build_engine,
    release_engine,
    run_engine,
    vocab_size_of,
    warm_up,
)

# The ratios a comparison reports, numerator first, where both runs were made.
PAIRS = (("async", "sync"), ("async_sched", "async"), ("async_sched", "sync"),
         ("lora", "async"), ("spec", "async"), ("quant", "async"), ("async", "floor"),
         ("async_sched", "floor"), ("sync", "floor"))

# Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom; beyond, the value
# at the low end of each range (a slightly wider interval, never a narrower one).
_T95_BEYOND = ((40, 2.042), (60, 2.021), (120, 2.000))
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(df: int) -> float:
    if df <= len(_T95):
        return _T95[df - 1]
    return next((t for upto, t in _T95_BEYOND if df <= upto), 1.980)


def median_records(records: list[dict]) -> list[dict]:
    """One record per run, batch size and host work, with the median output tok/s of its
    rounds (what a chart draws)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("output_tokens_per_s"):
            groups.setdefault((r["name"], r.get("host_work"), r["batch_size"]), []).append(r)
    return [{**rs[0], "output_tokens_per_s": statistics.median(
        x["output_tokens_per_s"] for x in rs)} for rs in groups.values()]


def round_workload(workload: Workload, rnd: int) -> Workload:
    """Round ``rnd``'s prompts and lengths: the same for every engine of the round, new for
    each round."""
    return dataclasses.replace(workload, seed=workload.seed + 7919 * rnd)


def needed_modes(modes: dict[str, dict], runs: list[str]) -> list[tuple[str, dict]]:
    """The engine modes to build for ``runs``: those asked for, and ``async`` for the floor,
    which runs on its backend."""
    return [(m, o) for m, o in modes.items() if m in runs or (m == "async" and "floor" in runs)]


def build_mode_engine(ns: argparse.Namespace, mode: str, overrides: dict, bs: int,
                      num_prompts: int) -> tuple[Any, dict | None]:
    """The engine of one run (``mode``), or None and the run's ``skipped`` record when the
    backend refuses async scheduling (the other runs go on)."""
    if overrides.get("speculative_config") and getattr(ns, "speculative_config", None):
        overrides = {**overrides, "speculative_config": ns.speculative_config}
    if overrides.get("quantization") and getattr(ns, "quantization", None):
        overrides = {**overrides, "quantization": ns.quantization}
    if overrides.get("quantization") and getattr(ns, "quant_model", None):
        # The checkpoint's quantization_config names its method unless --quantization does.
        overrides = {**overrides, "model": ns.quant_model,
                     "quantization": getattr(ns, "quantization", None)}
    try:
        return build_engine(ns, max_num_seqs=bs, **overrides), None
    except ValueError as e:
        if mode != "async_sched":
            raise
        return None, {"name": mode, "batch_size": bs, "num_prompts": num_prompts,
                      "output_tokens_per_s": None, "skipped": str(e)}


def interleaved_runs(ns: argparse.Namespace, runs: list[str], modes: dict[str, dict],
                     workload: Workload, bs: int, rounds: int, on_engine: Any
                     ) -> tuple[list[dict], list[list[int]] | None]:
    """Every run of ``runs`` (engine modes of ``modes`` and ``floor``) at batch size ``bs``,
    ``rounds`` times, interleaved. Returns one record per run per round (``round`` set) and
    the first round's prompts (None when no engine could run)."""
    names = [m for m in modes if m in runs] + (["floor"] if "floor" in runs else [])
    engines: dict[str, Any] = {}
    out: list[dict] = []
    try:
        needed = needed_modes(modes, runs)
        for mode, overrides in needed:
            if mode == "sync" and any(m == "async" for m, _ in needed):
                continue  # runs on the async engine (_run)
            engine, skipped = build_mode_engine(ns, mode, overrides, bs, workload.num_prompts)
            if skipped is not None:
                out.append(skipped)
                names.remove(mode)
            else:
                engines[mode] = engine
        if not names:  # the one engine run asked for cannot run on this backend
            return out, None
        first = next(iter(engines.values()))
        on_engine(first)
        vocab = vocab_size_of(first)
        prompts0 = workload.prompts(vocab, first.tokenizer)
        for engine in engines.values():
            warm_up(engine, workload, prompts0, bs)
        for rnd in range(rounds):
            wl = round_workload(workload, rnd)
            prompts, out_lens = wl.prompts(vocab, first.tokenizer), wl.output_lens()
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                if name == "floor":
                    rec = run_floor_of(engines["async"], wl, prompts, out_lens, bs,
                                       not ns.disable_tqdm)
                else:
                    rec = _run(engines, name, wl, prompts, out_lens, ns)
                rec["round"] = rnd
                out.append(rec)
    finally:
        release_all(list(engines.values()))
    return out, prompts0


def _run(engines: dict[str, Any], name: str, wl: Workload, prompts: list[list[int]],
         out_lens: list[int], ns: argparse.Namespace) -> dict:
    """One engine run of a round. ``sync`` runs on the ``async`` engine, where there is one,
    with async output processing switched off for the run: two engines of the same
    configuration differ by 1-4 % in throughput here, persistently (their worker processes),
    which is as much as the pair's ratio is asked to resolve. The switch is safe between
    runs: a run ends with nothing pending, and the engine reads the flag at every step.

    Every run starts with an empty prefix cache: the runs of a round share their prompts,
    so on a shared engine the second would reuse the first's prompt blocks, and the floor
    writes the async engine's KV blocks behind its block manager's back."""
    engine = engines.get(name)
    shared = engine is None and name == "sync"
    if shared:
        engine = engines["async"]
    if not engine.reset_prefix_cache():
        raise RuntimeError(f"the {name!r} engine still has requests before its run")
    if shared:
        engine.async_output = False
    try:
        return run_engine(engine, wl, prompts, out_lens, ns.breakdown, not ns.disable_tqdm,
                          name)
    finally:
        if shared:
            engine.async_output = True


def release_all(engines: list[Any]) -> None:
    """Shut every engine down, even when one of them fails to; the first failure is raised."""
    error: BaseException | None = None
    for engine in engines:
        try:
            release_engine(engine)
        except BaseException as e:  # noqa: BLE001  # the rest are released first
            error = error or e
    if error is not None:
        raise error


def paired_summary(records: list[dict]) -> list[dict]:
    """Per (host work, batch size) and pair of runs: the per-round ratios, their geometric
    mean, its 95 % interval and the rounds the numerator won."""
    cells: dict[tuple, dict[int, dict[str, float]]] = {}
    for r in records:
        if "round" not in r or not r.get("output_tokens_per_s"):
            continue
        key = (r.get("host_work"), r["batch_size"])
        cells.setdefault(key, {}).setdefault(r["round"], {})[r["name"]] = \
            r["output_tokens_per_s"]
    out = []
    for (hw, bs), by_round in cells.items():
        for num, den in PAIRS:
            ratios = [v[num] / v[den] for v in by_round.values() if num in v and den in v]
            if len(ratios) < 2:
                continue
            logs = [math.log(x) for x in ratios]
            mean = statistics.fmean(logs)
            half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
            out.append({"host_work": hw, "batch_size": bs, "pair": f"{num}/{den}",
                        "rounds": len(ratios), "ratios": ratios,
                        "geomean": math.exp(mean), "ci95_low": math.exp(mean - half),
                        "ci95_high": math.exp(mean + half),
                        "wins": sum(x >= 1.0 for x in ratios)})
    return out


def print_paired(summary: list[dict]) -> None:
    if not summary:
        return
    rows = [{**s, "ci95": f"{s['ci95_low']:.3f}..{s['ci95_high']:.3f}",
             "won": f"{s['wins']}/{s['rounds']}",
             "range": f"{min(s['ratios']):.3f}..{max(s['ratios']):.3f}"} for s in summary]
    print("\npaired ratios over interleaved rounds (output tok/s of the pair in each round):")
    print(format_table(rows, ["host_work", "batch_size", "pair", "geomean", "ci95", "range",
                              "won"],
                       ["host work", "batch", "pair", "geo-mean", "95 % interval", "range",
                        "rounds won"]))
