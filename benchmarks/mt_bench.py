"""MT-Bench speed on the stories260K exports: all 80 questions, both turns, greedy, each export's default tree.

    python benchmarks/mt_bench.py      # after train_heads.py for the three head types; ~8 min on 2 CPU cores
    python benchmarks/mt_bench.py --compile --max-new-tokens 256 --name mt_bench_compiled \
        --export ensemble5=benchmarks/exports/stories260k-ensemble-boost    # any exports, on the compiled path

Runs `draftlab eval mt-bench` for Medusa, Hydra and Hydra++ (or the --export ones; answers, reports and plots in
benchmarks/runs/<name>/<label>/) and records per-category accept length and speedup. With --compile the runs
decode on the static-shape compiled path, and the eval also measures draftlab's compiled plain decoding of the
same turns (the second baseline) and the time turns spent compiling (timed again without it). The answers of
a 260K-parameter TinyStories model are nonsense; this exercises the measurement machinery.
"""

from __future__ import annotations

import argparse

from common import DATA, EXPORTS, ROOT, STORIES_EXPORTS as KINDS, stories_base, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--export", action="append", default=[], metavar="LABEL=DIR",
                    help="exports to run (default: the three of benchmarks/train_heads.py)")
    ap.add_argument("--compile", action="store_true", help="the static-shape compiled path (eval mt-bench --compile)")
    ap.add_argument("--name", default="mt_bench", help="results/NAME.json")
    a = ap.parse_args()
    from draftlab.eval.mt_bench import compare_runs, run_mt_bench

    exports = dict(e.split("=", 1) for e in a.export) or {k: str(EXPORTS / n) for k, n in KINDS.items()}
    questions = DATA / "mt_bench" / "question.jsonl"
    keys = ("tree_size", "overall", "categories", "differences")
    runs, dirs = {}, []
    for label, path in exports.items():
        out = ROOT / "benchmarks" / "runs" / a.name / label
        s = run_mt_bench(path, str(questions), str(out), max_new_tokens=a.max_new_tokens, limit=a.limit,
                         overwrite=True, compile=a.compile, base=str(stories_base()) if a.export else None)
        runs[label] = {k: s[k] for k in keys}
        dirs.append(str(out))
        o = s["overall"]
        print(f"{label}: accept {o['accept_length']:.2f}, speedup {o['speedup']:.2f}x"
              + (f", vs compiled plain {o['speedup_vs_compiled_plain']:.2f}x, {o.get('turns_compiled', 0)} turns "
                 f"compiled ({o.get('compile_s', 0):.1f} s)" if a.compile else "")
              + f", identical {o['identical_share']:.0%}, differences {s['differences']}")
    table, _ = compare_runs(dirs)
    print(table)
    first = next(iter(runs.values()))
    write_result(a.name, {"questions": first["overall"]["answers"], "max_new_tokens": a.max_new_tokens,
                          "questions_file": str(questions.relative_to(ROOT)), "compiled": a.compile,
                          "exports": exports if a.export else None, "runs": runs})


if __name__ == "__main__":
    main()
