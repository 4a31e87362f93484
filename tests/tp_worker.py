"""One rank of a tensor-parallel decoding test (launched by test_parallel.py with torch.distributed.run).

argv: OUT_JSON EXPORT [EXPORT ...]. Every rank decodes the same prompts with every export, greedy and seeded
sampling, its base split with --tp, and writes OUT_JSON.rank{R}: tokens per run and the share of the base's
parameters this rank holds. TP_COMPILE=BACKEND: on the compiled static-shape path with that torch.compile backend
(the file then also says whether the base's forward compiled, or why not)."""

import os

import json
import sys

import torch

from draftlab.decode.acceptance import Sampling
from draftlab.serve.generate import load_decoder
from draftlab.decode.tensor_parallel import rank, shutdown

PROMPTS = [[1, 403, 261, 378], [1, 9, 62, 282, 30, 10, 260], [1, 500]]


def local_share(model) -> float:
    from torch.distributed.tensor import DTensor

    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    return local / sum(p.numel() for p in model.parameters())


def decode_all(exports: list[str], **placement) -> tuple[dict, object]:
    """Every export, greedy and seeded sampling, on PROMPTS: {export|mode: tokens and steps}, and the last decoder."""
    runs = {}
    for exp in exports:
        decoder, _, _ = load_decoder(exp, dtype="float64", **placement)
        for name, sampling in (("greedy", Sampling()), ("sampled", Sampling(temperature=0.8, top_p=0.95))):
            res = decoder.generate(PROMPTS, max_new_tokens=24, sampling=sampling,
                                   generator=torch.Generator().manual_seed(7))
            runs[f"{exp}|{name}"] = {"tokens": res.tokens, "steps": res.steps}
    return runs, decoder


def main(out: str, exports: list[str]) -> None:
    torch.set_num_threads(1)
    backend = os.environ.get("TP_COMPILE") or False
    runs, decoder = decode_all(exports, tp=True, compile=backend)
    compiled = decoder.forward is not None and not decoder.forward.failed
    with open(f"{out}.rank{rank()}", "w") as f:
        json.dump({"runs": runs, "local_share": local_share(decoder.base), "compiled": compiled,
                   "compile_failed": decoder.forward.failed if decoder.forward is not None else None}, f)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
