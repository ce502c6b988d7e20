"""``engine bench compare --rounds N``: interleaved rounds and their paired ratios.

Speed is not asserted (benchmarks carry speed claims): the order of the runs, the fresh
prompts of each round and the statistics of the summary are.
"""

from __future__ import annotations

import json
import math

import pytest

from cadence.bench.rounds import median_records, paired_summary, round_workload, t95
from cadence.bench.throughput import Workload
from cadence.cli.main import main

WORKLOAD = ["--input-len", "8", "--output-len", "4", "--disable-tqdm",
            "--cpu-kv-cache-gb", "0.05"]


def _rec(name: str, rnd: int, tps: float, bs: int = 8) -> dict:
    return {"name": name, "round": rnd, "batch_size": bs, "host_work": "light",
            "output_tokens_per_s": tps}


def test_paired_summary_geomean_interval_and_wins():
    ratios = [1.10, 0.95, 1.02, 1.05]
    recs = []
    for rnd, q in enumerate(ratios):
        recs += [_rec("sync", rnd, 100.0 + rnd), _rec("async", rnd, (100.0 + rnd) * q)]
    recs.append(_rec("async", 9, 50.0))  # a round without its pair adds nothing
    (s,) = paired_summary(recs)
    assert s["pair"] == "async/sync" and s["rounds"] == 4 and s["wins"] == 3
    assert s["ratios"] == pytest.approx(ratios)
    logs = [math.log(q) for q in ratios]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    assert s["geomean"] == pytest.approx(math.exp(mean))
    assert s["ci95_low"] == pytest.approx(math.exp(mean - 3.182 * sd / 2))
    assert s["ci95_high"] == pytest.approx(math.exp(mean + 3.182 * sd / 2))
    assert s["ci95_low"] < s["geomean"] < s["ci95_high"]


def test_paired_summary_keeps_cells_apart_and_needs_two_rounds():
    recs = [_rec("async", r, 10.0 * (r + 1), bs) for r in range(2) for bs in (1, 4)]
    recs += [_rec("sync", r, 10.0, bs) for r in range(2) for bs in (1, 4)]
    recs += [_rec("floor", 0, 10.0, 1)]
    out = {(s["batch_size"], s["pair"]): s for s in paired_summary(recs)}
    assert set(out) == {(1, "async/sync"), (4, "async/sync")}
    assert out[1, "async/sync"]["ratios"] == pytest.approx([1.0, 2.0])
    assert paired_summary([_rec("async", 0, 1.0), _rec("sync", 0, 1.0)]) == []


def test_t_quantiles():
    assert t95(1) == pytest.approx(12.706) and t95(7) == pytest.approx(2.365)
    assert t95(31) == pytest.approx(2.042) and t95(200) == pytest.approx(1.98)
    assert all(t95(d) >= t95(d + 1) for d in range(1, 300))


def test_median_records_one_point_per_run():
    recs = [_rec("async", r, v) for r, v in enumerate((3.0, 1.0, 2.0))] + [_rec("sync", 0, 5.0)]
    med = {r["name"]: r["output_tokens_per_s"] for r in median_records(recs)}
    assert med == {"async": 2.0, "sync": 5.0}


def test_each_round_has_its_own_prompts():
    w = Workload(input_len=6, num_prompts=3, output_len_range=(1, 9))
    p = [round_workload(w, r).prompts(1000) for r in range(3)]
    assert p[0] == w.prompts(1000) and p[1] != p[0] and p[2] != p[1]
    assert round_workload(w, 1).prompts(1000) == p[1]  # the same for every engine of a round
    assert round_workload(w, 1).output_lens() == round_workload(w, 1).output_lens()


