"""`draftlab simulate`: expected latency of non-SI, SI and DSI for a target / drafter pair (see draftlab.parallel.simulate)."""

from __future__ import annotations

import json
from pathlib import Path

from .args import positive_int


def add_simulate_args(p) -> None:
    p.add_argument("--target-ms", type=float, default=None, help="one target forward, ms")
    p.add_argument("--drafter-ms", type=float, default=None, help="one drafter forward, ms")
    p.add_argument("--drafter-ratio", type=float, default=None, help="drafter latency as a fraction of the target's")
    p.add_argument("--acceptance", type=float, default=None, help="probability a drafted token is accepted (i.i.d.)")
    p.add_argument("--from-report", default=None,
                   help="a `draftlab generate --json` output file: latencies and acceptance measured on your pair")
    p.add_argument("--lookahead", type=int, default=None, help="DSI lookahead (default: the smallest sufficient one)")
    p.add_argument("--sp", type=positive_int, default=7, help="DSI target servers (SP degree; an 8-GPU node with one "
                   "GPU drafting: 7)")
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens generated")
    p.add_argument("--prefill-ms", type=float, default=None, help="TTFT (default: one target forward)")
    p.add_argument("--monte-carlo", type=int, default=0, metavar="RUNS",
                   help="also simulate RUNS runs event by event (finite server pool)")
    p.add_argument("--heatmap", default=None, metavar="PNG", help="draw the three pairwise speedup heatmaps")
    p.add_argument("--json", action="store_true")


def simulate_command(a) -> int:
    from ..parallel.simulate import Config, expected, from_generate, heatmaps, min_lookahead, monte_carlo

    src = {}
    if a.from_report:
        lines = [l for l in Path(a.from_report).read_text().splitlines() if l.strip().startswith("{")]
        if not lines:
            raise ValueError(f"--from-report {a.from_report}: no JSON object (write `draftlab generate --json` to it)")
        src = from_generate(json.loads(lines[-1]))
        src["t_target"], src["t_draft"] = 1000 * src["t_target"], 1000 * src["t_draft"]
    t_target = a.target_ms if a.target_ms is not None else src.get("t_target")
    t_draft = a.drafter_ms if a.drafter_ms is not None else (
        a.drafter_ratio * t_target if a.drafter_ratio is not None and t_target else src.get("t_draft"))
    acc = a.acceptance if a.acceptance is not None else src.get("acceptance")
    if not t_target or not t_draft or acc is None:
        raise ValueError("give --target-ms, --drafter-ms (or --drafter-ratio) and --acceptance, or --from-report")
    if not 0 <= acc <= 1:
        raise ValueError(f"--acceptance {acc}: a probability in [0, 1]")
    k = a.lookahead or min_lookahead(t_draft, t_target, a.sp)
    c = Config(t_target, t_draft, acc, k, a.sp, a.tokens, a.prefill_ms)
    rep = {"inputs": {"t_target_ms": t_target, "t_draft_ms": t_draft, "acceptance": acc, "lookahead": k, "sp": a.sp,
                      "tokens": a.tokens, "from_report": a.from_report}, **expected(c)}
    if a.monte_carlo:
        rep["monte_carlo"] = monte_carlo(c, a.monte_carlo)
    if a.heatmap:
        rep["heatmap"] = heatmaps(t_target, a.sp, a.tokens, a.heatmap)["png"]
    if a.json:
        print(json.dumps(rep))
        return 0
    print(f"target {t_target:.3g} ms, drafter {t_draft:.3g} ms, acceptance {acc:.3f}, {a.tokens} tokens; SI lookahead "
          f"{rep['si_lookahead']} (its best), DSI lookahead {k} on {a.sp} servers "
          f"({'enough' if rep['sp_sufficient'] else 'too few: tasks wait'}; smallest sufficient {rep['dsi_min_lookahead']})")
    print("| method | TTFT ms | TPOT ms | total ms |\n|---|---|---|---|")
    for m in ("non_si", "si", "dsi"):
        print(f"| {m} | {rep['ttft']:.3g} | {rep['tpot'][m]:.3g} | {rep['total'][m]:.4g} |")
    sp = rep["speedup"]
    print(f"\nDSI vs SI {sp['dsi_vs_si']:.2f}x, DSI vs non-SI {sp['dsi_vs_non_si']:.2f}x, SI vs non-SI {sp['si_vs_non_si']:.2f}x")
    return 0
