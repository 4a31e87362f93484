"""Progress reporting: a tqdm bar on a terminal; in logs and Slurm `.out` files, where a bar's redraws pile up as
thousands of lines, one plain line every DRAFTLAB_PROGRESS_SECONDS (default 30) and one at the end. Other
libraries' bars and messages that say nothing to a draftlab user are kept out (quiet_libraries)."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings

# Library bars: loading / saving weights (transformers), downloads (huggingface_hub), dataset preparation
# (datasets). Each library reads its variable when first imported; an explicit setting of the user's wins.
LIBRARY_BARS_ENV = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


def _cpu_only_torch() -> bool:
    import torch  # imported already by whoever logs the message

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


# Log messages that say nothing a user can act on: (logger name, text the message contains, condition or None).
LIBRARY_NOISE = (
    # accelerate's save_state writes safetensors, which keep one name per storage, so it drops the second name of
    # a tied weight (an SSM's lm_head tied to its embeddings) and warns; load_state reads the file with
    # safetensors' load_model, which restores the tie (the resume tests check it).
    ("accelerate.utils.other", "Removed shared tensor", None),
    # DeepSpeed imported with a CPU-only torch build: there is no GPU it could have failed to detect.
    ("DeepSpeed", "Setting accelerator to CPU", _cpu_only_torch),
)

# Python warnings of the same kind: (category, the start of the message, literally).
LIBRARY_WARNINGS = (
    # peft (0.21) reads transformers' renamed `is_gradient_checkpointing` when it wraps a base for Medusa-2's adapter:
    # peft's rename to make, not the user's (walk-through: it landed in Medusa-2 training's output).
    (FutureWarning, "`is_gradient_checkpointing` is deprecated and will be removed"),
)


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
        self.shown = None  # (n, postfix) of the last line written

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
            self.last, self.shown = now, (self.n, self.postfix)
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
        # (a resumed job with nothing left did no work here: "0 prompt/s" read as a stall)
        speed = (f"{rate:.3g} {self.unit}/s" if self.n > self.start_n or not self.start_n else
                 "all done before this run" if self.total and self.n >= self.total else "resumed")
        return f"{self.desc}: {done}, {speed}, elapsed {_clock(elapsed)}{eta}{post}"

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.shown != (self.n, self.postfix):  # the last line already says how it ended
                self.refresh(force=True)


class _DropMessage(logging.Filter):
    def __init__(self, text: str, condition=None):
        super().__init__()
        self.text, self.condition = text, condition

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.text in record.getMessage() and (self.condition is None or self.condition()))


def quiet_libraries(bars: bool | None = None) -> None:
    """Keep other libraries' noise out of draftlab's output, process-wide: drop the LIBRARY_NOISE messages, and
    turn off their progress bars when bars is False, or (bars None) when stderr is not a terminal, where a bar is
    redraw debris in a log. On a terminal a long load or download keeps its bar."""
    for name, text, condition in LIBRARY_NOISE:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.text == text for f in log.filters):
            log.addFilter(_DropMessage(text, condition))
    specs = os.environ.get("PYTHONWARNINGS", "").split(",")
    for category, message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        spec = f"ignore:{message}:{category.__name__}"  # child processes too (DSI servers, pipeline drafters)
        if spec not in specs:
            specs.append(spec)
    os.environ["PYTHONWARNINGS"] = ",".join(s for s in specs if s)
    if bars is None:
        bars = _is_terminal(sys.stderr)
    if bars:
        return
    hub, datasets = LIBRARY_BARS_ENV
    if hub not in os.environ:  # transformers' bars follow huggingface_hub's setting
        os.environ[hub] = "1"  # for the libraries imported from now on, and child processes
        if "transformers" in sys.modules:  # imported already: switch them off directly
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # huggingface_hub's too
        elif "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
    if datasets not in os.environ:
        os.environ[datasets] = "1"
        if "datasets" in sys.modules:
            from datasets.utils import disable_progress_bars as disable_datasets_bars

            disable_datasets_bars()
