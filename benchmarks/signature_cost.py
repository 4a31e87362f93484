"""What a compiled call's signature costs per step (decode.compiled._signature, computed on every call to skip
dynamo's guards for a signature seen before): the arguments of a real fused verify step of draftlab's compiled plain
decoding of stories260K, as the decoder passes them (the static cache's KV buffers as one decode.compiled.Fixed, the
sampling settings a frozen dataclass that keeps its signature) and as they were passed before (the buffers in plain
lists, a new Sampling object), timed with timeit in one run; then per argument, the costly ones.

    python benchmarks/signature_cost.py     # about a minute on a CPU; writes benchmarks/results/signature_cost.json
"""

from __future__ import annotations

import dataclasses
import timeit

import torch

from common import heldout_story_prompts, stories_base, write_result

N = 20000


def us(fn) -> float:
    fn()
    return round(timeit.timeit(fn, number=N) / N * 1e6, 2)


def main() -> None:
    from draftlab.base import load_base
    from draftlab.decode import compiled as C
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt

    base, tok = load_base(str(stories_base()), "float32")
    dec = SpeculativeDecoder(base, NoDraft(), compile=True)
    prompt = encode_prompt(tok, heldout_story_prompts(1)[0], chat=False)
    dec.generate([prompt], 32)
    seen = []
    real = C.Compiled._call

    def spy(self, *args, **kwargs):
        seen.append(args)
        return real(self, *args, **kwargs)
    C.Compiled._call = spy
    try:
        dec.generate([prompt], 8)
    finally:
        C.Compiled._call = real
    args = next(a for a in seen if any(type(x) is C.Fixed for x in a))  # a fused verify step's
    at = {type(x).__name__: i for i, x in enumerate(args)}
    state, settings = args[at["Fixed"]], args[at["Sampling"]]
    before = list(args)
    before[at["Fixed"]] = tuple(list(part) for part in state)  # the lists device_state returned before

    def before_args():  # a new Sampling object per call, as a signature that kept nothing would see it
        before[at["Sampling"]] = dataclasses.replace(settings)
        return tuple(before)
    res = {"arguments": len(args), "tensors_in_state": sum(len(p) for p in state),
           "signature_us": {"now": us(lambda: C._signature(args)),
                            "before": us(lambda: C._signature(before_args())),
                            "building_the_before_arguments_alone": us(before_args)},
           "per_argument_us": {"state now": us(lambda: C._signature(state)),
                               "state before": us(lambda: C._signature(before[at["Fixed"]])),
                               "sampling now": us(lambda: C._signature(settings)),
                               "sampling before": us(lambda: C._signature(dataclasses.replace(settings))),
                               "sampling, building it alone": us(lambda: dataclasses.replace(settings))},
           "threads": torch.get_num_threads()}
    print(res)
    write_result("signature_cost", res)


if __name__ == "__main__":
    main()
