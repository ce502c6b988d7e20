"""scripts/cuda_device_check.sh, on a machine without a GPU: it parses, its dry run says
what it would do, it refuses clearly without a GPU or a CUDA build of torch, and the bench
flags it passes exist. (What it measures needs an NVIDIA GPU.)"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "cuda_device_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, *args: str, nvidia_smi: str | None = None,
         **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = os.environ["PATH"]
    if nvidia_smi is not None:  # a stand-in for the driver's tool
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        fake.chmod(0o755)
        path = f"{bin_dir}{os.pathsep}{path}"
    else:  # hide a real one, if any, keeping bash and python reachable
        path = os.pathsep.join(p for p in path.split(os.pathsep)
                               if not (Path(p) / "nvidia-smi").exists())
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, check=False,
                          env={**os.environ, "PATH": path, "PYTHON": sys.executable, **env})


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_without_nvidia_smi_it_refuses_and_writes_nothing(tmp_path) -> None:
    proc = _run(tmp_path, "out")
    assert proc.returncode == 2
    assert "needs an NVIDIA GPU" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_driver_without_a_gpu_is_refused(tmp_path) -> None:
    proc = _run(tmp_path, "out", nvidia_smi="echo 'No devices found.'")
    assert proc.returncode == 2
    assert "lists no GPU: No devices found." in proc.stderr


def test_dry_run_names_the_gpu_and_the_commands(tmp_path) -> None:
    proc = _run(tmp_path, "--dry-run", "out", nvidia_smi="echo 'GPU 0: Fake GPU (UUID: x)'",
                BATCH_SIZES="1,8")
    assert proc.returncode == 0, proc.stderr
    assert "GPU: GPU 0: Fake GPU" in proc.stdout
    assert f"output folder: {tmp_path / 'out'}" in proc.stdout
    assert "pip install -e .[cuda,test,default-model]" in proc.stdout
    assert "--batch-sizes 1,8" in proc.stdout
    assert f"make-small-model --output {tmp_path / 'out' / 'small'}" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_dry_run_takes_a_given_small_model(tmp_path) -> None:
    proc = _run(tmp_path, "--dry-run", nvidia_smi="echo 'GPU 0: Fake GPU (UUID: x)'",
                STAGES="hostheavy", SMALL_MODEL="tiny")
    assert proc.returncode == 0, proc.stderr
    assert "make-small-model" not in proc.stdout
    assert f"--model {tmp_path / 'tiny'} --host-work light,heavy" in proc.stdout
    assert "-m pytest" not in proc.stdout and "pip install" not in proc.stdout


def test_dry_run_without_a_gpu_says_it_would_stop(tmp_path) -> None:
    proc = _run(tmp_path, "--dry-run", STAGES="tests")
    assert proc.returncode == 0
    assert "needs an NVIDIA GPU" in proc.stdout and "stops here" in proc.stdout
    assert "pytest tests/test_cuda_gpu.py" in proc.stdout and "pip install" not in proc.stdout


def test_bad_arguments_print_the_usage(tmp_path) -> None:
    proc = _run(tmp_path, "--budget", "9")
    assert proc.returncode == 2 and proc.stderr.startswith("usage:")


def test_torch_without_cuda_stops_after_the_probe_with_a_summary(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run for real")
    proc = _run(tmp_path, "out", nvidia_smi="echo 'GPU 0: Fake GPU (UUID: x)'",
                STAGES="env,tests", INSTALL="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "CUDA backend: unavailable" in summary
    assert "stopping: the CUDA backend cannot run here" in summary
    assert not (tmp_path / "out" / "pytest.log").exists()


def test_the_bench_flags_it_passes_exist() -> None:
    from cadence.cli.main import build_parser

    text = SCRIPT.read_text()
    cmd = re.search(r'limited bench "\$PY" -m cadence\.cli\.main (bench compare .*?) >"', text,
                    re.DOTALL).group(1)
    values = {"$model_dir": "m", "$DTYPE": "bfloat16", "$BATCH_SIZES": "1,8",
              "$results": "out"}
    for name, value in values.items():
        cmd = cmd.replace(name, value)
    ns = build_parser().parse_args(shlex.split(cmd.replace("\\\n", " ")))
    assert ns.backend == "cuda" and ns.runs == "async,async_sched,sync,floor" and ns.skip_hf
    assert ns.breakdown


def test_the_host_heavy_flags_it_passes_exist() -> None:
    from cadence.cli.main import build_parser

    text = SCRIPT.read_text()
    cmd = re.search(r'limited hostheavy "\$PY" -m cadence\.cli\.main (bench compare .*?) >>"',
                    text, re.DOTALL).group(1)
    for name, value in {"$small_dir": "m", "$results": "out"}.items():
        cmd = cmd.replace(name, value)
    ns = build_parser().parse_args(shlex.split(cmd.replace("\\\n", " ")))
    assert ns.backend == "cuda" and ns.runs == "async,async_sched,sync,floor"
    assert ns.host_work == "light,heavy" and ns.rounds == 2 and ns.breakdown
    # The summary greps the paired-ratio rows: the pairs it names must be ones the bench prints.
    from cadence.bench import rounds

    assert {("async_sched", "async"), ("async_sched", "floor")} <= set(rounds.PAIRS)


def test_the_speculative_decoding_flags_it_passes_exist() -> None:
    from cadence.cli.main import build_parser

    text = SCRIPT.read_text()
    cmd = re.search(r'limited spec "\$PY" -m cadence\.cli\.main (bench compare .*?) >"', text,
                    re.DOTALL).group(1)
    for name, value in {"$model_dir": "m", "$DTYPE": "bfloat16", "$results": "out"}.items():
        cmd = cmd.replace(name, value)
    ns = build_parser().parse_args(shlex.split(cmd.replace("\\\n", " ")))
    assert ns.backend == "cuda" and ns.runs == "async,spec" and ns.temperature == 0
    assert ns.rounds == 2 and ns.batch_sizes == "1,8"
    from cadence.bench import rounds

    assert ("spec", "async") in rounds.PAIRS  # the summary greps that pair's rows


def test_the_quantized_weights_flags_it_passes_exist() -> None:
    from cadence.cli.main import build_parser

    text = SCRIPT.read_text()
    cmd = re.search(r'limited quant "\$PY" -m cadence\.cli\.main (bench compare .*?) >"', text,
                    re.DOTALL).group(1)
    for name, value in {"$model_dir": "m", "$DTYPE": "bfloat16", "$results": "out",
                        '"${weights[@]}"': "--quant-model awq"}.items():
        cmd = cmd.replace(name, value)
    ns = build_parser().parse_args(shlex.split(cmd.replace("\\\n", " ")))
    assert ns.backend == "cuda" and ns.runs == "async,quant" and ns.quant_model == "awq"
    assert ns.rounds == 2 and ns.batch_sizes == "1,64"
    from cadence.bench import rounds

    assert ("quant", "async") in rounds.PAIRS  # the summary greps that pair's rows
