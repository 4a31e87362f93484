"""Progress reporting: a tqdm bar on a terminal; in logs and Slurm `.out` files, where a bar's redraws pile up as
thousands of lines, one plain line every DRAFTLAB_PROGRESS_SECONDS (default 30) and one at the end."""

from __future__ import annotations

import os
import sys
import time


def _is_terminal(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def progress(iterable=None, total=None, desc: str = "", unit: str = "it", initial: int = 0, disable: bool = False,
             leave: bool = True, file=None):
    """A progress reporter with tqdm's interface (iteration, update, set_postfix, refresh, close, .n)."""
    file = file or sys.stderr
    if disable or _is_terminal(file):
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, disable=disable, leave=leave,
                    file=file)
    return LineProgress(iterable, total, desc, unit, initial, file)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class LineProgress:
    """Plain lines: `desc: n/total unit (pct%), rate unit/s, elapsed, eta, postfix`."""

    def __init__(self, iterable=None, total=None, desc="", unit="it", initial=0, file=None):
        self.iterable, self.desc, self.unit, self.file = iterable, desc, unit, file or sys.stderr
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n = self.start_n = initial
        self.postfix = ""
        self.interval = float(os.environ.get("DRAFTLAB_PROGRESS_SECONDS", "30"))
        self.t0 = self.last = time.monotonic()
        self.closed = False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __len__(self):
        return self.total or 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def set_postfix(self, ordered_dict=None, refresh: bool = False, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.interval:
            self.last = now
            self.file.write(self.line(now) + "\n")
            self.file.flush()

    def line(self, now: float) -> str:
        elapsed = now - self.t0
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        done = f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"
        if self.total:
            done += f" ({100 * self.n / self.total:.0f}%)"
        eta = f", eta {_clock((self.total - self.n) / rate)}" if self.total and rate > 0 and self.n < self.total else ""
        post = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {done}, {rate:.3g} {self.unit}/s, elapsed {_clock(elapsed)}{eta}{post}"

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.refresh(force=True)
