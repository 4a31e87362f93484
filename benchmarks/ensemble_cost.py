"""The ensemble's cost schedule on a CPU: does a 5-member ensemble decode at least as fast as its best member?

Greedy, batch 1, held-out TinyStories prompts, every method compiled (draftlab's static-shape path), in one process,
prompt by prompt, interleaved, after a warm-up over every prompt (decode.compare; the warm-up compiles, and the
schedules learn there too: their state carries over from run to run, as in a server):
- draftlab's compiled plain loop;
- each member of the boost-tuned 5-member ensemble alone (its export's default tree);
- the ensemble as exported (merged trees; the default `gain` schedule; members drafting as one grouped model);
- the same ensemble with `policy=cost` (drafting with the k members of highest gain, k chosen by measured tokens per
  second; one member drafting alone is verified alone and chains).

Then, after the timed comparison: the steps each prompt would take decoded by the member that took the fewest on it
(chosen in hindsight: the ceiling of choosing one member per prompt), and one more pass of each member and of the
cost schedule over the prompts with every step timed by its kind (a prompt's first step, members drafting, chained
or not): where the cost schedule's time goes against its members'.

    python benchmarks/ensemble_cost.py [--prompts 20] [--name ensemble_cost] [--only METHOD ...] [--option NAME=VALUE]
        [--alt-option NAME=VALUE]

--only keeps some of the methods (plain, member1..member5, ensemble_gain, ensemble_cost; plain and
ensemble_cost_alt always run): fewer decoders in the process. --option sets a cost-schedule option (repeatable;
e.g. probe_max=1024). --alt-option adds the method ensemble_cost_alt, the cost schedule with these options instead
(repeatable): two settings interleaved in one run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from common import EXPORTS, heldout_story_prompts, write_result
from decode import compare
from tables import ensemble_cost as render


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", default=str(EXPORTS / "stories260k-ensemble-boost"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--name", default="ensemble_cost")
    ap.add_argument("--only", nargs="*", default=None, help="the methods to run (plain always runs)")
    ap.add_argument("--option", action="append", default=[], help="a cost-schedule option NAME=VALUE")
    ap.add_argument("--alt-option", action="append", default=[],
                    help="a cost-schedule option NAME=VALUE of a second cost-schedule ensemble (ensemble_cost_alt)")
    a = ap.parse_args()
    from draftlab.base import load_base
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.drafters import kind_of
    from draftlab.interop.export import load_export, read_meta
    from draftlab.serve.generate import encode_prompt

    meta = read_meta(a.export)
    base, tok = load_base(meta["base"]["name_or_path"], "float32")
    module = load_export(a.export, base=base)[0]
    eos, N = tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    ensemble = kind_of("ensemble")
    drafters = {"plain": NoDraft()}
    for i, m in enumerate(module.members):
        drafters[f"member{i + 1}"] = kind_of(m.kind).drafter(m, kind_of(m.kind).default_tree(m))
    drafters["ensemble_gain"] = ensemble.drafter(module, None)
    options = dict(o.split("=", 1) for o in a.option)
    drafters["ensemble_cost"] = ensemble.drafter(module, None, options={"policy": "cost", **options})
    alt = dict(o.split("=", 1) for o in a.alt_option)
    if alt:
        drafters["ensemble_cost_alt"] = ensemble.drafter(module, None, options={"policy": "cost", **alt})
    if a.only:
        drafters = {k: d for k, d in drafters.items() if k in ("plain", "ensemble_cost_alt") or k in a.only}
    warmup_s, methods, decoders = {}, {}, {}
    for name, drafter in drafters.items():
        dec = decoders[name] = SpeculativeDecoder(base, drafter, compile=True)

        def run(ids, dec=dec, name=name):
            t0 = time.perf_counter()
            out = dec.generate([ids], N, eos_token_id=eos)
            warmup_s.setdefault(name, round(time.perf_counter() - t0, 2))  # the first call: compiling
            return out
        methods[name] = run
    results = compare(methods, prompts, reference="plain", per_prompt=True)
    members = [k for k in results if k.startswith("member")]
    best = max(members, key=lambda k: results[k]["tokens_per_s"])
    # The ceiling of choosing one member per prompt: each prompt decoded by the member that took the fewest steps on
    # it, chosen in hindsight (and for free).
    hindsight = sum(min(results[k]["steps_per_prompt"][i] for k in members) for i in range(len(prompts)))
    for k, r in results.items():
        r["tree_size"] = drafters[k].max_nodes if k != "plain" else 1
        r["warmup_s"] = warmup_s[k]
        r["vs_best_member"] = round(r["tokens_per_s"] / results[best]["tokens_per_s"], 3)
    # Where the cost schedule's time goes against its members': one more pass each, every step timed by its kind.
    by_kind = {k: step_kinds(decoders[k], prompts, N, eos) for k in members + ["ensemble_cost"] if k in decoders}
    schedules = {k: summary(drafters[k]) for k in ("ensemble_cost", "ensemble_cost_alt") if k in drafters}
    data = write_result(a.name, {"export": str(a.export).split("benchmarks/")[-1], "prompts": len(prompts),
                                 "max_new_tokens": N, "only": a.only, "options": options,
                                 **({"alt_options": alt} if alt else {}), "best_member": best,
                                 "best_member_per_prompt": {"steps": hindsight,
                                                            "best_member_steps": results[best]["steps"]},
                                 "methods": results, "steps_by_kind": by_kind,
                                 "cost_schedule": schedules["ensemble_cost"],
                                 **({"cost_schedule_alt": schedules["ensemble_cost_alt"]} if alt else {})})
    print()
    render(print, json.loads(data.read_text()))


def step_kinds(dec, prompts: list, n: int, eos: int) -> dict:
    """One pass of dec over the prompts with each decoding step timed (from the end of one step's commit to the end of
    the next) and labelled by its kind: a prompt's first step (its time holds the first proposal; the ensemble's
    member also begins there, with its prefill), then for an ensemble the members that drafted, chained or not (one
    call verified and drafted the next step), for a lone drafter whether it chained; and the rest of each call (the
    prefill with the drafter's begin, the last step). -> {kind: {steps, ms}} (the rest: steps counts the calls)."""
    from draftlab.drafters.ensemble import EnsembleDrafter

    drafter, rows, last = dec.drafter, [], [None, None]  # last: the previous step's end, a prompt's first step next

    def kind_now() -> str | None:  # the step's members, read before its commit (a chained one plans the next step)
        if last[1]:
            return "a prompt's first step"
        if isinstance(drafter, EnsembleDrafter):
            k = sum(drafter.on)
            return f"{k} member{'s' if k > 1 else ''} drafting"
        return None

    def mark(kind: str | None, chained: bool) -> None:
        now = time.perf_counter()
        if kind is None:
            kind = "chained" if chained else "not chained"
        elif chained and not last[1]:
            kind += ", chained"
        rows.append((kind, now - last[0]))
        last[:] = [now, False]

    def begin(*args, _begin=drafter.begin):
        _begin(*args)
        last[:] = [time.perf_counter(), True]

    def commit(step, _commit=drafter.commit):
        kind = kind_now()
        out = _commit(step)
        mark(kind, False)
        return out

    def chained(step, _chained=drafter.chained):
        kind = kind_now()
        out = _chained(step)
        mark(kind, True)
        return out

    drafter.begin, drafter.commit, drafter.chained = begin, commit, chained  # this pass only
    try:
        for ids in prompts:
            t0, steps = time.perf_counter(), len(rows)
            dec.generate([ids], n, eos_token_id=eos)
            rows.append(("the rest of each call (prefill and begin, the last step)",
                         time.perf_counter() - t0 - sum(dt for _, dt in rows[steps:])))
    finally:
        del drafter.begin, drafter.commit, drafter.chained
    out: dict = {}
    for kind, dt in rows:
        r = out.setdefault(kind, {"steps": 0, "ms": 0.0})
        r["steps"] += 1
        r["ms"] += 1e3 * dt
    return {k: {"steps": r["steps"], "ms": round(r["ms"], 2)}
            for k, r in sorted(out.items(), key=lambda kv: -kv[1]["ms"])}


def summary(drafter) -> dict:
    """What a cost-schedule ensemble did over the run (warm-up included)."""
    sched = drafter.scheduler
    counts = Counter(sum(on) for on in sched.history)
    return {"members_drafting_per_step": {str(k): counts[k] for k in sorted(counts)},
            "steps": len(sched.history), "final_choice": sched.k,
            "step_ms_by_members": {str(k): round(1e3 * min(t), 3) for k, t in enumerate(sched.seconds) if t},
            "ranking": [drafter.names[m] for m in sched.order]}


if __name__ == "__main__":
    main()
