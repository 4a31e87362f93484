"""Progress output: plain periodic lines when stderr is not a terminal (logs, Slurm .out files)."""

import io

from draftlab.progress import LineProgress, progress


def test_lines_not_redraws_when_not_a_terminal(monkeypatch):
    monkeypatch.setenv("DRAFTLAB_PROGRESS_SECONDS", "0")
    out = io.StringIO()
    bar = progress(total=4, desc="train", unit="step", file=out)
    assert isinstance(bar, LineProgress)
    for _ in range(4):
        bar.update(1)
        bar.set_postfix(loss="1.234")
    bar.close()
    lines = out.getvalue().splitlines()
    # One per refresh (interval 0); the end adds none, the last refresh said it all.
    assert "\r" not in out.getvalue() and len(lines) == 4
    assert lines[-1].startswith("train: 4/4 step (100%)") and lines[-1].endswith("loss=1.234")


def test_quiet_between_intervals_and_iteration(monkeypatch):
    monkeypatch.setenv("DRAFTLAB_PROGRESS_SECONDS", "3600")
    out = io.StringIO()
    assert list(progress(range(1000), desc="x", file=out)) == list(range(1000))
    assert out.getvalue().count("\n") == 1 and "x: 1000/1000 it (100%)" in out.getvalue()


def test_the_closing_line_says_what_changed_since_the_last(monkeypatch):
    monkeypatch.setenv("DRAFTLAB_PROGRESS_SECONDS", "0")
    out = io.StringIO()
    bar = progress(total=2, desc="eval", unit="prompt", file=out)
    bar.update(2)
    bar.set_postfix(accept="2.5")  # after the last refresh: the closing line carries it
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("eval: 2/2") and lines[1].endswith("accept=2.5")


def test_a_resumed_job_with_nothing_left_says_so_rather_than_a_zero_rate():
    out = io.StringIO()
    progress(total=5, initial=5, desc="distill", unit="prompt", file=out).close()
    assert out.getvalue().startswith("distill: 5/5 prompt (100%), all done before this run, elapsed")
    assert "prompt/s" not in out.getvalue()  # ("0 prompt/s" read as a stall; walk-through)
    out = io.StringIO()
    bar = progress(total=5, initial=2, desc="distill", unit="prompt", file=out)
    bar.refresh(force=True)  # (a resumed job that has not finished a chunk yet)
    assert out.getvalue().startswith("distill: 2/5 prompt (40%), resumed, elapsed")
