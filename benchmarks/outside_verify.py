"""Issue 20's first CPU target: each drafter kind's time per step outside the base's verify forward, against that
forward (the target: at most 50% of it), on the compiled path where a drafter's work may share the verify's call.

    python benchmarks/outside_verify.py EXPORT [EXPORT ...] [--prompts 20] [--max-new-tokens 128]
        [--ensemble-option LABEL:NAME=VALUE] [--name outside_verify]

EXPORT as in benchmarks/compiled.py (LABEL=DIR@TREE; DIR `lookup` is prompt lookup on the first export's base).
--ensemble-option sets an option of the ensemble export labelled LABEL (repeatable), so one run can hold an ensemble
under two schedules (e.g. ens=DIR ens-cost=DIR --ensemble-option ens-cost:policy=cost).

Greedy, batch 1, held-out TinyStories prompts, on the static-shape compiled path, every method on every prompt,
interleaved after a warm-up (decode.compare). Each drafter runs two ways on one base object and one drafter object
(a schedule's state is shared by the two):
- as draftlab decodes by default (LABEL): the verification in one call (the base's forward over the tree, the
  acceptance rule, keeping the accepted path in the KV cache) and, for drafters that chain, their commit and next
  proposal in that same call;
- unchained (LABEL_unchained, SpeculativeDecoder(chained=False)): the same verification call without the drafter in
  it; the drafter's commit and proposal in calls of their own.
Greedy, both ways verify the same trees at the same widths and positions step for step, so the unchained way's verify
phase per step is the verification as plain decoding pays it, at this drafter's tree width: the base's forward with
the acceptance rule and the keep (a few kernels of microseconds) in one call. Per method: step ms (the default way's
whole run less its prefill, per step: its phases and what lies between them, e.g. padding a proposal to the tree's
width), the verification's ms,
outside = step - verification, and outside / verification. Plain decoding (no drafter) is the floor: its outside is
the host copy of the step's tokens and emitting them.
"""

from __future__ import annotations

import argparse
import json

import torch

from common import ROOT, heldout_story_prompts, write_result
from compiled import load_exports
from decode import compare
from tables import outside_verify as render

TARGET = 0.5  # issue 20: time per step outside the verify forward at most 50% of the forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", help="export directories of one base (LABEL=DIR@TREE)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ensemble-option", action="append", default=[], metavar="LABEL:NAME=VALUE",
                    help="an option of the ensemble export labelled LABEL")
    ap.add_argument("--name", default="outside_verify")
    a = ap.parse_args()
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt

    options: dict = {}
    for o in a.ensemble_option:
        label, _, nv = o.partition(":")
        name, _, value = nv.partition("=")
        if not (label and name and value):
            raise SystemExit(f"--ensemble-option {o!r}: write LABEL:NAME=VALUE")
        options.setdefault(label, {"options": {}})["options"][name] = value
    tok, meta, base, rows = load_exports(a.exports, options=options)
    eos, N = tok.eos_token_id, a.max_new_tokens
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.prompts)]
    methods, sizes, exports = {}, {}, {}

    def add(label, drafter, ways=((None, ""), (False, "_unchained"))):
        for chained, suffix in ways:
            dec = SpeculativeDecoder(base, drafter, compile=True, chained=chained)
            methods[label + suffix] = lambda ids, dec=dec: dec.generate([ids], N, eos_token_id=eos)
            sizes[label + suffix] = drafter.max_nodes

    add("plain", NoDraft(), ways=((None, ""),))  # nothing to chain
    for kind, path, tree, drafter, _ in rows:
        exports[kind] = path.replace(str(ROOT) + "/", "") + (f"@{tree}" if tree else "")
        add(kind, drafter)
    results = compare(methods, prompts, reference="plain")
    out = {}
    for label in ["plain", *exports]:
        own, apart = results[label], results.get(f"{label}_unchained", results[label])
        step = own["loop_ms_per_step"]
        verify = apart["ms_per_step"]["verify"]
        out[label] = {"tree_size": sizes[label], "accept_length": own["accept_length"],
                      "tokens_per_s": own["tokens_per_s"], "unchained_tokens_per_s": apart["tokens_per_s"],
                      "identical_to_plain": own["identical_to_baseline"] and apart["identical_to_baseline"],
                      "same_steps": own["steps"] == apart["steps"], "step_ms": round(step, 3),
                      "phases_ms": own["ms_per_step"], "unchained_phases_ms": apart["ms_per_step"],
                      "verify_ms": verify, "outside_ms": round(step - verify, 3),
                      "outside_share": round((step - verify) / verify, 3),
                      "graphs_compiled_timed": own["graphs_compiled_timed"]
                      + (apart["graphs_compiled_timed"] if apart is not own else 0)}
    data = write_result(a.name, {"exports": exports, "ensemble_options": {k: v["options"] for k, v in options.items()},
                                 "base": meta["base"]["name_or_path"].replace(str(ROOT) + "/", ""),
                                 "prompts": len(prompts), "max_new_tokens": N, "target": TARGET,
                                 "torch_threads": torch.get_num_threads(), "methods": out})
    print()
    render(print, json.loads(data.read_text()))


if __name__ == "__main__":
    main()
