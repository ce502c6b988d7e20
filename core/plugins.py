"""Plugin discovery and backend selection.

Built-in backends load exactly like third-party ones: through the ``cadence.backends``
entry-point group. Loading rules:

- ``CADENCE_PLUGINS=a,b`` loads only the named entry points; ``CADENCE_DISABLE_PLUGINS=c``
  skips the named ones. Names are entry-point names.
- A plugin that raises while loading is kept as a ``PluginError`` and reported by name with
  its error by ``engine backends`` and by backend selection; it is never skipped silently.
- Two backends claiming one name is an error naming both distributions.
- Selecting a backend that is missing or unavailable fails with every backend's probe
  reason. There is no silent fallback; ``auto`` picks the best available one and says why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy

from cadence import hookspecs

if TYPE_CHECKING:
    from cadence.backend import Backend, ProbeResult

ENTRY_POINT_GROUP = "cadence.backends"
# ``auto`` prefers accelerators; third-party names not listed here come after these.
AUTO_PREFERENCE = ("cuda", "hpu", "cpu")


@dataclass(frozen=True, slots=True)
class BackendInfo:
    name: str
    cls: type[Backend]
    distribution: str
    version: str


@dataclass(frozen=True, slots=True)
class PluginError:
    entry_point: str
    distribution: str
    error: str


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var, "").strip()
    return {n.strip() for n in raw.split(",") if n.strip()} if raw else None


class PluginRegistry:
    """The loaded plugins: a pluggy manager plus the backends they registered."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.backends: dict[str, BackendInfo] = {}
        self.errors: list[PluginError] = []
        # Names claimed by two distributions: selecting them fails with this message.
        self.duplicates: dict[str, str] = {}
        # Entry points left unloaded by the environment, and which setting did it.
        self.skipped: dict[str, str] = {}
        # Each loaded entry point: its distribution and the backend names it registered.
        self.registered: dict[str, tuple[str, list[str]]] = {}
        self._loaded = False

    def load(self) -> PluginRegistry:
        if self._loaded:
            return self
        self._loaded = True
        allow = _env_names("CADENCE_PLUGINS")
        deny = _env_names("CADENCE_DISABLE_PLUGINS") or set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in deny:
                self.skipped[ep.name] = (f"disabled by CADENCE_DISABLE_PLUGINS="
                                         f"{os.environ.get('CADENCE_DISABLE_PLUGINS', '')}")
                continue
            if allow is not None and ep.name not in allow:
                self.skipped[ep.name] = (f"not loaded: CADENCE_PLUGINS="
                                         f"{os.environ.get('CADENCE_PLUGINS', '')} does not "
                                         "name it")
                continue
            dist = ep.dist.name if ep.dist is not None else "unknown"
            version = ep.dist.version if ep.dist is not None else "unknown"
            try:
                self.register_plugin(ep.load(), ep.name, dist, version)
            except Exception as e:  # reported, never swallowed: see engine backends
                self.errors.append(PluginError(ep.name, dist, f"{type(e).__name__}: {e}"))
        return self

    def register_plugin(self, module: object, name: str, dist: str, version: str) -> None:
        """Register one plugin module (or object) and the backends it declares."""
        if self.pm.is_registered(module):
            return
        self.pm.register(module, name=name)
        names: list[str] = []
        self.registered[name] = (dist, names)

        def register(cls: type[Backend]) -> None:
            existing = self.backends.get(cls.name)
            if existing is not None and existing.cls is not cls:
                msg = (f"backend name {cls.name!r} is claimed twice: by {existing.distribution} "
                       f"({existing.cls.__module__}) and by {dist} ({cls.__module__})")
                self.duplicates[cls.name] = msg
                raise ValueError(msg)
            self.backends[cls.name] = BackendInfo(cls.name, cls, dist, version)
            names.append(cls.name)

        impl = getattr(module, "cadence_register_backends", None)
        if impl is not None:
            try:
                impl(register=register)
            except Exception:
                # A plugin that failed to register must not keep its other hooks running
                # (its error is reported, not a mismatch of names).
                self.pm.unregister(module)
                self.registered.pop(name, None)
                raise

    def probe_all(self) -> dict[str, ProbeResult]:
        from cadence.backend import ProbeResult

        results = {}
        for name, info in sorted(self.backends.items()):
            try:
                results[name] = info.cls.probe()
            except Exception as e:
                results[name] = ProbeResult(False, f"probe raised {type(e).__name__}: {e}")
        return results

    def mismatches(self) -> dict[str, tuple[str, str]]:
        """Entry points that loaded but did not register the backend of their own name:
        entry point -> (distribution, what went wrong). A misspelt hook registers nothing,
        and a ``Backend.name`` other than the entry point's cannot be selected by it."""
        out = {}
        for ep, (dist, names) in self.registered.items():
            if not names:
                out[ep] = (dist, "registered no backend: the module has no "
                                 "cadence_register_backends hook (is it misspelt?), or the "
                                 "hook called register() with none")
            elif ep not in names:
                out[ep] = (dist, f"registered {names}, not {ep!r}: Backend.name must equal "
                                 "the entry-point name")
        return out

    def _explain(self) -> str:
        lines = [f"  {n}: {'available' if r.available else r.reason}"
                 for n, r in self.probe_all().items()]
        lines += [f"  {e.entry_point} ({e.distribution}): failed to load: {e.error}"
                  for e in self.errors]
        lines += [f"  entry point {ep} ({dist}): {why}"
                  for ep, (dist, why) in sorted(self.mismatches().items())]
        return "\n".join(lines) or "  (no backend plugins are installed)"

    def select(self, name: str) -> tuple[type[Backend], str]:
        """The backend class for ``name`` (or ``auto``) and a sentence saying why."""
        if name == "auto":
            probes = self.probe_all()
            order = [n for n in AUTO_PREFERENCE if n in probes and n not in self.duplicates]
            order += sorted(n for n in probes
                            if n not in AUTO_PREFERENCE and n not in self.duplicates)
            for n in order:
                if probes[n].available:
                    skipped = [f"{m} ({probes[m].reason})" for m in order[: order.index(n)]]
                    why = f"auto selected {n!r}" + (
                        f"; not available: {', '.join(skipped)}" if skipped else ""
                    )
                    return self.backends[n].cls, why
            raise ValueError(f"backend 'auto': no backend is available here:\n{self._explain()}")
        if name in self.duplicates:
            raise ValueError(f"{self.duplicates[name]}\n{self._explain()}")
        info = self.backends.get(name)
        if info is None and name in self.skipped:
            # A backend's name is its entry point's name (docs/writing_a_backend.md).
            raise ValueError(f"backend {name!r} is installed but {self.skipped[name]}; "
                             "unset that variable or pick another backend\n"
                             f"{self._explain()}")
        if info is None:
            raise ValueError(
                f"unknown backend {name!r}; valid choices: "
                f"{', '.join(sorted(self.backends)) or '(none)'} or auto\n{self._explain()}"
            )
        probe = self.probe_all()[name]
        if not probe.available:
            raise ValueError(f"backend {name!r} is not available: {probe.reason}\n{self._explain()}")
        return info.cls, f"backend {name!r} selected"

    @property
    def hook(self) -> pluggy.HookRelay:
        return self.pm.hook

    def has_impl(self, hook_name: str) -> bool:
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())


