"""`draftlab dsi`: distributed speculative inference (speculation parallelism) with an SSM export."""

from __future__ import annotations

import json
import sys

from .args import DTYPE_HELP, SEED_HELP, add_compile_cache_arg, non_negative_float, positive_int


def add_dsi_args(p) -> None:
    p.add_argument("export", help="an ssm export (its base is the target)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several (decoded in turn)")
    p.add_argument("--sp", type=positive_int, default=2,
                   help="target servers (SP degree): processes each holding the base, one per GPU when there are "
                        "more GPUs than servers (GPU 0 drafts), else on CPU")
    p.add_argument("--lookahead", type=positive_int, default=None,
                   help="drafts per verification task (default: chosen by --lookahead-rule)")
    p.add_argument("--acceptance", type=float, default=None,
                   help="the drafter's expected acceptance rate (e.g. `draftlab simulate --from-report`'s): the "
                        "default lookahead is then the one of least expected latency with the --sp servers")
    p.add_argument("--lookahead-rule", choices=["expected", "no-wait"], default="expected",
                   help="how the lookahead is chosen when not given: expected (default; needs --acceptance, else "
                        "no-wait): least expected latency, tasks' waits for a server included; no-wait: the smallest "
                        "with which no task waits for a server")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens decoded per prompt")
    p.add_argument("--target-latency-ms", type=non_negative_float, default=0.0,
                   help="emulate a slower target: each server forward lasts at least this long (as the DSI authors "
                        "emulate a multi-GPU node)")
    p.add_argument("--draft-latency-ms", type=non_negative_float, default=0.0,
                   help="emulate the drafter's forward time")
    p.add_argument("--compare", action="store_true",
                   help="also run SI and non-SI with the same latencies (greedy), and check the tokens against HF "
                        "generate's")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); the text also ends at EOS")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sample (lossless) instead of greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    p.add_argument("--base", default=None, help="base model path or hub id (default: the one the export names)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"], help=DTYPE_HELP)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--compile", action="store_true",
                   help="the static-shape compiled path (see generate --compile) for the servers, the drafter and "
                        "--compare's SI / non-SI; everything compiles before it is timed; same tokens")
    add_compile_cache_arg(p)  # the servers' processes inherit it
    p.add_argument("--json", action="store_true")


def dsi_command(a) -> int:
    from ..decode.acceptance import Sampling
    from ..parallel.dsi import run_dsi

    rep = run_dsi(a.export, a.prompt, a.sp, a.max_new_tokens, a.lookahead, a.target_latency_ms, a.draft_latency_ms,
                  a.compare, a.base, a.dtype, a.chat, Sampling(a.temperature, a.top_p, a.top_k), a.seed,
                  stops=a.stop, acceptance=a.acceptance, lookahead_rule=a.lookahead_rule, compile=a.compile)
    if a.json:
        print(json.dumps(rep))
        return 0
    for r in rep["runs"]:
        print(r["text"])
    times = (f" (target {rep['t_target_ms']} ms, drafter {rep['t_draft_ms']} ms per forward)"
             if rep["t_target_ms"] is not None and rep["t_draft_ms"] is not None else "")
    line = f"\nDSI: SP {rep['sp']}, lookahead {rep['lookahead']}{times}, {rep['dsi_s']:.2f} s"
    if a.compare:
        line += (f"; SI {rep['si_s']:.2f} s, non-SI {rep['non_si_s']:.2f} s; DSI vs SI {rep['dsi_vs_si']:.2f}x, vs non-SI "
                 f"{rep['dsi_vs_non_si']:.2f}x; identical to greedy: {rep['identical_to_greedy']}")
    print(line, file=sys.stderr)
    return 0
