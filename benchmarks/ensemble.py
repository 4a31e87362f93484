"""SSM ensembles on stories260K, greedy unless said otherwise, held-out TinyStories prompts, all methods in one
process, prompt by prompt, interleaved, after a warm-up:

1. tau and tokens/s of ensembles of 1, 2, 3 and 5 members, merged trees (SpecInfer; chains of 3 per member,
   32-token budget) and weighted-majority vote (Minions; chains of 3), boost-tuned vs independently trained
   members of the same compute, against every member alone;
2. adaptive speculation length (vote mode, one member) against every fixed length;
3. the scheduler's effect when one member is deliberately bad (an untrained SSM);
4. the share of step time the ensemble's own bookkeeping (merging, voting, weights, schedule) takes;
5. one sampled run (temperature 0.8): tau and tokens/s against plain HF sampling;
6. members drafting as one grouped model (the default) against one by one, eager and compiled, next to the best
   member alone and draftlab's compiled plain loop (compile warm-up reported).

    python benchmarks/train_ensemble.py && python benchmarks/ensemble.py
"""

from __future__ import annotations

import argparse
import time

import torch

from common import EXPORTS, RESULTS, heldout_story_prompts, write_result
from decode import compare, hf_method

SIZES = (1, 2, 3, 5)


def run_decoder(decoder, eos: int, n: int):
    return lambda ids: decoder.generate([ids], n, eos_token_id=eos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chain", type=int, default=3)
    a = ap.parse_args()
    from draftlab.base import load_base
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt, plain_generate
    from draftlab.decode.tree import Tree
    from draftlab.drafters import build_draft
    from draftlab.drafters.ensemble import AdaptiveLength, EnsembleDrafter, Scheduler
    from draftlab.drafters.ssm import SSMDrafter
    from draftlab.interop.export import load_export, read_meta

    meta = read_meta(EXPORTS / "stories260k-ensemble-boost")
    base, tok = load_base(meta["base"]["name_or_path"], "float32")
    ens = {name: load_export(EXPORTS / f"stories260k-ensemble-{name}", base=base)[0].members
           for name in ("boost", "independent")}
    eos, N, c = tok.eos_token_id, a.max_new_tokens, a.chain
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    chain = lambda ms: [SSMDrafter(m.lm, Tree.chain(c)) for m in ms]
    drafters = {}

    warmup_s = {}

    def method(name, drafter, compile=False):
        drafters[name] = drafter
        run, warm = run_decoder(SpeculativeDecoder(base, drafter, compile=compile), eos, N), []

        def timed(ids):
            t0 = time.perf_counter()
            out = run(ids)
            if not warm:  # compare() warms every method up first (compiling, for compiled ones)
                warmup_s[name] = round(time.perf_counter() - t0, 2)
                if isinstance(drafter, EnsembleDrafter):
                    drafter.time_s = {k: 0.0 for k in drafter.time_s}
            warm.append(True)
            return out
        return timed

    # 1. Ensemble sizes, modes and training.
    methods = {"hf_generate": hf_method(base, eos, N)}
    for name, members in ens.items():
        for i, m in enumerate(members):
            methods[f"{name}_member{i + 1}"] = method(f"{name}_member{i + 1}", chain([m])[0])
        for size in SIZES[1:]:
            methods[f"{name}_merge{size}"] = method(f"{name}_merge{size}", EnsembleDrafter(
                chain(members[:size]), mode="merge", node_budget=32))
            methods[f"{name}_vote{size}"] = method(f"{name}_vote{size}", EnsembleDrafter(
                chain(members[:size]), mode="vote", length=c))
    # 2. Adaptive length against every fixed length (vote mode over one member = a chain of s).
    best = ens["boost"][0]
    lengths = (1, 2, 3, 4, 5, 6, 8)
    for s in lengths:
        methods[f"fixed{s}"] = method(f"fixed{s}", EnsembleDrafter(chain([best]), mode="vote", length=s))
    adaptive = AdaptiveLength(s=4)
    methods["adaptive"] = method("adaptive", EnsembleDrafter(chain([best]), mode="vote", adaptive=adaptive))
    # 3. A deliberately bad member (an untrained SSM), with and without the scheduler.
    torch.manual_seed(0)
    bad = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "random"}}, base).eval()
    sched = Scheduler()
    methods["good_alone"] = method("good_alone", chain([best])[0])
    methods["good+bad"] = method("good+bad", EnsembleDrafter(chain([best, bad]), mode="merge", node_budget=32))
    methods["good+bad_scheduled"] = method("good+bad_scheduled", EnsembleDrafter(
        chain([best, bad]), mode="merge", node_budget=32, scheduler=sched))
    # 6. Grouped members (the default above) against one by one, eager and compiled.
    boost = ens["boost"]
    methods["plain_compiled"] = method("plain_compiled", NoDraft(), compile=True)
    methods["boost_member1_compiled"] = method("boost_member1_compiled", chain(boost[:1])[0], compile=True)
    for mode, kw in (("merge", {"node_budget": 32}), ("vote", {"length": c})):
        for grouped, tag in ((True, ""), (False, "_one_by_one")):
            if not grouped:
                methods[f"boost_{mode}5{tag}"] = method(f"boost_{mode}5{tag}", EnsembleDrafter(
                    chain(boost), mode=mode, batch_members=False, **kw))
            methods[f"boost_{mode}5{tag}_compiled"] = method(f"boost_{mode}5{tag}_compiled", EnsembleDrafter(
                chain(boost), mode=mode, batch_members=grouped, **kw), compile=True)
    results = compare(methods, prompts)
    for k, w in warmup_s.items():
        results[k]["warmup_s"] = w
    for k, r in results.items():
        d = drafters.get(k)
        if isinstance(d, EnsembleDrafter):
            # the ensemble's own bookkeeping (merge / vote / weights / schedule) per step and as a share of the step
            per_step = 1000 * d.time_s["ensemble"] / r["steps"]
            r["ensemble_overhead_ms_per_step"] = round(per_step, 3)
            r["ensemble_overhead_share"] = round(per_step / sum(r["ms_per_step"].values()), 4)
    on = sched.history[sched.warmup:]
    sched_share = sum(h[1] for h in on) / max(1, len(on))

    # 5. One sampled run: plain HF sampling vs a single member vs the boosted 5-member merge.
    s = Sampling(temperature=0.8)
    sampled = {}
    for name, drafter in (("single", chain([best])[0]), ("boost_merge5", EnsembleDrafter(
            chain(ens["boost"]), mode="merge", node_budget=32))):
        dec = SpeculativeDecoder(base, drafter)
        g = torch.Generator().manual_seed(0)
        dec.generate(prompts[:1], 8, sampling=s, generator=g, eos_token_id=eos)
        t0, toks, committed, rows = time.perf_counter(), 0, 0, 0
        for p in prompts:
            r = dec.generate([p], N, sampling=s, generator=g, eos_token_id=eos)
            toks, committed, rows = toks + r.new_tokens, committed + sum(r.committed), rows + sum(r.rows_per_step)
        sampled[name] = {"tokens_per_s": round(toks / (time.perf_counter() - t0), 1),
                         "accept_length": round(committed / rows, 3)}
    plain, t_plain = plain_generate(base, prompts, N, s, eos)
    base_toks = sum(len(x) for x in plain)
    sampled["hf_sample"] = {"tokens_per_s": round(base_toks / t_plain, 1)}
    for v in sampled.values():
        v["speedup"] = round(v["tokens_per_s"] / sampled["hf_sample"]["tokens_per_s"], 3)

    sizes = {}
    for name in ens:
        singles = [results[f"{name}_member{i + 1}"] for i in range(len(ens[name]))]
        best_single = max(singles, key=lambda r: r["accept_length"])
        sizes[name] = {"best_single_accept_length": best_single["accept_length"],
                       "member_accept_lengths": [r["accept_length"] for r in singles],
                       "merge": {1: results[f"{name}_member1"]["accept_length"],
                                 **{size: results[f"{name}_merge{size}"]["accept_length"] for size in SIZES[1:]}},
                       "vote": {1: results[f"{name}_member1"]["accept_length"],
                                **{size: results[f"{name}_vote{size}"]["accept_length"] for size in SIZES[1:]}}}
    out = {"prompts": len(prompts), "max_new_tokens": N, "chain": c, "methods": results, "sizes": sizes,
           "fixed_lengths": {s: results[f"fixed{s}"]["tokens_per_s"] for s in lengths},
           "adaptive": {"tokens_per_s": results["adaptive"]["tokens_per_s"], "lengths": adaptive.history},
           "scheduler": {"bad_member_active_share": round(sched_share, 3)}, "sampled": sampled,
           "grouped": grouped_summary(results)}
    plots(out)
    for k, r in results.items():
        print(f"{k:24s} accept {r.get('accept_length', '-'):>6} tok/s {r['tokens_per_s']:7.1f} "
              f"speedup {r['speedup']:.2f} identical {r['identical_to_baseline']}")
    print("sampled", sampled, "scheduler", out["scheduler"])
    write_result("ensemble", out)


