"""The EAGLE-3-style drafter and Medusa-2 next to Medusa, Hydra and Hydra++ on stories260K: same data, same
optimizer steps, same verification budget (25 tokens: the heads' default tree; EAGLE-2 dynamic trees of 25
tokens), and EAGLE's own default (depth 7, top-k 10, 60 tokens).

    python benchmarks/train_heads.py --recipe recipes/stories260k-eagle3.yaml --name stories260k-eagle3
    python benchmarks/train_heads.py --recipe recipes/stories260k-medusa2.yaml --name stories260k-medusa2
    python benchmarks/eagle.py        # after the three head runs of benchmarks/heads.py

Greedy decoding of 50 held-out prompts x 128 new tokens, all methods in one process, interleaved, after a warm-up;
speedup against plain HF generate of the same base in the same run. Medusa-2 decodes the adapted base (base +
its LoRA), so its speedup and identity are against plain HF generate of that adapted base, also in the run.
"""

from __future__ import annotations

import argparse
import json

from common import EXPORTS, RESULTS, STORIES_EXPORTS, heldout_story_prompts, write_result
from decode import compare, draftlab_method, hf_method, print_table

EAGLE = "stories260k-eagle3"
MEDUSA2 = "stories260k-medusa2"
EAGLE_TREES = {"eagle3": "dynamic:5,8,25", "eagle3_t60": "dynamic:7,10,60"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    from draftlab.serve.generate import encode_prompt, load_decoder

    decoders, tok = {}, None
    for kind, name in STORIES_EXPORTS.items():
        decoders[kind], tok, _ = load_decoder(str(EXPORTS / name), tree="default")
    for label, tree in EAGLE_TREES.items():
        decoders[label], _, _ = load_decoder(str(EXPORTS / EAGLE), tree=tree)
    medusa2 = None
    if (EXPORTS / MEDUSA2 / "draftlab.json").is_file():
        medusa2, _, _ = load_decoder(str(EXPORTS / MEDUSA2), tree="default")  # its own, adapted base
    base = decoders["medusa"].base
    for d in decoders.values():  # one base object for all, so every method runs the same weights
        d.base = base
        if hasattr(d.drafter, "m"):
            d.drafter.m.attach_base(base)
    eos, N = tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    methods = {"hf_generate": hf_method(base, eos, N)}
    if medusa2 is not None:
        methods["hf_generate_adapted"] = hf_method(medusa2.base, eos, N)
    methods.update({k: draftlab_method(d, eos, N) for k, d in decoders.items()})
    trees = {**{k: "default (25 tokens)" for k in STORIES_EXPORTS}, **EAGLE_TREES}
    names = {**STORIES_EXPORTS, **{k: EAGLE for k in EAGLE_TREES}}
    if medusa2 is not None:
        methods["medusa2"], decoders["medusa2"] = draftlab_method(medusa2, eos, N), medusa2
        trees["medusa2"], names["medusa2"] = "default (25 tokens)", MEDUSA2
    results = compare(methods, prompts, references={"medusa2": "hf_generate_adapted"} if medusa2 else None)
    out = {"prompts": len(prompts), "max_new_tokens": N, "baseline_tokens_per_s": results["hf_generate"]["tokens_per_s"],
           "adapted_baseline_tokens_per_s": results.get("hf_generate_adapted", {}).get("tokens_per_s"), "trees": trees}
    for kind, name in names.items():
        train = json.loads((RESULTS / ("train_heads.json" if kind == "medusa" else f"train_heads_{name}.json")).read_text())
        out[kind] = {**results[kind], "tree_size": decoders[kind].drafter.max_nodes, "train_steps": train["steps"],
                     "train_wall_s": train["wall_s"], "train_tokens_per_s": train["train_tokens_per_s"],
                     "agree_top1": train["agree_top1"]}
    print_table(results)
    write_result("eagle", out)


if __name__ == "__main__":
    main()
