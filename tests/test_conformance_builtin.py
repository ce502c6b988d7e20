"""The built-in backends (and the worked example, when installed) pass the conformance kit.

The kit's checks are imported here and run in this process against each backend below, the
way a third-party package runs them (``from cadence.testing.conformance import *``); one
test also runs the real ``pytest --cadence-backend`` command line in a subprocess.
Cases: cpu with each overlap strategy; hpu in its emulation mode; cuda where it probes
available; ``example`` where ``pip install -e examples/backend-plugin --no-deps`` was run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import pytest

# The kit's checks, collected here exactly as in a third-party package's test module.
from cadence.testing.conformance import *
from cadence.testing.conformance import probe_in_subprocess

# The kit's fixtures, imported so that this module works whether or not pytest loaded the
# kit through its pytest11 entry point.
from cadence.testing.pytest_plugin import (  # noqa: F401
    cadence_llm,
    cadence_llm_sync,
    cadence_logprob_atol,
    cadence_lora_reference,
    cadence_model_dir,
    cadence_reference,
    cadence_reference_embeddings,
    cadence_window_model_dir,
    cadence_window_reference,
)


def _entry_point_names(group: str) -> set[str]:
    return {ep.name for ep in metadata.entry_points(group=group)}


def _cuda_available() -> bool:
    from cadence.plugins import PluginRegistry

    reg = PluginRegistry().load()
    return "cuda" in reg.backends and reg.probe_all()["cuda"].available


def _cases() -> list[Any]:
    slow = pytest.mark.slow
    cases = [pytest.param(("cpu", {"overlap": "sync"}, {}), id="cpu-sync"),
             pytest.param(("cpu", {}, {}), id="cpu-process-default"),
             pytest.param(("cpu", {"overlap": "thread"}, {}), id="cpu-thread", marks=slow),
             # Emulation compiles each shape bucket the first time it appears; skipping the
             # warmup keeps that to the shapes the kit uses. Padding is unchanged.
             pytest.param(("hpu", {"skip_warmup": True}, {"CADENCE_HPU_EMULATE": "1"}),
                          id="hpu-emulated", marks=slow)]
    if _cuda_available():
        cases.append(pytest.param(("cuda", {}, {}), id="cuda", marks=pytest.mark.cuda))
    example = "example" in _entry_point_names("cadence.backends")
    cases.append(pytest.param(("example", {}, {}), id="example", marks=pytest.mark.skipif(
        not example, reason="pip install -e examples/backend-plugin --no-deps")))
    return cases


@pytest.fixture(scope="session", params=_cases())
def _kit_case(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict, dict]]:
    name, options, env = request.param
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield name, options, env


@pytest.fixture(scope="session")
def cadence_backend(_kit_case: tuple[str, dict, dict]) -> str:
    return _kit_case[0]


@pytest.fixture(scope="session")
def cadence_backend_options(_kit_case: tuple[str, dict, dict]) -> dict:
    return _kit_case[1]


def test_cpu_plugin_and_probe_import_no_torch() -> None:
    # `engine backends` and `engine --help` must not load torch (cli/main.py's promise).
    facts = probe_in_subprocess("cpu")
    assert facts["available"] and not facts["torch_imported"], facts


@pytest.mark.skipif("example" not in _entry_point_names("cadence.backends"),
                    reason="pip install -e examples/backend-plugin --no-deps")
def test_example_plugin_and_probe_import_no_torch() -> None:
    facts = probe_in_subprocess("example")
    assert facts["available"] and not facts["torch_imported"], facts


def test_kit_runs_from_the_pytest_command_line(tmp_path) -> None:
    """``pytest --pyargs cadence.testing.conformance --cadence-backend cpu`` collects the
    kit (only the two checks that need no model, to stay fast)."""
    # -p is only needed while no pytest11 entry point loads the kit.
    loaded = any(ep.value == "cadence.testing.pytest_plugin"
                 for ep in metadata.entry_points(group="pytest11"))
    plugin = [] if loaded else ["-p", "cadence.testing.pytest_plugin"]
    cmd = [sys.executable, "-m", "pytest", *plugin, "--pyargs", "cadence.testing.conformance",
           "--cadence-backend", "cpu", "-k", "probe or registration", "-q",
           "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'kit'}"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTEST_ADDOPTS": "", "CADENCE_PLUGINS": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout, proc.stdout