def grouped_summary(results: dict) -> dict:
    """Section 6: 5-member ensembles (boost-tuned) grouped vs one by one, eager and compiled, as tokens/s over the
    best member alone on the same path and over draftlab's compiled plain loop."""
    eager = [k for k in results if k.startswith("boost_member") and not k.endswith("_compiled")]
    out = {"best_member_eager": max(eager, key=lambda k: results[k]["tokens_per_s"]),
           "best_member_compiled": "boost_member1_compiled"}  # member 1 alone has the highest accept length
    for path, suffix in (("eager", ""), ("compiled", "_compiled")):
        best = results[out[f"best_member_{path}"]]
        for mode in ("merge", "vote"):
            for tag in ("", "_one_by_one"):
                r = results[f"boost_{mode}5{tag}{suffix}"]
                out[f"{mode}5{tag or '_grouped'}_{path}"] = {
                    "tokens_per_s": r["tokens_per_s"], "accept_length": r.get("accept_length"),
                    "vs_best_member": round(r["tokens_per_s"] / best["tokens_per_s"], 3),
                    "vs_plain_compiled": round(r["tokens_per_s"] / results["plain_compiled"]["tokens_per_s"], 3)}
    return out


def plots(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("boost", "-"), ("independent", "--")):
        z = out["sizes"][name]
        for mode, marker in (("merge", "o"), ("vote", "s")):
            xs = sorted(int(k) for k in z[mode])
            ax.plot(xs, [z[mode][k] for k in xs], marker=marker, ls=style, label=f"{name}, {mode}")
        ax.axhline(z["best_single_accept_length"], color="0.6", ls=style, lw=1)
    ax.set_xlabel("members")
    ax.set_ylabel("accept length (tokens per verification)")
    ax.set_title("SSM ensembles on stories260K (grey: best single member)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "ensemble_tau.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(out["adaptive"]["lengths"], lw=1)
    ax.set_xlabel("verification step (all prompts in turn)")
    ax.set_ylabel("speculation length s")
    best = max(out["fixed_lengths"], key=out["fixed_lengths"].get)
    ax.axhline(best, color="tab:red", ls="--", lw=1, label=f"fastest fixed length ({best})")
    ax.legend(fontsize=8)
    ax.set_title("adaptive speculation length (start 4)")
    fig.tight_layout()
    fig.savefig(RESULTS / "ensemble_adaptive.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
