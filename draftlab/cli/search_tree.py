"""`draftlab search-tree`: the fastest tree for an export, on this machine, at a batch size (static trees for heads
and SSMs; EAGLE-2 depth / top_k / total_tokens for eagle3 exports)."""

from __future__ import annotations

import json

from ..serve.tree_search import search_tree
from .args import add_placement_args, positive_int


def add_search_args(p) -> None:
    p.add_argument("export")
    p.add_argument("--data", required=True, help="calibration text: .txt / JSON(L) of text, ShareGPT or Alpaca records")
    p.add_argument("--out", required=True, help="tree file to write (.json)")
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree (non-root nodes) to consider")
    p.add_argument("--batch-size", type=int, default=1, help="batch size the tree is tuned for")
    p.add_argument("--max-rank", type=int, default=10, help="candidates per depth considered (top-k)")
    p.add_argument("--calibration-prompts", type=int, default=64)
    p.add_argument("--timing-prompts", type=int, default=8)
    p.add_argument("--timing-rounds", type=positive_int, default=3,
                   help="times each tree is timed, interleaved with the others; its fastest round counts (a busy "
                        "machine's slow spells then do not decide the choice)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="tree sizes to time (default 1, 2, 4, ...)")
    p.add_argument("--max-depth", type=int, default=8, help="SSM exports: deepest tree / longest chain considered")
    p.add_argument("--plot", action="store_true", help="write OUT.sizes.png and OUT.tree.png")
    p.add_argument("--compile", action="store_true",
                   help="time the trees on the static-shape compiled path (generate --compile), so the tree fits "
                        "that path's costs; each tree size compiles once (tens of seconds on a CPU)")
    add_placement_args(p)
    p.add_argument("--json", action="store_true")


def search_command(a) -> int:
    rep = search_tree(a.export, a.data, a.out, a.max_nodes, a.batch_size, a.max_rank, a.calibration_prompts,
                      a.timing_prompts, a.max_new_tokens, sizes=a.sizes, plot=a.plot, max_depth=a.max_depth,
                      tp=a.tp, device_map=a.device_map, compile=a.compile, timing_rounds=a.timing_rounds)
    if a.json:
        print(json.dumps(rep))
        return 0
    print("| tree | nodes | depth | expected accept | measured accept | tokens/s |\n|---|---|---|---|---|---|")
    for r in rep["sizes"]:
        expected = "-" if r["expected_accept_length"] is None else f"{r['expected_accept_length']:.3f}"
        print(f"| {r['name']} | {r['tree_size']} | {r['tree_depth']} | {expected} | "
              f"{r['measured_accept_length']:.3f} | {r['tokens_per_s']:.1f} |")
    path = "compiled" if rep["compiled"] else "eager"
    print(f"\nchose {rep['tree_size']} nodes ({rep['tokens_per_s']:.1f} tokens/s at batch size {rep['batch_size']} on "
          f"{rep['hardware']}, {path} decoding); wrote {rep['tree']}")
    return 0
