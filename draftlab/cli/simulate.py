"""`draftlab simulate`: expected latency of non-SI, SI and DSI for a target / drafter pair (see draftlab.parallel.simulate)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .args import non_negative_float, non_negative_int, positive_float, positive_int


def add_simulate_args(p) -> None:
    p.add_argument("--target-ms", type=positive_float, default=None, help="one target forward, ms")
    p.add_argument("--drafter-ms", type=positive_float, default=None, help="one drafter forward, ms")
    p.add_argument("--drafter-ratio", type=positive_float, default=None,
                   help="drafter latency as a fraction of the target's")
    p.add_argument("--acceptance", type=float, default=None, help="probability a drafted token is accepted (i.i.d.)")
    p.add_argument("--from-report", default=None,
                   help="a `draftlab generate --json` output file: latencies and acceptance measured on your pair")
    p.add_argument("--lookahead", type=positive_int, default=None,
                   help="DSI lookahead (default: chosen by --lookahead-rule)")
    p.add_argument("--lookahead-rule", choices=["expected", "no-wait"], default="expected",
                   help="how DSI's lookahead is chosen when not given (also for --heatmap): expected (default): the "
                        "one of least expected latency with the --sp servers, tasks' waits included; no-wait: the "
                        "smallest with which no task waits for a server")
    p.add_argument("--sp", type=positive_int, default=7, help="DSI target servers (SP degree; an 8-GPU node with one "
                   "GPU drafting: 7)")
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens generated")
    p.add_argument("--prefill-ms", type=non_negative_float, default=None, help="TTFT (default: one target forward)")
    p.add_argument("--monte-carlo", type=non_negative_int, default=0, metavar="RUNS",
                   help="also simulate RUNS runs event by event (finite server pool)")
    p.add_argument("--heatmap", default=None, metavar="PNG", help="draw the three pairwise speedup heatmaps")
    p.add_argument("--json", action="store_true")


def simulate_command(a) -> int:
    from ..parallel.simulate import (Config, drafts_ahead_note, dsi_lookahead, expected, from_generate, heatmaps,
                                     monte_carlo)

    if a.drafter_ms is not None and a.drafter_ratio is not None:  # (the ratio was dropped in silence: walk-through)
        raise ValueError("--drafter-ms and --drafter-ratio both give the drafter's latency: give one")
    src = {}
    if a.from_report:
        lines = [l for l in Path(a.from_report).read_text().splitlines() if l.strip().startswith("{")]
        if not lines:
            raise ValueError(f"--from-report {a.from_report}: no JSON object (write `draftlab generate --json` to it)")
        report = json.loads(lines[-1])
        if "error" in report and "steps" not in report:  # (a failed run's report: a KeyError before, walk-through)
            raise ValueError(f"--from-report {a.from_report}: the run it holds failed ({report['error']}); nothing "
                             "to simulate from")
        src = from_generate(report)
        src["t_target"], src["t_draft"] = 1000 * src["t_target"], 1000 * src["t_draft"]
        note = drafts_ahead_note(src["kind"])
        if note:
            print(f"note: --from-report {a.from_report}: {note}", file=sys.stderr)
    t_target = a.target_ms if a.target_ms is not None else src.get("t_target")
    t_draft = a.drafter_ms if a.drafter_ms is not None else (
        a.drafter_ratio * t_target if a.drafter_ratio is not None and t_target else src.get("t_draft"))
    acc = a.acceptance if a.acceptance is not None else src.get("acceptance")
    if not t_target or not t_draft or acc is None:
        raise ValueError("give --target-ms, --drafter-ms (or --drafter-ratio) and --acceptance, or --from-report")
    if not 0 <= acc <= 1:
        raise ValueError(f"--acceptance {acc}: a probability in [0, 1]")
    if t_draft > t_target:  # (the model's tasks always wait for their drafts: walk-through, 0.77x here, 0.92x run)
        raise ValueError(f"drafter {t_draft:.3g} ms > target {t_target:.3g} ms: this model (the DSI paper's) has a "
                         "drafter no slower than the target; with a slower one draftlab's DSI commits the target's own "
                         "token whenever a server returns before the next draft, which the model does not describe, "
                         "and no speculation pays")
    k = a.lookahead or dsi_lookahead(a.lookahead_rule, acc, t_draft, t_target, a.sp, a.tokens, a.prefill_ms)
    c = Config(t_target, t_draft, acc, k, a.sp, a.tokens, a.prefill_ms)
    rule = "given" if a.lookahead else a.lookahead_rule
    rep = {"inputs": {"t_target_ms": t_target, "t_draft_ms": t_draft, "acceptance": acc, "lookahead": k,
                      "lookahead_rule": rule, "sp": a.sp, "tokens": a.tokens, "from_report": a.from_report,
                      **({"report_path": src["path"], "report_batch_size": src["batch_size"]} if src else {})},
           **expected(c)}
    if a.monte_carlo:
        rep["monte_carlo"] = monte_carlo(c, a.monte_carlo)
    if a.heatmap:
        rep["heatmap"] = heatmaps(t_target, a.sp, a.tokens, a.heatmap, lookahead_rule=a.lookahead_rule)["png"]
    if a.json:
        print(json.dumps(rep))
        return 0
    print(f"target {t_target:.3g} ms, drafter {t_draft:.3g} ms, acceptance {acc:.3f}, {a.tokens} tokens; SI lookahead "
          f"{rep['si_lookahead']} (its best), DSI lookahead {k} ({rule}) on {a.sp} servers "
          f"({'no task waits' if rep['sp_sufficient'] else 'tasks wait'}; smallest with no waits "
          f"{rep['dsi_min_lookahead']})")
    if src:  # (what was read from the report: it was named as the source of figures given on the command line)
        read = [what for what, given in (("the target's latency", a.target_ms),
                                         ("the drafter's", a.drafter_ms or a.drafter_ratio),
                                         ("the acceptance rate", a.acceptance)) if given is None]
        print(f"from {a.from_report}: {', '.join(read)}, of its {src['path']} path at batch size {src['batch_size']}"
              if read else f"--from-report {a.from_report}: not read, every figure was given on the command line")
    print("| method | TTFT ms | TPOT ms | TTFT + TPOT per token, ms | exact total ms (the text's end included) |\n"
          "|---|---|---|---|---|")
    for m in ("non_si", "si", "dsi"):
        print(f"| {m} | {rep['ttft']:.3g} | {rep['tpot'][m]:.3g} | {rep['total'][m]:.4g} | "
              f"{rep['exact_total'][m]:.4g} |")
    sp, per = rep["speedup"], rep["speedup_per_token"]
    print(f"\nDSI vs SI {sp['dsi_vs_si']:.2f}x, DSI vs non-SI {sp['dsi_vs_non_si']:.2f}x, SI vs non-SI "
          f"{sp['si_vs_non_si']:.2f}x (exact totals of {a.tokens} tokens; per token at these lookaheads, the closed "
          f"form: {per['dsi_vs_si']:.2f}x, {per['dsi_vs_non_si']:.2f}x, {per['si_vs_non_si']:.2f}x)")
    if a.monte_carlo:
        mc = rep["monte_carlo"]
        print(f"\nsimulated event by event, mean of {a.monte_carlo} runs: total ms non-SI {mc['total']['non_si']:.4g}, "
              f"SI {mc['total']['si']:.4g}, DSI {mc['total']['dsi']:.4g} (DSI's tasks waited for a server "
              f"{mc['dsi_wait']:.3g} ms a run)")
    if a.heatmap:
        print(f"heatmaps: {rep['heatmap']}")
    return 0