_registry: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry, loaded on first use."""
    global _registry
    if _registry is None:
        _registry = PluginRegistry().load()
    return _registry


def reset_registry() -> None:
    """Forget loaded plugins (tests, and after changing CADENCE_PLUGINS)."""
    global _registry
    _registry = None


_WARNED: set[tuple] = set()


def warn_ignored_options(config: dict, owner: str, dests: Iterable[str]) -> None:
    """For a plugin's ``cadence_configure`` when another backend runs: warn once about the
    plugin's own options that were set (``dests``, argparse destinations), which that
    backend ignores; a value there is a mistake or a leftover, never silently honoured."""
    backend = config.get("backend")
    if backend == owner:
        return
    given = tuple(sorted("--" + d.replace("_", "-") for d in dests
                         if config.get(d) is not None and config.get(d) is not False))
    # Once per process: a command that builds its configuration twice (engine bench's
    # header, then its engine) says it once.
    if given and (backend, owner, given) not in _WARNED:
        _WARNED.add((backend, owner, given))
        logging.getLogger("cadence.plugins").warning(
            "backend %r ignores %s (options of the %s backend)", backend, ", ".join(given),
            owner)


def check_backend_options(backend_options: Any, backend: str, valid: Iterable[str]) -> None:
    """For a backend's constructor: raise ValueError naming any key of ``backend_options``
    outside ``valid`` and the valid ones. A misspelt knob (``{"kv_cahce_gb": 8}``) must
    not be ignored without a word."""
    valid = tuple(valid)
    unknown = sorted(set(dict(backend_options)) - set(valid))
    if unknown:
        raise ValueError(f"unknown {backend} backend option(s) {unknown}; valid: "
                         f"{', '.join(valid)}")
