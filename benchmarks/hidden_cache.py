"""Hidden-state cache: training tokens/s with the base recomputed every epoch vs read from the disk cache.

    python benchmarks/hidden_cache.py      # ~6 min on 2 CPU cores

Trains the stories260K Hydra++ recipe for 2 epochs twice, with train.cache_hidden false and true.
Epoch 1 of the cached run computes the base and writes the cache; epoch 2 reads it. The figure
that matters is epoch 2 (and every later epoch of a 10-epoch Hydra++ run): cached vs recomputed.
"""

from __future__ import annotations

import json
import statistics
import time

from common import ROOT, stories_base, write_result


def epoch_speeds(metrics) -> dict:
    """Median training tokens/s per epoch from metrics.jsonl (first window of each epoch dropped)."""
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    out = {}
    for e in (0, 1):
        xs = [r["tokens_per_s"] for r in rows if e < r["epoch"] <= e + 1][1:]
        out[f"epoch{e + 1}"] = round(statistics.median(xs), 1)
    return out


def main() -> None:
    from draftlab.config import load_recipe
    from draftlab.train import train

    base = stories_base()
    result = {"recipe": "recipes/stories260k-hydra++.yaml", "epochs": 2}
    for cached in (False, True):
        run_dir = ROOT / "benchmarks" / "runs" / f"hidden-cache-{'on' if cached else 'off'}"
        recipe = load_recipe(ROOT / "recipes" / "stories260k-hydra++.yaml",
                             [f"base.name_or_path={base}", f"output_dir={run_dir}", f"train.cache_hidden={cached}",
                              "train.epochs=2", "train.eval_every_steps=100000", "train.save_every_steps=100000"])
        t0 = time.perf_counter()
        train(recipe, overwrite=True)
        result["cache_on" if cached else "cache_off"] = {"wall_s": round(time.perf_counter() - t0, 1),
                                                         **epoch_speeds(run_dir / "metrics.jsonl")}
    on, off = result["cache_on"], result["cache_off"]
    result["epoch2_speedup"] = round(on["epoch2"] / off["epoch2"], 3)
    result["cache_bytes"] = sum(p.stat().st_size for p in (ROOT / "benchmarks" / "runs" / "hidden-cache-on" /
                                                           "hidden_cache").iterdir())
    print(json.dumps(result, indent=2))
    write_result("hidden_cache", result)


if __name__ == "__main__":
    main()
