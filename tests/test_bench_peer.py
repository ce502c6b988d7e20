"""`engine bench compare --peer vllm` with a stand-in peer python: a small script that reads
the workload file, writes plausible figures and logs how it was called. No vLLM needed."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from cadence.bench.peer import (
    PeerError,
    PeerOptions,
    PeerWorkdir,
    check_peer,
    compare_with_peer,
    peer_env,
    peer_options,
    print_peer,
    summarize,
)
from cadence.bench.throughput import Workload
from cadence.cli.main import main

WORKLOAD = ["--input-len", "8", "--output-len", "6", "--disable-tqdm",
            "--cpu-kv-cache-gb", "0.05"]
PEER_KEYS = {"name", "python", "version", "rounds", "configs", "batch_size", "host_work", "env",
             "runs", "cadence_median_tokens_per_s", "peer_median_tokens_per_s",
             "best_peer_config", "best_peer_median_tokens_per_s", "ratio_vs_best_peer"}
RUN_KEYS = {"order", "round", "engine", "config", "output_tokens", "elapsed_s",
            "output_tokens_per_s", "dtype"}
MACHINE_KEYS = {"cpu_model", "cpu_family", "cpu_model_id", "cpu_flags", "torch_cpu_capability",
                "native_bf16", "cpu_count", "threads", "dtype"}

# argv: [peer_vllm.py, --check] or [peer_vllm.py, --input F, --output F, --config C, ...].
# eager takes 2 s and default 1 s for whatever it generates, so default is the faster one.
FAKE_PEER = """#!{python}
import json, os, sys
args = sys.argv[2:]
with open(os.environ["FAKE_PEER_LOG"], "a") as log:
    log.write(json.dumps({{"script": sys.argv[1], "args": args, "env": {{k: os.environ.get(k)
        for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                  "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")}}}}) + "\\n")
if args == ["--check"]:
    print(json.dumps({{"vllm_version": "0.32.0-fake"}}))
    sys.exit(0)
opt = dict(zip(args[::2], args[1::2]))
with open(opt["--input"]) as f:
    work = json.load(f)
with open(os.environ["FAKE_PEER_LOG"] + ".input", "w") as f:
    json.dump(work, f)
