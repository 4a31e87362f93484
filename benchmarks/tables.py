"""Print the README's benchmark tables from benchmarks/results/*.json (the only source of README figures)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict | None:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def where(d: dict) -> str:
    m = d["machine"]
    return f"{m.get('gpu') or m['cpu']}, {m['torch_threads']} threads, torch {m['torch']}, {d['date']}"


def main() -> None:
    if d := load("train_heads"):
        print(f"### Training Medusa heads (`benchmarks/train_heads.py`; {where(d)})\n")
        print(f"{d['steps']} steps, {d['train_tokens_per_s']:.0f} training tokens/s, {d['wall_s']:.0f} s wall; "
              f"held-out positions: {d['eval_positions']}\n")
        print("| head | top-1 | top-5 |\n|---|---|---|")
        for k, (a, b) in enumerate(zip(d["head_top1"], d["head_top5"]), 1):
            print(f"| {k} | {a:.3f} | {b:.3f} |")
        print()
    if d := load("decode"):
        print(f"### Greedy decoding (`benchmarks/decode.py`; {d['prompts']} prompts x {d['max_new_tokens']} "
              f"tokens; {where(d)})\n")
        print("| method | tree size | accept length | tokens/s | speedup | identical to plain greedy | "
              "ms/step draft / verify / accept |")
        print("|---|---|---|---|---|---|---|")
        for m, r in d["methods"].items():
            split = " / ".join(f"{v:.2f}" for v in r.get("ms_per_step", {}).values()) or "-"
            print(f"| {m} | {r.get('tree_size', '-')} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.0f} | "
                  f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {split} |")
        print()
    if d := load("heads"):
        print(f"### Medusa vs Hydra vs Hydra++ (`benchmarks/heads.py`; same data and optimizer steps, default tree of "
              f"{d['tree_size']} tokens, {d['prompts']} prompts x {d['max_new_tokens']} tokens, greedy; {where(d)})\n")
        print(f"plain HF generate: {d['baseline_tokens_per_s']:.0f} tokens/s\n")
        print("| heads | head top-1 (1..4) | accept length | tokens/s | speedup | identical | ms/step draft / verify / accept |")
        print("|---|---|---|---|---|---|---|")
        for k in ("medusa", "hydra", "hydra++"):
            r = d[k]
            split = " / ".join(f"{v:.2f}" for v in r["ms_per_step"].values())
            print(f"| {k} | {' '.join(f'{x:.3f}' for x in r['head_top1'])} | {r['accept_length']:.3f} | "
                  f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['identical_to_baseline']} | {split} |")
        print()
    if d := load("hidden_cache"):
        on, off = d["cache_on"], d["cache_off"]
        print(f"### Hidden-state cache (`benchmarks/hidden_cache.py`; Hydra++ recipe, 2 epochs; {where(d)})\n")
        print("| run | epoch 1 tokens/s | epoch 2 tokens/s | wall s |\n|---|---|---|---|")
        print(f"| recompute the base | {off['epoch1']:.0f} | {off['epoch2']:.0f} | {off['wall_s']:.0f} |")
        print(f"| `train.cache_hidden: true` | {on['epoch1']:.0f} | {on['epoch2']:.0f} | {on['wall_s']:.0f} |")
        print(f"\nepoch-2 speed-up {d['epoch2_speedup']:.2f}x; cache size {d['cache_bytes'] / 2**20:.0f} MiB\n")
    if d := load("tree_search"):
        print(f"### Tree search (`benchmarks/tree_search.py`; statistics from {d['calibration_prompts']} training "
              f"stories, check on {d['heldout_prompts']} held-out prompts x {d['max_new_tokens']} tokens; {where(d)})\n")
        print("| heads | chosen tree size | expected accept | replayed accept (calibration) | measured accept "
              "(held-out) | error | chosen tokens/s | default tree size | default accept | default tokens/s | "
              "plain tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for k in ("medusa", "hydra"):
            if k in d:
                r = d[k]
                print(f"| {k} | {r['tree_size']} | {r['expected_accept_length']:.3f} | "
                      f"{r['replayed_accept_length']:.3f} | {r['measured_accept_length']:.3f} | "
                      f"{100 * r['relative_error']:.1f}% | {r['tokens_per_s']:.0f} | {r['default_tree_size']} | "
                      f"{r['default_accept_length']:.3f} | {r['default_tokens_per_s']:.0f} | "
                      f"{r['baseline_tokens_per_s']:.0f} |")
        print()
    if d := load("mt_bench"):
        print(f"### MT-Bench (`benchmarks/mt_bench.py`; {d['questions']} questions, 2 turns, max "
              f"{d['max_new_tokens']} new tokens, greedy, default trees; {where(d)})\n")
        cats = list(d["runs"]["medusa"]["categories"])
        print("| heads | " + " | ".join(cats) + " | overall speedup | accept length | identical |")
        print("|---" * (len(cats) + 4) + "|")
        for k, r in d["runs"].items():
            print(f"| {k} | " + " | ".join(f"{r['categories'][c]['speedup']:.2f}x" for c in cats) +
                  f" | {r['overall']['speedup']:.2f}x | {r['overall']['accept_length']:.2f} | "
                  f"{100 * r['overall']['identical_share']:.0f}% |")
        print()

if __name__ == "__main__":
    main()
