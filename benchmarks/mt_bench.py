"""MT-Bench speed on the stories260K exports: all 80 questions, both turns, greedy, each export's default tree.

    python benchmarks/mt_bench.py      # after train_heads.py for the three head types; ~8 min on 2 CPU cores

Runs `draftlab eval mt-bench` for Medusa, Hydra and Hydra++ (answers, reports and plots in
benchmarks/runs/mt_bench/<kind>/) and records per-category accept length and speedup. The answers of
a 260K-parameter TinyStories model are nonsense; this exercises the measurement machinery.
"""

from __future__ import annotations

import argparse

from common import DATA, EXPORTS, ROOT, STORIES_EXPORTS as KINDS, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args()
    from draftlab.eval.mt_bench import compare_runs, run_mt_bench

    questions = DATA / "mt_bench" / "question.jsonl"
    runs, dirs = {}, []
    for kind, name in KINDS.items():
        out = ROOT / "benchmarks" / "runs" / "mt_bench" / kind
        s = run_mt_bench(str(EXPORTS / name), str(questions), str(out), max_new_tokens=a.max_new_tokens,
                         limit=a.limit, overwrite=True)
        runs[kind] = {k: s[k] for k in ("tree_size", "overall", "categories", "differences")}
        dirs.append(str(out))
        print(f"{kind}: accept {s['overall']['accept_length']:.2f}, speedup {s['overall']['speedup']:.2f}x, "
              f"identical {s['overall']['identical_share']:.0%}")
    table, _ = compare_runs(dirs)
    print(table)
    write_result("mt_bench", {"questions": runs["medusa"]["overall"]["answers"], "max_new_tokens": a.max_new_tokens,
                              "questions_file": str(questions.relative_to(ROOT)), "runs": runs})


if __name__ == "__main__":
    main()
