"""Layering rules: core/ names no device library, the host-side core imports no torch, and
``import cadence`` / ``engine backends`` stay light."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE_LIBS = re.compile(r"^\s*(import|from)\s+(triton|habana_frameworks)\b|torch\.cuda\.|"
                         r"torch\.hpu", re.M)
NO_TORCH_MODULES = ["cadence.request", "cadence.sampling_params", "cadence.block_manager",
                    "cadence.scheduler", "cadence.output_processor", "cadence.detokenizer",
                    "cadence.input_builder", "cadence.backend", "cadence.plugins",
                    "cadence.metrics", "cadence.config", "cadence.scheduling"]


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True, cwd="/").stdout


def test_core_names_no_device_library():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "core").rglob("*.py")
                 if DEVICE_LIBS.search(p.read_text())]
    assert offenders == []


def test_backends_never_import_each_other():
    names = ["cpu", "cuda", "hpu"]
    for name in names:
        for p in (ROOT / "backends" / name).rglob("*.py"):
            text = p.read_text()
            for other in names:
                if other != name:
                    assert f"cadence.backends.{other}" not in text, (p, other)


def test_import_cadence_and_host_core_import_no_torch():
    mods = ", ".join(NO_TORCH_MODULES)
    out = _run(f"import sys, cadence, {mods}; print('torch' in sys.modules)")
    assert out.strip() == "False"


def test_engine_backends_imports_no_torch():
    out = _run("import sys; from cadence.cli.main import main; main(['backends']); "
               "print('TORCH', 'torch' in sys.modules)")
    assert "cpu" in out and "TORCH False" in out


def test_pyproject_lists_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(cfg["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("core", "cadence"), ("backends", "cadence.backends")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert listed == found
