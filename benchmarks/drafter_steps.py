"""Per-step costs of the decoder phases, eager vs compiled, for drafters that need no training to time.

    python benchmarks/drafter_steps.py [--prompts 12] [--max-new-tokens 64]

stories260K base; an untrained EAGLE-3 module (dynamic tree 7/10/60) and an untrained one-layer SSM (expansion
2,2,1), greedy, batch 1. Untrained drafters accept little, so tokens/s here says nothing about speedups: what
this measures is the milliseconds per step each phase costs (draft / verify / accept / commit) on the eager
path and on the static-shape compiled path, which do not depend on the weights' values. Tokens are checked equal
between the two paths. warmup_s is the first call's time; torch.compile keeps compiled kernels in an on-disk cache,
so a run after an earlier one warms up faster than a first run.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import heldout_story_prompts, stories_base, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    from draftlab.base import load_base
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt
    from draftlab.decode.tree import DynamicTree, Tree
    from draftlab.drafters import build_draft, make_drafter

    base, tok = load_base(str(stories_base()), "float32")
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    torch.manual_seed(0)
    drafters = {
        "eagle3 7/10/60": lambda: make_drafter(build_draft({"type": "eagle3", "eagle": {}}, base).eval(),
                                               DynamicTree(7, 10, 60)),
        "ssm expansion 2,2,1": lambda: make_drafter(
            build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base).eval(),
            Tree.expansion([2, 2, 1])),
    }
    results = {}
    for name, make in drafters.items():
        module_drafter = make()
        tokens = {}
        for compiled in (False, True):
            dec = SpeculativeDecoder(base, module_drafter, compile=compiled)
            t0 = time.perf_counter()
            dec.generate(prompts[:1], max_new_tokens=a.max_new_tokens)  # warm-up (compiles on the compiled path)
            warm = time.perf_counter() - t0
            split, steps, n, committed, out = {}, 0, 0, 0, []
            t0 = time.perf_counter()
            for p in prompts:
                r = dec.generate([p], max_new_tokens=a.max_new_tokens)
                steps, n, committed = steps + r.steps, n + len(r.tokens[0]), committed + sum(r.committed)
                out.append(r.tokens[0])
                for k, v in r.time_s.items():
                    split[k] = split.get(k, 0.0) + v
            wall = time.perf_counter() - t0
            path = "compiled" if compiled else "eager"
            tokens[path] = out
            results[f"{name}, {path}"] = {
                "ms_per_step": {k: round(1000 * v / steps, 3) for k, v in split.items() if k != "prefill"},
                "steps": steps, "accept_length": round(committed / steps, 3), "tokens_per_s": round(n / wall, 1),
                "warmup_s": round(warm, 1)}
        results[f"{name}, compiled"]["identical_to_eager"] = tokens["compiled"] == tokens["eager"]
    for m, r in results.items():
        print(m, r)
    write_result("drafter_steps", {"base": "stories260K", "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
                                   "methods": results})


if __name__ == "__main__":
    main()
