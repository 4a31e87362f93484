"""`draftlab eval mt-bench` and `draftlab eval compare`."""

from __future__ import annotations

import json
from pathlib import Path

from ..eval.mt_bench import compare_runs, run_mt_bench
from ..shipped import mt_bench_questions
from .args import add_placement_args, add_typical_args, positive_int, sampling_from_args


def add_eval_args(sub) -> None:
    p = sub.add_parser("mt-bench", help="speed and losslessness on MT-Bench / Spec-Bench questions",
                       description="Answer FastChat-format questions (two turns through the chat template) with "
                                   "the speculative decoder and with plain decoding of the same base, interleaved; "
                                   "write FastChat answer files, summary.json, report.md and PNG plots. "
                                   "Resumable: answers already in --out are kept.")
    p.add_argument("export", help="export directory")
    p.add_argument("--questions", default=None,
                   help="question.jsonl (FastChat or Spec-Bench) or a hub dataset id (default: the 80 MT-Bench "
                        "questions that ship with draftlab, data/mt_bench/question.jsonl)")
    p.add_argument("--out", default=None, help="run directory (default: runs/eval/<export name>)")
    p.add_argument("--tree", default=None, help="tree file, 'chain' or 'default'")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_typical_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=1024)
    p.add_argument("--compile", action="store_true",
                   help="the static-shape, compiled decode path (see generate --compile); same answers")
    p.add_argument("--limit", type=int, default=None, help="first N selected questions")
    p.add_argument("--category", action="append", default=None, help="only this category; repeatable")
    p.add_argument("--base", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", default=None)
    add_placement_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-id", default=None, help="model_id in the answer file")
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup, no identity check)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="discard answers already in --out")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    c = sub.add_parser("compare", help="side-by-side table of eval run directories",
                       description="Compare `draftlab eval mt-bench` runs (Medusa vs Hydra vs Hydra++, or two trees).")
    c.add_argument("runs", nargs="+", help="run directories holding summary.json")
    c.add_argument("--json", action="store_true")


def eval_command(a) -> int:
    if a.eval_cmd == "compare":
        table, runs = compare_runs(a.runs)
        if a.json:
            print(json.dumps([{"dir": r["dir"], "head": r["head"], "tree_size": r["tree_size"], "overall": r["overall"],
                               "categories": r["categories"]} for r in runs]))
        else:
            print(table)
        return 0
    sampling_from_args(a)  # a bad flag fails before anything loads
    out = a.out or str(Path("runs") / "eval" / Path(a.export.rstrip("/")).parent.name)
    s = run_mt_bench(a.export, a.questions or str(mt_bench_questions()), out, a.tree, a.temperature, a.top_p, a.top_k, a.typical,
                     a.max_new_tokens, a.limit, a.category, a.base, a.dtype, a.device, a.seed, not a.no_baseline,
                     a.model_id, a.overwrite, progress=not a.json, plots=not a.no_plots, tp=a.tp,
                     device_map=a.device_map, typical_epsilon=a.typical_epsilon, typical_alpha=a.typical_alpha,
                     compile=a.compile)
    if a.json:
        print(json.dumps(s))
        return 0
    print(Path(s["report"]).read_text())
    print(f"answers: {', '.join(s['answers'].values())}\nreport: {s['report']}")
    if s["greedy"] and s["baseline"] and s["differences"]:
        print(f"WARNING: {len(s['differences'])} turns differ from plain greedy decoding", flush=True)
        return 1
    return 0
