"""Does a second run of the same length compile again? The compiled decoder on one prompt, the same long run
repeated, before (git commit C, unpacked as `draftlab_v0` as in refactor_check.py) and now, in one process:
graphs dynamo compiled during each run and each run's tokens/s.

    python benchmarks/rerun_compiles.py --commit 9612d26 --export ensemble5=benchmarks/exports/stories260k-ensemble-boost

A run's compiled shapes follow its caches' sizes. Before ca9c66b a drafter sized its cache from the prompt (+256
slots) and doubled it during a run that outgrew it; the next run reused the grown cache from its start and met
other shapes than the first (and an SSM's feed stayed as wide as the last run left it). Greedy, batch 1.
"""

from __future__ import annotations

import time

from common import stories_base, write_result
from refactor_check import before_after_parser, old_package

PROMPT = "Once upon a time there was a little girl named Lily. She"


def runs(load, compiled_graphs, label: str, export: str, base: str, n: int, reps: int) -> list[dict]:
    decoder, tok, _ = load(export, base=base, compile=True)
    ids = tok(PROMPT).input_ids
    out, first = [], None
    for r in range(reps):
        graphs, t0 = compiled_graphs(), time.perf_counter()
        res = decoder.generate([ids], max_new_tokens=n, eos_token_id=None)
        dt = time.perf_counter() - t0
        first = first or res.tokens
        out.append({"run": r + 1, "graphs": compiled_graphs() - graphs, "seconds": round(dt, 2),
                    "tokens_per_s": round(res.new_tokens / dt, 1), "same_tokens": res.tokens == first})
        print(label, out[-1], flush=True)
    return out


def main() -> None:
    ap = before_after_parser(__doc__, "rerun_compiles")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    old_package(a.commit)
    from draftlab_v0.decode.compiled import compiled_graphs as graphs_before
    from draftlab_v0.serve.generate import load_decoder as load_before

    from draftlab.decode.compiled import compiled_graphs
    from draftlab.serve.generate import load_decoder

    label, export = a.export.split("=", 1)
    base = str(stories_base())
    sides = {"before": runs(load_before, graphs_before, "before", export, base, a.max_new_tokens, a.reps),
             "after": runs(load_decoder, compiled_graphs, "after", export, base, a.max_new_tokens, a.reps)}
    write_result(a.name, {"commit": a.commit, "export": {label: export}, "prompt": PROMPT,
                          "max_new_tokens": a.max_new_tokens, "runs": sides})


if __name__ == "__main__":
    main()
