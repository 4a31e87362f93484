"""A per-batch-size speculation schedule against one fixed tree and plain decoding, at batch sizes 1..16, in one run.

    OMP_NUM_THREADS=2 python benchmarks/batch_schedule.py [--export runs/b250-hydra++/export]   # ~15 min, 2 cores

1. `search-tree --batch-sizes` (draftlab.serve.schedule.search_schedule) on the export: statistics from stories of
   the first 90% of the TinyStories sample, then at each batch size the greedy trees, chains and plain decoding
   timed on this machine (every timed batch full), chosen by `--schedule-by` (estimate, the default, or timed:
   the tokens/s of static batches, as step 2 decodes them); the schedule file goes to
   benchmarks/results/batch_schedule.tree.json.
2. On held-out stories (the last 10%), at each batch size, three methods decode the same prompts in batches of
   that size, interleaved in rounds (each keeps its fastest round): the schedule's tree for that batch size
   (plain decoding where the schedule says speculation does not pay), the export's default tree at every batch
   size, and plain decoding (draftlab's loop with a drafter that drafts nothing, batched the same way). Every
   output is checked against plain HF greedy `generate` of the prompt alone.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import ROOT, heldout_story_prompts, tinystories_split, write_result


def calibration_file(n: int) -> str:
    """The first n stories of the TinyStories sample's training part, as JSONL for --data."""
    train, _ = tinystories_split()
    out = ROOT / "benchmarks" / "runs" / "batch_schedule_calibration.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"text": d}) + "\n" for d in train[:n]))
    return str(out)


def decode_all(decoder, prompts, batch_size: int, n: int, eos) -> tuple[float, list[list[int]], int, int]:
    """(seconds, tokens per prompt, committed tokens, row-steps) of decoding prompts in batches of batch_size."""
    toks, committed, rows = [], 0, 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        res = decoder.generate(prompts[s:s + batch_size], max_new_tokens=n, eos_token_id=eos)
        toks += res.tokens
        committed += sum(res.committed)
        rows += sum(res.rows_per_step)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, toks, committed, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", default="runs/b250-hydra++/export")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts decoded at every batch size")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--calibration-prompts", type=int, default=64)
    ap.add_argument("--timing-prompts", type=int, default=16, help="search-tree's timing prompts")
    ap.add_argument("--max-nodes", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schedule-by", choices=["estimate", "timed"], default="estimate",
                    help="search-tree's --schedule-by: timed fits the schedule to static batches, as decoded here")
    a = ap.parse_args()
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.drafters import make_drafter
    from draftlab.interop.export import load_export
    from draftlab.serve.generate import encode_prompt, load_decoder, plain_generate, resolve_tree
    from draftlab.serve.schedule import search_schedule, tree_for_batch

    sizes = [int(b) for b in a.batch_sizes.split(",")]
    tree_file = ROOT / "benchmarks" / "results" / "batch_schedule.tree.json"
    t0 = time.perf_counter()
    rep = search_schedule(a.export, calibration_file(a.calibration_prompts + a.timing_prompts), str(tree_file),
                          sizes, max_nodes=a.max_nodes, calibration_prompts=a.calibration_prompts,
                          timing_prompts=a.timing_prompts, max_new_tokens=a.max_new_tokens, timing_rounds=a.rounds,
                          schedule_by=a.schedule_by)
    search_s = time.perf_counter() - t0

    fixed, tok, meta = load_decoder(a.export, tree="default")
    base, eos, N = fixed.base, tok.eos_token_id, a.max_new_tokens
    draft, _ = load_export(a.export, base=base, device=fixed.device)
    plain = SpeculativeDecoder(base, NoDraft(), check_base=False)
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    reference, _ = plain_generate(base, prompts, N, Sampling(), eos)  # plain HF greedy, one prompt at a time
    rows = []
    for B in sizes:
        tree = tree_for_batch(tree_file, B)
        sched = plain if tree is None else SpeculativeDecoder(base, make_drafter(draft, tree))  # None: plain wins
        methods = {"schedule": sched, "fixed": fixed, "plain": plain}
        for dec in methods.values():  # warm-up, outside the timing
            dec.generate(prompts[:B], max_new_tokens=8, eos_token_id=eos)
        best = {}
        for _ in range(a.rounds):
            for m, dec in methods.items():
                dt, toks, committed, steps = decode_all(dec, prompts, B, N, eos)
                tps = sum(len(t) for t in toks) / dt
                if m not in best or tps > best[m]["tokens_per_s"]:
                    best[m] = {"tokens_per_s": tps, "accept_length": committed / max(steps, 1),
                               "identical": toks == reference}
        row = {"batch_size": B, "schedule_tree": "plain" if tree is None else tree.metadata.get("tree", "plain"),
               "schedule_tree_size": 1 if tree is None else tree.size, "fixed_tree_size": fixed.drafter.max_nodes}
        for m, r in best.items():
            row[m] = {"tokens_per_s": round(r["tokens_per_s"], 1), "accept_length": round(r["accept_length"], 3),
                      "identical_to_plain_greedy": r["identical"]}
        row["schedule_vs_fixed"] = round(best["schedule"]["tokens_per_s"] / best["fixed"]["tokens_per_s"], 3)
        row["schedule_vs_plain"] = round(best["schedule"]["tokens_per_s"] / best["plain"]["tokens_per_s"], 3)
        rows.append(row)
        print(f"batch {B}: schedule {row['schedule_tree']} ({row['schedule_tree_size']} nodes) "
              f"{row['schedule']['tokens_per_s']} tok/s, fixed ({row['fixed_tree_size']} nodes) "
              f"{row['fixed']['tokens_per_s']}, plain {row['plain']['tokens_per_s']}; identical "
              f"{[row[m]['identical_to_plain_greedy'] for m in methods]}")
    load = open("/proc/loadavg").read().split()[:3]
    write_result("batch_schedule", {
        "export": a.export, "base": meta["base"]["name_or_path"], "prompts": len(prompts), "max_new_tokens": N,
        "rounds": a.rounds, "schedule_by": a.schedule_by, "fixed_tree": "the export's default tree",
        "search_s": round(search_s, 1),
        "schedule_file": str(tree_file.relative_to(ROOT)), "no_speculation_above": rep["no_speculation_above"],
        "search": [{k: e[k] for k in ("batch_size", "tree", "tree_size", "accept_length", "estimated_tokens_per_s",
                                      "estimated_plain_tokens_per_s", "tokens_per_s", "plain_tokens_per_s",
                                      "chain_length")} for e in rep["schedule"]],
        "load_average_at_end": [float(x) for x in load], "batch_sizes": rows})


if __name__ == "__main__":
    main()
