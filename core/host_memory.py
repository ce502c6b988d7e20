"""Host memory for CPU tensors that are streamed every step: anonymous mappings, on
transparent huge pages where the kernel offers them (backends/cpu/memory.py says why).

Linux hands out 2 MiB pages for anonymous memory when THP is ``always``, or ``madvise`` and
the range was marked with ``MADV_HUGEPAGE`` (the common default).
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's THP setting ("always", "madvise" or "never"), or None where unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_pages_available() -> bool:
    """Whether ``anonymous_buffer(..., huge_pages=True)`` gets 2 MiB pages here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def anonymous_buffer(nbytes: int, huge_pages: bool,
                     purpose: str = "a buffer") -> torch.Tensor:
    """A zero-filled uint8 tensor of ``nbytes`` on a private anonymous mapping, marked for
    huge pages when ``huge_pages``. Pages are materialized on first touch, so what is never
    written costs no memory (2 MiB at a time on huge pages). ``purpose`` says what it is
    for when the mapping is refused (a ValueError)."""
    import torch

    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError) as e:  # more than the address space or the limits allow
        raise ValueError(f"cannot map {nbytes / (1 << 30):.3g} GiB of memory ({e}) for "
                         f"{purpose}") from None
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge_pages and advice is not None:
        try:
            buf.madvise(advice)
        except OSError as e:  # a kernel built without THP: 4 KiB pages, same contents
            logger.warning("madvise(MADV_HUGEPAGE) failed (%s); using 4 KiB pages", e)
    # frombuffer keeps the mapping alive for as long as any view of it lives.
    return torch.frombuffer(buf, dtype=torch.uint8)
