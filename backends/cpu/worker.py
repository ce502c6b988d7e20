"""The CPU backend's forward worker process, for the ``process`` overlap strategy.

torch CPU ops are synchronous, and a worker *thread* fights the engine thread for the GIL on
every op (measured here: both sides 48-62 % slower on 2 cores). A separate process owns the
model and the KV cache instead: the engine sends a ``ModelInput`` (plain host data, so it
pickles), runs finalize while the worker computes, then reads the ``SamplerOutput``.

NOTE steps in flight: without async scheduling the engine sends step N+1 only after it read
step N's result; with it, step N+1 may wait in the pipe while step N computes (at most two
in flight). The worker runs them one after the other, so its KV cache is never written by
two steps at once, and step N+1's placeholders are filled from the ids step N sampled here.
Two rules keep the pipes from deadlocking and the step deadline honest: a reader thread
takes inputs off the pipe as they come (the engine never blocks writing step N+1 while the
worker blocks writing step N's result), and replies are length-prefixed and read exactly,
so none is ever buffered in the engine process where ``select`` would not see it.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Any, BinaryIO

from cadence.backend import ModelInput, SamplerOutput, WorkerLostError
from cadence.config import EngineConfig
from cadence.executor.pipes import (
    START_NOTICE_S,
    exit_with_parent,
    kill_worker,
    on_interrupt,
    read_inputs,
    read_reply,
    reply,
    send,
    start_worker,
)
from cadence.structured_output.bitmask import expect_after_step, is_bitmask_message

logger = logging.getLogger(__name__)


def _serve(inp: BinaryIO, out: BinaryIO) -> None:
    config, kv_cache_bytes, num_threads = pickle.load(inp)
    try:
        import torch

        from cadence.backends.cpu.placement import place, placement_options

        # A replica among several takes its share of the cores, and any reserved for the
        # engine process are left out (placement.py), before torch starts its thread pool.
        bind, reserved = placement_options(config)
        num_threads = place(config.parallel_config, bind, False, reserved) or num_threads
        if num_threads:
            torch.set_num_threads(num_threads)
        from cadence.backends.cpu.runtime import build_runtime

        rt = build_runtime(config, kv_cache_bytes)
        runner = rt.runner
        reply(out, ("ready", rt.num_blocks, rt.describe()))
    except BaseException as e:
        reply(out, ("error", isinstance(e, ValueError), str(e), traceback.format_exc()))
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_inputs, args=(inp, inbox), daemon=True,
                     name="cadence-cpu-worker-inputs").start()
    while True:
        msg = inbox.get()
        if msg is None:
            return
        if msg == "ping":
            reply(out, "pong")
            continue
        if is_bitmask_message(msg):
            continue  # for a step that failed before it needed its bitmask
        try:
            mi: ModelInput = msg
            expect_after_step(mi.sampling.grammar, inbox)
            t0 = time.perf_counter()
            logits = runner.forward(mi)
            result = runner.to_host(runner.sample(logits, mi.sampling))
            result.device_seconds = time.perf_counter() - t0
            result.device_done_at = time.monotonic()
        except BaseException:
            # A plain tuple: this module runs as ``__main__`` here, so a class defined in it
            # would pickle under a name the engine process cannot import.
            result = ("error", traceback.format_exc())
        reply(out, result)


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
        self.startup_timeout_s = config.fault_config.startup_timeout_s
        self._closing = False
        self._proc = start_worker("cadence.backends.cpu.worker")
        self._in = self._proc.stdout
        self._out = self._proc.stdin
        self._in_flight = 0  # steps sent and not yet read back (2 under async scheduling)
        self._failure: str | None = None  # why it was stopped after an interrupt, if it was
        # An engine dropped without shutdown() must not leave its worker (and its KV cache)
        # behind for the rest of the process.
        self._finalizer = weakref.finalize(self, kill_worker, self._proc)
        self._ready = False
        send(self._out, (config, kv_cache_bytes, num_threads))

    def wait_ready(self) -> None:
        """Wait until the worker has built the model and its KV cache (``num_blocks`` and
        ``runtime_info`` are set then). Separate from ``__init__`` so the caller can do its
        own start-up work, such as loading the tokenizer, while the worker loads."""
        if self._ready:
            return
        try:
            self._await_start()
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

    def _await_start(self) -> None:
        """Until the worker's first reply starts to arrive (or it dies: EOF reads as ready),
        saying every minute that it is still starting; past ``startup_timeout_s`` it is
        stuck (a lock held by a stuck process, a filesystem that stopped answering): killed,
        and ``WorkerLostError`` raised."""
        started = time.monotonic()
        limit = self.startup_timeout_s
        while True:
            waited = time.monotonic() - started
            if waited >= limit:
                self.kill()
                raise WorkerLostError(
                    f"the CPU forward worker (pid {self.pid}) was not ready within {limit:g} s "
                    "(--startup-timeout, startup_timeout); it was killed")
            ready, _, _ = select.select([self._in], [], [], min(START_NOTICE_S, limit - waited))
            if ready:
                return
            logger.warning("the CPU forward worker (pid %d) is still starting after %.0f s "
                           "(a first start builds the CPU kernels; the start gives up after "
                           "%g s, --startup-timeout)", self.pid, time.monotonic() - started,
                           limit)

    def _recv(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            # Replies are read exactly (never buffered here), so the pipe's fd says whether
            # the next one has started to arrive.
            ready, _, _ = select.select([self._in], [], [], timeout)
            if not ready:
                self.kill()
                raise WorkerLostError(
                    f"the CPU forward worker gave no reply within {timeout:g} s "
                    "(step_timeout); it was killed")
        try:
            fd = self._in.fileno()
            return read_reply(fd)
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
        if self._failure is not None:
            raise WorkerLostError(self._failure, interrupted=True)
        if not self._closing and self._proc.poll() is not None:
            raise WorkerLostError(self._exit_message())

    @property
    def pid(self) -> int:
        return self._proc.pid

    def kill(self) -> None:
        kill_worker(self._proc)

    def ping(self) -> None:
        """Between steps: a worker that does not answer within the step deadline is frozen
        (it is killed, and ``WorkerLostError`` raised)."""
        assert not self._in_flight, "ping() while a step is in flight"
        with on_interrupt(self.interrupted):
            try:
                send(self._out, "ping")
            except OSError:
                raise WorkerLostError(self._exit_message()) from None
            if self._recv(self.step_timeout_s) != "pong":
                self.kill()
                raise WorkerLostError("the CPU forward worker answered a ping with something "
                                      "else; it was killed")

    def submit(self, model_input: ModelInput) -> None:
        if self._failure is not None:
            raise WorkerLostError(self._failure, interrupted=True)
        assert self._in_flight < 2, "at most two steps in flight"
        with on_interrupt(self.interrupted):
            try:
                send(self._out, model_input)
            except OSError:  # a broken pipe: the worker is gone
                raise WorkerLostError(self._exit_message()) from None
            self._in_flight += 1

    def send_bitmask(self, grammar: Any) -> None:
        """Compute the grammar bitmask of the step just submitted and send it; the worker
        waits for it before sampling. If computing it fails the worker is told, so the step
        fails there too instead of waiting for a bitmask that never comes."""
        with on_interrupt(self.interrupted):
            try:
                value = grammar.get()
            except Exception:
                send(self._out, ("bitmask", None))
                raise
            try:
                send(self._out, ("bitmask", value))
            except OSError:
                raise WorkerLostError(self._exit_message()) from None

    def result(self) -> SamplerOutput:
        """The oldest step's samples (steps are answered in the order they were sent)."""
        if self._failure is not None:
            raise WorkerLostError(self._failure, interrupted=True)
        assert self._in_flight, "result() without submit()"
        self._in_flight -= 1
        with on_interrupt(self.interrupted):
            out = self._recv(self.step_timeout_s)
        if isinstance(out, tuple):  # ("error", the worker's traceback)
            raise RuntimeError(f"the CPU forward worker failed:\n{out[1]}")
        return out

    def discard_in_flight(self) -> None:
        """Read and drop the reply of every step in flight (the engine no longer wants
        them), each within the step deadline. A worker an interrupt stopped holds none;
        ``check_alive`` reports it."""
        while self._in_flight:
            try:
                self.result()
            except WorkerLostError:
                raise
            except RuntimeError:  # noqa: S110  # that step failed; the later one answers
                pass

    def interrupted(self, error: BaseException) -> None:
        """Stop the worker: an interrupt cut an exchange with it short (``on_interrupt``)."""
        self.kill()
        self._in_flight = 0
        self._failure = (f"a step was interrupted ({type(error).__name__}) while the CPU "
                         "forward worker ran it; the worker was stopped, so that no later "
                         "step reads its reply")

    def close(self) -> None:
        self._closing = True
        if self._proc.poll() is None:
            try:
                while self._in_flight:
                    try:
                        self.result()
                    except WorkerLostError:
                        raise
                    except RuntimeError:  # that step failed; the later one still answers
                        pass
                send(self._out, None)
            except (OSError, RuntimeError):  # WorkerLostError included
                pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_worker(self._proc)
        self._finalizer.detach()
        for f in (self._in, self._out):
            try:
                f.close()
            except OSError:
                pass


def main() -> None:
    exit_with_parent()
    # The protocol owns the original stdout; anything the model stack prints goes to stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, proto_out)
    # Nothing is left to save, and the engine waits for this exit: skip the interpreter's
    # teardown (freeing the model and KV cache page by page, torch's module finalizers),
    # measured at 1.5-2.5 s of every shutdown.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
