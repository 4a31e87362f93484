"""An SSM distilled from stories260K, side by side with what a user would otherwise run, greedy, on 50 held-out
TinyStories prompts x 128 new tokens, all in one process, prompt by prompt, interleaved, after a warm-up:

- plain HF generate (the speedup baseline), HF prompt lookup;
- HF assisted generation with the same SSM: its defaults (the results record them: up to 20 draft tokens,
  constant schedule, confidence threshold 0.4 in transformers 5.x) and a fixed chain of the same length as
  draftlab's (num_assistant_tokens=gamma, threshold 0), set on the assistant's generation_config, where HF
  reads them;
- draftlab with the SSM: that chain, and the fastest tree `search-tree` finds for it on training prompts;
- draftlab with the Hydra heads of the same base (benchmarks/exports/stories260k-hydra), default tree;
- the SSM distilled with the other divergence(s), same chain: the divergences compared on tau.

    python benchmarks/train_heads.py --recipe recipes/stories260k-hydra.yaml --name stories260k-hydra
    python benchmarks/train_ssm.py && python benchmarks/ssm.py

Per method: tokens per base forward (every forward of the base, prefill included: comparable between HF and
draftlab), draftlab's accept length (tokens per verification step), and for SSM drafting the measured cost
ratio c = (draft time per SSM forward) / (verify time per step), the speedup Leviathan et al.'s model predicts
from tau and c, tau / (gamma c + 1) with gamma SSM forwards per step, and the c at which the SSM breaks even,
(tau - 1) / gamma.
"""

from __future__ import annotations

import argparse
import json

import torch

from common import EXPORTS, RESULTS, ROOT, heldout_story_prompts, tinystories_split, write_result
from decode import compare, draftlab_method, hf_method


class ForwardCounter:
    """Counts forward calls of a module (the base): verification steps + prefills."""

    def __init__(self, model):
        self.n = 0
        model.register_forward_pre_hook(lambda *_: setattr(self, "n", self.n + 1))


