"""Distil small speculative models (SSMs) from stories260K, one per divergence, on its self-distilled data.

    python benchmarks/train_ssm.py                        # forward KL and total variation, ~3 min each on 2 cores
    python benchmarks/train_ssm.py --divergences fkl rkl tvd jsd

1. The base continues the first 64 characters of each of the 2085 training stories (greedy, 256 new tokens):
   `draftlab distill-data --mode text`, kept in runs/stories260k-self.jsonl (resumable, made once).
2. recipes/stories260k-ssm.yaml is trained once per divergence with the same data, steps and seed; the exports
   go to benchmarks/exports/stories260k-ssm-<divergence> for benchmarks/ssm.py.
"""

from __future__ import annotations

import argparse
import json

from common import ROOT, TINYSTORIES, stories_base, tinystories_split, write_result
from train_heads import train_recipe

SELF_DATA = ROOT / "runs" / "stories260k-self.jsonl"


def self_distilled(max_new_tokens: int = 256) -> str:
    """The base's own greedy continuations of the training stories' openings (made once, resumable)."""
    from draftlab.train.distill import distill_data

    train_docs, _ = tinystories_split()
    summary = distill_data(str(stories_base()), str(TINYSTORIES), str(SELF_DATA), max_new_tokens=max_new_tokens,
                           batch_size=64, max_records=len(train_docs), dtype="float32", mode="text", prompt_chars=64)
    print(f"self-distilled data: {summary}")
    return str(SELF_DATA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--divergences", nargs="*", default=["fkl", "tvd"])
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    data = self_distilled()
    results = {}
    for div in a.divergences:
        name = f"stories260k-ssm-{div}"
        results[div] = train_recipe(str(ROOT / "recipes" / "stories260k-ssm.yaml"), name,
                                    [f"data.path={data}", f"loss.divergence={div}", *a.overrides])
        print(json.dumps(results[div], indent=2))
    write_result("train_ssm", {"data": str(SELF_DATA.relative_to(ROOT)), "divergences": results})


if __name__ == "__main__":
    main()
