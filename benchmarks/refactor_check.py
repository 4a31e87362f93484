"""The drafter interface must not slow the heads down: the decoder as it was before it (git commit 39ef22b,
unpacked from git and imported as the package `draftlab_v0`) and as it is now, on the same exports, base
object, prompts and tree, in one process, prompt by prompt, interleaved (plus plain HF generate).

    python benchmarks/train_heads.py ...   # the three exports (see README)
    python benchmarks/refactor_check.py
    python benchmarks/refactor_check.py --commit C --export medusa=runs/x/export --export eagle3=...  # any exports
    python benchmarks/refactor_check.py --commit C --train recipes/stories260k-hydra++.yaml ...  # + the training loop
    python benchmarks/refactor_check.py --commit C --compile --export ...  # the static-shape compiled path, plain too
    python benchmarks/refactor_check.py --commit C --export eagle3=DIR@dynamic:4,2,8 ...  # a tree (--tree) for both
    python benchmarks/refactor_check.py --commit C --compile --export ensemble=DIR --ensemble-option policy=cost
        # an ensemble's schedule options (both sides)
    python benchmarks/refactor_check.py --commit C --temperature 0.8 --export ...  # sampled decoding (the two sides
        # draw differently where their samplers differ: compare time per step and accept length, not tokens)
    python benchmarks/refactor_check.py --commit C --temperature 0.8 --typical --export ...  # typical acceptance
"""

from __future__ import annotations

import argparse
import copy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import EXPORTS, ROOT, STORIES_EXPORTS, heldout_story_prompts, write_result
from decode import compare, draftlab_method, hf_method, print_table

BEFORE = "39ef22b"


