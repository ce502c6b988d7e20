"""`engine bench` runs on a tiny model and writes the JSON keys docs/benchmarks.md documents.

Speed is not asserted here (benchmarks carry speed claims); only shapes, keys and sanity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.cli.main import main

WORKLOAD = ["--input-len", "8", "--output-len", "6", "--disable-tqdm",
            "--cpu-kv-cache-gb", "0.05"]
TOP_KEYS = {"output_tokens_per_s", "requests_per_s", "total_tokens_per_s", "elapsed_s",
            "num_prompts", "num_input_tokens", "num_output_tokens", "batch_size", "name",
            "host_work", "async_output", "config", "env"}
ENV_KEYS = {"torch", "cpu_count", "dtype", "backend", "git_commit", "transformers", "date",
            "plugins_env"}
BREAKDOWN_KEYS = {"num_steps", "wall_s", "phases_s", "per_step_ms", "device_s",
                  "device_source", "device_per_step_ms", "finalize_s", "finalize_in_execute_s",
                  "hidden_finalize_s", "hidden_source", "exposed_finalize_s", "hidden_fraction",
                  "host_critical_s", "other_s", "device_idle_fraction"}
PHASES = {"schedule", "prepare", "execute", "post_sample", "commit", "drain", "bitmask"}
MACHINE_KEYS = {"cpu_model", "cpu_family", "cpu_model_id", "cpu_flags", "torch_cpu_capability",
                "native_bf16", "cpu_count", "threads", "dtype", "transparent_hugepages"}


def _run(argv: list[str], out: Path) -> dict:
    assert main(argv + ["--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def _check_breakdown(b: dict) -> None:
    assert BREAKDOWN_KEYS <= set(b)
    assert set(b["phases_s"]) == PHASES and set(b["per_step_ms"]) == PHASES
    assert b["num_steps"] > 0 and b["device_source"] in ("measured", "reported", "estimated")
    for k, v in b.items():
        if isinstance(v, (int, float)):
            assert v >= 0, k
    assert all(v >= 0 for v in b["phases_s"].values())
    assert 0 <= b["device_idle_fraction"] <= 1 and 0 <= b["hidden_fraction"] <= 1
    assert b["hidden_finalize_s"] + b["exposed_finalize_s"] == pytest.approx(b["finalize_s"])


@pytest.mark.parametrize("extra", [
    ["--breakdown", "--host-work", "heavy"],
    ["--disable-async-output-proc", "--disable-detokenize", "--output-len-range", "2:5",
     "--temperature", "0"],
])
def test_throughput_json(tiny_model_dir, tmp_path, capsys, extra):
    data = _run(["bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts",
                 "5", *WORKLOAD, *extra], tmp_path / "tp.json")
    assert TOP_KEYS <= set(data) and ENV_KEYS <= set(data["env"])
    machine = data["machine"]
    assert MACHINE_KEYS <= set(machine) and machine["dtype"] == data["env"]["dtype"]
    assert machine["threads"] >= 1 and isinstance(machine["cpu_flags"], list)
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("machine: ") and f"{machine['threads']} threads" in header
    thp = machine["transparent_hugepages"]
    assert header.endswith(f"dtype {machine['dtype']}" + (f" | THP {thp}" if thp else ""))
    assert data["num_prompts"] == 5 and data["num_input_tokens"] == 40
    assert data["output_tokens_per_s"] > 0 and data["requests_per_s"] > 0
    if "--output-len-range" in extra:
        assert data["name"] == "sync" and data["async_output"] is False
        assert 10 <= data["num_output_tokens"] <= 25
        assert "breakdown" not in data
    else:
        assert data["num_output_tokens"] == 30 and data["host_work"] == "heavy"
        _check_breakdown(data["breakdown"])
        # The worker process stamps when each step's results were ready, so the hidden part
        # of finalize is measured, not estimated. How much of it overlaps a tiny model's
        # forward depends on when the OS lets the engine process run after it sends a step
        # (on two busy cores, sometimes only after the forward): the arithmetic is checked
        # with fixed timestamps below, not here.
        assert data["breakdown"]["hidden_source"] == "timestamps"


class _FakeOut:
    def __init__(self, done_at: float) -> None:
        self.device_seconds, self.device_done_at = 0.0, done_at


@pytest.mark.parametrize("overlapped", [True, False])
def test_hidden_finalize_from_timestamps(overlapped):
    """post_sample's span clipped at the moment the device's results were ready."""
    import time
    from types import SimpleNamespace

    from cadence.backend import PostSample
    from cadence.bench.floor import StepTimer, breakdown_from

    def execute(model_input, post_sample):
        if not overlapped:
            done = time.monotonic()
        post_sample()
        if overlapped:
            time.sleep(0.02)  # the device is still busy after post_sample returns
            done = time.monotonic()
        return _FakeOut(done)

    backend = SimpleNamespace(execute=execute)
    engine = SimpleNamespace(backend=backend, output_processor=SimpleNamespace())
    timer = StepTimer(engine)
    post = PostSample(lambda: time.sleep(0.01))
    t0 = time.perf_counter()
    engine.backend.execute(None, post)
    spent = time.perf_counter() - t0
    phases = {"schedule": 0.0, "prepare": 0.0, "commit": 0.0, "drain": 0.0,
              "execute": spent, "post_sample": post.ended_at - post.started_at}
    b = breakdown_from(phases, 1, spent, timer)
    assert b["hidden_source"] == "timestamps"
    if overlapped:
        assert b["hidden_finalize_s"] == pytest.approx(phases["post_sample"])
    else:
        assert b["hidden_finalize_s"] == 0


class _DelayedDevice:
    """A device that starts each step ``delay`` s after it is handed over, runs 5 ms, and
    reports both: an executor-shaped backend (execute is its own submit + collect)."""

    def __init__(self, delay: float) -> None:
        self.delay, self.queue = delay, []

    def submit(self, model_input):
        import time

        time.sleep(self.delay)
        start = time.monotonic()
        time.sleep(0.005)
        out = _FakeOut(time.monotonic())
        out.device_seconds = out.device_done_at - start
        self.queue.append(out)

    def collect(self):
        return self.queue.pop(0)

    def execute(self, model_input, post_sample):
        self.submit(model_input)
        post_sample()
        return self.collect()


@pytest.mark.parametrize("shape", ["execute", "submit_collect"])
def test_launch_latency_and_one_span_per_step(shape):
    """The launch latency is the device's reported start minus the hand-over, and a step
    that goes through an executor's execute (itself submit + collect) counts once."""
    from types import SimpleNamespace

    from cadence.backend import PostSample
    from cadence.bench.floor import StepTimer, breakdown_from

    backend = _DelayedDevice(0.01)
    engine = SimpleNamespace(backend=backend, output_processor=SimpleNamespace())
    timer = StepTimer(engine)
    if shape == "execute":
        for _ in range(3):
            backend.execute(None, PostSample(None))
    else:  # async scheduling: two steps in flight, collected oldest first
        backend.submit(None)
        for _ in range(2):
            backend.submit(None)
            backend.collect()
        backend.collect()
    timer.restore()
    assert timer.calls["reported"] == 3 and len(timer.spans) == 3
    assert len(timer.launches) == 3
    phases = {"schedule": 0.0, "prepare": 0.0, "commit": 0.0, "drain": 0.0}
    b = breakdown_from(phases, 3, 0.1, timer)
    assert all(0.009 <= t < 0.06 for t in timer.launches)
    assert 9 <= b["launch_per_step_ms"] < 60
    assert b["launch_p50_ms"] <= b["launch_p90_ms"] < 60
    assert "submit" not in vars(backend) and "collect" not in vars(backend)


