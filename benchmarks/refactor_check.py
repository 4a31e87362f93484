"""The drafter interface must not slow the heads down: the decoder as it was before it (git commit 39ef22b,
unpacked from git and imported as the package `draftlab_v0`) and as it is now, on the same exports, base
object, prompts and tree, in one process, prompt by prompt, interleaved (plus plain HF generate).

    python benchmarks/train_heads.py ...   # the three exports (see README)
    python benchmarks/refactor_check.py
    python benchmarks/refactor_check.py --commit C --export medusa=runs/x/export --export eagle3=...  # any exports
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--commit", default=BEFORE)
    ap.add_argument("--name", default="refactor_check", help="results/NAME.json")
    ap.add_argument("--export", action="append", default=[], metavar="LABEL=DIR",
                    help="exports to compare (default: the three of benchmarks/train_heads.py)")
    a = ap.parse_args()
    old_package(a.commit)
    try:
        from draftlab_v0.serve.generate import load_decoder as load_before
    except ImportError:  # before the layout move it was decode/generate.py, at 39ef22b decode/cli.py
        try:
            from draftlab_v0.decode.generate import load_decoder as load_before
        except ImportError:
            from draftlab_v0.decode.cli import load_decoder as load_before

    from draftlab.serve.generate import encode_prompt, load_decoder

    methods, base, tok = {}, None, None
    pairs = {}
    exports = dict(e.split("=", 1) for e in a.export) or {k: str(EXPORTS / n) for k, n in STORIES_EXPORTS.items()}
    for kind, path in exports.items():
        after, tok, _ = load_decoder(path)
        before, _, _ = load_before(path)
        base = base or after.base
        after.base = before.base = base  # one base object: every method runs the same weights
        pairs[kind] = (before, after)
    eos, N = tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    methods["hf_generate"] = hf_method(base, eos, N)
    for kind, (before, after) in pairs.items():
        methods[f"{kind}_before"] = draftlab_method(before, eos, N)
        methods[f"{kind}_after"] = draftlab_method(after, eos, N)
    results = compare(methods, prompts)
    print_table(results)
    ratio = {k: round(results[f"{k}_after"]["tokens_per_s"] / results[f"{k}_before"]["tokens_per_s"], 3)
             for k in pairs}
    same = {k: results[f"{k}_after"]["accept_length"] == results[f"{k}_before"]["accept_length"] for k in pairs}
    print(f"tokens/s after / before: {ratio}; accept length unchanged: {same}")
    write_result(a.name, {"before": a.commit, "prompts": len(prompts), "max_new_tokens": N,
                                    "methods": results, "after_over_before": ratio, "same_accept_length": same})


if __name__ == "__main__":
    main()
