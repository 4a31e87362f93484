"""Train Medusa heads on stories260K (first 90% of the TinyStories sample); record speed and accuracy.

    python benchmarks/train_heads.py            # ~5 min on 2 CPU cores

Leaves the export in benchmarks/exports/stories260k-medusa/ for benchmarks/decode.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

from common import EXPORTS, ROOT, stories_base, write_result


def train_recipe(recipe_path: str, name: str, overrides: list[str]) -> dict:
    """Train a recipe on the imported stories260K base, copy its export to benchmarks/exports/NAME, and return
    the run's speed and held-out figures."""
    from draftlab.config import load_recipe
    from draftlab.train import train

    base = stories_base()
    run_dir = ROOT / "benchmarks" / "runs" / name
    recipe = load_recipe(recipe_path, [f"base.name_or_path={base}", f"output_dir={run_dir}", *overrides])
    t0 = time.perf_counter()
    summary = train(recipe, overwrite=True)
    wall = time.perf_counter() - t0
    dest = EXPORTS / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(summary["export"], dest)
    logs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [l["tokens_per_s"] for l in logs if "tokens_per_s" in l][1:]  # first window includes warm-up
    start = logs[0]
    ev = summary["eval"]
    return {
        "recipe": str(recipe_path).replace(str(ROOT) + "/", ""), "overrides": overrides,
        "head": recipe.head.model_dump(), "loss": recipe.loss.model_dump(), "steps": summary["step"],
        "train_examples": start["train_examples"], "train_tokens_per_epoch": start["train_tokens"],
        "wall_s": round(wall, 1), "train_tokens_per_s": round(sum(speeds) / len(speeds), 1),
        "head_top1": [round(x, 4) for x in ev["top1"]], "head_top5": [round(x, 4) for x in ev["topk"]],
        "agree_top1": [round(x, 4) for x in ev["agree1"]],
        "eval_positions": int(ev["eval_positions"][0]), "export": str(dest.relative_to(ROOT)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "stories260k-medusa.yaml"))
    ap.add_argument("--name", default="stories260k-medusa")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    result = train_recipe(a.recipe, a.name, a.overrides)
    print(json.dumps(result, indent=2))
    write_result("train_heads" if a.name == "stories260k-medusa" else f"train_heads_{a.name}", result)


if __name__ == "__main__":
    main()
