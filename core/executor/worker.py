"""One rank of the ``mp`` executor: a fresh interpreter that builds the backend for its rank
and runs every step the engine sends.

Protocol over the process's stdin/stdout: the engine sends one pickle with the start-up
spec, then ``ModelInput``s (or "ping", or None to stop). Replies are length-prefixed pickles:
("ready", num_blocks, env_info) or ("error", is_user_error, message, traceback) at start-up,
then one reply per step, in order: rank 0's ``SamplerOutput``, None from the other ranks
(their samples are identical, so only one crosses the pipe), or ("error", traceback).

NOTE pipes: a reader thread takes inputs off stdin as they come, so the engine never blocks
writing step N+1 while this process blocks writing step N's reply (async scheduling keeps
two in flight); replies are read exactly by the engine, never buffered where ``select``
would not see them. The same rules as the CPU backend's forward worker.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

LEN = struct.Struct("<Q")


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


def _read_inputs(inp: BinaryIO, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            msg = pickle.load(inp)
        except (EOFError, OSError, pickle.UnpicklingError):
            msg = None
        inbox.put(msg)
        if msg is None:
            return


def _start(spec: dict) -> Any:
    from cadence.plugins import get_registry

    config = spec["config"]
    backend_cls, _ = get_registry().select(config.backend)
    backend = backend_cls(config)
    backend.init_distributed(spec["rank"], spec["world_size"], spec["init_method"],
                             spec["timeout_s"])
    backend.load_model()
    num_blocks = backend.allocate_kv_cache()
    backend.warmup()
    return backend, num_blocks


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    spec = pickle.load(inp)
    rank = spec["rank"]
    try:
        backend, num_blocks = _start(spec)
        reply(out, ("ready", num_blocks, backend.env_info()))
    except BaseException as e:
        reply(out, ("error", isinstance(e, ValueError), str(e), traceback.format_exc()))
        return
    from cadence.backend import PostSample

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_inputs, args=(inp, inbox), daemon=True,
                     name=f"cadence-rank{rank}-inputs").start()
    while True:
        msg = inbox.get()
        if msg is None:
            break
        if msg == "ping":
            reply(out, "pong")
            continue
        try:
            t0 = time.perf_counter()
            result = backend.execute(msg, PostSample(None))
            result.device_seconds = time.perf_counter() - t0
            result.device_done_at = time.monotonic()
        except BaseException:
            # A plain tuple: this module runs as ``__main__`` here, so a class defined in it
            # would pickle under a name the engine process cannot import.
            result = ("error", traceback.format_exc())
        reply(out, result if rank == 0 or isinstance(result, tuple) else None)
    backend.shutdown()


def main() -> None:
    # The protocol owns the original stdout; anything the model stack prints goes to stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, proto_out)
    # Nothing is left to save and the engine waits for this exit: skip the interpreter's
    # teardown (and torch.distributed's, which would wait for the other ranks).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
