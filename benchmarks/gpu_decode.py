"""The decoder on a GPU at 7B scale: a random-weight Llama-2-7B-shaped base in bfloat16, batch 1.

1. Plain HF generate (the baseline) and one plain decoding step.
2. Verification cost against tree size: one base forward over N tree tokens (4D mask, explicit positions) on a
   512-token context, N = 1..128, and the accept + cache compaction cost after it.
3. The whole decoder loop with an oracle drafter that knows the base's greedy continuation (from plain generate)
   and proposes each token on the rank-0 path correctly with probability alpha (so tau is controlled; drafting
   costs nothing): tokens/s and speedup against plain generate for chains and trees. This is the ceiling a
   drafter with that acceptance reaches. In bfloat16 a forward over N tree tokens does not round exactly like a
   1-token forward, so where the base's top two logits nearly tie the two can pick different tokens; the run
   records whether the output equals plain generate's and where it first differs (after that the oracle's
   "truth" is off and acceptance drops, which the measured tau includes).
4. What real drafters cost per step on this base: Medusa heads (4), Hydra++ heads (4 x 4 layers + prefix layer),
   and SSMs (llama-68m's shape: 2 layers x 768; and a 1-layer, 4096-wide SSM), each through its own drafter.
   Random weights: their acceptance is meaningless here, only their time.

    python benchmarks/gpu_decode.py --out $OUT        # on a GPU machine; ~4 minutes on an H100
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from common import ROOT, SHAPE_7B, Oracle, random_llama, sync, timed


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=512, max_position_embeddings=2048)  # --tiny: a CPU smoke test of this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "results")))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 base on this machine's device (smoke test)")
    ap.add_argument("--reps", type=int, default=3, help="decoder runs per configuration (the median is reported)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of one run per drafter")
    ap.add_argument("--alphas", type=float, nargs="*", default=[0.6, 0.8, 0.9])
    ap.add_argument("--trees", nargs="*", default=["chain-1", "chain-3", "chain-5", "chain-8", "default-4h-25"])
    ap.add_argument("--parts", nargs="*", default=["verify", "loop", "drafters"], help="which parts to run")
    a = ap.parse_args()
    from draftlab.decode.acceptance import accept_greedy
    from draftlab.decode.cache import SlotCache
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.decode.search import default_tree
    from draftlab.decode.tree import Tree, TreeView
    from draftlab.drafters import build_draft, make_drafter

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape, dtype = (TINY, "float32") if a.tiny else (SHAPE_7B, "bfloat16")
    base = random_llama(shape, dtype, dev)
    V = base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, V, (1, a.context), generator=g).tolist()[0]
    res = {"gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
           "shape": shape, "dtype": dtype,
           "context": a.context, "new_tokens": a.new_tokens}

    # 1. Plain decoding.
    ids = torch.tensor([prompt], device=dev)
    gen = lambda n: base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  temperature=None, top_p=None, top_k=None, pad_token_id=0)
    truth_plain = gen(a.new_tokens + 16)[0, len(prompt):].tolist()
    plain_ms = timed(lambda: gen(a.new_tokens), reps=3, warmup=1)
    res["plain"] = {"tokens_per_s": round(1000 * a.new_tokens / plain_ms, 1), "ms_per_token": round(plain_ms / a.new_tokens, 3)}
    print("plain", res["plain"], flush=True)

    if "verify" not in a.parts:
        a.sizes = []
    # 2. Verification forward vs tree size (default trees for 4 heads grown to N-1 nodes), and accept + keep.
    target = SlotCache(base)
    valid = torch.ones(1, len(prompt), dtype=torch.bool, device=dev)
    with torch.no_grad():
        target.prefill(ids, valid)
        step1 = torch.tensor([[prompt[-1]]], device=dev)
        rows = []
        for n in a.sizes:
            tree = default_tree(4, n - 1) if n > 1 else Tree.from_paths([])
            view = TreeView.of_static(tree.buffers(dev), 1)
            toks = torch.randint(3, V, (1, tree.size), device=dev)
            start = target.length

            def verify():
                out = target.forward(toks, view.ancestors, view.depth)
                target.keep(start, torch.zeros(1, 0, dtype=torch.long, device=dev),
                            torch.zeros(1, 0, dtype=torch.bool, device=dev))
                return out

            ms = timed(verify)

            def verify_accept():
                out = target.forward(toks, view.ancestors, view.depth)
                paths, _ = accept_greedy(toks, out.logits, view)
                keep = torch.tensor([paths[0]], device=dev)
                target.keep(start, keep, torch.ones_like(keep, dtype=torch.bool))
                target.keep(start, torch.zeros(1, 0, dtype=torch.long, device=dev),
                            torch.zeros(1, 0, dtype=torch.bool, device=dev))  # undo: the context stays 512
            ms_all = timed(verify_accept)
            rows.append({"tree_size": tree.size, "verify_ms": round(ms, 3), "verify_accept_keep_ms": round(ms_all, 3),
                         "over_plain_step": round(ms / res["plain"]["ms_per_token"], 3)})
            print(rows[-1], flush=True)
    res["verify"] = rows

    # 3. The decoder loop with an oracle drafter of per-token acceptance alpha.
    loops = []
    trees = {"chain-1": Tree.chain(1), "chain-3": Tree.chain(3), "chain-5": Tree.chain(5), "chain-8": Tree.chain(8),
             "default-4h-25": default_tree(4, 24)}
    for alpha in a.alphas if "loop" in a.parts else []:
        for name in a.trees:
            tree = trees[name]
            SpeculativeDecoder(base, Oracle(base, prompt, truth_plain, tree, alpha)).generate([prompt], max_new_tokens=8)
            runs = []
            for rep in range(a.reps):
                drafter = Oracle(base, prompt, truth_plain, tree, alpha, seed=rep)
                dec = SpeculativeDecoder(base, drafter)
                sync()
                t0 = time.perf_counter()
                r = dec.generate([prompt], max_new_tokens=a.new_tokens)
                sync()
                runs.append((time.perf_counter() - t0 - drafter.excluded_s, r, drafter))
            wall, r, drafter = sorted(runs, key=lambda x: x[0])[len(runs) // 2]
            tps = a.new_tokens / wall
            diff = next((i for i, (x, y) in enumerate(zip(r.tokens[0], truth_plain)) if x != y), None)
            ms = {k: round(1000 * v / r.steps, 3) for k, v in r.time_s.items() if k != "prefill"}
            ms["commit"] = round(ms["commit"] - 1000 * drafter.excluded_s / r.steps, 3)
            row = {"alpha": alpha, "tree": name, "tree_size": tree.size, "accept_length": round(r.accept_length, 3),
                   "tokens_per_s": round(tps, 1), "speedup": round(tps / res["plain"]["tokens_per_s"], 3),
                   "ms_per_step": ms, "identical_to_plain": diff is None, "first_difference": diff,
                   "bf16_resyncs": drafter.resyncs}
            loops.append(row)
            print(row, flush=True)
    res["oracle_loop"] = loops

    # 4. Real drafters' cost per step on this base (random weights: times only).
    costs = []
    ssm68 = {"type": "ssm", "ssm": {"num_layers": 2, "hidden_size": 768, "num_attention_heads": 12,
                                    "intermediate_size": 3072, "init": "random"}}
    ssm_wide = {"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}
    cases = [("medusa", {"type": "medusa", "num_heads": 4, "num_layers": 1}, default_tree(4, 24)),
             ("hydra++", {"type": "hydra", "num_heads": 4, "num_layers": 4, "prefix_attention": True}, default_tree(4, 24)),
             ("ssm-68m-shape", ssm68, Tree.chain(4)), ("ssm-68m-shape", ssm68, Tree.expansion([2, 2, 1])),
             ("ssm-1x4096", ssm_wide, Tree.chain(4))]
    for name, head, tree in cases if "drafters" in a.parts else []:
        module = build_draft(head, base).to(device=dev, dtype=base.dtype).eval().requires_grad_(False)
        dec = SpeculativeDecoder(base, make_drafter(module, tree))
        dec.generate([prompt], max_new_tokens=8)
        r = min((dec.generate([prompt], max_new_tokens=64) for _ in range(a.reps)),
                key=lambda x: sum(x.time_s.values()) / x.steps)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            with profile(activities=acts) as prof:
                dec.generate([prompt], max_new_tokens=16)
            print(f"--- profile: {name} {tree.metadata.get('name', '')}")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60))
        ms = {k: round(1000 * v / r.steps, 3) for k, v in r.time_s.items() if k != "prefill"}
        row = {"drafter": name, "tree": tree.metadata.get("name", ""), "tree_size": tree.size, "ms_per_step": ms,
               "draft_over_verify": round(ms["draft"] / ms["verify"], 3),
               "params": sum(p.numel() for p in module.parameters())}
        costs.append(row)
        print(row, flush=True)
        del module, dec
        if dev == "cuda":
            torch.cuda.empty_cache()
    res["drafter_costs"] = costs
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("gpu_decode_tiny.json" if a.tiny else "gpu_decode.json")).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
