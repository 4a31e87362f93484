"""`draftlab eval mt-bench` and `draftlab eval compare`."""

from __future__ import annotations

import json
from pathlib import Path

from ..eval.compare import compare_slices, format_comparison, held_fixed
from ..eval.mt_bench import EvalError, compare_runs, load_summary, run_mt_bench
from ..shipped import mt_bench_questions
from .args import (DEVICE_HELP, DTYPE_HELP, SEED_HELP, add_compile_cache_arg, add_placement_args, add_typical_args,
                   non_negative_float, positive_int, sampling_from_args)


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
    p.add_argument("--out", default=None, help="run directory (default: runs/eval/<the folder holding the export: its "
                   "training run>; answers already there are kept when the export, base and settings match)")
    p.add_argument("--tree", default=None,
                   help="'default', 'kind', 'chain', 'chain:N', 'expansion:K1,K2,...', 'dynamic:DEPTH,TOP_K,TOTAL' "
                        "(eagle3 "
                        "exports), a tree file (JSON/YAML), FILE.py:NAME or inline paths, as generate --tree")
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_typical_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=1024, help="per turn (FastChat's MT-Bench setting)")
    p.add_argument("--compile", action="store_true",
                   help="the static-shape, compiled decode path (see generate --compile); same answers")
    add_compile_cache_arg(p)
    p.add_argument("--limit", type=positive_int, default=None, help="first N selected questions")
    p.add_argument("--category", action="append", default=None, help="only this category; repeatable")
    p.add_argument("--slice-field", default=None, metavar="NAME",
                   help="slice the report by this field of the question records instead of `category` "
                        "(a field of your own question file; every record must have it)")
    p.add_argument("--base", default=None, help="base model path or hub id (default: the one the export names)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"], help=DTYPE_HELP)
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    add_placement_args(p)
    p.add_argument("--seed", type=int, default=0, help=SEED_HELP + "; each turn's stream is seeded from it and "
                   "its question id, so a resumed run draws as a whole one would")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message opening every conversation (default: none, or the chat template's own). "
                        "Published accept lengths often use one: FastChat's Vicuna and Llama-2-chat templates")
    p.add_argument("--model-id", default=None,
                   help="model_id in the answer file (FastChat's field; default: BASE-draftlab-KIND, e.g. "
                        "vicuna-7b-v1.3-draftlab-medusa)")
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup, no identity check)")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots (per category, histogram, per slicing)")
    p.add_argument("--overwrite", action="store_true", help="discard answers already in --out")
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on the last line (exit 1 still if a greedy answer "
                        "differs from plain decoding other than at a near tie)")
    c = sub.add_parser("compare", help="side-by-side table of eval runs; with two, their slices and what got worse",
                       description="Compare `draftlab eval mt-bench` runs (Medusa vs Hydra vs Hydra++, or two trees). "
                                   "With exactly two runs A B, also each slicing's slices side by side, marking those "
                                   "whose accept length or speedup is lower in B by more than --threshold and by "
                                   "more than --noise standard errors of the difference. The exit code is 0 whether "
                                   "or not a slice got worse.")
    c.add_argument("runs", nargs="+", help="run directories holding summary.json, or summary.json files")
    c.add_argument("--threshold", type=float, default=0.05,
                   help="relative drop that marks a slice as worse (default 0.05: 5%%)")
    c.add_argument("--noise", type=float, default=2.0,
                   help="a drop must also exceed this many standard errors of the difference, where both runs give "
                        "them (slices of two questions or more); smaller drops read 'within noise' (default 2; 0: the "
                        "threshold alone)")
    c.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def eval_command(a) -> int:
    if a.eval_cmd == "compare":
        if not 0 <= a.threshold < 1:
            raise EvalError(f"--threshold {a.threshold}: a relative drop, from 0 to below 1 (0.05 = 5%)")
        if not a.noise >= 0:
            raise EvalError(f"--noise {a.noise}: a number of standard errors, 0 or more (0: the threshold alone)")
        table, runs = compare_runs(a.runs)
        differ = held_fixed(runs)
        cmp = None
        older = []
        if len(a.runs) == 2:
            sa, sb = load_summary(a.runs[0]), load_summary(a.runs[1])
            older = [r["dir"] for r in (sa, sb) if "slices" not in r]
            cmp = None if older else compare_slices(sa, sb, a.threshold, a.noise)
        if a.json:
            obj = {"runs": [{"dir": r["dir"], "head": r["head"], "tree_size": r["tree_size"], "overall": r["overall"],
                             "categories": r["categories"]} for r in runs]}
            print(json.dumps({**obj, "not_comparable": differ, **(cmp or {})}))
        else:
            if differ:
                print("warning: these runs differ in what a comparison holds fixed, so their figures were measured "
                      "under different conditions:\n" + "".join(f"- {d}\n" for d in differ))
            print(table)
            if cmp:
                print("\n" + format_comparison(cmp, *a.runs))
            for d in older:  # the overview above still compares them
                print(f"\n{d}: no per-slice section (a summary made by an older draftlab); run `draftlab eval "
                      "mt-bench` again with the same --out to add it (answers are kept)")
        return 0
    sampling_from_args(a)  # a bad flag fails before anything loads
    out = a.out or str(Path("runs") / "eval" / Path(a.export.rstrip("/")).parent.name)
    s = run_mt_bench(a.export, a.questions or str(mt_bench_questions()), out, a.tree, a.temperature, a.top_p, a.top_k, a.typical,
                     a.max_new_tokens, a.limit, a.category, a.base, a.dtype, a.device, a.seed, not a.no_baseline,
                     a.model_id, a.overwrite, progress=not a.json, plots=not a.no_plots, tp=a.tp,
                     device_map=a.device_map, typical_epsilon=a.typical_epsilon, typical_alpha=a.typical_alpha,
                     compile=a.compile, slice_field=a.slice_field, system=a.system)
    differ = s["differences"] if s["greedy"] and s["baseline"] else []
    # A difference not explained as a near tie (a turn after a differing one follows other answers: no verdict).
    bugs = [d for d in differ if not d.get("near_tie") and not d.get("after_earlier_difference")]
    later = sum(bool(d.get("after_earlier_difference")) for d in differ)
    if a.json:
        print(json.dumps(s), flush=True)
        return 1 if bugs else 0
    print(Path(s["report"]).read_text())
    print(f"answers: {', '.join(s['answers'].values())}\nreport: {s['report']}")
    if differ:
        print(f"WARNING: {len(differ)} turns differ from plain greedy decoding, {len(differ) - len(bugs) - later} of "
              f"them at a near tie of the base's logits, {later} after an earlier turn's difference (see the report)",
              flush=True)
    return 1 if bugs else 0
