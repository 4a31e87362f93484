"""Greedy decoding speed on stories260K: draftlab (Medusa heads, several trees) vs plain HF generate vs
HF prompt-lookup decoding, on 50 held-out TinyStories prompts x 128 new tokens.

    python benchmarks/train_heads.py && python benchmarks/decode.py

All methods run in the same process, prompt by prompt, interleaved, after a warm-up.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import EXPORTS, ROOT, heldout_story_prompts, write_result


def hf_method(base, eos: int, n: int, **kw):
    """Plain (or assisted) HF generate of one prompt, cut after EOS."""
    def run(ids):
        x = torch.tensor([ids], device=base.device)
        out = base.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                            temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=eos, **kw)
        gen = out[0, len(ids):].tolist()
        return gen[: gen.index(eos) + 1] if eos in gen else gen
    return run


def draftlab_method(decoder, eos: int, n: int, sampling=None, seed: int = 0):
    """draftlab's decoder on one prompt: greedy, or with `sampling` from a generator seeded alike for every prompt."""
    if sampling is None:
        return lambda ids: decoder.generate([ids], n, eos_token_id=eos)
    return lambda ids: decoder.generate([ids], n, eos_token_id=eos, sampling=sampling,
                                        generator=torch.Generator(device=decoder.base.device).manual_seed(seed))


def compare(methods: dict, prompts: list[list[int]], reference: str = "hf_generate",
            references: dict | None = None, per_prompt: bool = False) -> dict:
    """Run every method on every prompt (interleaved, after a warm-up); figures per method. Speedup and identity
    are against `reference`, or for the methods named in `references` against the method given there (a method
    that decodes another base, e.g. Medusa-2's adapted one; references must come first in `methods`). per_prompt:
    also each method's verification steps per prompt (steps_per_prompt, in prompt order)."""
    references = references or {}
    # The warm-up decodes every prompt in full: a compiled method's shapes (its static cache's size bucket, a drafter
    # cache's growth) follow the prompt's length and the number of steps the run takes, and a shape first met inside
    # the timed loop would put its compile time there, on whichever method meets it first (methods share dynamo's
    # compiled variants of one model). It once warmed up on 8 tokens of the first prompt, which missed the 512-slot
    # cache of 60-node trees, then on the shortest and the longest prompt, which missed the draft caches that grow
    # with a run's steps (EAGLE-3's, DFlash's: a cold compile of EAGLE-3's drafting graph inside the timed loop cost
    # it 30 ms per step). The compile time stays reported, as each method's warm-up.
    # A graph compiled inside the timed loop all the same (a shape the warm-up did not meet: one that depends on
    # where an adaptive schedule's probes fall, say) is counted per method, and the tables say so.
    from draftlab.decode.compiled import compiled_graphs

    for fn in methods.values():
        for ids in prompts:
            fn(ids)
    stats = {m: {"tokens": 0, "time_s": 0.0, "steps": 0, "committed": 0, "split": {}, "identical": 0, "compiled": 0,
                 "per_prompt": []} for m in methods}
    for ids in prompts:
        got = {}
        for m, fn in methods.items():
            graphs = compiled_graphs()
            t0 = time.perf_counter()
            out = fn(ids)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            s = stats[m]
            s["time_s"] += time.perf_counter() - t0
            s["compiled"] += compiled_graphs() - graphs
            toks = out if isinstance(out, list) else out.tokens[0]
            if not isinstance(out, list):
                s["steps"] += out.steps  # verification forwards (the prefill is not one)
                s["per_prompt"].append(out.steps)
                s["committed"] += sum(out.committed)  # tokens those forwards committed, bonus included
                for k, v in out.time_s.items():
                    s["split"][k] = s["split"].get(k, 0.0) + v
            got[m] = toks
            s["tokens"] += len(toks)
            s["identical"] += int(toks == got.get(references.get(m, reference)))
    out = {}
    for m, s in stats.items():
        tps = s["tokens"] / s["time_s"]
        ref = stats[references.get(m, reference)]
        r = {"tokens_per_s": round(tps, 1), "speedup": round(tps / (ref["tokens"] / ref["time_s"]), 3),
             "new_tokens": s["tokens"], "identical_to_baseline": s["identical"] == len(prompts),
             "graphs_compiled_timed": s["compiled"]}
        if m in references:
            r["baseline"] = references[m]
        if s["steps"]:
            r["steps"] = s["steps"]
            r["accept_length"] = round(s["committed"] / s["steps"], 3)  # as Result.accept_length
            r["ms_per_step"] = {k: round(1000 * v / s["steps"], 3) for k, v in s["split"].items()
                                if k != "prefill"}
            # the whole run but its prefill, per step (the phases less what lies between them)
            r["loop_ms_per_step"] = round(1000 * (s["time_s"] - s["split"].get("prefill", 0.0)) / s["steps"], 3)
            if per_prompt:
                r["steps_per_prompt"] = s["per_prompt"]
        out[m] = r
    return out


def print_table(results: dict) -> None:
    print("\n| method | tree size | accept length | tokens/s | speedup | identical | draft/verify/accept ms per step |")
    print("|---|---|---|---|---|---|---|")
    for m, r in results.items():
        split = "/".join(f"{v:.2f}" for v in r.get("ms_per_step", {}).values()) or "-"
        print(f"| {m} | {r.get('tree_size', '-')} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {split} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--export", default=str(EXPORTS / "stories260k-medusa"))
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trees", nargs="*", default=["chain", "default"], help="'chain', 'default', or tree files")
    ap.add_argument("--name", default="decode")
    a = ap.parse_args()
    from draftlab.serve.generate import encode_prompt, load_decoder, resolve_tree
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.drafters import make_drafter
    from draftlab.interop.export import load_export

    decoder, tok, meta = load_decoder(a.export)
    base, eos, N = decoder.base, tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    methods = {"hf_generate": hf_method(base, eos, N), "hf_prompt_lookup": hf_method(base, eos, N, prompt_lookup_num_tokens=4)}
    sizes = {}
    draft, _ = load_export(a.export, base=base, device=decoder.device)
    for t in a.trees:
        dec = SpeculativeDecoder(base, make_drafter(draft, resolve_tree(t, meta)))
        methods[f"draftlab_{t}"] = draftlab_method(dec, eos, N)
        sizes[f"draftlab_{t}"] = dec.drafter.max_nodes
    results = compare(methods, prompts)
    for m, size in sizes.items():
        results[m]["tree_size"] = size
    print_table(results)
    write_result(a.name, {"export": a.export.replace(str(ROOT) + "/", ""), "prompts": len(prompts), "max_new_tokens": N,
                          "base": meta["base"]["name_or_path"].replace(str(ROOT) + "/", ""), "methods": results})


if __name__ == "__main__":
    main()
