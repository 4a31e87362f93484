"""Pipelined drafting/verification (Minions) against the same decoder without pipelining, on a request stream:
64 MT-Bench first turns (chat template, prompts cut to their last 200 tokens) x 128 new tokens, greedy, the
stories260K base and the fkl-distilled SSM (benchmarks/train_ssm.py), chains of 2 and 4.

Per configuration (tree, verifier batch size):
  sequential x1 / x2   the plain decoder, batch after batch, one process with 1 / 2 torch threads
  pipelined            verifier (this process, 1 thread) + drafter worker (1 thread), 2 groups in flight, the
                       drafter pausing while the pool holds a verifier batch (Minions' rule)
  pipelined, no limit  the same without the pause rule (how far the pool grows)
Every output is checked against plain HF greedy decoding of the same prompt.

    python benchmarks/train_ssm.py && python benchmarks/pipeline.py
"""

from __future__ import annotations

import argparse
import json

import torch

from common import DATA, EXPORTS, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--trees", nargs="*", default=["chain:2", "chain:4"])
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="runs per method, interleaved; the median wall time is reported")
    a = ap.parse_args()
    from draftlab.serve.generate import encode_prompt, load_decoder, plain_generate
    from draftlab.decode.acceptance import Sampling
    from draftlab.parallel.pipeline import DraftPipeline, sequential_generate

    export = str(EXPORTS / "stories260k-ssm-fkl")
    torch.set_num_threads(1)
    decoders = {t: load_decoder(export, tree=t, device="cpu") for t in a.trees}
    _, tok, _ = decoders[a.trees[0]]
    base = decoders[a.trees[0]][0].base
    qs = [json.loads(l) for l in open(DATA / "mt_bench" / "question.jsonl")][: a.prompts]
    prompts = []
    for q in qs:
        ids = encode_prompt(tok, q["turns"][0], chat=True)
        prompts.append(ids[:1] + ids[1:][-199:])
    eos = tok.eos_token_id
    plain, plain_s = plain_generate(base, prompts, a.max_new_tokens, Sampling(), eos)
    n_plain = sum(len(t) for t in plain)
    print(f"plain HF greedy (1 thread, one prompt at a time): {n_plain / plain_s:.1f} tokens/s", flush=True)
    rows = []
    for tree in a.trees:
        decoder = decoders[tree][0]
        with DraftPipeline(base, export, tree=tree) as pipe:
            for bs in a.batch_sizes:
                sequential_generate(decoder, prompts[:bs], bs, 8, eos_token_id=eos)  # warm-up
                pipe.run(prompts[:bs], bs, a.in_flight, 8, eos_token_id=eos)
                methods = {
                    "sequential x1": lambda: sequential_generate(decoder, prompts, bs, a.max_new_tokens, eos_token_id=eos),
                    "sequential x2": lambda: sequential_generate(decoder, prompts, bs, a.max_new_tokens, eos_token_id=eos),
                    "pipelined": lambda: pipe.run(prompts, bs, a.in_flight, a.max_new_tokens, eos_token_id=eos),
                    "pipelined, no pool limit": lambda: pipe.run(prompts, bs, a.in_flight, a.max_new_tokens,
                                                                 eos_token_id=eos, pool_limit=None)}
                runs = {m: [] for m in methods}
                for _ in range(a.reps):  # interleaved, so drifts of the machine hit every method alike
                    for name, fn in methods.items():
                        torch.set_num_threads(2 if name == "sequential x2" else 1)
                        runs[name].append(fn())
                torch.set_num_threads(1)
                for name, rs in runs.items():
                    r = sorted(rs, key=lambda x: x.wall_s)[len(rs) // 2]
                    assert all(x.tokens == r.tokens for x in rs)
                    row = {"tree": tree, "batch_size": bs, "method": name, "tokens": r.new_tokens,
                           "tokens_per_s": round(r.new_tokens / r.wall_s, 1), "wall_s": round(r.wall_s, 3),
                           "accept_length": round(r.accept_length, 3), "steps": r.steps,
                           "verify_s": round(r.verify_s, 3), "verifier_wait_s": round(r.verifier_wait_s, 3),
                           "identical_to_plain": r.tokens == plain}
                    if r.drafter:
                        row["drafter"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.drafter.items()}
                    rows.append(row)
                    print(row, flush=True)
    write_result("pipeline", {"prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "in_flight": a.in_flight,
                              "reps": a.reps,
                              "export": "stories260k-ssm-fkl",
                              "plain_tokens_per_s": round(n_plain / plain_s, 1), "rows": rows})


if __name__ == "__main__":
    main()
