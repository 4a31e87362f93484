"""Argument types the commands share."""

from __future__ import annotations

import argparse


def positive_int(text: str, least: int = 1) -> int:
    """argparse type: an integer >= 1 (>= least)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is not >= {least}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return positive_int(text, least=0)


def add_placement_args(p) -> None:
    """--tp / --device-map: how a base too large for one device is split (draftlab.decode.tensor_parallel)."""
    p.add_argument("--tp", action="store_true",
                   help="tensor parallel: split the base over the processes of `torchrun --nproc-per-node N` or "
                        "`accelerate launch --num_processes N` (one per GPU); rank 0 prints and writes")
    p.add_argument("--device-map", default=None, metavar="MAP",
                   help="layer-wise placement of the base over the visible devices, e.g. 'auto' (one process)")


DEVICE_HELP = "where the base runs: cpu, cuda, cuda:N or mps (default: cuda where there is one, else cpu)"
DTYPE_HELP = "the base's dtype (default: the one the export records)"
SEED_HELP = ("seed of the random streams (sampling at --temperature > 0; each role, e.g. drafter and verifier, draws "
             "from a stream of its own)")


def _number(text: str, ok, rule: str) -> float:
    """A float argument that satisfies ok(value), else argparse's error saying the rule it breaks."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{value} is not {rule}")
    return value


def probability(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    return _number(text, lambda v: 0 < v <= 1, "in (0, 1]")


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    return _number(text, lambda v: v > 0, "> 0")


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0 (a temperature: 0 is greedy)."""
    return _number(text, lambda v: v >= 0, ">= 0")


def add_typical_args(p) -> None:
    """--typical and its threshold min(epsilon, alpha * exp(-H(p))), defaults as Medusa's (epsilon 0.09, alpha
    sqrt(epsilon)); setting --typical-epsilon alone sweeps epsilon the way Hydra does (alpha follows)."""
    p.add_argument("--typical", action="store_true",
                   help="Medusa typical acceptance (lossy; at temperature 0 it is greedy and exact)")
    p.add_argument("--typical-epsilon", type=probability, default=None, metavar="EPS",
                   help="typical acceptance's epsilon, the posterior threshold (default 0.09, Medusa's)")
    p.add_argument("--typical-alpha", type=positive_float, default=None, metavar="ALPHA",
                   help="typical acceptance's alpha, the entropy-scaled threshold (default sqrt(epsilon))")


def sampling_from_args(a):
    """The Sampling that --temperature/--top-p/--top-k/--typical[-epsilon|-alpha] ask for."""
    from ..decode.acceptance import Sampling

    if not a.typical and (a.typical_epsilon is not None or a.typical_alpha is not None):
        raise ValueError("--typical-epsilon / --typical-alpha set the typical acceptance rule: add --typical")
    extra = {} if a.typical_epsilon is None else {"posterior_threshold": a.typical_epsilon}
    return Sampling(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, typical=a.typical,
                    posterior_alpha=a.typical_alpha, **extra)


def add_compile_cache_arg(p) -> None:
    """--compile-cache DIR: where torch.compile keeps what it generates (decode.compiled.use_compile_cache)."""
    p.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="with --compile: keep torch.compile's on-disk cache (generated code, built kernels) in DIR, "
                        "so that later runs, on this machine or on others of the same kind that see DIR (a shared "
                        "file system for cluster jobs), load the compiled graphs rather than build them again "
                        "(default: $TORCHINDUCTOR_CACHE_DIR, else torch's per-user folder in the temporary directory)")


def apply_compile_cache(a) -> None:
    """Point the on-disk compile cache at --compile-cache, which needs --compile."""
    if getattr(a, "compile_cache", None) is None:
        return
    if not a.compile:
        raise ValueError("--compile-cache DIR keeps the compiled path's cache: add --compile")
    from ..decode.compiled import use_compile_cache

    use_compile_cache(a.compile_cache)
