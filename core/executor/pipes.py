"""The framing both kinds of worker process speak over their stdin/stdout: the CPU backend's
forward worker (backends/cpu/worker.py) and the ``mp`` executor's ranks (worker.py here).

The engine writes plain pickles (``send``); a worker writes length-prefixed pickles
(``reply``) that the engine reads exactly (``read_reply``), so nothing sits in a Python
buffer where ``select`` on the pipe would not see it. A worker takes its inputs off stdin on
a thread (``read_inputs``), so the engine never blocks writing step N+1 while the worker
blocks writing step N's reply.

Both start as ``start_worker`` starts them, in a process group of their own, and end as
``kill_worker`` ends them: with everything they started (a kernel build's compilers).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

LEN = struct.Struct("<Q")
# How a worker learns which process started it (exit_with_parent).
ENGINE_PID_ENV = "CADENCE_ENGINE_PID"
# How often a worker's or rank's start that takes long says so (a first start builds the
# CPU kernels: minutes on 2 cores).
START_NOTICE_S = 60.0


def send(f: BinaryIO, obj: Any) -> None:
    pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
    f.flush()


def reply(f: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(LEN.pack(len(data)) + data)
    f.flush()


def read_exactly(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_reply(fd: int) -> Any:
    """One ``reply`` from the pipe ``fd``; EOFError when the writer is gone."""
    (size,) = LEN.unpack(read_exactly(fd, LEN.size))
    return pickle.loads(read_exactly(fd, size))


def read_inputs(inp: BinaryIO, inbox: queue.SimpleQueue) -> None:
    """Move every pickle from ``inp`` to ``inbox``; None last (end of input or a broken pipe)."""
    while True:
        try:
            msg = pickle.load(inp)
        except (EOFError, OSError, pickle.UnpicklingError):
            msg = None
        inbox.put(msg)
        if msg is None:
            return


def start_worker(module: str) -> subprocess.Popen:
    """``python -m module`` with pipes for stdin and stdout, leading a process group of its
    own. Its own session also keeps a terminal's Ctrl-C to the engine, which stops it."""
    env = {**os.environ, ENGINE_PID_ENV: str(os.getpid())}
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True, env=env)


def kill_worker(proc: subprocess.Popen) -> None:
    """Kill a worker and what it started, and reap it. A worker killed alone while it builds
    the CPU kernels would leave its compilers writing into the build folder beside the next
    build there."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait()


def exit_with_parent() -> None:
    """Called first in a worker: when the engine process that started it is gone, the worker
    and what it started exit too. Its own process group keeps it from the signals a terminal
    or a CI runner sends the engine's group, and it would otherwise notice only when it next
    reads its closed stdin, which it does not while it loads (minutes). A watch of the
    parent's pid, not Linux's PR_SET_PDEATHSIG, which fires when the *thread* that started
    the worker ends (a replica's start-up thread)."""
    # The engine's pid as it started us (not whatever getppid() says by now: a parent that
    # already died reads as a subreaper's pid, and an engine running as pid 1 in a
    # container is a live parent).
    engine = int(os.environ.get(ENGINE_PID_ENV) or os.getppid())

    def leave() -> None:
        if os.getpgrp() == os.getpid():  # started by start_worker: its group is its own
            os.killpg(0, signal.SIGKILL)
        os._exit(1)

    def watch() -> None:
        while os.getppid() == engine:
            time.sleep(1.0)
        leave()

    if os.getppid() != engine:  # the engine died before this worker got here
        leave()
    threading.Thread(target=watch, daemon=True, name="cadence-parent-watch").start()


class on_interrupt:  # used as a function: with on_interrupt(handler)
    """Run ``handler`` when a ``KeyboardInterrupt`` (or another ``BaseException`` that is
    not an ``Exception``) leaves the block, then let it go on. Wraps the engine's side of a
    step's exchange with a worker: interrupted there, a step's message may be half written
    or its reply left unread, and the next step would read that reply as its own, so the
    handler stops the worker (it is restarted like a lost one). A class, not a generator:
    it wraps every step's exchange, so it costs next to nothing."""

    __slots__ = ("handler",)

    def __init__(self, handler: Callable[[BaseException], None]) -> None:
        self.handler = handler

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> bool:
        if error is not None and not isinstance(error, Exception):
            self.handler(error)
        return False  # the interrupt goes on
