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
    for name in ("heads", "tree_search", "mt_bench"):
        if d := load(name):
            print(f"### {name}\n\n```json\n{json.dumps({k: v for k, v in d.items() if k != 'machine'}, indent=1)[:3000]}\n```\n")


if __name__ == "__main__":
    main()
