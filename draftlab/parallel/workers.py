"""Worker processes (DSI target servers, the pipeline's drafter): they die with their parent, report errors with
their traceback, and the parent checks they are alive while it waits for them."""

from __future__ import annotations

import pickle
import queue
import signal
import threading
import time
import traceback
from concurrent.futures import Future
from contextlib import contextmanager

from ..procs import die_with_parent  # noqa: F401 (the workers' first call; it lives where every stage reaches it)


class WorkerError(RuntimeError):
    """A worker process failed (its traceback is in the message), died, or went silent."""


_LAUNCHER: list = []  # the queue of jobs of the thread that starts workers off the main thread


def start_workers(procs: list) -> None:
    """Start the worker processes: from the main thread as they are; from another thread, on one thread that lasts as
    long as the process (Linux's parent-death signal, die_with_parent, follows the thread that started a worker, which
    would end a worker with a short-lived thread that started it). An error starting one is raised here."""
    if threading.current_thread() is threading.main_thread():
        for p in procs:
            p.start()
        return
    if not _LAUNCHER:
        jobs: queue.Queue = queue.Queue()

        def launch():
            while True:
                start, done = jobs.get()
                try:
                    done.set_result(start())
                except BaseException as e:  # handed to the caller
                    done.set_exception(e)
        threading.Thread(target=launch, daemon=True, name="draftlab-worker-launcher").start()
        _LAUNCHER.append(jobs)
    for p in procs:
        done: Future = Future()
        _LAUNCHER[0].put((p.start, done))
        done.result()


def reading_end_only(q) -> None:
    """Close the parent's copy of the writing end of q, a queue that only workers write to, once they have started.
    A read then sees the end of the pipe when the workers holding it have all ended, also in the middle of a message:
    a worker killed while it writes a message larger than the pipe's buffer (64 KiB) would otherwise leave the reader
    waiting for the rest of it for good, with the parent's own copy holding the pipe open (the queue's read has no
    deadline once a message has begun)."""
    writer = getattr(q, "_writer", None)  # multiprocessing.queues.Queue's end of the pipe for put
    if writer is not None:
        writer.close()


def error_message(who: str) -> tuple:
    """The message a worker sends when it fails: ("error", who, traceback)."""
    return ("error", who, traceback.format_exc())


@contextmanager
def ctrl_c_held():
    """Ctrl-C (SIGINT) held back until the block ends, then raised as it would have been. A read interrupted in the
    middle of a message leaves the rest of it in the pipe, and the next read of the same queue (a pipeline or DSI
    pool reused after an interrupted run) takes a length from the middle of it and waits for good. Only the main
    thread gets SIGINT, and only a Python handler can be held back; elsewhere the block runs as it is."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    got: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if got:
            handler(signal.SIGINT, got[0])


def _get(q, wait_s: float, procs: list, what: str, loads=None):
    """q's next message within wait_s seconds (none: only one already there), passed through loads; queue.Empty when
    none came. A worker's error report, and a message that cannot be read, raise WorkerError. Ctrl-C waits for the
    read to end (ctrl_c_held; wait_s is at most receive's poll_s, half a second, where a caller blocks)."""
    try:
        with ctrl_c_held():
            msg = q.get(timeout=wait_s) if wait_s > 0 else q.get_nowait()
            if loads is not None:
                msg = loads(msg)
    except (EOFError, OSError, pickle.UnpicklingError) as e:  # a message that cannot be read: unpickling a tensor
        # shared by a worker that has died since (its resource sharer refuses), a truncated message, the pipe's end
        dead = _dead(procs, wait_s=1.0)
        raise WorkerError(f"{what}: a message from the workers could not be read ({type(e).__name__}: {e})"
                          + (f"; worker {dead[0]} has died" if dead else "")) from e
    raise_if_error(msg, what)
    return msg


def _dead(procs: list, wait_s: float = 0.0) -> list[str]:
    """'name (exit code N)' of each worker that has ended, waiting up to wait_s for one to be seen ended (a dying
    process closes its files before it can be reaped, so the end of its pipe can come first)."""
    deadline = time.perf_counter() + wait_s
    while True:
        dead = [f"{p.name} (exit code {p.exitcode})" for p in procs if not p.is_alive()]
        if dead or time.perf_counter() >= deadline:
            return dead
        time.sleep(0.01)


def poll(q, procs: list, wait_s: float, what: str, loads=None):
    """The next message within wait_s seconds, or None: as receive, for a caller that does not wait for one. A worker
    found dead when none came raises WorkerError here too (DSI's drafter polls between drafts: a killed server was
    noticed only once it had drafted to its cap and blocked, tens of seconds later: walk-through)."""
    try:
        return _get(q, wait_s, procs, what, loads)
    except queue.Empty:
        dead = _dead(procs)
        if dead:
            raise WorkerError(f"{what}: worker {dead[0]} died without a report") from None
        return None


def receive(q, procs: list, timeout_s: float | None, what: str, poll_s: float = 0.5, loads=None):
    """The next message from q (passed through loads, if given), checking every poll_s that the worker processes
    are alive. A worker's ("error", who, traceback) message, a message that cannot be read, a dead worker or no
    message within timeout_s raise WorkerError."""
    t0 = time.perf_counter()
    while True:
        wait = poll_s if timeout_s is None else min(poll_s, max(0.0, timeout_s - (time.perf_counter() - t0)))
        try:
            return _get(q, wait, procs, what, loads)
        except queue.Empty:
            dead = _dead(procs)
            if dead:
                raise WorkerError(f"{what}: worker {dead[0]} died without a report") from None
            if timeout_s is not None and time.perf_counter() - t0 >= timeout_s:
                raise WorkerError(f"{what}: no word from the workers for {timeout_s:.0f} s") from None


def raise_if_error(msg, what: str) -> None:
    """Raise WorkerError with the worker's traceback when msg is an error report."""
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise WorkerError(f"{what}: worker {msg[1]} failed:\n{msg[2]}")


def stop_workers(procs: list, timeout_s: float = 10.0, queues: tuple = ()) -> None:
    """Wait up to timeout_s for the workers to exit (after they were asked to), then terminate, then kill; workers
    never started (a start that failed part-way) are passed over. queues: the parent's queues to them, which are
    then closed without waiting for their feeder threads (a message to a worker that died could keep one writing,
    and the interpreter's exit waiting on it, for good)."""
    procs = [p for p in procs if p.pid is not None]
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
    for q in queues:
        q.cancel_join_thread()
        q.close()
