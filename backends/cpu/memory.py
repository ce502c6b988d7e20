"""The CPU backend's host memory: glibc's allocator settings (``tune_allocator``), and the
weights and the KV cache on transparent huge pages (2 MiB), by choice
(``--cpu-huge-pages``; docs/backends/cpu.md, "Memory allocator" and "Huge pages").

A decode step streams every weight and every cached K/V row once: ~270 MB of weights and
as much KV on the default model in bf16. With 4 KiB pages that is a TLB miss every 4 KiB,
and under a hypervisor each miss walks two page tables. On an Intel Xeon VM, one layer's
GEMMs and decode attention over the default model's shapes ran 1.06x and 1.15x faster on
huge pages with the host quiet, and 1.7x and 1.7x with the host's memory contended. In the
engine that came to level to 1.02x (quiet) and 1.06x (contended) once the pages were
touched, while a fresh engine paid more for first touching huge KV pages than it gained.
So it is a choice, off by default: ``weights`` or ``all`` (weights and KV cache, for
long-running servers, where every KV page is touched once).

torch's allocations come from glibc's heap, which is never marked for huge pages, so the
weights move into a mapping of their own once they are packed, and the KV cache is
allocated on one (core/host_memory.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import torch
from torch import nn

from cadence.host_memory import THP_ENABLED, anonymous_buffer, huge_pages_available, thp_mode

HUGE_PAGE_CHOICES = ("off", "weights", "all")
# Each moved storage starts on its own page: the kernels' 64-byte alignment holds, and the
# waste is at most a page per tensor.
_ALIGN = 4096


def resolve_huge_pages(requested: str) -> str:
    """``requested`` (one of HUGE_PAGE_CHOICES), checked against the kernel's THP setting."""
    if requested not in HUGE_PAGE_CHOICES:
        raise ValueError(f"cpu huge pages must be one of {HUGE_PAGE_CHOICES}, got {requested!r}")
    if requested != "off" and not huge_pages_available():
        raise ValueError(f"cpu huge pages {requested!r} needs transparent huge pages set to "
                         f"'always' or 'madvise' in {THP_ENABLED} (it is {thp_mode()!r}); "
                         f"use --cpu-huge-pages off")
    return requested


def _module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold: parameters, buffers and plain attributes (the
    packed weights of backends/cpu/linear.py), also inside a list or tuple (the parts of a
    quantized weight, backends/cpu/quantized.py)."""
    found = []
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for item in held:
            parts = item if isinstance(item, (list, tuple)) else (item,)
            found.extend(t for t in parts if isinstance(t, torch.Tensor))
    return found


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def tune_allocator() -> bool:
    """Keep freed activation buffers in glibc's heap instead of returning them to the OS.

    By default glibc serves every allocation above a few MB with a fresh mmap and unmaps it
    on free, so each large activation of a forward pays page faults on first touch: measured
    here, SiLU-and-mul over a 2048-token prefill chunk ran 4.7x slower that way. Raising the
    mmap threshold only reaches glibc's cap (32 MiB), and a decode batch of 256 makes
    logits of 48 MiB (and softmax temporaries the same size): a softmax over them took
    18 ms with a fresh mapping per call against 4.7 ms from the heap. So mmap is off
    altogether (``M_MMAP_MAX`` 0; glibc still maps when the heap cannot grow) and trimming
    is deferred. The price is that memory freed in the middle of the heap stays with the
    process for reuse, as it would in any caching allocator. Returns False where the C
    library is not glibc.
    """
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    ok = ok and mallopt(_M_MMAP_MAX, 0) == 1
    return ok and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1


def trim_heap() -> None:
    """Hand the heap's freed pages back to the OS (glibc keeps them otherwise, as
    ``tune_allocator`` asks): the weights' old copies would stay resident."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


@torch.no_grad()
def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Moves every strided CPU tensor the model holds into one mapping on huge pages; each
    tensor keeps its identity (``set_``), so tied weights stay tied and every module that
    holds one sees the move. Returns the bytes moved."""
    tensors = [t for t in _module_tensors(model)
               if t.device.type == "cpu" and t.layout == torch.strided and t.numel() > 0]
    groups: dict[int, list[torch.Tensor]] = {}  # storage -> the tensor objects on it
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = [-(-g[0].untyped_storage().nbytes() // _ALIGN) * _ALIGN for g in groups.values()]
    total = sum(sizes)
    if total == 0:
        return 0
    arena = anonymous_buffer(total, huge_pages=True,
                             purpose="the model's weights on huge pages (--cpu-huge-pages off "
                                     "keeps them where they were loaded)")
    new_storage = arena.untyped_storage()
    offset = untrimmed = 0
    # One storage at a time, its old copy freed before the next: the peak stays near the
    # weights' size plus what the heap has not yet handed back (trimmed every 1 GiB).
    for group, size in zip(groups.values(), sizes):
        old = group[0].untyped_storage()
        arena[offset:offset + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
        del old
        for t in group:
            t.set_(new_storage, offset // t.element_size() + t.storage_offset(), t.size(),
                   t.stride())
        offset += size
        untrimmed += size
        if untrimmed >= 1 << 30:
            trim_heap()
            untrimmed = 0
    trim_heap()
    return total


# Start-up time the KV cache's first pages may take to be touched (prefault_kv_cache).
PREFAULT_SECONDS = 0.5
_PREFAULT_STEP = 2 << 20  # one huge page of each layer's cache per round


@torch.no_grad()
def prefault_kv_cache(caches: list[torch.Tensor], seconds: float = PREFAULT_SECONDS) -> int:
    """Touches the caches' pages from their first block up, a huge page of every layer per
    round, until all are touched or ``seconds`` have passed; returns the bytes touched.

    A page's first touch costs a fault that zeroes it: ~0.2 ms per MiB on huge pages where
    the memory was in use before, and ~3 ms per MiB on a VM whose host backs guest memory
    only when first touched (measured: docs/backends/cpu.md, "Huge pages"). Left to the
    forward, those faults land on the first requests' ``write_kv``. The block pool hands out
    the lowest free ids first, so the first blocks are the ones to touch; the time bound
    keeps a large cache on a slow VM from holding up the start."""
    flats = [c.view(-1).view(torch.uint8) for c in caches]
    size = max((f.numel() for f in flats), default=0)
    deadline = time.monotonic() + seconds
    done = 0
    for start in range(0, size, _PREFAULT_STEP):
        for f in flats:
            f[start:start + _PREFAULT_STEP].zero_()
        done = min(size, start + _PREFAULT_STEP)
        if time.monotonic() >= deadline:
            break
    return done * len(flats)
