"""DSI as processes with emulated latencies (fixed target and drafter forward times, as the DSI authors emulate a
multi-GPU node on one machine) against SI and non-SI with the same latencies, and against `draftlab simulate`'s
expectations for the same configuration: the exact expected total of a text of that length (its end included),
DSI at the lookahead draftlab chooses (least expected latency with the SP servers, waits included).

    python benchmarks/dsi.py

The drafter is an oracle with i.i.d. acceptance: it drafts the base's greedy token with probability a (else a
wrong one), the simulator's assumption, so measured and expected times are comparable. Base: stories260K.
Each configuration runs `--runs` generations of `--tokens` tokens; reported times are means.
"""

from __future__ import annotations

import argparse
import random

from common import heldout_story_prompts, stories_base, write_result

CONFIGS = [  # target s, drafter s, acceptance, SP degree
    (0.05, 0.005, 0.8, 3), (0.05, 0.005, 0.5, 3), (0.05, 0.0125, 0.8, 2), (0.05, 0.0025, 0.9, 7)]


def oracle(prompt, ref, a, V, rng):
    def draft_next(tokens):
        i = len(tokens) - len(prompt)
        right = ref[i] if i < len(ref) else 0
        return right if tokens[len(prompt):] == ref[:i] and rng.random() < a else (right + 1 + rng.randrange(V - 1)) % V
    return draft_next


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args()
    from draftlab.base import load_base
    from draftlab.decode.acceptance import Sampling
    from draftlab.serve.generate import encode_prompt, plain_generate
    from draftlab.parallel.dsi import DSI, si_generate
    from draftlab.parallel.simulate import Config, best_dsi_lookahead, best_si_lookahead, expected, min_lookahead

    base_dir = stories_base()
    model, tok = load_base(str(base_dir), "float32")
    model.generation_config.eos_token_id = None
    prompts = [encode_prompt(tok, p, chat=False) for p in heldout_story_prompts(a.runs)]
    refs = [plain_generate(model, [p], a.tokens, Sampling(), None)[0][0] for p in prompts]
    V = model.config.vocab_size
    rows = []
    for tt, td, acc, sp in CONFIGS:
        k, k_si = best_dsi_lookahead(acc, td, tt, sp, a.tokens), best_si_lookahead(acc, td, tt)
        e = expected(Config(tt, td, acc, k, sp, a.tokens, si_lookahead=k_si))  # (the SI that runs below)
        meas = {"dsi": 0.0, "si": 0.0, "non_si": 0.0}
        emulated = waits = 0.0  # DSI's own run on the emulated clock (no runtime overheads), and its server waits
        identical = True
        with DSI(str(base_dir), sp=sp, target_latency_s=tt) as dsi:
            for j, (p, ref) in enumerate(zip(prompts, refs)):
                # Each method its own draws from the same seed (a shared generator would hand SI whatever DSI's
                # timing-dependent number of drafts left over).
                runs = {"dsi": dsi.generate(p, a.tokens, oracle(p, ref, acc, V, random.Random(j)), k, td),
                        "si": si_generate(model, p, a.tokens, oracle(p, ref, acc, V, random.Random(j)), k_si, tt, td),
                        "non_si": si_generate(model, p, a.tokens, oracle(p, ref, acc, V, random.Random(j)), 0, tt, td)}
                for m, r in runs.items():
                    meas[m] += r["wall_s"] / len(prompts)
                    identical &= r["tokens"] == ref
                emulated += runs["dsi"]["emulated_s"] / len(prompts)
                waits += runs["dsi"]["server_waits"] / len(prompts)
        ex = e["exact_total"]
        row = {"t_target_s": tt, "t_draft_s": td, "acceptance": acc, "sp": sp, "lookahead": k,
               "no_wait_lookahead": min_lookahead(td, tt, sp), "si_lookahead": k_si, "identical_to_greedy": identical,
               "measured_s": {m: round(v, 3) for m, v in meas.items()},
               "expected_s": {m: round(v, 3) for m, v in ex.items()},
               "measured_over_expected": {m: round(meas[m] / ex[m], 3) for m in meas},
               # Where DSI's gap to its expectation comes from: the runtime (wall over the same run's emulated clock)
               # or the draws of these few runs (emulated clock over the expectation).
               "dsi_emulated_s": round(emulated, 3), "dsi_wall_over_emulated": round(meas["dsi"] / emulated, 3),
               "dsi_emulated_over_expected": round(emulated / ex["dsi"], 3), "dsi_server_waits": round(waits, 2),
               "measured_speedup": {"dsi_vs_si": round(meas["si"] / meas["dsi"], 3),
                                    "dsi_vs_non_si": round(meas["non_si"] / meas["dsi"], 3),
                                    "si_vs_non_si": round(meas["non_si"] / meas["si"], 3)},
               "expected_speedup": {"dsi_vs_si": round(ex["si"] / ex["dsi"], 3),
                                    "dsi_vs_non_si": round(ex["non_si"] / ex["dsi"], 3),
                                    "si_vs_non_si": round(ex["non_si"] / ex["si"], 3)}}
        print(row)
        rows.append(row)
    write_result("dsi", {"tokens": a.tokens, "runs": a.runs, "configs": rows})


if __name__ == "__main__":
    main()
