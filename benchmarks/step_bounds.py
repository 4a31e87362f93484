"""Where a compiled decoding step's time goes, and the speedup each drafter could reach if nothing but its compiled
kernels cost time.

    python benchmarks/step_bounds.py EXPORT [EXPORT ...] [--prompts 20] [--profiled-prompts 6] [--name step_bounds]

EXPORT is written as for benchmarks/compiled.py (LABEL=DIR@TREE). Greedy, batch 1, held-out TinyStories prompts,
every method on the static-shape compiled path (draftlab's plain loop and each export's drafter), warmed up first.

After a warm-up over every prompt (it compiles), each prompt goes through every method in turn:
1. timed, no profiler: wall milliseconds per step, tokens per second and accept length;
2. for the first --profiled-prompts prompts, again under torch.profiler (CPU), right after its timed run, so the
   machine's drifting speed affects both alike. Each call of a compiled function is labelled (the base's verify
   forward and the acceptance graph, or the two as one call where the step is fused, each drafter call by its
   name), and the time spent inside the compiled graphs' generated code (inductor's "## Call CompiledFxGraph"
   events: the kernels and, with the C++ wrapper, the C++ that calls them) is summed per label and step.

Per method: the step's wall time split into compiled kernels (per label) and everything else (dynamo's entry and
guards, the Python and eager tensor operations between the calls, the host copy and bookkeeping); and two bounds
against plain decoding. The kernel-only bound: tokens per second if a step cost only its kernels (accept length /
kernel ms), against plain decoding's kernel-only figure. The bound at plain's overhead (computed by tables.py): a
step costing its kernels plus plain decoding's non-kernel time per step, against plain decoding as measured; no
speculative step can pay less besides its kernels than a plain step does (one compiled call, the host copy,
emitting), so a bound at plain's overhead below a target says that no cut of overhead reaches the target with that
drafter, tree and base on this machine; only cheaper kernels, a smaller tree or a higher accept length can.

--ops: the profiled runs also record what the kernels are, per step: each matrix product, attention and top-k call
by the number of rows it multiplies (its first operand's rows; attention: its queries), and inductor's generated
kernels, with their calls per step and microseconds per call (tables.py: step_ops). The C++ wrapper hides the
calls it makes from the profiler, so this mode compiles with the Python wrapper (DRAFTLAB_CPP_WRAPPER=0): the
kernels are the same, the time between them is not, so read its wall figures beside a run without --ops.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from common import ROOT, heldout_story_prompts, write_result
from compiled import load_exports
from tables import step_bounds as render, step_ops

TARGETS = {"eagle3": 1.5, "hydra++": 1.6, "hydra": 1.6, "ssm": 1.3}  # issue 20's CPU targets vs plain


def graph_ms(prof, into: dict) -> None:
    """Add a profile's milliseconds spent in compiled graphs' generated code, per label of the enclosing compiled
    call, and the calls of each label, to into[label] = [ms, calls]."""
    for e in prof.events():
        if e.name.startswith("draftlab::"):
            into.setdefault(e.name[len("draftlab::"):], [0.0, 0])[1] += 1
        if not e.name.startswith("## Call CompiledFxGraph"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("draftlab::"):
            p = p.cpu_parent
        label = p.name[len("draftlab::"):] if p is not None else "other"
        into.setdefault(label, [0.0, 0])[0] += e.cpu_time_total / 1e3


# Extern calls of compiled graphs the --ops table breaks down by rows (the rest of a graph is generated kernels).
OPS = {"aten::mm": "matrix product", "aten::addmm": "matrix product", "aten::bmm": "batched product",
       "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::topk": "top-k", "aten::sort": "sort"}


# Where an extern call's rows are: (operand, dimension). mm: its first operand's rows; addmm: the same after the
# bias; bmm: per batch entry; attention: the queries of [B, H, T, D].
ROWS = {"aten::mm": (0, 0), "aten::addmm": (1, 0), "aten::bmm": (0, 1),
        "aten::_scaled_dot_product_flash_attention_for_cpu": (0, 2)}


def op_rows(name: str, shapes: list) -> int | None:
    """The rows an extern call multiplies (ROWS); None for calls without rows (top-k, sort)."""
    try:
        operand, dim = ROWS[name]
        return shapes[operand][dim]
    except (KeyError, IndexError):
        return None


def op_us(prof, into: dict) -> None:
    """Add a profile's extern calls (OPS, keyed by kind and rows) and generated kernels (inductor's kernel profile)
    to into[key] = [us, calls] (self time)."""
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in OPS:
            rows = op_rows(e.key, e.input_shapes)
            key = OPS[e.key] + (f", {rows} rows" if rows is not None else "")
        elif "cpp_fused" in e.key:
            key = "generated kernels"
        else:
            continue
        slot = into.setdefault(key, [0.0, 0])
        slot[0] += e.self_cpu_time_total
        slot[1] += e.count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", help="export directories of one base (LABEL=DIR@TREE)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--profiled-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--name", default="step_bounds")
    ap.add_argument("--ops", action="store_true", help="also break the kernels down by operation and rows (see above)")
    a = ap.parse_args()
    if a.ops:  # before anything compiles
        import torch._inductor.config as inductor_config

        os.environ["DRAFTLAB_CPP_WRAPPER"] = "0"
        inductor_config.cpp.enable_kernel_profile = True
    from draftlab.decode import compiled as compiled_mod
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt

    tok, meta, base, rows = load_exports(a.exports)
    eos, N = tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    decoders = {"plain": SpeculativeDecoder(base, NoDraft(), compile=True)}
    exports = {}
    for kind, e, tree, drafter, _ in rows:
        exports[kind] = e.replace(str(ROOT) + "/", "") + (f"@{tree}" if tree else "")
        decoders[kind] = SpeculativeDecoder(base, drafter, compile=True)

    # Label every compiled call (the profile attributes graph time to the label of the call it ran in).
    def label(c) -> str:
        if c.model is base:
            return "verify forward"
        name = getattr(c.model, "__qualname__", None) or type(c.model).__name__
        if name == "verify_and_keep":  # the fused verify step (docs/decoding.md)
            return "verify forward + acceptance"
        if name == "verify_keep_and_draft":  # the chained step: the drafter's commit and proposal too
            return "verify forward + acceptance + draft"
        return "acceptance" if name in ("decide", "decide_and_keep") else f"draft: {name}"

    call = compiled_mod.Compiled.__call__

    def labelled(self, *args, **kwargs):
        with torch.profiler.record_function(f"draftlab::{label(self)}"):
            return call(self, *args, **kwargs)

    run = {k: (lambda ids, d=d: d.generate([ids], N, eos_token_id=eos)) for k, d in decoders.items()}
    warm = {}
    for k, fn in run.items():  # warm-up: every prompt, so every shape the timed runs meet is compiled (decode.compare)
        t0 = time.perf_counter()
        for p in prompts:
            fn(p)
        warm[k] = round(time.perf_counter() - t0, 2)
    wall, steps, tokens, outputs = defaultdict(float), defaultdict(int), defaultdict(int), defaultdict(list)
    graphs, profiled_steps, late, ops = defaultdict(dict), defaultdict(int), defaultdict(int), defaultdict(dict)
    for i, p in enumerate(prompts):  # interleaved: each prompt through every method, timed, then profiled
        for k, fn in run.items():
            g0 = compiled_mod.compiled_graphs()
            t0 = time.perf_counter()
            r = fn(p)
            wall[k] += time.perf_counter() - t0
            late[k] += compiled_mod.compiled_graphs() - g0  # graphs compiled inside the timed loop (decode.compare)
            steps[k] += r.steps
            tokens[k] += r.new_tokens
            outputs[k].append(r.tokens[0])
            if i >= a.profiled_prompts:
                continue
            compiled_mod.Compiled.__call__ = labelled
            try:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            record_shapes=a.ops) as prof:
                    profiled_steps[k] += fn(p).steps
            finally:
                compiled_mod.Compiled.__call__ = call
            graph_ms(prof, graphs[k])
            if a.ops:
                op_us(prof, ops[k])
    profiles = {k: {g: {"kernels_ms": round(ms / profiled_steps[k], 4),
                        "calls_per_step": round(calls / profiled_steps[k], 2)}
                    for g, (ms, calls) in sorted(v.items(), key=lambda kv: -kv[1][0])} for k, v in graphs.items()}
    results = {}
    for k in run:
        step_ms = wall[k] / steps[k] * 1e3
        kernels = sum(v["kernels_ms"] for v in profiles[k].values())
        accept = tokens[k] / steps[k]
        results[k] = {"tree_size": decoders[k].drafter.max_nodes, "accept_length": round(accept, 3),
                      "tokens_per_s": round(tokens[k] / wall[k], 1), "step_ms": round(step_ms, 3),
                      "kernels_ms": round(kernels, 3), "other_ms": round(step_ms - kernels, 3),
                      "kernel_share": round(kernels / step_ms, 3), "graphs": profiles[k],
                      "bound_tokens_per_s": round(accept / kernels * 1e3, 1), "warmup_s": warm[k],
                      "identical_to_plain": outputs[k] == outputs["plain"], "graphs_compiled_timed": late[k]}
        if a.ops:
            results[k]["ops"] = {o: {"calls_per_step": round(c / profiled_steps[k], 2), "us_per_call": round(us / c, 2),
                                     "us_per_step": round(us / profiled_steps[k], 1)}
                                 for o, (us, c) in sorted(ops[k].items(), key=lambda kv: -kv[1][0])}
    plain = results["plain"]
    for k, r in results.items():
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
        r["bound_vs_plain"] = round(r["bound_tokens_per_s"] / plain["bound_tokens_per_s"], 3)
        r["target"] = TARGETS.get(k.split("-")[0])
        if r["target"]:  # the accept length at which this step's kernels alone would just reach the target
            r["accept_for_target"] = round(r["target"] * plain["bound_tokens_per_s"] * r["kernels_ms"] / 1e3, 2)
    data = write_result(a.name, {"exports": exports, "prompts": len(prompts), "profiled_prompts": a.profiled_prompts,
                          "max_new_tokens": N, "base": meta["base"]["name_or_path"].replace(str(ROOT) + "/", ""),
                          "torch_threads": torch.get_num_threads(), "ops": a.ops, "methods": results})
    written = json.loads(data.read_text())  # as the docs' tables read it (write_result adds the machine and date)
    print()
    render(print, written)
    if a.ops:
        print()
        step_ops(print, written)


if __name__ == "__main__":
    main()
