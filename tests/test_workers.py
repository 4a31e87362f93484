"""Worker-process plumbing shared by DSI and the pipeline: workers end with their parent, however it ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import REPO

CHILD = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys, threading, time
    from draftlab.parallel.workers import die_with_parent, start_workers

    def child():
        die_with_parent()
        time.sleep(300)

""")  # a worker; the scripts below start it

PARENT = CHILD + textwrap.dedent("""
    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=child, daemon=True)
        p.start()
        print(p.pid, flush=True)
        time.sleep(300)
""")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has ended; only its entry waits to be reaped
    except FileNotFoundError:
        return False


def test_a_worker_ends_when_its_parent_is_killed(tmp_path):
    """SIGKILL on the parent (no clean-up code runs there): the worker still goes within seconds."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # let the child set itself up
        assert _running(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.time() + 20
        while _running(child) and time.time() < deadline:
            time.sleep(0.1)
        assert not _running(child)
    finally:
        parent.kill()


STARTER = CHILD + textwrap.dedent("""
    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=child, daemon=True)
        t = threading.Thread(target=start_workers, args=([p],))  # started from a thread that then ends
        t.start()
        t.join()
        time.sleep(2.0)  # the thread has ended; let the child set itself up
        os.kill(p.pid, signal.SIGINT)  # a Ctrl-C reaches the worker too
        time.sleep(1.0)
        print(p.is_alive(), p.exitcode, flush=True)
        p.kill()
""")


def test_a_worker_outlives_the_thread_that_started_it_and_leaves_interrupts_to_its_parent(tmp_path):
    """Linux's parent-death signal follows the parent's thread that started a worker: start_workers starts workers
    off the main thread from one that lasts as long as the process, so a worker started from a short-lived thread
    (a server built in a helper thread) is not killed when that thread ends. A SIGINT (Ctrl-C at a terminal reaches
    the whole process group) does not end a worker: its parent, which may catch the interrupt and go on, decides."""
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.split() == ["True", "None"], out.stdout + out.stderr


def test_a_message_that_cannot_be_read_and_a_worker_never_started_are_reported_not_hung_on():
    """A message that cannot be unpickled (a tensor shared by a worker that has died since: its resource sharer
    refuses the connection) raises WorkerError rather than a bare OSError; stopping workers of which some never started
    (a start that failed part-way) stops the others rather than fail on the first."""
    import multiprocessing as mp

    import pytest

    from draftlab.parallel.workers import WorkerError, receive, stop_workers

    q = mp.get_context("spawn").Queue()
    q.put(b"x")

    def refused(_):
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(WorkerError, match="could not be read"):
        receive(q, [], 5.0, "test", loads=refused)
    never = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    stop_workers([never], queues=(q,))  # no AssertionError ("can only join a started process")


def test_a_poll_that_finds_no_message_checks_the_workers_are_alive():
    """poll (DSI's drafter, between drafts) raises for a dead worker, as receive does, instead of returning None until
    the caller blocks (a killed server was noticed tens of seconds late: walk-through); with the workers alive it
    returns None."""
    import multiprocessing as mp

    import pytest

    from draftlab.parallel.workers import WorkerError, poll

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    alive, dead = ctx.Process(target=time.sleep, args=(60,), daemon=True), ctx.Process(target=time.sleep, args=(0,))
    alive.start(), dead.start()
    try:
        dead.join(60)
        assert poll(q, [alive], 0.0, "test") is None
        with pytest.raises(WorkerError, match=f"test: worker {dead.name} \\(exit code 0\\) died without a report"):
            poll(q, [alive, dead], 0.0, "test")
    finally:
        alive.kill()


TORN = textwrap.dedent("""
    import multiprocessing as mp, time
    from draftlab.parallel.workers import WorkerError, reading_end_only, receive, start_workers

    def child(q):
        q.put(b"x" * (1 << 20))  # more than the pipe holds: the write waits for a reader
        time.sleep(300)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,), daemon=True)
        start_workers([p])
        reading_end_only(q)
        assert q._reader.poll(60)  # the message has begun
        time.sleep(0.5)
        p.kill()  # in the middle of writing it
        try:
            receive(q, [p], 30.0, "test")
        except WorkerError as e:
            print("WorkerError:", e, flush=True)
""")


def test_a_worker_killed_in_the_middle_of_a_large_message_is_reported_not_waited_for(tmp_path):
    """A message larger than the pipe's buffer is written in pieces as the reader reads. A worker killed between
    pieces left the reader waiting for the rest for good while the parent's own copy of the writing end kept the pipe
    open; with that copy closed (reading_end_only, as DSI and the pipeline do) the read ends with WorkerError, naming
    the worker and its exit code."""
    script = tmp_path / "torn.py"
    script.write_text(TORN)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "WorkerError: test: a message from the workers could not be read" in out.stdout, out.stdout + out.stderr
    assert "has died" in out.stdout and "(exit code -9)" in out.stdout, out.stdout  # who died, and how


INTERRUPTED = CHILD.replace("time.sleep(300)\n", "") + textwrap.dedent("""
    def sender(inbox, pool):
        die_with_parent()
        import pickle
        while True:
            i = inbox.get()
            pool.put(pickle.dumps((i, bytes([i % 256]) * (8 << 20))))  # 8 MB: read from the pipe in many pieces

    if __name__ == "__main__":
        import pickle
        from draftlab.parallel.workers import reading_end_only, receive

        # A test run started in the background of a shell without job control ignores SIGINT, and this process
        # would inherit that: Ctrl-C's own handler, as at a terminal.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ctx = mp.get_context("spawn")
        inbox, pool = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=sender, args=(inbox, pool), daemon=True)
        start_workers([p])
        reading_end_only(pool)
        interrupts = 0
        for attempt in range(1, 31):
            inbox.put(attempt)
            assert pool._reader.poll(30)  # the message has begun to arrive
            timer = threading.Timer(0.0005 * attempt, os.kill, (os.getpid(), signal.SIGINT))
            try:
                timer.start()  # (inside: on a loaded machine the interrupt can land while the thread starts)
                receive(pool, [p], 30.0, "test", loads=pickle.loads)
                timer.join()  # (the interrupt lands here when the read was quicker)
                time.sleep(0.05)
            except KeyboardInterrupt:
                interrupts += 1
        print("interrupts", interrupts, flush=True)
        inbox.put(255)
        while True:  # a whole message (an interrupt before a read began leaves one), then the next one, intact
            i, payload = receive(pool, [p], 30.0, "test", loads=pickle.loads)
            assert payload == bytes([i]) * (8 << 20), i
            if i == 255:
                break
        print("reused: every message whole", flush=True)
""")


def test_ctrl_c_while_a_large_message_is_read_leaves_the_queue_readable(tmp_path):
    """Ctrl-C landing in the middle of a message's read left the rest of it in the pipe: the next read of that queue
    (a pipeline or DSI pool reused after an interrupted run) took a length from its middle and waited for good, with
    no timeout and the worker alive (found by review). The read now ends first, then the interrupt is raised."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "interrupts 30" in out.stdout, out.stdout + out.stderr[-2000:]  # every Ctrl-C still interrupts
    assert "reused: every message whole" in out.stdout, out.stdout + out.stderr[-2000:]
