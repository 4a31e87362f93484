"""Process hygiene every stage may use: a worker process ends with its parent (DSI's servers, the pipeline's
drafter, the processes that tokenize a data set)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading


def die_with_parent() -> None:
    """Called first thing in a worker: end this process when the parent ends, however it ends (killed included), and
    leave interrupts to the parent.

    Linux's parent-death signal covers a parent killed with SIGKILL; a watcher thread on the parent's sentinel
    covers other platforms (and a parent that exits while the signal is being set up). The signal is sent when the
    parent's thread that started the worker ends: start workers with start_workers, which starts them from a thread
    that lasts as long as the process. SIGINT is ignored here: a Ctrl-C at a terminal reaches every process of its
    group, and the parent, which may catch it and go on, stops its workers itself (or they end with it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
