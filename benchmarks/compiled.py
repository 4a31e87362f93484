"""Eager vs static-shape compiled decoding, next to the fastest plain decoding available in the same run.

    python benchmarks/compiled.py EXPORT [EXPORT ...] [--prompts 20] [--max-new-tokens 128]

An EXPORT may be written LABEL=DIR@TREE: LABEL names its rows (default: its kind), TREE is its --tree (default: --tree,
else the export's default). The block-drafter comparison of docs/benchmarks.md is

    python benchmarks/compiled.py medusa=runs/stories260k-medusa/export hydra++=runs/stories260k-hydra++/export \
        eagle3=runs/stories260k-eagle3/export eagle3.1=runs/stories260k-eagle31/export \
        dflash-b8=runs/stories260k-dflash/export dflash-b16=runs/stories260k-dflash-b16/export --name block_drafters

Greedy, batch 1, held-out TinyStories prompts; every method runs every prompt, interleaved, after a warm-up that
also compiles (its time is reported as warmup_s, never hidden). Methods: HF `generate` (dynamic cache), HF
`generate` with a static cache and torch.compile (where transformers can), draftlab's plain loop (a drafter that
drafts nothing) eager and compiled, and each export's drafter eager and compiled. Speedups are against HF
generate and against the fastest plain method of the run; identity is against HF generate's tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import ROOT, heldout_story_prompts, write_result
from decode import compare, hf_method


def parse_export(spec: str, tree: str | None) -> tuple[str | None, str, str | None]:
    """LABEL=DIR@TREE (label and tree optional) -> (label, dir, tree)."""
    label, _, rest = spec.rpartition("=") if "=" in spec.split("@")[0] else (None, "", spec)
    path, _, own = rest.partition("@")
    return label or None, path, own or tree


def load_exports(exports: list[str], tree: str | None = None, options: dict | None = None) -> tuple:
    """The drafters of exports of one base (each LABEL=DIR@TREE, parse_export; tree: the default TREE) on one base
    object, so every method runs the same weights: (tokenizer, first export's meta, base, rows), a row per export
    (kind: its label, else its head type; dir; tree; drafter; meta). DIR `lookup` (or `lookup:N`) is prompt lookup
    on the first export's base (not first itself); options: drafter options per label (ensembles' schedules)."""
    from draftlab.serve.generate import load_decoder

    rows, base, first = [], None, None
    for label, path, own in (parse_export(e, tree) for e in exports):
        lookup = path.split(":")[0] == "lookup"
        if lookup and first is None:
            raise ValueError("prompt lookup (lookup) decodes the first export's base: name another export first")
        own = None if lookup and own == tree else own  # (the global --tree is the exports'; lookup takes no tree)
        d, tok, m = load_decoder(path, tree=own, **({"base": first[1]["base"]["name_or_path"]} if lookup else {}),
                                 **(options or {}).get(label, {}))
        if base is None:
            base, first = d.base, (tok, m)
        else:
            d.base = base
            if hasattr(d.drafter, "m"):
                d.drafter.m.attach_base(base)
        kind = label or m["head"]["type"] + ("++" if m["head"].get("prefix_attention") else "")
        rows.append((kind, path, own, d.drafter, m))
    return (*first, base, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", help="export directories of one base")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--name", default="compiled")
    ap.add_argument("--title", default=None, help="the docs table's heading (default: Eager vs compiled decoding)")
    ap.add_argument("--no-hf-compile", action="store_true", help="skip HF generate with a static cache + compile")
    ap.add_argument("--tree", default=None, help="tree for every export (a file, e.g. from search-tree --compile)")
    a = ap.parse_args()
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt

    tok, meta, base, rows = load_exports(a.exports, a.tree)
    eos, N = tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    methods = {"hf_generate": hf_method(base, eos, N)}
    decoders = {}

    def timed(fn):
        """fn with the time of its first call (the warm-up: compilation included) recorded."""
        state = {"first": None}

        def run(ids):
            t0 = time.perf_counter()
            out = fn(ids)
            if state["first"] is None:
                state["first"] = time.perf_counter() - t0
            return out
        run.state = state
        return run

    if not a.no_hf_compile:
        # transformers compiles generate's forward by itself only on accelerators (CUDA, XPU, ...); on a CPU its
        # CompileConfig has to ask for it (the flag it documents for compiling on every device), with the default
        # mode, reduce-overhead being CUDA graphs.
        from transformers import CompileConfig

        cc = CompileConfig(mode="reduce-overhead" if base.device.type == "cuda" else "default")
        cc._compile_all_devices = True
        methods["hf_generate_static_compiled"] = timed(hf_method(base, eos, N, cache_implementation="static",
                                                                 compile_config=cc))

    def add(name, drafter, compiled):
        dec = SpeculativeDecoder(base, drafter, compile=compiled)
        decoders[name] = dec
        methods[name] = timed(lambda ids, dec=dec: dec.generate([ids], N, eos_token_id=eos))

    add("plain_eager", NoDraft(), False)
    add("plain_compiled", NoDraft(), True)
    kinds, trees, steps = {}, {}, {}
    for kind, e, tree, drafter, m in rows:
        kinds[kind], trees[kind] = e, tree
        steps[kind] = (m.get("training") or {}).get("steps")  # optimizer steps the export was trained for
        add(f"{kind}_eager", drafter, False)
        add(f"{kind}_compiled", drafter, True)
    try:
        results = compare(methods, prompts)
    except Exception as err:  # noqa: BLE001 - HF's compiled generate may not run here; the rest still can
        if "hf_generate_static_compiled" not in methods:
            raise
        print(f"HF generate with a static cache + compile failed ({type(err).__name__}: {err}); run without it")
        methods.pop("hf_generate_static_compiled")
        results = compare(methods, prompts)
        results["hf_generate_static_compiled"] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
    plain = [m for m in ("hf_generate", "hf_generate_static_compiled", "plain_eager", "plain_compiled")
             if "tokens_per_s" in results.get(m, {})]
    fastest = max(plain, key=lambda m: results[m]["tokens_per_s"])
    for m, r in results.items():
        if "tokens_per_s" not in r:
            continue
        r["speedup_vs_fastest_plain"] = round(r["tokens_per_s"] / results[fastest]["tokens_per_s"], 3)
        fn = methods.get(m)
        if fn is not None and hasattr(fn, "state"):
            r["warmup_s"] = round(fn.state["first"], 2)
        if m in decoders:
            r["tree_size"] = decoders[m].drafter.max_nodes
            r["compile_s"] = round(decoders[m].compile_s, 2)
            if decoders[m].compile_failed:
                r["compile_failed"] = decoders[m].compile_failed
    print(f"\nfastest plain decoding: {fastest}")
    print("| method | tree size | accept length | tokens/s | vs HF generate | vs fastest plain | identical | "
          "draft/verify/accept/commit ms per step | warm-up s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, r in results.items():
        if "tokens_per_s" not in r:
            print(f"| {m} | {r.get('error')} |")
            continue
        split = "/".join(f"{v:.2f}" for v in r.get("ms_per_step", {}).values()) or "-"
        print(f"| {m} | {r.get('tree_size', '-')} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['speedup_vs_fastest_plain']:.2f}x | {r['identical_to_baseline']} | {split} | "
              f"{r.get('warmup_s', '-')} |")
    write_result(a.name, {"title": a.title, "exports": {k: v.replace(str(ROOT) + "/", "") for k, v in kinds.items()},
                          "prompts": len(prompts), "max_new_tokens": N, "fastest_plain": fastest, "tree": a.tree,
                          "trees": {k: v for k, v in trees.items() if v}, "train_steps": steps,
                          "base": meta["base"]["name_or_path"].replace(str(ROOT) + "/", ""),
                          "torch_threads": torch.get_num_threads(), "methods": results})


if __name__ == "__main__":
    main()
