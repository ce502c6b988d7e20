"""The CPU backend's compiled kernels: built once per machine with ``torch.utils.cpp_extension``
and cached under ``~/.cache/cadence/kernels``.

The build targets the CPU it runs on (``-march=native``), so the cache folder is keyed by the
source, the compiler flags, torch's and Python's versions and the CPU's model and flags: a
home directory shared by machines with different CPUs never loads a kernel built for
another. The first build announces itself on stderr (one to five minutes: about four on
two Zen 3 cores); later loads import the finished module directly. Concurrent first builds
(several worker processes) wait for one another on a lock the OS releases when its holder
dies, so a worker killed mid-build never stalls the next one.
Where there is no compiler, or the build fails, ``load_kernels`` returns None after one
warning that says so and names the fallback (the torch reference path).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from cadence.cpuinfo import cpu_info

logger = logging.getLogger(__name__)

_SOURCES = ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "ops.cpp",
            "logits.cpp", "brgemm_linear.cpp", "amx_linear.cpp", "tiled_linear.cpp",
            "quant_linear.cpp", "lora.cpp")
_HEADERS = ("vec.h", "attention_common.h", "gemm_chunks.h", "tiled_core.h")
# -fopenmp: at::parallel_for is inline OpenMP code; without it the loop runs on one thread.
# The extension then shares torch's own libgomp (same soname, already loaded).
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
# Under an ISA cap (cadence.cpuinfo.isa_limit) the build targets that level instead of
# this CPU: the x86-64 micro-architecture levels, tuned for the CPU at hand.
_MARCH_FOR_LIMIT = {"avx2": "-march=x86-64-v3", "default": "-march=x86-64-v2"}
_BUILT = "built"  # names the finished .so; see _compile
_loaded: dict[str, ModuleType | None] = {}


def cache_root() -> Path:
    from cadence.cache_dir import cache_dir

    return cache_dir("kernels")


def cflags() -> list[str]:
    """The compiler flags for this CPU, or for the level ``ATEN_CPU_CAPABILITY`` caps it to."""
    limit = cpu_info().isa_limit
    if limit is None:
        return list(_CFLAGS)
    return [_MARCH_FOR_LIMIT[limit] if f == "-march=native" else f for f in _CFLAGS] + \
        ["-mtune=native"]


def _build_dir(sources: list[Path]) -> Path:
    import torch

    h = hashlib.sha256()
    for src in [*sources, *(sources[0].parent / n for n in _HEADERS)]:
        h.update(src.read_bytes())
    info = cpu_info()
    # The interpreter too: the module is built against one Python's ABI (its file name
    # carries no tag), so venvs of two Pythons sharing one home must not share a build.
    h.update(repr((cflags(), torch.__version__, info.model, sorted(info.flags),
                   sys.implementation.cache_tag)).encode())
    return cache_root() / f"cpu_kernels_{h.hexdigest()[:16]}"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def load_kernels() -> ModuleType | None:
    """The compiled kernel module, or None (with one logged warning) where it cannot be built.

    ``CADENCE_CPU_KERNELS=0`` skips the build and takes the torch path on purpose.
    """
    if "cpu" in _loaded:
        return _loaded["cpu"]
    _loaded["cpu"] = mod = _build()
    return mod


def _build() -> ModuleType | None:
    if os.environ.get("CADENCE_CPU_KERNELS", "1") == "0":
        logger.info("CADENCE_CPU_KERNELS=0: CPU attention runs the torch reference path")
        return None
    if _compiler() is None:
        logger.warning("no C++ compiler found (c++/g++, or $CXX): the CPU backend falls back to "
                       "the torch attention path, which is slower; install g++ to enable the "
                       "compiled kernel")
        return None
    csrc = Path(__file__).resolve().parent / "csrc"
    sources = [csrc / s for s in _SOURCES]
    build_dir = _build_dir(sources)
    mod = _import_built(build_dir)
    if mod is not None:
        return mod
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(build_dir) as locked:
            # Another process may have finished it while this one waited for the lock.
            return _import_built(build_dir) or _compile(sources, build_dir, locked)
    except Exception as e:  # a broken toolchain must not take the engine down
        logger.warning("building the CPU kernels failed (%s: %s); the CPU backend "
                       "falls back to the torch attention path, which is slower",
                       type(e).__name__, str(e).strip().splitlines()[-1] if str(e) else "")
        return None


def _compile(sources: list[Path], build_dir: Path, locked: bool) -> ModuleType:
    from torch.utils.cpp_extension import load

    if not any(build_dir.glob("*.so")):
        target = "this CPU" if cpu_info().isa_limit is None else \
            f"ATEN_CPU_CAPABILITY={cpu_info().isa_limit}"
        print("cadence: compiling the CPU kernels (attention, norm, activation, rotary, logits, "
              f"GEMM, LoRA) for {target} (once, 1-5 minutes); cached in {build_dir}",
              file=sys.stderr, flush=True)
    # torch's own build lock is a plain file that a killed process leaves behind, and every
    # later load would wait on it forever. Every cadence build holds the flock taken in
    # _exclusive, which the kernel drops when its holder dies, so a lock file found while
    # holding it was left by a build that can no longer be running. Without the flock (a
    # filesystem that has none) it may be a live build's: left alone.
    if locked:
        (build_dir / "lock").unlink(missing_ok=True)
    # Named after its folder: torch suffixes `_v1` to a name it already built in this process
    # from another folder (a test's cache root, an ATEN_CPU_CAPABILITY cap), and a folder built
    # under the suffixed name is compiled again, whole, by the next process that has to load
    # it through torch (a damaged record). One name per folder is the same in every process.
    mod = load(name=f"cadence_{build_dir.name}", sources=[str(s) for s in sources],
               build_directory=str(build_dir), extra_cflags=cflags(), extra_ldflags=["-fopenmp"],
               verbose=False)
    # Written last, and whole (a reader without the lock sees the old record or the new):
    # the folder's key names these exact sources and flags, so from here on a load is an
    # import, with no ninja run and no torch lock for a killed worker to leave. The module's
    # name, not just its file: an extension imports only under the name it was built with.
    tmp = build_dir / f".{_BUILT}.{os.getpid()}"
    tmp.write_text(f"{mod.__name__}\n")
    os.replace(tmp, build_dir / _BUILT)
    return mod


def _import_built(build_dir: Path) -> ModuleType | None:
    """The module a finished build recorded, or None: no record yet, or one that does not
    load (a cache folder damaged by hand), which the build then writes again."""
    import importlib.util

    import torch  # noqa: F401  (the extension links against libtorch)

    record = build_dir / _BUILT
    if not record.exists():
        return None
    try:
        name = record.read_text().strip()
        spec = importlib.util.spec_from_file_location(name, build_dir / f"{name}.so")
        assert spec is not None and spec.loader is not None, name
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:
        logger.info("the cached CPU kernels in %s did not load (%s); rebuilding", build_dir, e)
        return None
    return mod


@contextlib.contextmanager
def _exclusive(build_dir: Path) -> Iterator[bool]:
    """Holds the build folder's flock; yields whether it could (some network filesystems
    have no flock: the build then runs unguarded, as torch's own lock alone guards it)."""
    import fcntl

    with open(build_dir / "cadence.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:
            logger.info("no file lock on %s (%s); building without one", build_dir, e)
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
