"""The conformance kit's test ids name the kit (cadence/testing/conformance.py::test_...[NAME])
however a plugin author collects it, never a test file of the author's; the author's own
tests and fixtures are left as they are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cadence.testing import conformance

KIT = "cadence/testing/conformance.py::"
OWN = """
import pytest

from cadence.testing.conformance import *


def test_own():
    pass
"""
ONE = "from cadence.testing.conformance import test_registration_is_idempotent\n"
# The author's fixture decides the backend: it must still apply to the kit's checks.
WITH_FIXTURE = """
import pytest

from cadence.testing.conformance import *


@pytest.fixture(scope="session")
def cadence_backend():
    return "cpu"
"""


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-p", "cadence.testing.pytest_plugin", "-q",
           "-p", "no:cacheprovider", f"--basetemp={cwd / 'tmp'}", *args]
    env = {**os.environ, "PYTEST_ADDOPTS": "", "CADENCE_PLUGINS": "cpu"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
                          check=False)


def _ids(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if "::" in line]


def _project(tmp_path: Path, **modules: str) -> Path:
    (tmp_path / "tests").mkdir()
    for name, source in modules.items():
        (tmp_path / "tests" / f"{name}.py").write_text(source)
    return tmp_path


def test_star_import_ids_name_the_kit_and_the_backend(tmp_path) -> None:
    root = _project(tmp_path, test_mine=OWN)
    ids = _ids(_pytest(root, "--collect-only", "--cadence-backend", "cpu", "tests"))
    kit = [i for i in ids if i.startswith(KIT)]
    assert {i.removeprefix(KIT).split("[")[0] for i in kit} == set(conformance.__all__)
    assert all(i.split("[")[1].startswith("cpu") for i in kit), kit
    assert [i for i in ids if not i.startswith(KIT)] == ["tests/test_mine.py::test_own"]


def test_only_the_imported_checks_are_collected(tmp_path) -> None:
    root = _project(tmp_path, test_one=ONE)
    ids = _ids(_pytest(root, "--collect-only", "--cadence-backend", "cpu", "tests"))
    assert ids == [f"{KIT}test_registration_is_idempotent[cpu]"]


def test_pyargs_ids_name_the_kit(tmp_path) -> None:
    ids = _ids(_pytest(tmp_path, "--collect-only", "--pyargs", "cadence.testing.conformance",
                       "--cadence-backend", "cpu"))
    assert len(ids) >= len(conformance.__all__)
    assert all(i.startswith(KIT) and "[cpu" in i for i in ids), ids


def test_the_importing_modules_fixtures_still_apply(tmp_path) -> None:
    root = _project(tmp_path, test_fixture=WITH_FIXTURE)
    proc = _pytest(root, "-k", "registration", "-rs", "tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Without the module's fixture the check would skip: no backend was named.
    assert "1 passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout
    assert f"{KIT}test_registration_is_idempotent" in _ids(
        _pytest(root, "--collect-only", "tests"))
