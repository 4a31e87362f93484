"""Argument types the commands share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def add_placement_args(p) -> None:
    """--tp / --device-map: how a base too large for one device is split (draftlab.decode.parallel)."""
    p.add_argument("--tp", action="store_true",
                   help="tensor parallel: split the base over the processes of `torchrun --nproc-per-node N` or "
                        "`accelerate launch --num_processes N` (one per GPU); rank 0 prints and writes")
    p.add_argument("--device-map", default=None, metavar="MAP",
                   help="layer-wise placement of the base over the visible devices, e.g. 'auto' (one process)")
