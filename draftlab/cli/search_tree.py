"""`draftlab search-tree`: the fastest tree for an export, on this machine, at a batch size (static trees for heads
and SSMs; EAGLE-2 depth / top_k / total_tokens for eagle3 exports), or with --batch-sizes a schedule: the tree per
batch size and the batch size above which plain decoding wins, as a tree file and in vLLM's and SGLang's syntax."""

from __future__ import annotations

import argparse
import json
import sys

from ..serve.tree_search import search_tree
from .args import add_compile_cache_arg, add_placement_args, positive_int


def batch_sizes(text: str) -> list[int]:
    """argparse type: comma-separated positive batch sizes, e.g. 1,2,4,8,16."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2,4,8,16") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive batch sizes, e.g. 1,2,4,8,16")
    return sorted(set(sizes))


def add_search_args(p) -> None:
    p.add_argument("export")
    p.add_argument("--data", required=True, help="calibration text: .txt / JSON(L) of text, ShareGPT or Alpaca records")
    p.add_argument("--out", required=True, help="tree file to write (.json)")
    p.add_argument("--base", default=None, help="the base to search with (default: the one the export names; another "
                   "path to it, e.g. on another machine)")
    p.add_argument("--max-nodes", type=positive_int, default=64, help="largest tree (non-root nodes) to consider")
    p.add_argument("--batch-size", type=positive_int, default=1, help="batch size the tree is tuned for")
    p.add_argument("--batch-sizes", type=batch_sizes, default=None, metavar="B1,B2,...",
                   help="a schedule instead of one tree: time trees, chains and plain decoding at each batch size and "
                        "write OUT (tree file with a `schedule`), OUT.vllm.json and OUT.sglang.txt "
                        "(docs/decoding.md, schedules per batch size)")
    p.add_argument("--engine-draft", default=None, metavar="DIR",
                   help="with --batch-sizes: the draft directory the engines load (e.g. `draftlab export --to "
                        "vllm-medusa` output), written into OUT.vllm.json / OUT.sglang.txt (default: EXPORT)")
    p.add_argument("--schedule-by", choices=["estimate", "timed"], default="estimate",
                   help="with --batch-sizes: choose each batch size's tree by the estimate B x accept length / step "
                        "time (a full batch, as continuously batched engines keep it; default) or by the measured "
                        "tokens/s of decoding the timing prompts in static batches (draftlab's own decoder, whose "
                        "rows end at different steps), among the top 3 by estimate and plain decoding; the vLLM and "
                        "SGLang files follow the estimate either way")
    p.add_argument("--max-rank", type=positive_int, default=10, help="candidates per depth considered (top-k)")
    p.add_argument("--calibration-prompts", type=positive_int, default=64,
                   help="prompts whose greedy continuations give the drafter's acceptance statistics")
    p.add_argument("--timing-prompts", type=positive_int, default=8, help="prompts each candidate tree is timed on")
    p.add_argument("--timing-rounds", type=positive_int, default=3,
                   help="times each tree is timed, interleaved with the others; its fastest round counts (a busy "
                        "machine's slow spells then do not decide the choice)")
    p.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                   help="stop timing trees after this many minutes (compiles included) and choose among those "
                        "timed; the rest are listed as untimed (not with --batch-sizes)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens decoded per prompt (calibration "
                   "and timing)")
    p.add_argument("--sizes", type=positive_int, nargs="*", default=None,
                   help="tree sizes (non-root nodes) to time (default 1, 2, 4, ...)")
    p.add_argument("--max-depth", type=positive_int, default=8,
                   help="SSM exports: deepest tree / longest chain considered")
    p.add_argument("--plot", action="store_true", help="write OUT.sizes.png and OUT.tree.png")
    p.add_argument("--compile", action="store_true",
                   help="time the trees on the static-shape compiled path (generate --compile), so the tree fits "
                        "that path's costs; each tree size compiles once (tens of seconds on a CPU)")
    add_compile_cache_arg(p)
    add_placement_args(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def schedule_command(a) -> int:
    from ..serve.schedule import search_schedule

    rep = search_schedule(a.export, a.data, a.out, a.batch_sizes, a.max_nodes, a.max_rank, a.calibration_prompts,
                          a.timing_prompts, a.max_new_tokens, sizes=a.sizes, max_depth=a.max_depth, tp=a.tp,
                          device_map=a.device_map, compile=a.compile, timing_rounds=a.timing_rounds,
                          engine_model=a.engine_draft, schedule_by=a.schedule_by, base_name=a.base)
    if a.json:
        print(json.dumps(rep))
        return 0
    print("| batch size | chosen | nodes | accept length (statistics) | est. tokens/s | est. plain tokens/s | "
          "measured tokens/s | measured plain tokens/s | best chain K |\n|---|---|---|---|---|---|---|---|---|")
    for e in rep["schedule"]:
        print(f"| {e['batch_size']} | {e['tree']} | {e['tree_size']} | {e['accept_length']:.3f} | "
              f"{e['estimated_tokens_per_s']:.1f} | {e['estimated_plain_tokens_per_s']:.1f} | "
              f"{e['tokens_per_s']:.1f} | {e['plain_tokens_per_s']:.1f} | {e['chain_length']} |")
    cut = rep["no_speculation_above"]
    top = rep["schedule"][-1]["batch_size"]
    print("\n" + ("speculation did not pay at any batch size measured" if cut == 0 else
                  f"speculation pays up to batch size {top} (the largest measured)" if cut is None else
                  f"plain decoding wins above batch size {cut}") +
          f" on {rep['hardware']} ({'compiled' if rep['compiled'] else 'eager'} decoding"
          f"{', chosen by timed static batches' if rep['schedule_by'] == 'timed' else ''})")
    for what, where in rep["files"].items():
        print(f"{what}: {where}")
    return 0


def search_command(a) -> int:
    if a.time_budget is not None and (a.batch_sizes or a.time_budget < 0):
        raise ValueError("--time-budget takes minutes >= 0 and applies to the search of one tree, not --batch-sizes")
    if a.batch_sizes:
        return schedule_command(a)
    given = [f for f, v in (("--schedule-by timed", a.schedule_by != "estimate"), ("--engine-draft", a.engine_draft))
             if v]
    if given:
        raise ValueError(f"{', '.join(given)}: settings of a schedule; add --batch-sizes B1,B2,...")
    rep = search_tree(a.export, a.data, a.out, a.max_nodes, a.batch_size, a.max_rank, a.calibration_prompts,
                      a.timing_prompts, a.max_new_tokens, sizes=a.sizes, plot=a.plot, max_depth=a.max_depth,
                      tp=a.tp, device_map=a.device_map, compile=a.compile, timing_rounds=a.timing_rounds,
                      time_budget_s=None if a.time_budget is None else a.time_budget * 60, base_name=a.base)
    if a.json:
        print(json.dumps(rep))
        return 0
    print("| tree | nodes (root included) | depth | expected accept | measured accept | tokens/s "
          "| two fastest rounds apart |\n|---|---|---|---|---|---|---|")
    print(f"| plain decoding | 1 | 0 | 1.000 | 1.000 | {rep['plain_tokens_per_s']:.1f} | - |")
    for r in rep["sizes"]:
        expected = "-" if r["expected_accept_length"] is None else f"{r['expected_accept_length']:.3f}"
        apart = "-" if r["rounds_gap"] is None else f"{100 * r['rounds_gap']:.0f}%"
        name = r["name"] + (" (the export's default)" if r.get("export_default") and r["name"] != "export default"
                            else "")
        print(f"| {name} | {r['tree_size']} | {r['tree_depth']} | {expected} | "
              f"{r['measured_accept_length']:.3f} | {r['tokens_per_s']:.1f} | {apart} |")
    path = "compiled" if rep["compiled"] else "eager"
    print(f"\nchose {rep['tree_size']} nodes, the root included ({rep['tokens_per_s']:.1f} tokens/s at batch size "
          f"{rep['batch_size']} on {rep['hardware']}, {path} decoding, "
          f"{rep['tokens_per_s'] / rep['plain_tokens_per_s']:.2f}x plain decoding's"
          + (f", {rep['tokens_per_s'] / rep['default_tokens_per_s']:.2f}x the export's default tree's"
             if rep.get("default_tokens_per_s") else "") + f"); wrote {rep['tree']}")
    for line in search_warnings(rep, a):
        print(line, file=sys.stderr)
    return 0


def search_warnings(rep: dict, a) -> list[str]:
    """What the figures above cannot show by themselves: plain decoding was faster, or the runner-up is within the
    timing's own noise (how far apart the two trees' two fastest rounds are)."""
    out = []
    if rep["plain_tokens_per_s"] >= rep["tokens_per_s"]:
        out.append(f"warning: plain decoding ({rep['plain_tokens_per_s']:.1f} tokens/s) was faster than every tree "
                   f"on this machine{' compiled' if rep['compiled'] else ''}: speculation with this drafter does not "
                   "pay here" + ("" if rep["compiled"] else "; try --compile"))
    else:  # (1.03x over plain with rounds 21% apart was printed as a speedup; the next --compare measured 0.61x)
        chosen = max(rep["sizes"], key=lambda r: r["tokens_per_s"])
        over = rep["tokens_per_s"] / rep["plain_tokens_per_s"] - 1
        if chosen["rounds_gap"] is not None and over <= chosen["rounds_gap"]:
            out.append(f"note: the chosen tree is {100 * over:.1f}% faster than plain decoding, less than its two "
                       f"fastest timing rounds differ ({100 * chosen['rounds_gap']:.0f}%): it may be no faster than "
                       f"plain decoding here; more --timing-prompts (now {a.timing_prompts}) or --timing-rounds (now "
                       f"{a.timing_rounds}) narrow it, and `draftlab generate --compare` measures it")
    close = toss_up(rep)
    if close:
        out.append(f"note: {close['runner_up']} ran within {100 * close['gap']:.1f}% of the chosen {close['chosen']}, "
                   f"less than their two fastest timing rounds differ ({100 * close['rounds_gap']:.0f}%): a toss-up "
                   f"between them; more --timing-prompts (now {a.timing_prompts}) or --timing-rounds (now "
                   f"{a.timing_rounds}) narrow it")
    return out


def toss_up(rep: dict) -> dict | None:
    """The chosen tree's name and the runner-up's, its gap below the chosen tree and the larger of their rounds_gap,
    where the gap is within it (so the choice between the two is a toss-up); None otherwise."""
    ranked = sorted(rep["sizes"], key=lambda r: -r["tokens_per_s"])
    if len(ranked) < 2 or ranked[0]["tokens_per_s"] <= 0:
        return None
    first, second = ranked[:2]
    gap = 1 - second["tokens_per_s"] / first["tokens_per_s"]
    noise = max(first["rounds_gap"] or 0.0, second["rounds_gap"] or 0.0)
    return ({"chosen": first["name"], "runner_up": second["name"], "gap": round(gap, 4), "rounds_gap": noise}
            if gap <= noise else None)
