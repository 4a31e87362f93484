"""Compiled shapes of a long eval: how many variants of each compiled function an `eval mt-bench --compile` of
long turns makes, before (git commit C, unpacked as `draftlab_v0` as in refactor_check.py) and now, each side in a
process of its own (the model classes' forwards are code objects both sides would share).

    python benchmarks/compile_shapes.py --commit eefe41e \
        --export ensemble5=benchmarks/exports/stories260k-ensemble-boost

dynamo keeps at most `recompile_limit` variants of one code object (draftlab raises torch's 8 to 64), and a call
of a shape past that runs eagerly; every variant costs a compile (seconds with inductor, more on a GPU with CUDA
graphs). A compiled call's shapes follow the sizes of the buffers it reads: the base's static cache (and the
attention windows used with it), a drafter's caches. Each side runs the eval on stories260K with its context raised
to 4,096 positions (a copy of the base whose config says so; its RoPE needs nothing else), greedy, batch 1, the
first --questions questions, two turns each, through the `eager` torch.compile backend: dynamo traces and
guards as with inductor, so the variants are the same, without inductor's code generation (minutes per side
instead of an hour). The figures: dynamo's cache entries per compiled code object after the run (what its limit
counts), the graphs compiled in all, and the eval's own summary (turns during which something compiled).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, stories_base, write_result
from refactor_check import before_after_parser, old_package

CONTEXT = 4096


def long_base() -> str:
    """stories260K with max_position_embeddings = CONTEXT, in a temporary directory."""
    out = Path(tempfile.mkdtemp(prefix="stories260k-long-")) / "base"
    shutil.copytree(stories_base(), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = CONTEXT
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def variants(compiled_cls) -> dict:
    """Dynamo's cache entries per code object that `compiled_cls` objects (decode.compiled.Compiled) compiled."""
    import torch
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    out = {}
    for c in gc.get_objects():
        try:
            ours = isinstance(c, compiled_cls) and c.calls
        except ReferenceError:  # (a dead weak proxy)
            continue
        if not ours:
            continue
        fn = c.model
        if isinstance(fn, torch.nn.Module):
            code, name = type(fn).forward.__code__, f"{type(fn).__name__}.forward"
        else:
            code, name = getattr(fn, "__func__", fn).__code__, fn.__qualname__
        out[name] = max(out.get(name, 0), len(entries(code)))
    return dict(sorted(out.items()))


def side(label: str, run_mt_bench, compiled_cls, compiled_graphs, export: str, base: str, questions: int,
         max_new: int) -> dict:
    out = tempfile.mkdtemp(prefix=f"compile-shapes-{label}-")
    graphs, t0 = compiled_graphs(), time.perf_counter()
    summary = run_mt_bench(export, str(ROOT / "data/mt_bench/question.jsonl"), out, base=base, compile=True,
                           max_new_tokens=max_new, limit=questions, overwrite=True, progress=False, plots=False)
    o = summary["overall"]
    return {"variants": variants(compiled_cls), "graphs": compiled_graphs() - graphs,
            "wall_s": round(time.perf_counter() - t0, 1), "turns": o["turns"],
            "turns_compiled": o.get("turns_compiled", 0),  # (absent from the summary when no turn compiled)
            "compile_s": o.get("compile_s", 0.0), "identical_share": o["identical_share"]}


def main() -> None:
    ap = before_after_parser(__doc__, "compile_shapes")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--side", choices=("before", "after"), help=argparse.SUPPRESS)  # (one side, in its process)
    ap.add_argument("--base", help=argparse.SUPPRESS)
    a = ap.parse_args()
    label, export = a.export.split("=", 1)
    if a.side is None:
        base, sides = long_base(), {}
        for name in ("before", "after"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--side", name, "--base", base]
            lines = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()
            sides[name] = json.loads(lines[-1])
            print(name, sides[name], flush=True)
        write_result(a.name, {"commit": a.commit, "export": {label: export}, "context": CONTEXT,
                              "questions": a.questions, "max_new_tokens": a.max_new_tokens, "backend": "eager",
                              "sides": sides})
        return
    os.environ["DRAFTLAB_COMPILE_BACKEND"] = "eager"  # compile=True: tracing and guards without code generation
    if a.side == "before":
        old_package(a.commit)
        from draftlab_v0.decode.compiled import Compiled, compiled_graphs
        from draftlab_v0.eval.mt_bench import run_mt_bench
    else:
        from draftlab.decode.compiled import Compiled, compiled_graphs
        from draftlab.eval.mt_bench import run_mt_bench
    res = side(a.side, run_mt_bench, Compiled, compiled_graphs, export, a.base, a.questions, a.max_new_tokens)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
