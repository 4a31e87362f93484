"""Compile warm-up on a fresh machine and on one that has compiled before: inductor's on-disk cache.

    python benchmarks/compile_warmup.py [LABEL=DIR[@TREE] ...] [--prompts 4] [--max-new-tokens 128]

For plain decoding (draftlab's compiled loop, no drafter) and each export, two processes in turn, each one a user's
`generate --compile` session: the first with an empty cache folder (`--compile-cache`, decode.compiled.
use_compile_cache: what a fresh machine, container or cluster node has), the second with the folder the first
filled. The default exports: the boost-tuned five-SSM ensemble (benchmarks/train_ensemble.py) and random-weight
EAGLE-3 and Hydra++ heads of the stories260K recipes' shapes (written here when missing). Each process loads the
base and the drafter, then decodes --prompts held-out TinyStories prompts one by one (greedy, batch 1) on the
compiled path, then the same prompts again. Per process: seconds from its start to the first answer (the
interpreter started, torch imported, the model loaded, the first prompt's shapes compiled, its answer decoded), the
first pass's seconds (every shape the prompts meet compiled), the second pass's tokens/s (nothing left to compile),
and the graphs inductor loaded from the cache (hits) and generated and built (misses). The two processes must give
the same tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, heldout_story_prompts, stories_base, write_result
from compiled import parse_export

DEFAULT = ["ensemble5=benchmarks/exports/stories260k-ensemble-boost",
           "eagle3=benchmarks/exports/stories260k-eagle3-untrained",
           "hydra++=benchmarks/exports/stories260k-hydra++-untrained"]
# Random-weight drafters (what compiles, and how long, does not depend on the weights), written when missing.
UNTRAINED = {"stories260k-eagle3-untrained": {"type": "eagle3", "eagle": {"ttt_steps": 7, "step_decay": 0.8}},
             "stories260k-hydra++-untrained": {"type": "hydra", "num_heads": 4, "num_layers": 4,
                                               "prefix_attention": True}}


def write_untrained(path: str) -> None:
    """An UNTRAINED drafter's export at path (benchmarks/exports/NAME), the heads of the stories260K recipes."""
    import torch

    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    torch.manual_seed(0)
    base, _ = load_base(str(stories_base()), "float32")
    save_export(build_draft(UNTRAINED[Path(path).name], base), base, ROOT / path, "runs/stories260k-base")


def child(spec: str, cache: str, prompts: int, max_new_tokens: int, started: float) -> dict:
    """One session (runs in its own process, started at `started`, time.time()): load, decode the prompts twice on
    the compiled path."""
    from draftlab.decode.compiled import compile_cache_report, compiled_graphs, use_compile_cache

    use_compile_cache(cache)
    from draftlab.base import load_base
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt, load_decoder

    t0 = time.perf_counter()
    if spec == "plain":
        base, tok = load_base(str(stories_base()), "float32")
        decoder = SpeculativeDecoder(base, NoDraft(), compile=True)
    else:
        _, path, tree = parse_export(spec, None)
        decoder, tok, _ = load_decoder(path, tree=tree, compile=True)
    load_s = time.perf_counter() - t0
    ids = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(prompts)]
    tokens, seconds = [], []
    for p in ids + ids:
        t = time.perf_counter()
        r = decoder.generate([p], max_new_tokens, eos_token_id=tok.eos_token_id)
        seconds.append(time.perf_counter() - t)
        tokens.append(r.tokens[0])
        if len(seconds) == 1:
            first_answer = time.time() - started
    n = len(ids)
    return {"load_s": round(load_s, 2), "first_answer_s": round(first_answer, 2),
            "first_pass_s": round(sum(seconds[:n]), 2),
            "second_pass_tokens_per_s": round(sum(map(len, tokens[n:])) / sum(seconds[n:]), 1),
            "graphs": compiled_graphs(), "cache": {k: v for k, v in compile_cache_report().items() if k != "dir"},
            "tokens": tokens[:n], "second_pass_same": tokens[n:] == tokens[:n]}


def run_child(spec: str, cache: str, a) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", spec, "--cache", cache, "--prompts", str(a.prompts),
                          "--max-new-tokens", str(a.max_new_tokens), "--started", repr(time.time())], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{spec}: the session failed\n{out.stderr[-4000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="*", default=DEFAULT, help="LABEL=DIR[@TREE] (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--name", default="compile_warmup")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--started", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.cache, a.prompts, a.max_new_tokens, a.started)))
        return
    for spec in a.exports:
        path = parse_export(spec, None)[1]
        if Path(path).name in UNTRAINED and not (ROOT / path / "draftlab.json").is_file():
            write_untrained(path)
    methods = {}
    for spec in ["plain"] + a.exports:
        label = spec if spec == "plain" else (parse_export(spec, None)[0] or spec)
        with tempfile.TemporaryDirectory(prefix="draftlab-compile-cache-") as cache:
            cold = run_child(spec, cache, a)
            warm = run_child(spec, cache, a)
        same = cold.pop("tokens") == warm.pop("tokens")
        methods[label] = {"export": spec, "cold": cold, "warm": warm, "same_tokens": same}
        print(f"{label}: first answer {cold['first_answer_s']:.0f} s after start with an empty cache "
              f"({cold['cache']['misses']} graphs built), {warm['first_answer_s']:.0f} s with the filled one "
              f"({warm['cache']['hits']} loaded, {warm['cache']['misses']} built); same tokens: {same}", flush=True)
    write_result(a.name, {"prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "methods": methods})


if __name__ == "__main__":
    main()