def test_launch_pairing_survives_a_failed_collect():
    """A collect that raises drops its hand-over and any other in flight, so the steps
    after it are paired with their own hand-overs, not older ones."""
    from types import SimpleNamespace

    from cadence.bench.floor import StepTimer

    backend = _DelayedDevice(0.0)
    failing = [False]
    collect = backend.collect

    def flaky_collect():
        out = collect()
        if failing[0]:
            failing[0] = False
            raise RuntimeError("the step failed")
        return out

    backend.collect = flaky_collect
    engine = SimpleNamespace(backend=backend, output_processor=SimpleNamespace())
    timer = StepTimer(engine)
    backend.submit(None)
    backend.submit(None)
    failing[0] = True
    with pytest.raises(RuntimeError):
        backend.collect()
    backend.queue.clear()  # the loop discards the other step in flight
    import time

    time.sleep(0.03)  # a stale hand-over would now read as a 30 ms launch
    backend.submit(None)
    backend.collect()
    timer.restore()
    assert len(timer.launches) == 1 and timer.launches[0] < 0.02


def test_compare_without_hf(tiny_model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    chart = tmp_path / "chart.png"
    data = _run(["bench", "compare", "--model", tiny_model_dir("llama"), "--num-prompts", "4",
                 "--batch-sizes", "2", "--waves", "1", "--skip-hf", "--breakdown",
                 "--chart", str(chart), *WORKLOAD], tmp_path / "cmp.json")
    assert chart.stat().st_size > 1000
    assert {"runs", "config", "env", "machine", "elapsed_s"} <= set(data)
    names = [(r["name"], r["batch_size"]) for r in data["runs"]]
    assert sorted(names) == sorted((n, b) for n in ("async", "async_sched", "sync", "floor")
                                   for b in (2,))
    for r in data["runs"]:
        assert r["output_tokens_per_s"] > 0 and r["num_prompts"] == r["batch_size"]
        assert r["num_output_tokens"] == 6 * r["num_prompts"]
        assert r["ratio_to_floor"] > 0
        if r["name"] == "floor":
            assert r["ratio_to_floor"] == 1.0 and r["device_s"] > 0
        else:
            _check_breakdown(r["breakdown"])
            assert r["breakdown"]["device_slowdown_vs_floor"] > 0


def test_compare_lora_run(tiny_model_dir, tmp_path):
    """The lora run: every request under one of --max-loras random adapters, against the
    async run on the same prompts."""
    data = _run(["bench", "compare", "--model", tiny_model_dir("llama"), "--num-prompts", "4",
                 "--runs", "async,lora", "--max-loras", "2", "--max-lora-rank", "8",
                 "--cpu-overlap", "sync",
                 *WORKLOAD], tmp_path / "cmp.json")
    runs = {r["name"]: r for r in data["runs"]}
    assert runs["async"]["lora_adapters"] == 0 and runs["lora"]["lora_adapters"] == 2
    assert runs["lora"]["num_output_tokens"] == runs["async"]["num_output_tokens"] == 24
    assert runs["lora"]["ratio_to_async"] > 0


def test_compare_quant_run(tiny_model_dir, tmp_path):
    """The quant run: --quantization names its method; the async run keeps the checkpoint's
    weights, and each record says which dtype and weights it ran."""
    data = _run(["bench", "compare", "--model", tiny_model_dir("llama"), "--num-prompts", "4",
                 "--runs", "async,quant", "--quantization", "int8", "--cpu-overlap", "sync",
                 *WORKLOAD], tmp_path / "cmp.json")
    runs = {r["name"]: r for r in data["runs"]}
    assert runs["async"]["quantization"] is None and runs["quant"]["quantization"] == "int8"
    assert runs["quant"]["dtype"] == "float32"
    assert runs["quant"]["num_output_tokens"] == runs["async"]["num_output_tokens"] == 24
    assert runs["quant"]["ratio_to_async"] > 0


def test_compare_quant_run_on_a_packed_checkpoint(tiny_model_dir, tmp_path):
    """--quant-model: the quant run loads an AWQ checkpoint of the model, whose config
    names the method."""
    from cadence.testing.packed_checkpoint import write_packed

    packed, _ = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
    data = _run(["bench", "compare", "--model", tiny_model_dir("llama"), "--num-prompts", "4",
                 "--runs", "async,quant", "--quant-model", packed, "--cpu-overlap", "sync",
                 *WORKLOAD], tmp_path / "cmp.json")
    runs = {r["name"]: r for r in data["runs"]}
    assert runs["async"]["quantization"] is None and runs["quant"]["quantization"] == "awq"
    assert runs["quant"]["num_output_tokens"] == runs["async"]["num_output_tokens"] == 24


def test_compare_with_hf_generate(tiny_model_dir, tmp_path):
    data = _run(["bench", "compare", "--model", tiny_model_dir("llama"), "--num-prompts", "3",
                 "--runs", "floor,hf_generate,hf_generate_batch", *WORKLOAD],
                tmp_path / "cmp.json")
    runs = {r["name"]: r for r in data["runs"]}
    assert set(runs) == {"floor", "hf_generate", "hf_generate_batch"}
    hf = runs["hf_generate"]
    assert hf["batch_size"] == 3 and hf["num_output_tokens"] == 18
    assert hf["output_tokens_per_s"] > 0 and hf["num_computed_tokens"] == 18
    batch = runs["hf_generate_batch"]
    # Either it ran, or it says why not; never a silent gap.
    assert batch.get("output_tokens_per_s") or batch.get("skipped")


def test_scale_reports_both_queue_lengths(tiny_model_dir, tmp_path):
    data = _run(["bench", "scale", "--model", tiny_model_dir("llama"), "--num-queued", "2,40",
                 "--batch-size", "2", "--num-steps", "3", *WORKLOAD], tmp_path / "scale.json")
    by_q = {r["num_queued"]: r for r in data["scale"]}
    assert MACHINE_KEYS <= set(data["machine"])
    assert set(by_q) == {2, 40}
    assert by_q[40]["num_waiting"] == 40 and by_q[40]["num_running"] == 2
    for r in by_q.values():
        assert r["num_steps"] == 3
        assert all(v >= 0 for v in r["per_step_ms"].values())


def test_bad_flags_are_value_errors(tiny_model_dir, capsys):
    rc = main(["bench", "compare", "--model", tiny_model_dir("llama"), "--runs", "nope",
               *WORKLOAD])
    assert rc == 2 and "runs must be a subset" in capsys.readouterr().err
    rc = main(["bench", "throughput", "--model", tiny_model_dir("llama"),
               "--output-len-range", "5", *WORKLOAD])
    assert rc == 2


SERVE_KEYS = {"name", "num_prompts", "num_input_tokens", "num_output_tokens", "elapsed_s",
              "request_rate", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
              "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms",
              "tpot_p99_ms", "itl_median_ms", "itl_p99_ms", "ratio_to_offline"}


def test_small_moe_model_for_the_expert_parallel_bench(tiny_model_dir, tmp_path):
    """``make-small-model --num-experts``: a Qwen3-MoE with the source's vocabulary that the
    engine loads and runs (what scripts/perf_expert_parallel.sh measures)."""
    from engine_helpers import generate, make_llm

    from cadence import SamplingParams

    out = tmp_path / "moe"
    assert main(["bench", "make-small-model", "--model", tiny_model_dir("llama"),
                 "--output", str(out), "--num-layers", "2", "--hidden-size", "64",
                 "--num-experts", "4", "--experts-per-token", "2"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    # transformers 5 writes Qwen3-MoE's expert count under Mixtral's name.
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert (experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 24)
    llm = make_llm(str(out))
    try:
        got = generate(llm, ["hello"], SamplingParams(temperature=0.0, max_tokens=3,
                                                      ignore_eos=True))
        assert len(got[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_engine_flags_forwards_only_what_was_set():
    from cadence.bench.serve import engine_flags
    from cadence.cli.main import build_parser

    ns = build_parser().parse_args(["bench", "serve", "--model", "/m", "--cpu-overlap", "sync",
                                    "--no-enable-prefix-caching", "--max-num-seqs", "8",
                                    "--num-prompts", "3"])
    argv = engine_flags(ns)
    assert argv == ["--model", "/m", "--no-enable-prefix-caching", "--max-num-seqs", "8",
                    "--cpu-overlap", "sync"]


@pytest.mark.slow
def test_serve_bench_through_a_server_process(tiny_model_dir, tmp_path):
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    data = _run(["bench", "serve", "--model", tiny_model_dir("llama"), "--num-prompts", "4",
                 *WORKLOAD, "--host-work", "heavy", "--cpu-overlap", "sync",
                 "--request-rate", "50", "--compare-offline"], tmp_path / "serve.json")
    serve, offline = data["runs"]
    assert SERVE_KEYS <= set(serve) and serve["name"] == "serve"
    assert offline["name"] == "offline"
    # ignore_eos: both generate exactly 4 x 6 tokens, counted from the server's usage.
    assert serve["num_output_tokens"] == offline["num_output_tokens"] == 24
    assert serve["request_rate"] == 50 and serve["ttft_median_ms"] > 0
    assert serve["ratio_to_offline"] == pytest.approx(
        serve["output_tokens_per_s"] / offline["output_tokens_per_s"])
    assert ENV_KEYS <= set(data["env"])


def test_warm_up_serves_reversed_prompts_untimed() -> None:
    """Each engine run of compare/throughput first serves ``count`` prompts shaped like the
    measured ones, reversed (no prefix for the cache to give away), for a few tokens."""
    from cadence.bench.throughput import WARMUP_TOKENS, Workload, warm_up

    class Engine:
        def __init__(self) -> None:
            self.added, self.steps = [], 0

        def add_request(self, rid, prompt, params, output_kind=None) -> None:
            self.added.append((rid, prompt["prompt_token_ids"], params.max_tokens))

        def has_unfinished_requests(self) -> bool:
            return self.steps < 3

        def step(self) -> list:
            self.steps += 1
            return []

    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    eng = Engine()
    warm_up(eng, Workload(input_len=3, num_prompts=3), prompts, 2)
    assert [ids for _, ids, _ in eng.added] == [[3, 2, 1], [6, 5, 4]]
    assert {n for _, _, n in eng.added} == {WARMUP_TOKENS} and eng.steps == 3
    assert prompts[0] == [1, 2, 3]  # the measured prompts are untouched


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_reports_both_engines_and_checks_the_vectors(tiny_model_dir, tmp_path,
                                                           pooling):
    res = _run(["bench", "embed", "--model", tiny_model_dir("llama"), "--num-prompts", "5",
                "--rounds", "2", "--hf-batch-size", "2", "--pooling-type", pooling,
                *WORKLOAD], tmp_path / "embed.json")
    assert [r["engine"] for r in res["runs"]] == ["cadence", "hf"] * 2
    assert {r["round"] for r in res["runs"]} == {1, 2}
    assert all(r["prompt_tokens"] == 5 * 8 and r["prompt_tokens_per_s"] > 0
               for r in res["runs"])
    assert res["summary"]["cadence"]["vs_cadence"] == 1.0
    assert res["summary"]["hf"]["rounds"] == 2
    # fp32: cadence's vectors are transformers' (checked on every round).
    assert all(r["max_abs_diff_vs_hf"] < 1e-5 for r in res["runs"] if r["engine"] == "cadence")
    assert res["pooling"] == pooling and MACHINE_KEYS <= set(res["machine"])


def test_edit_prompts_quote_a_passage_and_end_at_eos(tokenizer_dir):
    """--prompt-kind edit: chat prompts asking for a passage back, the same for the same
    seed, stopping at EOS (the answer's end) rather than running to max_tokens."""
    from cadence.bench.texts import PASSAGES
    from cadence.bench.throughput import Workload
    from cadence.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    wl = Workload(num_prompts=5, prompt_kind="edit", seed=3)
    prompts = wl.prompts(1000, tok)
    assert prompts == wl.prompts(1000, tok) and len(prompts) == 5
    texts = [tok.decode(p) for p in prompts]
    assert all(any(p[:40] in t for p in PASSAGES) for t in texts)
    assert not wl.sampling_params(64).ignore_eos
    assert Workload().sampling_params(64).ignore_eos
    with pytest.raises(ValueError, match="prompt_kind must be one of"):
        Workload(prompt_kind="chat")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        wl.prompts(1000)


def test_edit_prompts_are_refused_where_runs_ignore_eos(tiny_model_dir, capsys):
    """The floor, transformers and the peer run every request to its full length: an edit
    comparison with them would compare other work."""
    for extra in (["--runs", "async,floor"], ["--runs", "async,hf_generate"],
                  ["--runs", "async", "--peer", "vllm", "--peer-python", "/nonexistent"]):
        rc = main(["bench", "compare", "--model", tiny_model_dir("llama"), "--prompt-kind",
                   "edit", *extra])
        assert rc == 2 and "--prompt-kind edit compares cadence's engine" in \
            capsys.readouterr().err


@pytest.mark.parametrize("in_execute", [True, False])
def test_other_time_counts_each_second_once(in_execute):
    """The engine's own step times post_sample (and the grammar bitmask) inside execute's
    clock; the step loops of async scheduling and the pipeline time it apart. Either way
    other_s is the wall time no phase covered."""
    from types import SimpleNamespace

    from cadence.bench.floor import StepTimer, breakdown_from

    timer = StepTimer(SimpleNamespace(backend=SimpleNamespace(execute=None),
                                      output_processor=SimpleNamespace()))
    phases = {"schedule": 0.05, "prepare": 0.05, "execute": 0.8, "commit": 0.05,
              "drain": 0.0, "post_sample": 0.3, "bitmask": 0.02}
    wall = 1.0 if in_execute else 1.32
    b = breakdown_from(phases, 4, wall, timer, finalize_in_execute=in_execute)
    assert b["other_s"] == pytest.approx(0.05)


def test_serve_latencies_are_nearest_rank_and_end_at_the_last_chunk():
    """p99 of 1..100 ms is 99 ms (nearest rank, as numpy's is 99.01), not the maximum; TPOT
    runs from the first chunk with text to the last, not to the stream's close."""
    from cadence.bench.serve import _summary

    results = [{"sent": 0.0, "arrivals": [0.001 * i, 0.001 * i + 0.1, 0.001 * i + 0.2],
                "done": 0.001 * i + 0.25, "num_out": 3} for i in range(1, 101)]
    s = _summary(results, 10.0, 100, float("inf"))
    assert s["ttft_p99_ms"] == pytest.approx(99.0)
    assert s["tpot_median_ms"] == pytest.approx(100.0)
    assert s["itl_p99_ms"] == pytest.approx(100.0)
