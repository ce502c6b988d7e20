"""Plugin loading rules (core/plugins.py, `engine backends`): entry points, allow/block lists,
load errors reported by name, duplicate names, auto selection, no silent fallback.

Fake entry points replace ``importlib.metadata.entry_points`` as core/plugins.py uses it;
one test installs a real ``.dist-info`` folder on ``sys.path`` instead. No torch needed.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import cadence
import pytest
from cadence import plugins
from cadence.backend import Backend, ProbeResult
from cadence.cli.main import main as engine_main
from cadence.hookspecs import hookimpl


class FakeBackend(Backend):
    """A backend that only probes; the loading rules never build one."""

    result = ProbeResult(True, "fake device ready")

    @classmethod
    def probe(cls) -> ProbeResult:
        return cls.result

    def load_model(self) -> None: ...
    def allocate_kv_cache(self) -> int: return 1
    def forward(self, model_input): ...
    def sample(self, logits, sampling): ...
    def to_host(self, sampled): ...


def backend(name: str, available: bool = True, reason: str = "") -> type[Backend]:
    reason = reason or ("fake device ready" if available else f"no {name} device")
    return type(f"Fake_{name}", (FakeBackend,), {"name": name,
                                                 "result": ProbeResult(available, reason)})


def plugin(*classes: type[Backend]) -> types.ModuleType:
    module = types.ModuleType("fake_plugin")

    @hookimpl
    def cadence_register_backends(register: Callable) -> None:
        for cls in classes:
            register(cls)

    module.cadence_register_backends = cadence_register_backends
    return module


@dataclass
class FakeDist:
    name: str
    version: str = "1.2.3"


@dataclass
class FakeEntryPoint:
    name: str
    loader: Callable[[], object]
    dist: FakeDist
    loads: int = 0

    def load(self) -> object:
        self.loads += 1
        return self.loader()


def _raise(error: Exception) -> Callable[[], object]:
    def load() -> object:
        raise error
    return load


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CADENCE_PLUGINS", raising=False)
    monkeypatch.delenv("CADENCE_DISABLE_PLUGINS", raising=False)
    plugins.reset_registry()
    yield
    plugins.reset_registry()


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[FakeEntryPoint]]:
    """``install(ep, ...)``: these are the only entry points of ``cadence.backends``."""
    def apply(*eps: FakeEntryPoint) -> list[FakeEntryPoint]:
        def entry_points(*, group: str) -> list[FakeEntryPoint]:
            return list(eps) if group == plugins.ENTRY_POINT_GROUP else []
        monkeypatch.setattr(plugins.metadata, "entry_points", entry_points)
        return list(eps)
    return apply


def ep(name: str, *classes: type[Backend], dist: str = "fake-dist") -> FakeEntryPoint:
    module = plugin(*(classes or (backend(name),)))
    return FakeEntryPoint(name, lambda: module, FakeDist(dist))


def test_builtins_are_entry_points_of_the_cadence_distribution() -> None:
    found = {e.name: e for e in metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)}
    for name in ("cpu", "cuda", "hpu"):
        assert found[name].value == f"cadence.backends.{name}"
        assert found[name].dist.name == "cadence"
    info = plugins.get_registry().backends["cpu"]
    assert (info.distribution, info.version) == ("cadence", cadence.__version__)


def test_nothing_is_hard_coded(install) -> None:
    install()
    assert plugins.get_registry().backends == {}
    with pytest.raises(ValueError, match="no backend plugins are installed"):
        plugins.get_registry().select("cpu")


def test_a_real_dist_info_on_sys_path_is_found(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "kitplug").mkdir()
    (tmp_path / "kitplug" / "__init__.py").write_text(
        "from cadence.hookspecs import hookimpl\n"
        "from cadence.backends.cpu.backend import CpuBackend\n"
        "class KitBackend(CpuBackend):\n    name = 'kitplug'\n"
        "@hookimpl\ndef cadence_register_backends(register):\n    register(KitBackend)\n")
    info = tmp_path / "kitplug-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kitplug\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[cadence.backends]\nkitplug = kitplug\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    backends = plugins.get_registry().backends
    assert (backends["kitplug"].distribution, backends["kitplug"].version) == ("kitplug", "0.3")
    assert "cpu" in backends
    sys.modules.pop("kitplug", None)


@pytest.mark.parametrize(("allow", "deny", "loaded"), [
    ("a", "", ["a"]), (" a , c ", "", ["a", "c"]), ("", "b", ["a", "c"]),
    ("a,b", "b", ["a"]), ("", "", ["a", "b", "c"]),
])
def test_allow_and_block_lists(install, monkeypatch, allow: str, deny: str,
                               loaded: list[str]) -> None:
    eps = install(ep("a"), ep("b"), ep("c"))
    monkeypatch.setenv("CADENCE_PLUGINS", allow)
    monkeypatch.setenv("CADENCE_DISABLE_PLUGINS", deny)
    assert sorted(plugins.get_registry().backends) == loaded
    # A plugin left out is not even imported: that is what the lists are for.
    assert [e.name for e in eps if e.loads] == loaded


@pytest.mark.parametrize(("var", "value", "words"), [
    ("CADENCE_DISABLE_PLUGINS", "b,c", "disabled by CADENCE_DISABLE_PLUGINS=b,c"),
    ("CADENCE_PLUGINS", "a", "CADENCE_PLUGINS=a does not name it")])
def test_selecting_a_plugin_the_environment_left_out_says_so(install, monkeypatch, var,
                                                             value, words) -> None:
    install(ep("a"), ep("b"), ep("c"))
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match="backend 'b' is installed but") as info:
        plugins.get_registry().select("b")
    assert words in str(info.value)
    with pytest.raises(ValueError, match="unknown backend 'zzz'"):  # not installed at all
        plugins.get_registry().select("zzz")


def test_env_lists_are_read_when_the_registry_loads(install, monkeypatch) -> None:
    install(ep("a"), ep("b"))
    assert sorted(plugins.get_registry().backends) == ["a", "b"]
    monkeypatch.setenv("CADENCE_DISABLE_PLUGINS", "a")
    plugins.reset_registry()
    assert sorted(plugins.get_registry().backends) == ["b"]


def test_a_plugin_that_fails_to_load_is_reported_by_name(install, capsys) -> None:
    install(ep("good"), FakeEntryPoint("broken", _raise(ImportError("no module named 'npu'")),
                                       FakeDist("broken-dist", "0.9")))
    reg = plugins.get_registry()
    assert [(e.entry_point, e.distribution) for e in reg.errors] == [("broken", "broken-dist")]
    assert "ImportError: no module named 'npu'" in reg.errors[0].error
    assert engine_main(["backends"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "broken" in line)
    assert "broken-dist" in row and "failed to load" in row and "no module named 'npu'" in row
    for name in ("broken", "nope"):
        with pytest.raises(ValueError, match=r"broken \(broken-dist\): failed to load: "
                                             r"ImportError: no module named 'npu'"):
            reg.select(name)


def test_register_hook_and_probe_errors_are_reported(install) -> None:
    class Boom(FakeBackend):
        name = "boom"

        @classmethod
        def probe(cls) -> ProbeResult:
            raise RuntimeError("driver exploded")

    bad = types.ModuleType("bad_plugin")

    @hookimpl
    def cadence_register_backends(register) -> None:
        raise KeyError("missing config")

    bad.cadence_register_backends = cadence_register_backends
    install(ep("boom", Boom), FakeEntryPoint("bad", lambda: bad, FakeDist("bad-dist")))
    reg = plugins.get_registry()
    assert [e.entry_point for e in reg.errors] == ["bad"]
    assert "KeyError" in reg.errors[0].error
    assert reg.probe_all()["boom"] == ProbeResult(False, "probe raised RuntimeError: "
                                                         "driver exploded")
    with pytest.raises(ValueError, match="driver exploded"):
        reg.select("boom")


def test_two_backends_claiming_one_name_name_both_distributions(install) -> None:
    install(ep("dup", backend("dup"), dist="dist-one"), ep("dup2", backend("dup"),
                                                         dist="dist-two"))
    reg = plugins.get_registry()
    message = " ".join(e.error for e in reg.errors)
    assert "'dup'" in message and "dist-one" in message and "dist-two" in message


def test_selecting_a_name_claimed_twice_fails(install) -> None:
    install(ep("dup", backend("dup"), dist="dist-one"), ep("dup2", backend("dup"),
                                                         dist="dist-two"))
    with pytest.raises(ValueError, match="dist-one.*dist-two"):
        plugins.get_registry().select("dup")


def test_engine_backends_lists_name_version_distribution_and_status(install, capsys) -> None:
    install(ep("fast", dist="fast-dist"), ep("slow", backend("slow", False, "no slow chip"),
                                             dist="slow-dist"))
    assert engine_main(["backends"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "version", "distribution", "status"]
    rows = {line.split()[0]: line for line in out[1:]}
    assert rows["fast"].split()[1:4] == ["1.2.3", "fast-dist", "available"]
    assert rows["slow"].split()[1:3] == ["1.2.3", "slow-dist"]
    assert "unavailable: no slow chip" in rows["slow"]


def test_engine_backends_shows_the_probe_reason_of_available_backends(install, capsys) -> None:
    install(ep("fast", backend("fast", True, "fast chip 0 found")))
    engine_main(["backends"])
    assert "fast chip 0 found" in capsys.readouterr().out


def test_auto_picks_the_best_available_backend_and_says_why(install) -> None:
    install(ep("cpu"), ep("cuda", backend("cuda", False, "no GPU")),
            ep("hpu", backend("hpu", False, "no Gaudi")), ep("zeta"))
    cls, why = plugins.get_registry().select("auto")
    assert cls.name == "cpu"
    assert "auto selected 'cpu'" in why and "cuda (no GPU)" in why and "hpu (no Gaudi)" in why


def test_auto_takes_a_third_party_backend_after_the_built_ins(install) -> None:
    install(ep("cpu", backend("cpu", False, "disabled")), ep("zeta"), ep("alpha"))
    cls, why = plugins.get_registry().select("auto")
    assert cls.name == "alpha" and "cpu (disabled)" in why


@pytest.mark.parametrize("name", ["nope", "off", "auto"])
def test_selection_failure_lists_every_backends_probe_reason(install, name: str) -> None:
    install(ep("off", backend("off", False, "off chip is missing")),
            ep("gone", backend("gone", False, "gone chip is missing")))
    with pytest.raises(ValueError) as info:
        plugins.get_registry().select(name)
    message = str(info.value)
    assert "off: off chip is missing" in message and "gone: gone chip is missing" in message
    if name == "nope":
        assert "unknown backend 'nope'" in message and "gone, off or auto" in message


def test_loading_twice_and_registering_a_plugin_twice_is_harmless(install) -> None:
    eps = install(ep("a"))
    reg = plugins.PluginRegistry().load()
    assert reg.load() is reg and eps[0].loads == 1
    module = eps[0].loader()
    reg.register_plugin(module, "a", "fake-dist", "1.2.3")
    assert list(reg.backends) == ["a"] and reg.errors == []


def test_an_entry_point_that_registers_no_backend_or_another_name_says_so(install,
                                                                          capsys) -> None:
    """A misspelt hook (cadence_register_backend) registers nothing, and a Backend.name
    other than the entry point's cannot be selected by it: both are named where a user
    looks (engine backends, and the error of selecting the entry point's name)."""
    silent = types.ModuleType("silent_plugin")
    silent.cadence_register_backend = lambda register: register(backend("silent"))
    install(ep("good"), FakeEntryPoint("silent", lambda: silent, FakeDist("silent-dist")),
            ep("naive", backend("naive2"), dist="naive-dist"))
    reg = plugins.get_registry()
    assert set(reg.mismatches()) == {"silent", "naive"}
    for name, words in (("silent", "registered no backend: the module has no "
                                   "cadence_register_backends hook"),
                        ("naive", "registered ['naive2'], not 'naive': Backend.name must "
                                  "equal the entry-point name")):
        with pytest.raises(ValueError, match=re.escape(words)):
            reg.select(name)
    assert engine_main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "silent-dist" in out and "registered no backend" in out
    assert "naive-dist" in out and "registered ['naive2']" in out
