"""`python -m draftlab.train.finished OUTPUT_DIR`: whether a training run has finished, as its exit status (0:
finished, 1: not yet, 2: no such directory or a usage error), with one line saying so. slurm/train.sbatch asks it
before it requeues a stopped job (run_dir.run_finished)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftlab.train.finished",
                                description="exit 0 when the run in OUTPUT_DIR has finished (its export is there and "
                                            "no checkpoint is newer), 1 when not, 2 when OUTPUT_DIR is no directory")
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="the recipe's output_dir")
    d = Path(p.parse_args(argv).output_dir)
    if not d.is_dir():  # (a typo read as "not finished" in silence: walk-through)
        print(f"{d}: no such run directory", file=sys.stderr)
        return 2
    from .run_dir import run_finished

    done = run_finished(d)
    print(f"{d}: " + ("finished" if done else "not finished (no export yet, or a checkpoint newer than it)"))
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
