"""Tree search against reality: the search's expected accept length vs what the decoder measures on held-out
prompts, and the chosen tree's tokens/s vs the shipped default tree.

    python benchmarks/tree_search.py      # after train_heads.py for medusa and hydra; ~20 min on 2 CPU cores

For each export: `draftlab search-tree` statistics come from 512 stories of the first 90% of the TinyStories
sample (the heads' training part); the check uses 200 held-out stories x 128 new tokens, greedy, with the
chosen tree, the default tree and plain HF generate, interleaved in one process. Besides the per-state
expected accept length the search also reports the replay of its statistics along the decoder's own walk
(exact on the calibration texts), so the gap to the held-out measurement separates estimator bias from the
difference between calibration and held-out text.
"""

from __future__ import annotations

import argparse
import json

from common import EXPORTS, ROOT, STORIES_EXPORTS, heldout_story_prompts, tinystories_split, write_result
from decode import compare, draftlab_method, hf_method, print_table

KINDS = {k: STORIES_EXPORTS[k] for k in ("medusa", "hydra")}


def calibration_file() -> str:
    train, _ = tinystories_split()
    out = ROOT / "benchmarks" / "runs" / "tinystories_train.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"text": d}) + "\n" for d in train))
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--calibration-prompts", type=int, default=512)
    ap.add_argument("--max-nodes", type=int, default=64)
    a = ap.parse_args()
    from draftlab.serve.generate import encode_prompt, load_decoder
    from draftlab.decode.search_cli import search_tree

    data = calibration_file()
    out = {"calibration": "first 90% of the TinyStories sample", "calibration_prompts": a.calibration_prompts,
           "heldout_prompts": a.prompts, "max_new_tokens": a.max_new_tokens}
    for kind, name in KINDS.items():
        tree_file = ROOT / "benchmarks" / "results" / f"tree_{kind}.json"
        rep = search_tree(str(EXPORTS / name), data, str(tree_file), max_nodes=a.max_nodes,
                          calibration_prompts=a.calibration_prompts, timing_prompts=16,
                          max_new_tokens=a.max_new_tokens)
        chosen, tok, _ = load_decoder(str(EXPORTS / name), tree=str(tree_file))
        default, _, _ = load_decoder(str(EXPORTS / name), tree="default")
        default.base = chosen.base
        eos, N = tok.eos_token_id, a.max_new_tokens
        prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
        res = compare({"hf_generate": hf_method(chosen.base, eos, N), "chosen": draftlab_method(chosen, eos, N),
                       "default": draftlab_method(default, eos, N)}, prompts)
        print_table(res)
        exp, meas = rep["expected_accept_length"], res["chosen"]["accept_length"]
        out[kind] = {
            "tree_file": str(tree_file.relative_to(ROOT)), "tree_size": rep["tree_size"],
            "expected_accept_length": exp, "measured_accept_length": meas,
            "relative_error": round(abs(exp - meas) / meas, 4),
            "replayed_accept_length": rep["replayed_accept_length"],
            "search_timing_accept_length": rep["measured_accept_length"],
            "tokens_per_s": res["chosen"]["tokens_per_s"], "default_tree_size": default.tree.size,
            "default_accept_length": res["default"]["accept_length"],
            "default_tokens_per_s": res["default"]["tokens_per_s"],
            "baseline_tokens_per_s": res["hf_generate"]["tokens_per_s"],
            "identical": res["chosen"]["identical_to_baseline"] and res["default"]["identical_to_baseline"],
            "sizes": rep["sizes"],
        }
        print(f"{kind}: expected {exp:.3f} vs measured {meas:.3f} ({100 * out[kind]['relative_error']:.1f}%); "
              f"chosen {rep['tree_size']} tokens {out[kind]['tokens_per_s']:.0f} tok/s vs default "
              f"{default.tree.size} tokens {out[kind]['default_tokens_per_s']:.0f} tok/s")
    write_result("tree_search", out)


if __name__ == "__main__":
    main()