def test_compare_rounds_interleave_and_rotate(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "rounds.json"
    rc = main(["bench", "compare", "--model", tiny_model_dir("llama"), "--num-prompts", "2",
               "--batch-sizes", "2", "--runs", "async,sync,floor", "--skip-hf",
               "--rounds", "2", "--cpu-overlap", "thread", *WORKLOAD, "--output-json",
               str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    order = [(r["round"], r["name"]) for r in data["runs"]]
    assert order == [(0, "async"), (0, "sync"), (0, "floor"),
                     (1, "sync"), (1, "floor"), (1, "async")]
    for r in data["runs"]:
        assert r["num_output_tokens"] == 8 and r["output_tokens_per_s"] > 0
        if r["name"] != "floor":  # the ratios are the round's own
            floor = next(x for x in data["runs"]
                         if x["round"] == r["round"] and x["name"] == "floor")
            assert r["ratio_to_floor"] == pytest.approx(
                r["output_tokens_per_s"] / floor["output_tokens_per_s"])
    pairs = {s["pair"]: s for s in data["paired"]}
    assert set(pairs) == {"async/sync", "async/floor", "sync/floor"}
    by = {(r["round"], r["name"]): r["output_tokens_per_s"] for r in data["runs"]}
    assert pairs["async/sync"]["ratios"] == pytest.approx(
        [by[i, "async"] / by[i, "sync"] for i in range(2)])
    assert "paired ratios over interleaved rounds" in capsys.readouterr().out


def test_async_and_sync_rounds_share_one_engine(tiny_model_dir, tmp_path, monkeypatch):
    """Two engines of one configuration differ by a few per cent here (their worker
    processes), so ``sync`` runs on the ``async`` engine with async output processing off
    for its runs, each run reports the mode it ran in, and each starts with an empty prefix
    cache."""
    from cadence.bench import rounds

    built = []
    build = rounds.build_engine

    def counting_build(ns, **overrides):
        built.append(overrides)
        return build(ns, **overrides)

    monkeypatch.setattr(rounds, "build_engine", counting_build)
    cached_at_start = []
    run = rounds.run_engine

    def cold_run(engine, *args, **kwargs):
        cached_at_start.append(engine.block_manager.num_cached_blocks)
        return run(engine, *args, **kwargs)

    monkeypatch.setattr(rounds, "run_engine", cold_run)
    out = tmp_path / "shared.json"
    rc = main(["bench", "compare", "--model", tiny_model_dir("llama"), "--num-prompts", "2",
               "--batch-sizes", "2", "--runs", "async,sync", "--skip-hf", "--rounds", "3",
               "--cpu-overlap", "thread", *WORKLOAD, "--input-len", "40",
               "--output-json", str(out)])
    assert rc == 0
    assert len(built) == 1 and not built[0].get("disable_async_output_proc")
    runs = json.loads(out.read_text())["runs"]
    assert [(r["round"], r["name"]) for r in runs] == [
        (0, "async"), (0, "sync"), (1, "sync"), (1, "async"), (2, "async"), (2, "sync")]
    assert all(r["async_output"] == (r["name"] == "async") for r in runs)
    # The runs of a round share their prompts: the second must not find the first's.
    assert cached_at_start == [0] * 6


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--rounds", "2", "--peer", "vllm", "--peer-python", "/nonexistent/python"],
     "against a peer the rounds are --peer-rounds"),
    (["--rounds", "2", "--runs", "hf_generate"], "--rounds interleaves engine runs"),
])
def test_compare_rounds_bad_flags(tiny_model_dir, capsys, argv, message):
    rc = main(["bench", "compare", "--model", tiny_model_dir("llama"), "--skip-hf", *argv,
               *WORKLOAD])
    assert rc == 2 and message in capsys.readouterr().err


def test_compare_runs_the_transformers_baselines_after_every_engine_run(
        tiny_model_dir, monkeypatch, tmp_path):
    """The baselines load torch into the bench process, which is the engine process: no
    engine run may come after one (cadence.cpuinfo.torch_facts says why it matters)."""
    from cadence.bench import compare, hf_baselines

    calls: list[tuple[str, int]] = []

    def engine_runs(ns, runs, workload, bs, prompts, info):
        calls.append(("engine", bs))
        return ([{"name": "async", "batch_size": bs, "num_prompts": 2,
                  "output_tokens_per_s": 10.0 * bs}], [[1, 2, 3]] * 2)

    def hf_runs(ns, runs, hf_model, workload, bs, prompts):
        assert hf_model == "hf-model" and prompts == [[1, 2, 3]] * 2
        calls.append(("hf", bs))
        return [{"name": "hf_generate", "batch_size": bs, "num_prompts": 2,
                 "output_tokens_per_s": 5.0 * bs}]

    monkeypatch.setattr(compare, "_engine_runs", engine_runs)
    monkeypatch.setattr(compare, "_hf_runs", hf_runs)
    monkeypatch.setattr(hf_baselines, "load_hf_model", lambda path, dtype: "hf-model")
    out = tmp_path / "order.json"
    rc = main(["bench", "compare", "--model", tiny_model_dir("llama"), "--num-prompts", "2",
               "--batch-sizes", "1,2", "--host-work", "light,heavy", "--runs",
               "async,hf_generate", *WORKLOAD, "--output-json", str(out)])
    assert rc == 0
    engine_calls = [("engine", bs) for _ in range(2) for bs in (1, 2)]
    assert calls == engine_calls + [("hf", bs) for _ in range(2) for bs in (1, 2)]
    data = json.loads(out.read_text())
    # The records keep their cells together, each cell's ratios its own.
    assert [(r["host_work"], r["batch_size"], r["name"]) for r in data["runs"]] == [
        (hw, bs, name) for hw in ("light", "heavy") for bs in (1, 2)
        for name in ("async", "hf_generate")]


def test_compare_refuses_baselines_without_an_engine_run_before_running(
        tiny_model_dir, monkeypatch, capsys):
    from cadence.bench import compare

    def no_engine(*a, **kw):
        raise AssertionError("nothing may run before the refusal")

    monkeypatch.setattr(compare, "_engine_runs", no_engine)
    rc = main(["bench", "compare", "--model", tiny_model_dir("llama"), "--runs",
               "hf_generate,hf_generate_batch", *WORKLOAD])
    assert rc == 2 and "hf runs need an engine run" in capsys.readouterr().err
