"""Train the stories260K SSM ensemble twice with the same compute: collectively boost-tuned, and independent
(every member on all data, its own seed), from recipes/stories260k-ensemble.yaml.

    python benchmarks/train_ssm.py        # makes the self-distilled data (runs/stories260k-self.jsonl)
    python benchmarks/train_ensemble.py   # ~7 min per ensemble on 2 cores

Exports go to benchmarks/exports/stories260k-ensemble-{boost,independent} for benchmarks/ensemble.py.
"""

from __future__ import annotations

import json
import shutil
import time

from common import EXPORTS, ROOT, stories_base, write_result
from train_ssm import self_distilled


def main() -> None:
    from draftlab.config import load_recipe
    from draftlab.train import train

    data = self_distilled()
    out = {}
    for name, boost in (("boost", True), ("independent", False)):
        run = ROOT / "benchmarks" / "runs" / f"stories260k-ensemble-{name}"
        recipe = load_recipe(ROOT / "recipes" / "stories260k-ensemble.yaml", [
            f"base.name_or_path={stories_base()}", f"data.path={data}", f"output_dir={run}", f"ensemble.boost={boost}"])
        t0 = time.perf_counter()
        summary = train(recipe, overwrite=True)
        dest = EXPORTS / f"stories260k-ensemble-{name}"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(summary["export"], dest)
        out[name] = {"wall_s": round(time.perf_counter() - t0, 1), "stages": summary["stages"],
                     "member_agree_top1": [json.loads((run / "stages" / f"member{i}" / "metrics.jsonl").read_text()
                                                      .splitlines()[-1])["agree1"][0] for i in range(1, 6)]}
        print(name, json.dumps(out[name], indent=1))
    write_result("train_ensemble", {"recipe": "recipes/stories260k-ensemble.yaml", **out})


if __name__ == "__main__":
    main()
