"""The handle a step's ``SamplingMetadata`` carries for its constrained rows. No torch.

NOTE the overlap: the bitmask of step N+1 depends on the tokens of step N, which commit has
fed to the grammars before step N+1's inputs are built, so it can be computed any time
before step N+1 samples. The engine computes it first thing in ``post_sample``, i.e. while
the device runs step N+1's forward; the sampler calls ``get()`` before it samples, so a
backend that never calls ``post_sample`` before sampling still gets the mask (computed then,
without overlap). A lock makes "whoever comes first computes" safe across the CPU backend's
forward thread and the engine thread.

Pickled (to a worker process), a handle keeps its rows and its bitmask if one was computed,
never the function that computes it (vLLM #9931): a worker then receives the bitmask
separately, after the step (backends/cpu/worker.py, core/executor/worker.py): its input loop
hands the step's handle that message as its source (``expect_after_step``), read when the
sampler first asks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class GrammarBitmask:
    """Token bitmask of the rows of a step that follow a grammar.

    ``rows[i]`` is the sampled row (index into the step's sampled rows) that bitmask row i
    constrains. The bitmask is an int32 numpy array ``[len(rows), ceil(vocab / 32)]``: bit
    ``t % 32`` of word ``t // 32`` set means token t is allowed (xgrammar's layout).
    """

    __slots__ = ("_fn", "_lock", "_value", "rows", "seconds")

    def __init__(self, rows: list[int], fn: Callable[[], Any] | None = None,
                 value: Any = None) -> None:
        self.rows = rows
        self._fn = fn
        self._value = value
        self._lock = threading.Lock()
        #: How long computing the bitmask took (the bench breakdown's "bitmask" phase).
        self.seconds = 0.0

    @property
    def is_ready(self) -> bool:
        return self._value is not None

    def get(self) -> Any:
        """The bitmask, computed now if nobody has yet."""
        with self._lock:
            if self._value is None:
                if self._fn is None:
                    raise RuntimeError("this step's grammar bitmask was never delivered "
                                       "(a backend that ships steps elsewhere must send it)")
                t0 = time.perf_counter()
                self._value = self._fn()
                self.seconds = time.perf_counter() - t0
                self._fn = None
            return self._value

    def fetch_with(self, fn: Callable[[], Any]) -> None:
        """Where a pickled handle's bitmask comes from when it is first needed: ``fn``
        waits for the message that brings it (a rank reads it from its input pipe)."""
        with self._lock:
            if self._value is None:
                self._fn = fn

    def set(self, value: Any) -> None:
        with self._lock:
            self._value = value
            self._fn = None

    def select(self, rows: list[int | None]) -> GrammarBitmask:
        """The handle for a padded batch whose row r carries sampled row ``rows[r]`` (None:
        padding): every batch row gets a bitmask row (all tokens allowed where
        unconstrained), so the shapes depend on the batch size only (HPU graphs)."""
        pos = {j: i for i, j in enumerate(self.rows)}
        return GrammarBitmask(list(range(len(rows))),
                              lambda: _padded(self.get(), [pos.get(j) for j in rows]))

    def __getstate__(self) -> tuple[list[int], Any]:
        return (self.rows, self._value)

    def __setstate__(self, state: tuple[list[int], Any]) -> None:
        self.rows, self._value = state
        self._fn = None
        self._lock = threading.Lock()
        self.seconds = 0.0


def _padded(bitmask: Any, order: list[int | None]) -> Any:
    import numpy as np

    out = np.full((len(order), bitmask.shape[1]), -1, dtype=bitmask.dtype)
    for r, i in enumerate(order):
        if i is not None:
            out[r] = bitmask[i]
    return out



def is_bitmask_message(msg: Any) -> bool:
    """Whether ``msg`` is a late bitmask, ``("bitmask", array or None)``: an input loop
    skips one that no step read (a stage that samples nothing, a step that failed first)."""
    return isinstance(msg, tuple) and bool(msg) and msg[0] == "bitmask"


def expect_after_step(grammar: GrammarBitmask | None, inbox: Any) -> None:
    """For a process that received a step whose bitmask the engine sends after it (it
    computes it while this process runs the forward): the handle's bitmask is the next
    message of ``inbox`` (a queue of this process's inputs), read when the sampler first
    asks. Nothing to do without a grammar or with the bitmask already inside the step."""
    if grammar is not None and not grammar.is_ready:
        grammar.fetch_with(lambda: _bitmask_from(inbox))


def _bitmask_from(inbox: Any) -> Any:
    # ("bitmask", None): computing it failed in the engine, and the step fails here.
    msg = inbox.get()
    if msg is None:
        inbox.put(None)  # the engine is closing: the input loop sees it next
    if not (is_bitmask_message(msg) and msg[1] is not None):
        raise RuntimeError("the engine sent no grammar bitmask for a step that needs one")
    return msg[1]
