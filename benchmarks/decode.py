"""Greedy decoding speed on stories260K: draftlab (Medusa heads, several trees) vs plain HF generate vs
HF prompt-lookup decoding, on 50 held-out TinyStories prompts x 128 new tokens.

    python benchmarks/train_heads.py && python benchmarks/decode.py

All methods run in the same process, prompt by prompt, interleaved, after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import EXPORTS, ROOT, heldout_story_prompts, write_result


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--export", default=str(EXPORTS / "stories260k-medusa"))
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trees", nargs="*", default=["chain", "default"], help="'chain', 'default', or tree files")
    ap.add_argument("--name", default="decode")
    a = ap.parse_args()
    from draftlab.decode.cli import encode_prompt, load_decoder, resolve_tree
    from draftlab.decode.decoder import SpeculativeDecoder

    decoder, tok, meta = load_decoder(a.export)
    base = decoder.base
    eos = tok.eos_token_id
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    decoders = {t: SpeculativeDecoder(base, decoder.draft, resolve_tree(t, meta)) for t in a.trees}
    N = a.max_new_tokens

    def hf(ids, **kw):
        x = torch.tensor([ids])
        out = base.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                            temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=eos, **kw)
        gen = out[0, len(ids):].tolist()
        return gen[: gen.index(eos) + 1] if eos in gen else gen

    methods = {"hf_generate": lambda ids: hf(ids),
               "hf_prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=4)}
    for name, dec in decoders.items():
        methods[f"draftlab_{name}"] = (lambda d: lambda ids: d.generate([ids], N, eos_token_id=eos))(dec)
    for fn in methods.values():  # warm-up
        fn(prompts[0][:8])

    stats = {m: {"tokens": 0, "time_s": 0.0, "steps": 0, "committed": 0, "split": {}, "identical": 0} for m in methods}
    refs = []
    for ids in prompts:
        ref = None
        for m, fn in methods.items():
            out, dt = timed(lambda: fn(ids))
            s = stats[m]
            s["time_s"] += dt
            if m.startswith("draftlab"):
                toks = out.tokens[0]
                s["steps"] += out.steps + 1  # the prefill forward commits the first token
                s["committed"] += len(toks)
                for k, v in out.time_s.items():
                    s["split"][k] = s["split"].get(k, 0.0) + v
            else:
                toks = out
            if m == "hf_generate":
                ref = toks
            s["tokens"] += len(toks)
            s["identical"] += int(toks == ref)
        refs.append(ref)

    base_tps = stats["hf_generate"]["tokens"] / stats["hf_generate"]["time_s"]
    result = {"export": a.export.replace(str(ROOT) + "/", ""), "prompts": len(prompts), "max_new_tokens": N,
              "base": meta["base"]["name_or_path"].replace(str(ROOT) + "/", ""), "methods": {}}
    print(f"\n| method | tree size | accept length | tokens/s | speedup | identical | draft/verify/accept ms per step |")
    print("|---|---|---|---|---|---|---|")
    for m, s in stats.items():
        tps = s["tokens"] / s["time_s"]
        r = {"tokens_per_s": round(tps, 1), "speedup": round(tps / base_tps, 3), "new_tokens": s["tokens"],
             "identical_to_baseline": s["identical"] == len(prompts)}
        if m.startswith("draftlab"):
            steps = s["steps"] - len(prompts)
            r["accept_length"] = round(s["committed"] / s["steps"], 3)
            r["tree_size"] = decoders[m.removeprefix("draftlab_")].tree.size
            r["ms_per_step"] = {k: round(1000 * v / max(steps, 1), 3) for k, v in s["split"].items() if k != "prefill"}
        result["methods"][m] = r
        split = "/".join(f"{v:.2f}" for v in r.get("ms_per_step", {}).values()) or "-"
        print(f"| {m} | {r.get('tree_size', '-')} | {r.get('accept_length', '-')} | {tps:.1f} | {r['speedup']:.2f}x "
              f"| {r['identical_to_baseline']} | {split} |")
    write_result(a.name, result)


if __name__ == "__main__":
    main()