def counted(fn, counter: ForwardCounter, sink: dict):
    def run(ids):
        before = counter.n
        out = fn(ids)
        sink["forwards"] = sink.get("forwards", 0) + counter.n - before
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--divergences", nargs="*", default=["fkl", "tvd"], help="the first is the main SSM")
    ap.add_argument("--calibration-prompts", type=int, default=64)
    a = ap.parse_args()
    from draftlab.base import pretrained_lm
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt, load_decoder
    from draftlab.decode.tree import Tree
    from draftlab.serve.tree_search import search_tree
    from draftlab.drafters import make_drafter
    from draftlab.interop.export import load_export

    main_exp = EXPORTS / f"stories260k-ssm-{a.divergences[0]}"
    # 1. The fastest chain / tree for the SSM on training-story openings (not the held-out prompts).
    calib = ROOT / "runs" / "ssm-calibration.jsonl"
    train_docs, _ = tinystories_split()
    calib.write_text("".join(json.dumps({"text": d}) + "\n" for d in train_docs[: a.calibration_prompts + 8]))
    tree_file = RESULTS / "tree_ssm.json"
    search = search_tree(str(main_exp), str(calib), str(tree_file), max_nodes=32, calibration_prompts=a.calibration_prompts,
                         timing_prompts=8, max_new_tokens=a.max_new_tokens, max_depth=8)
    chains = [r for r in search["sizes"] if r["name"].startswith("chain")]
    gamma = max(chains, key=lambda r: r["tokens_per_s"])["tree_depth"]
    best = Tree.load(tree_file)
    print(f"search-tree: best chain {gamma}, best tree {best.size} nodes / depth {best.depth}")

    decoder, tok, meta = load_decoder(str(main_exp), tree=f"chain:{gamma}")
    base, eos, N = decoder.base, tok.eos_token_id, a.max_new_tokens
    # The export is an HF model directory. HF assisted generation reads its settings from the *assistant's*
    # generation_config: one copy keeps HF's defaults, one drafts a fixed chain like draftlab's.
    ssm_hf = pretrained_lm(main_exp, dtype=base.dtype).eval()
    ssm_fixed = pretrained_lm(main_exp, dtype=base.dtype).eval()
    ssm_fixed.generation_config.update(num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant",
                                       assistant_confidence_threshold=0.0)
    gc = ssm_hf.generation_config
    hf_defaults = {k: getattr(gc, k) if getattr(gc, k) is not None else gc._get_default_generation_params().get(k)
                   for k in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    ssm, _ = load_export(main_exp, base=base, dtype=base.dtype)
    hydra, _, _ = load_decoder(str(EXPORTS / "stories260k-hydra"))
    hydra.base = base
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    counter = ForwardCounter(base)
    fwd: dict[str, dict] = {}
    methods = {
        "hf_generate": hf_method(base, eos, N),
        "hf_prompt_lookup": hf_method(base, eos, N, prompt_lookup_num_tokens=4),
        "hf_assisted_default": hf_method(base, eos, N, assistant_model=ssm_hf),
        f"hf_assisted_chain{gamma}": hf_method(base, eos, N, assistant_model=ssm_fixed),
        f"draftlab_ssm_chain{gamma}": draftlab_method(decoder, eos, N),
        f"draftlab_ssm_tree{best.size}": draftlab_method(SpeculativeDecoder(base, make_drafter(ssm, best)), eos, N),
        "draftlab_hydra": draftlab_method(hydra, eos, N),
    }
    for div in a.divergences[1:]:
        other, _ = load_export(EXPORTS / f"stories260k-ssm-{div}", base=base, dtype=base.dtype)
        methods[f"draftlab_ssm_{div}_chain{gamma}"] = draftlab_method(
            SpeculativeDecoder(base, make_drafter(other, Tree.chain(gamma))), eos, N)
    methods = {m: counted(fn, counter, fwd.setdefault(m, {})) for m, fn in methods.items()}
    results = compare(methods, prompts)
    t_plain = 1.0 / results["hf_generate"]["tokens_per_s"]  # s per token of plain decoding
    depth = {f"draftlab_ssm_chain{gamma}": gamma, f"draftlab_ssm_tree{best.size}": best.depth,
             **{f"draftlab_ssm_{d}_chain{gamma}": gamma for d in a.divergences[1:]}}
    for m, r in results.items():
        r["base_forwards"] = fwd[m]["forwards"] - 1  # the warm-up call in compare()
        r["tokens_per_base_forward"] = round(r["new_tokens"] / r["base_forwards"], 3)
        if m in depth:
            ms = r["ms_per_step"]
            g = depth[m]
            c = ms["draft"] / g / ms["verify"]
            tau = r["accept_length"]
            r.update({"ssm_forwards_per_step": g, "cost_ratio_c": round(c, 3),
                      "predicted_speedup": round(tau / (g * c + 1), 3), "break_even_c": round((tau - 1) / g, 3),
                      "verify_over_plain_step": round(ms["verify"] / 1000 / t_plain, 3)})
    train = json.loads((RESULTS / "train_ssm.json").read_text())
    out = {"prompts": len(prompts), "max_new_tokens": N, "gamma": gamma, "tree": [list(p) for p in best.paths],
           "hf_assisted_defaults": hf_defaults,
           "search": search["sizes"], "methods": results,
           "ssm": {d: {k: v for k, v in train["divergences"][d].items() if k in ("head_top1", "agree_top1", "steps", "wall_s")}
                   for d in a.divergences if d in train["divergences"]},
           "ssm_params": meta["head"]["params"], "base": meta["base"]["name_or_path"].replace(str(ROOT) + "/", "")}
    print("\n| method | tokens / base forward | accept length | tokens/s | speedup | identical | c | predicted | break-even c |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, r in results.items():
        print(f"| {m} | {r['tokens_per_base_forward']} | {r.get('accept_length', '-')} | {r['tokens_per_s']} | "
              f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {r.get('cost_ratio_c', '-')} | "
              f"{r.get('predicted_speedup', '-')} | {r.get('break_even_c', '-')} |")
    write_result("ssm", out)


if __name__ == "__main__":
    main()