def old_package(commit: str) -> Path:
    """`draftlab` at `commit`, unpacked as the package `draftlab_v0` (its imports are all relative)."""
    root = Path(tempfile.mkdtemp(prefix="draftlab_v0_"))
    archive = subprocess.run(["git", "archive", commit, "draftlab"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    shutil.move(root / "draftlab", root / "draftlab_v0")
    sys.path.insert(0, str(root))
    return root


def before_after_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The options of a script that compares commit C (old_package) with the code now on one export: --commit,
    --export LABEL=DIR, --name (results/NAME.json)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", required=True, help="the before side")
    ap.add_argument("--export", required=True, metavar="LABEL=DIR")
    ap.add_argument("--name", default=name, help="results/NAME.json")
    return ap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--commit", default=BEFORE)
    ap.add_argument("--name", default="refactor_check", help="results/NAME.json")
    ap.add_argument("--export", action="append", default=[], metavar="LABEL=DIR[@TREE]",
                    help="exports to compare (default: the three of benchmarks/train_heads.py)")
    ap.add_argument("--train", action="append", default=[], metavar="RECIPE",
                    help="also train these recipes before and after (alternating), compare time and weights")
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--compile", action="store_true",
                    help="compare the static-shape compiled path (torch.compile), with plain decoding on it too")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled decoding at this temperature")
    ap.add_argument("--typical", action="store_true", help="with --temperature: typical acceptance (Medusa's)")
    ap.add_argument("--ensemble-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an ensemble option for both sides' decoders (the exports must be ensembles)")
    a = ap.parse_args()
    a.commit = subprocess.run(["git", "rev-parse", "--short", a.commit], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()  # a name such as HEAD: the commit it names now
    old_package(a.commit)
    training = {Path(r).stem: train_check(r, a.train_steps) for r in a.train}
    try:
        from draftlab_v0.serve.generate import load_decoder as load_before
    except ImportError:  # before the layout move it was decode/generate.py, at 39ef22b decode/cli.py
        try:
            from draftlab_v0.decode.generate import load_decoder as load_before
        except ImportError:
            from draftlab_v0.decode.cli import load_decoder as load_before

    from draftlab.interop.export import read_meta
    from draftlab.serve.generate import encode_prompt, load_decoder

    methods, base, tok = {}, None, None
    pairs = {}
    exports = dict(e.split("=", 1) for e in a.export) or {k: str(EXPORTS / n) for k, n in STORIES_EXPORTS.items()}
    ensemble = {"options": dict(o.split("=", 1) for o in a.ensemble_option)} if a.ensemble_option else {}
    for kind, spec in exports.items():
        path, _, tree = spec.partition("@")  # TREE: the --tree of both sides (default: the export's)
        options = ensemble if read_meta(path)["head"].get("type") == "ensemble" else {}  # --ensemble-option: ensembles
        after, tok, _ = load_decoder(path, tree=tree or None, **options)
        before, _, _ = load_before(path, tree=tree or None, **options)
        base = base or after.base
        after.base = before.base = base  # one base object: every method runs the same weights
        pairs[kind] = (before, after)
    if a.compile:  # each side's own decoder class on its compiled path, over the same drafter objects as above
        from draftlab_v0.decode.decoder import NoDraft as NoDraftBefore, SpeculativeDecoder as DecoderBefore

        from draftlab.decode.decoder import NoDraft, SpeculativeDecoder

        pairs = {"plain": (NoDraftBefore(), NoDraft()), **{k: (b.drafter, f.drafter) for k, (b, f) in pairs.items()}}
        # Each side's compiled path fuses its base's projections (decode.fuse) with its own classes, which only its
        # own compiled calls run fused: the before side decodes a copy of the base (the same weights).
        base_before = copy.deepcopy(base)
        pairs = {k: (DecoderBefore(base_before, b, compile=True), SpeculativeDecoder(base, f, compile=True))
                 for k, (b, f) in pairs.items()}
    eos, N = tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    methods["hf_generate"] = hf_method(base, eos, N)
    sampled = {}
    if a.temperature > 0:  # each side's own Sampling class
        from draftlab_v0.decode.acceptance import Sampling as SamplingBefore

        from draftlab.decode.acceptance import Sampling

        typical = {"typical": True} if a.typical else {}
        sampled = {"before": SamplingBefore(temperature=a.temperature, **typical),
                   "after": Sampling(temperature=a.temperature, **typical)}
    for kind, (before, after) in pairs.items():
        methods[f"{kind}_before"] = draftlab_method(before, eos, N, sampled.get("before"))
        methods[f"{kind}_after"] = draftlab_method(after, eos, N, sampled.get("after"))
    results = compare(methods, prompts)
    print_table(results)
    ratio = {k: round(results[f"{k}_after"]["tokens_per_s"] / results[f"{k}_before"]["tokens_per_s"], 3)
             for k in pairs}
    same = {k: results[f"{k}_after"]["accept_length"] == results[f"{k}_before"]["accept_length"] for k in pairs}
    print(f"tokens/s after / before: {ratio}; accept length unchanged: {same}")
    write_result(a.name, {"before": a.commit, "compiled": a.compile, "temperature": a.temperature,
                          **({"typical": True} if a.typical else {}),
                          **({"ensemble_options": options["options"]} if options else {}),
                          "exports": {k: str(v).replace(str(ROOT) + "/", "") for k, v in exports.items()},
                          "prompts": len(prompts), "max_new_tokens": N, "methods": results, "after_over_before": ratio,
                          "same_accept_length": same,
                          **({"training": training} if training else {})})


def train_check(recipe_path: str, steps: int, rounds: int = 2) -> dict:
    """Train the recipe with the package before and after, alternating (before, after, after, before, ...): each
    side's mean wall time, and whether the exported weights are bit-identical (same seed, same data order)."""
    import time

    import draftlab_v0.config as config_before
    import draftlab_v0.train as train_before
    from safetensors.torch import load_file

    import draftlab.config as config_after
    import draftlab.train as train_after
    from common import stories_base

    base = stories_base()
    sides = {"before": (config_before, train_before), "after": (config_after, train_after)}
    times, weights = {"before": [], "after": []}, {}
    order = [s for r in range(rounds) for s in (("before", "after") if r % 2 == 0 else ("after", "before"))]
    for side in order:
        config, train = sides[side]
        out = Path(tempfile.mkdtemp(prefix=f"refactor_{side}_"))
        recipe = config.load_recipe(recipe_path, [f"base.name_or_path={base}", f"output_dir={out}",
                                                  f"train.max_steps={steps}", "log.trackers=[]"])
        t0 = time.perf_counter()
        train.train(recipe, overwrite=True)
        times[side].append(time.perf_counter() - t0)
        files = sorted((out / "export").glob("*.safetensors"))
        weights[side] = {k: v for f in files for k, v in load_file(f).items()}
        shutil.rmtree(out, ignore_errors=True)
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    same = weights["before"].keys() == weights["after"].keys() and all(
        weights["before"][k].equal(weights["after"][k]) for k in weights["before"])
    r = {"steps": steps, "seconds_before": round(mean["before"], 2), "seconds_after": round(mean["after"], 2),
         "after_over_before": round(mean["before"] / mean["after"], 3), "identical_weights": same}
    print(f"training {recipe_path}: {r}")
    return r


if __name__ == "__main__":
    main()
