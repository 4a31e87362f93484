"""Worker-process plumbing shared by DSI and the pipeline: workers end with their parent, however it ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import REPO

PARENT = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    from draftlab.parallel.workers import die_with_parent

    def child():
        die_with_parent()
        time.sleep(300)

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
