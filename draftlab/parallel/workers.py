"""Worker processes (DSI target servers, the pipeline's drafter): they die with their parent, report errors with
their traceback, and the parent checks they are alive while it waits for them."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback


class WorkerError(RuntimeError):
    """A worker process failed (its traceback is in the message), died, or went silent."""


def die_with_parent() -> None:
    """Called first thing in a worker: end this process when the parent ends, however it ends (killed included).

    Linux's parent-death signal covers a parent killed with SIGKILL; a watcher thread on the parent's sentinel
    covers other platforms (and a parent that exits while the signal is being set up)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    parent = mp.parent_process()
    if parent is None:
        return

    def watch():
        parent.join()
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def error_message(who: str) -> tuple:
    """The message a worker sends when it fails: ("error", who, traceback)."""
    return ("error", who, traceback.format_exc())


def receive(q, procs: list, timeout_s: float | None, what: str, poll_s: float = 0.5, loads=None):
    """The next message from q (passed through loads, if given), checking every poll_s that the worker processes
    are alive. A worker's ("error", who, traceback) message, a dead worker or no message within timeout_s raise
    WorkerError."""
    t0 = time.perf_counter()
    while True:
        wait = poll_s if timeout_s is None else min(poll_s, max(0.0, timeout_s - (time.perf_counter() - t0)))
        try:
            msg = q.get(timeout=wait)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise WorkerError(f"{what}: worker {dead[0].name} died (exit code {dead[0].exitcode}) without a "
                                  "report") from None
            if timeout_s is not None and time.perf_counter() - t0 >= timeout_s:
                raise WorkerError(f"{what}: no word from the workers for {timeout_s:.0f} s") from None
            continue
        if loads is not None:
            msg = loads(msg)
        raise_if_error(msg, what)
        return msg


def raise_if_error(msg, what: str) -> None:
    """Raise WorkerError with the worker's traceback when msg is an error report."""
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise WorkerError(f"{what}: worker {msg[1]} failed:\n{msg[2]}")


def stop_workers(procs: list, timeout_s: float = 10.0) -> None:
    """Wait up to timeout_s for the workers to exit (after they were asked to), then terminate, then kill."""
    deadline = time.perf_counter() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.perf_counter()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join(timeout=2)
