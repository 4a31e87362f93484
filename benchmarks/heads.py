"""Medusa vs Hydra vs Hydra++ on stories260K: same data, same optimizer steps, same tree.

    python benchmarks/train_heads.py                                                            # medusa
    python benchmarks/train_heads.py --recipe recipes/stories260k-hydra.yaml --name stories260k-hydra
    python benchmarks/train_heads.py --recipe recipes/stories260k-hydra++.yaml --name stories260k-hydra++
    python benchmarks/heads.py

Greedy decoding of 50 held-out prompts x 128 new tokens with each export and one tree; speedup is
against plain HF generate of the same base measured in the same run.
"""

from __future__ import annotations

import argparse
import json

from common import EXPORTS, RESULTS, STORIES_EXPORTS as KINDS, heldout_story_prompts, write_result
from decode import compare, draftlab_method, hf_method, print_table



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default="default", help="'default', 'chain' or a tree file, used for every head type")
    a = ap.parse_args()
    from draftlab.serve.generate import encode_prompt, load_decoder

    decoders, tok = {}, None
    for kind, name in KINDS.items():
        decoders[kind], tok, _ = load_decoder(str(EXPORTS / name), tree=a.tree)
    base = decoders["medusa"].base
    for d in decoders.values():  # one base object for all, so every method runs the same weights
        d.base = base
    eos, N = tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    methods = {"hf_generate": hf_method(base, eos, N)}
    methods.update({k: draftlab_method(d, eos, N) for k, d in decoders.items()})
    results = compare(methods, prompts)
    out = {"tree": a.tree, "tree_size": decoders["medusa"].tree.size, "prompts": len(prompts), "max_new_tokens": N,
           "baseline_tokens_per_s": results["hf_generate"]["tokens_per_s"]}
    for kind, name in KINDS.items():
        train = json.loads((RESULTS / ("train_heads.json" if kind == "medusa" else f"train_heads_{name}.json")).read_text())
        out[kind] = {**results[kind], "head_top1": train["head_top1"], "head_top5": train["head_top5"],
                     "train_steps": train["steps"], "train_tokens_per_s": train["train_tokens_per_s"]}
    print_table(results)
    write_result("heads", out)


if __name__ == "__main__":
    main()
