"""The CPU backend's forward worker process, for the ``process`` overlap strategy.

torch CPU ops are synchronous, and a worker *thread* fights the engine thread for the GIL on
every op (measured here: both sides 48-62 % slower on 2 cores). A separate process owns the
model and the KV cache instead: the engine sends a ``ModelInput`` (plain host data, so it
pickles), runs finalize while the worker computes, then reads the ``SamplerOutput``.

NOTE one request in flight: the engine never sends step N+1 before it has read step N's
result, so the worker's KV cache is never written by two steps at once.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
import weakref
from typing import Any, BinaryIO

from cadence.backend import ModelInput, SamplerOutput, WorkerLostError
from cadence.config import EngineConfig


def _send(f: BinaryIO, obj: Any) -> None:
    pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
    f.flush()


def _serve(inp: BinaryIO, out: BinaryIO) -> None:
    config, kv_cache_bytes, num_threads = pickle.load(inp)
    try:
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        from cadence.backends.cpu.runtime import build_runtime

        rt = build_runtime(config, kv_cache_bytes)
        runner = rt.runner
        _send(out, ("ready", rt.num_blocks, rt.describe()))
    except BaseException as e:
        _send(out, ("error", isinstance(e, ValueError), str(e), traceback.format_exc()))
        return
    while True:
        try:
            msg = pickle.load(inp)
        except EOFError:
            return
        if msg is None:
            return
        if msg == "ping":
            _send(out, "pong")
            continue
        try:
            mi: ModelInput = msg
            t0 = time.perf_counter()
            result = runner.to_host(runner.sample(runner.forward(mi), mi.sampling))
            result.device_seconds = time.perf_counter() - t0
            result.device_done_at = time.monotonic()
        except BaseException:
            # A plain tuple: this module runs as ``__main__`` here, so a class defined in it
            # would pickle under a name the engine process cannot import.
            result = ("error", traceback.format_exc())
        _send(out, result)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class ForwardWorker:
    """Owns the worker process; ``submit`` then ``result`` once per step.

    The worker is a fresh interpreter (``python -m cadence.backends.cpu.worker``) talking
    pickles over its stdin/stdout: unlike multiprocessing's spawn it does not re-import the
    user's ``__main__``, so scripts need no ``if __name__ == "__main__"`` guard, and unlike
    fork it never inherits the parent's OpenMP threads.
    """

    def __init__(self, config: EngineConfig, kv_cache_bytes: int,
                 num_threads: int | None = None) -> None:
        self.step_timeout_s = config.fault_config.step_timeout_s
        self._closing = False
        self._proc = subprocess.Popen([sys.executable, "-m", "cadence.backends.cpu.worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._in = self._proc.stdout
        self._out = self._proc.stdin
        self._in_flight = False
        # An engine dropped without shutdown() must not leave its worker (and its KV cache)
        # behind for the rest of the process.
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        self._ready = False
        _send(self._out, (config, kv_cache_bytes, num_threads))

    def wait_ready(self) -> None:
        """Wait until the worker has built the model and its KV cache (``num_blocks`` and
        ``runtime_info`` are set then). Separate from ``__init__`` so the caller can do its
        own start-up work, such as loading the tokenizer, while the worker loads."""
        if self._ready:
            return
        try:
            reply = self._recv()
        except WorkerLostError as e:
            self.close()
            raise RuntimeError(f"the CPU forward worker failed to start: {e}") from None
        if reply[0] == "error":
            _, is_user_error, message, tb = reply
            self.close()
            if is_user_error:  # a bad model folder, a KV cache too small: the user's to fix
                raise ValueError(message)
            raise RuntimeError(f"the CPU forward worker failed to start:\n{tb}")
        _, self.num_blocks, self.runtime_info = reply
        self._ready = True

    def _recv(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            # Strict request-reply: nothing is buffered between replies, so the pipe's fd
            # says whether the next one has started to arrive.
            ready, _, _ = select.select([self._in], [], [], timeout)
            if not ready:
                self.kill()
                raise WorkerLostError(
                    f"the CPU forward worker gave no reply within {timeout:g} s "
                    "(step_timeout); it was killed")
        try:
            return pickle.load(self._in)
        except (EOFError, OSError, pickle.UnpicklingError):
            raise WorkerLostError(self._exit_message()) from None

    def _exit_message(self) -> str:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "the CPU forward worker closed its pipe and was killed"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the CPU forward worker died (killed by {name})"
        return f"the CPU forward worker exited (code {code})"

    def check_alive(self) -> None:
        """Raise ``WorkerLostError`` if the process has exited; safe from any thread."""
        if not self._closing and self._proc.poll() is not None:
            raise WorkerLostError(self._exit_message())

    @property
    def pid(self) -> int:
        return self._proc.pid

    def kill(self) -> None:
        _kill(self._proc)

    def ping(self) -> None:
        """Between steps: a worker that does not answer within the step deadline is frozen
        (it is killed, and ``WorkerLostError`` raised)."""
        assert not self._in_flight, "ping() while a step is in flight"
        try:
            _send(self._out, "ping")
        except OSError:
            raise WorkerLostError(self._exit_message()) from None
        if self._recv(self.step_timeout_s) != "pong":
            self.kill()
            raise WorkerLostError("the CPU forward worker answered a ping with something "
                                  "else; it was killed")

    def submit(self, model_input: ModelInput) -> None:
        assert not self._in_flight, "one step in flight at a time"
        try:
            _send(self._out, model_input)
        except OSError:  # a broken pipe: the worker is gone
            raise WorkerLostError(self._exit_message()) from None
        self._in_flight = True

    def result(self) -> SamplerOutput:
        assert self._in_flight, "result() without submit()"
        self._in_flight = False
        out = self._recv(self.step_timeout_s)
        if isinstance(out, tuple):  # ("error", the worker's traceback)
            raise RuntimeError(f"the CPU forward worker failed:\n{out[1]}")
        return out

    def close(self) -> None:
        self._closing = True
        if self._proc.poll() is None:
            try:
                if self._in_flight:
                    self.result()
                _send(self._out, None)
            except (OSError, RuntimeError):  # WorkerLostError included
                pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._finalizer.detach()
        for f in (self._in, self._out):
            try:
                f.close()
            except OSError:
                pass


def main() -> None:
    # The protocol owns the original stdout; anything the model stack prints goes to stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, proto_out)


if __name__ == "__main__":
    main()