if opt.get("--task") == "embed":
    with open(os.path.join(opt["--model"], "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    n = sum(map(len, work["prompts"]))
    with open(opt["--output"], "w") as f:
        json.dump({{"prompt_tokens": n, "elapsed_s": 0.5, "prompt_tokens_per_s": n / 0.5,
                   "vllm_version": "0.32.0-fake", "config": opt["--config"],
                   "dtype": opt["--dtype"], "first_embedding": [0.0] * hidden}}, f)
    sys.exit(0)
out = sum(work["max_tokens"])
elapsed = {{"eager": 2.0, "default": 1.0}}[opt["--config"]]
with open(opt["--output"], "w") as f:
    json.dump({{"output_tokens": out, "elapsed_s": elapsed, "output_tokens_per_s": out / elapsed,
               "vllm_version": "0.32.0-fake", "config": opt["--config"],
               "dtype": opt["--dtype"]}}, f)
"""

BROKEN_PEER = """#!/bin/sh
echo "Traceback (most recent call last):" >&2
echo "ModuleNotFoundError: No module named 'vllm'" >&2
exit 1
"""


def _script(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fake_peer(tmp_path, monkeypatch) -> tuple[str, Path]:
    log = tmp_path / "peer.log"
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    return _script(tmp_path / "fake-python", FAKE_PEER.format(python=sys.executable)), log


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _ns(**kw) -> argparse.Namespace:
    base = {"peer": "vllm", "peer_python": "/x/python", "peer_rounds": 2,
            "peer_configs": "eager,default"}
    return argparse.Namespace(**{**base, **kw})


def test_peer_options_validate():
    assert peer_options(_ns(peer=None, peer_python=None)) is None
    opts = peer_options(_ns(peer_configs="default, eager,default"))
    assert opts == PeerOptions("vllm", "/x/python", 2, ("default", "eager"))
    with pytest.raises(ValueError, match="--peer-python"):
        peer_options(_ns(peer_python=None))
    with pytest.raises(ValueError, match=r"\('vllm',\)"):
        peer_options(_ns(peer="sglang"))
    with pytest.raises(ValueError, match="--peer-rounds"):
        peer_options(_ns(peer_rounds=0))
    with pytest.raises(ValueError, match="--peer-configs"):
        peer_options(_ns(peer_configs="eager,compiled"))
    with pytest.raises(ValueError, match="--peer-python is only used with --peer"):
        peer_options(_ns(peer=None))


def test_peer_env_fills_only_what_is_unset():
    n = os.cpu_count()
    env = peer_env({"OMP_NUM_THREADS": "1"})
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{n - 1}"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_rounds_alternate_on_the_same_prompts(fake_peer, tmp_path):
    python, log = fake_peer
    workload = Workload(input_len=3, output_len=2, num_prompts=2, temperature=0.5)
    prompts = [[5, 6, 7], [8, 9, 10]]
    speeds = iter([10.0, 14.0])

    def cadence_run(rnd: int) -> dict:
        return {"num_output_tokens": 4, "elapsed_s": 0.3, "output_tokens_per_s": next(speeds),
                "dtype": "bfloat16"}

    opts = PeerOptions("vllm", python, 2, ("eager", "default"))
    section = compare_with_peer(opts, "0.32.0-fake", cadence_run, workload, prompts, 2,
                                "/models/m", None, tmp_path)
    assert PEER_KEYS <= set(section)
    order = [(r["order"], r["round"], r["engine"], r["config"]) for r in section["runs"]]
    assert order == [(1, 1, "cadence", "async"), (2, 1, "vllm", "eager"),
                     (3, 1, "vllm", "default"), (4, 2, "cadence", "async"),
                     (5, 2, "vllm", "eager"), (6, 2, "vllm", "default")]
    assert all(RUN_KEYS <= set(r) for r in section["runs"])
    # The peer ran in the order recorded, with cadence's dtype, the model and its env.
    calls = _calls(log)
    assert [c["args"][c["args"].index("--config") + 1] for c in calls] == ["eager", "default"] * 2
    for c in calls:
        assert c["script"].endswith("peer_vllm.py")
        args = dict(zip(c["args"][::2], c["args"][1::2]))
        assert args["--dtype"] == "bfloat16" and args["--model"] == "/models/m"
        assert c["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        assert c["env"]["OMP_NUM_THREADS"]
    work = json.loads(Path(str(log) + ".input").read_text())
    assert work["prompts"] == prompts and work["max_tokens"] == [2, 2]
    assert work["temperature"] == 0.5 and work["max_num_seqs"] == 2
    assert work["warmup_prompt"] == [7, 6, 5] and work["stop"] is None
    # medians: cadence (10, 14) -> 12; eager 4 tokens / 2 s = 2; default 4 / 1 s = 4.
    assert section["cadence_median_tokens_per_s"] == 12.0
    assert section["peer_median_tokens_per_s"] == {"eager": 2.0, "default": 4.0}
    assert section["best_peer_config"] == "default"
    assert section["ratio_vs_best_peer"] == pytest.approx(3.0)


def test_summary_and_table(capsys):
    runs = [{"order": 1, "round": 1, "engine": "cadence", "config": "async",
             "output_tokens_per_s": 90.0},
            {"order": 2, "round": 1, "engine": "vllm", "config": "eager",
             "output_tokens_per_s": 100.0},
            {"order": 3, "round": 2, "engine": "cadence", "config": "async",
             "output_tokens_per_s": 110.0},
            {"order": 4, "round": 2, "engine": "vllm", "config": "eager",
             "output_tokens_per_s": 80.0}]
    s = summarize(runs, ("eager",))
    assert s["cadence_median_tokens_per_s"] == 100.0 and s["best_peer_config"] == "eager"
    assert s["ratio_vs_best_peer"] == pytest.approx(100.0 / 90.0)
    print_peer({"name": "vllm", "version": "0.32.0", "configs": ["eager"], "batch_size": 4,
                "host_work": "light", **s})
    out = capsys.readouterr().out
    assert "cadence async / vllm eager: 1.111x" in out and "median" in out


def test_failing_peer_names_its_python_and_stderr(tmp_path):
    broken = _script(tmp_path / "broken-python", BROKEN_PEER)
    with pytest.raises(PeerError) as e, PeerWorkdir(tmp_path) as workdir:
        check_peer(PeerOptions("vllm", broken, 1, ("eager",)), workdir)
    msg = str(e.value)
    assert broken in msg and "No module named 'vllm'" in msg and "exited with 1" in msg
    assert (workdir / "check.stderr").exists()  # kept for reading after a failure
    missing = str(tmp_path / "no-such-venv" / "python")
    with pytest.raises(PeerError, match="no-such-venv"), PeerWorkdir(tmp_path) as workdir:
        check_peer(PeerOptions("vllm", missing, 1, ("eager",)), workdir)


def test_cli_errors(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kept cadence-peer-* folder
    model = tiny_model_dir("llama")
    rc = main(["bench", "compare", "--model", model, "--runs", "async", "--peer", "vllm",
               *WORKLOAD])
    assert rc == 2 and "--peer-python" in capsys.readouterr().err
    rc = main(["bench", "compare", "--model", model, "--peer", "tgi", "--peer-python", "x",
               *WORKLOAD])
    assert rc == 2 and "vllm" in capsys.readouterr().err
    broken = _script(tmp_path / "broken-python", BROKEN_PEER)
    rc = main(["bench", "compare", "--model", model, "--runs", "async", "--peer", "vllm",
               "--peer-python", broken, *WORKLOAD])
    err = capsys.readouterr().err
    assert rc == 1 and broken in err and "No module named 'vllm'" in err


def test_compare_with_fake_peer(tiny_model_dir, fake_peer, tmp_path, capsys):
    python, log = fake_peer
    model = tiny_model_dir("llama")
    out = tmp_path / "cmp.json"
    rc = main(["bench", "compare", "--model", model, "--num-prompts", "3", "--runs", "async",
               "--peer", "vllm", "--peer-python", python, "--peer-configs", "eager,default",
               *WORKLOAD, "--output-json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.startswith("machine: ") and "faster peer config: vllm default" in printed
    data = json.loads(out.read_text())
    peer = data["peer"]
    assert PEER_KEYS <= set(peer) and peer["rounds"] == 2 and peer["version"] == "0.32.0-fake"
    assert [r["engine"] for r in peer["runs"]] == ["cadence", "vllm", "vllm"] * 2
    asyncs = [r for r in data["runs"] if r["name"] == "async"]
    assert [r["round"] for r in asyncs] == [1, 2]
    assert [r["output_tokens_per_s"] for r in peer["runs"] if r["engine"] == "cadence"] == \
        [r["output_tokens_per_s"] for r in asyncs]
    assert peer["ratio_vs_best_peer"] == pytest.approx(
        peer["cadence_median_tokens_per_s"] / peer["peer_median_tokens_per_s"]["default"])
    assert MACHINE_KEYS <= set(data["machine"])
    calls = _calls(log)
    assert calls[0]["args"] == ["--check"] and len(calls) == 5
    args = dict(zip(calls[1]["args"][::2], calls[1]["args"][1::2]))
    assert args["--model"] == model and args["--dtype"] == data["machine"]["dtype"]
    work = json.loads(Path(str(log) + ".input").read_text())
    assert len(work["prompts"]) == 3 and all(len(p) == 8 for p in work["prompts"])
    assert work["max_tokens"] == [6, 6, 6] and work["temperature"] == 1.0


def test_embed_with_fake_peer(tiny_model_dir, fake_peer, tmp_path):
    """``engine bench embed --peer vllm``: each round runs cadence, transformers, then the
    peer's embed task on the same prompts; the peer's first vector is checked too."""
    python, log = fake_peer
    model = tiny_model_dir("llama")
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", "--model", model, "--num-prompts", "3", "--rounds", "2",
                 "--peer", "vllm", "--peer-python", python, *WORKLOAD,
                 "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["engine"] for r in data["runs"]] == ["cadence", "hf", "vllm-eager"] * 2
    assert data["summary"]["vllm-eager"]["median"] == pytest.approx(3 * 8 / 0.5)
    assert data["peer_version"] == "0.32.0-fake"
    # The stand-in returns zeros, which are not transformers' vector.
    assert all(r["max_abs_diff_vs_hf"] > 0.01 for r in data["runs"]
               if r["engine"] == "vllm-eager")
    calls = _calls(log)
    args = dict(zip(calls[1]["args"][::2], calls[1]["args"][1::2]))
    assert args["--task"] == "embed" and args["--model"] == model
    work = json.loads(Path(str(log) + ".input").read_text())
    assert len(work["prompts"]) == 3 and all(len(p) == 8 for p in work["prompts"])


def test_a_peer_that_crashes_after_writing_its_result_counts(tmp_path, capsys):
    """vLLM's CPU build may abort in teardown once its result is on disk: the result is
    used, with a note; a crash before the result is still an error."""
    from cadence.bench.peer import run_peer

    script = _script(tmp_path / "crashy", """#!/bin/sh
out=""
while [ $# -gt 0 ]; do [ "$1" = "--output" ] && out="$2"; shift; done
echo '{"output_tokens": 3}' > "$out"
exit 134
""")
    opts = PeerOptions("vllm", script, 1, ("eager",))
    res = run_peer(opts, "eager", 1, tmp_path / "in.json", "m", "float32", tmp_path)
    assert res == {"output_tokens": 3}
    assert "after writing its result" in capsys.readouterr().err
    broken = PeerOptions("vllm", _script(tmp_path / "broken", BROKEN_PEER), 1, ("eager",))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(PeerError, match="exited with 1"):
        run_peer(broken, "eager", 1, tmp_path / "in.json", "m", "float32", fresh)
