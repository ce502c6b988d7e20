"""The conformance kit judges the backend under test only: a correct plugin passes next to
a broken one, and a plugin that imports torch at probe time is told so in words."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cadence import plugins
from cadence.testing import conformance
from cadence.testing.helpers import assert_same_tokens

GOOD = """
from cadence.backends.cpu.backend import CpuBackend
from cadence.hookspecs import hookimpl


class {cls}(CpuBackend):
    name = "{name}"


@hookimpl
def cadence_register_backends(register):
    register({cls})
"""
HEAVY = "import torch\n" + GOOD
# Builds a new class on every registration: each registry load sees a different backend.
FLAKY = """
from cadence.hookspecs import hookimpl

@hookimpl
def cadence_register_backends(register):
    from cadence.backends.cpu.backend import CpuBackend

    class {cls}(CpuBackend):
        name = "{name}"
    register({cls})
"""
BROKEN = "raise ImportError('no module named npu_runtime')\n"


def _install(root: Path, name: str, source: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(source.format(name=name, cls=name.title()))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[cadence.backends]\n{name} = {name}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the kit's fresh interpreters too
    monkeypatch.delenv("CADENCE_PLUGINS", raising=False)
    monkeypatch.delenv("CADENCE_DISABLE_PLUGINS", raising=False)
    plugins.reset_registry()
    yield tmp_path
    for name in ("kitgood", "kitheavy", "kitbroken", "kitflaky"):
        sys.modules.pop(name, None)
    plugins.reset_registry()


def test_a_correct_plugin_passes_next_to_a_broken_one(site):
    _install(site, "kitgood", GOOD)
    _install(site, "kitbroken", BROKEN)
    _install(site, "kitflaky", FLAKY)
    assert [e.entry_point for e in plugins.get_registry().errors] == ["kitbroken"]
    conformance.test_registration_is_idempotent("kitgood")
    conformance.test_probe_never_initialises_the_device("kitgood")


def test_a_plugin_that_imports_torch_at_probe_time_fails_in_words(site):
    _install(site, "kitheavy", HEAVY)
    with pytest.raises(AssertionError, match="imported torch"):
        conformance.test_probe_never_initialises_the_device("kitheavy")


class _Out:
    def __init__(self, ids, top=None):
        self.token_ids, self.logprobs = ids, top


class _Req:
    def __init__(self, ids, top=None):
        self.prompt_token_ids = [7] * 5
        self.outputs = [_Out(ids, top)]


class _Lp:
    def __init__(self, logprob):
        self.logprob = logprob


def test_token_mismatch_messages_say_what_was_expected():
    ref = _Req([1, 2, 3], [{1: _Lp(0.0)}, {2: _Lp(-0.1), 9: _Lp(-0.5)}, {3: _Lp(0.0)}])
    with pytest.raises(AssertionError, match=r"prompt 0 \(5 tokens\) differs at output token 1"
                                             r".*rates them 0\.4 apart.*more than the 0\.01"):
        assert_same_tokens([_Req([1, 9, 3])], [ref], 0.01, "backend vs reference")
    with pytest.raises(AssertionError, match="not among the reference's top logprobs"):
        assert_same_tokens([_Req([1, 7, 3])], [ref], 0.01, "backend vs reference")
    assert_same_tokens([_Req([1, 9, 4])], [ref], 0.5, "near-tie accepted")
