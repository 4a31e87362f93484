"""Is DSI ever slower than SI or non-SI? Over the DSI paper's heatmap grid (drafter latency 0.01 to 1 of the
target's in steps of 0.01, acceptance rate 0 to 1 in steps of 0.01, SP 7, target latency 1), DSI at its lookahead
of least expected latency with the 7 servers (waits included) against SI at its best lookahead and non-SI, and the
same for the old no-wait rule (the smallest lookahead with which no task waits for a server).

    python benchmarks/dsi_grid.py                  # ~1.5 min on one core
    python benchmarks/dsi_grid.py --runs 0         # the expectations only (seconds)

Three ways, `draftlab simulate`'s model throughout (draftlab/parallel/simulate.py):
- closed form, per token (the text's end left out): DSI with the finite pool (`dsi_pool_time_per_token`), SI
  (`si_time_per_token`, best lookahead up to 64), non-SI (t_target);
- the exact expectation of the event simulator for a text of --tokens tokens, its end included
  (`dsi_expected_total`, `si_expected_total`; each method at its best lookahead for that text): no noise;
- the event simulator itself (`simulate_dsi`, `simulate_si`), --runs runs a point at the lookaheads chosen above.
  Noise: every run of DSI and of SI at a point draws from the same seeded stream (common random numbers), and a
  point counts as slower only when DSI's mean exceeds the better baseline's by more than --z standard errors of the
  paired difference (z = 4: about 0.6 false alarms expected over 10,100 points if every point tied). The same runs
  check the simulator against the exact expectation (z-scores of its means).
A point is slower where DSI / min(SI, non-SI) > 1 + 1e-9 (rounding).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from common import write_result

TOL = 1e-9


def summary(dsi, ref, acc, ratios, k, extra=None) -> dict:
    """Slower-point count, worst ratio and where, for DSI against the better baseline."""
    r = dsi / ref
    i, j = np.unravel_index(np.argmax(r), r.shape)
    slower = np.argwhere(r > 1 + TOL)
    out = {"slower_points": int(len(slower)), "worst_dsi_over_best_baseline": round(float(r[i, j]), 6),
           "worst_at": {"acceptance": float(acc[i]), "drafter_ratio": float(ratios[j]), "dsi_lookahead": int(k[i, j])},
           "median_speedup_vs_best_baseline": round(float(np.median(1 / r)), 4),
           "slower_by_drafter_ratio": {f"{ratios[b]:.2f}": int((slower[:, 1] == b).sum())
                                       for b in sorted(set(slower[:, 1].tolist()))},
           "slower_examples": [{"acceptance": float(acc[a]), "drafter_ratio": float(ratios[b]),
                                "dsi_over_best_baseline": round(float(r[a, b]), 6)} for a, b in slower[:12]]}
    return {**out, **(extra or {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=50, help="tokens per text (the prefill's first included)")
    ap.add_argument("--sp", type=int, default=7)
    ap.add_argument("--runs", type=int, default=16, help="event-simulator runs per grid point (0: none)")
    ap.add_argument("--z", type=float, default=4.0, help="standard errors beyond which a simulated point counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="dsi_grid")
    a = ap.parse_args()
    from draftlab.parallel.simulate import grid_expectations, simulate_dsi, simulate_si

    ratios = np.round(np.arange(1, 101) * 0.01, 2)
    acc = np.round(np.arange(0, 101) * 0.01, 2)
    t0 = time.perf_counter()
    res = {"grid": {"drafter_ratio": "0.01..1.00 step 0.01", "acceptance": "0.00..1.00 step 0.01", "sp": a.sp,
                    "t_target": 1.0, "tokens": a.tokens, "points": int(len(ratios) * len(acc))}}
    for name, n in (("closed_form", None), ("exact", a.tokens)):
        res[name] = {}
        for rule in ("expected", "no-wait"):
            g = grid_expectations(acc, ratios, 1.0, a.sp, n_tokens=n, rule=rule)
            ref = np.minimum(g["si"], g["non_si"])
            k, km = g["dsi_lookahead"], g["min_lookahead"]
            res[name][rule] = summary(g["dsi"], ref, acc, ratios, k, {
                "lookahead_below_no_wait": int((k < km).sum()), "lookahead_above_no_wait": int((k > km).sum())})
            if rule == "expected":
                chosen = g
        # what the rule gains over the no-wait one
        nw = grid_expectations(acc, ratios, 1.0, a.sp, n_tokens=n, rule="no-wait")
        gain = nw["dsi"] / chosen["dsi"]
        res[name]["gain_over_no_wait"] = {"points_faster": int((gain > 1 + TOL).sum()),
                                          "max_speedup": round(float(gain.max()), 4),
                                          "never_slower": bool((gain >= 1 - TOL).all())}
    res["expectations_s"] = round(time.perf_counter() - t0, 1)
    print({k: v for k, v in res.items() if k != "grid"})

    if a.runs:
        g = grid_expectations(acc, ratios, 1.0, a.sp, n_tokens=a.tokens, rule="expected")
        n = a.tokens
        t1 = time.perf_counter()
        z_diff = np.full(g["dsi"].shape, -np.inf)
        z_dsi, z_si, slower_mean = np.zeros_like(z_diff), np.zeros_like(z_diff), 0
        for i, ai in enumerate(acc):
            for j, rj in enumerate(ratios):
                k, ks = int(g["dsi_lookahead"][i, j]), int(g["si_lookahead"][i, j])
                use_si = g["si"][i, j] < g["non_si"][i, j]  # the better baseline (exact expectations)
                dsi, si = [], []
                for r in range(a.runs):
                    seed = (a.seed * 101 + i) * 100_000 + j * 1000 + r
                    dsi.append(simulate_dsi(n, ai, k, rj, 1.0, a.sp, random.Random(seed))["time"])
                    si.append(simulate_si(n, ai, ks, rj, 1.0, random.Random(seed)))
                dsi, si = np.array(dsi), np.array(si)
                base = si if use_si else np.full(a.runs, float(n))
                diff = dsi - base
                slower_mean += diff.mean() > TOL * n
                se = diff.std(ddof=1) / np.sqrt(a.runs)
                z_diff[i, j] = diff.mean() / se if se > 1e-12 else (np.inf if diff.mean() > TOL * n else -np.inf)
                for z, x, e in ((z_dsi, dsi, g["dsi"][i, j]), (z_si, si, g["si"][i, j])):
                    s = x.std(ddof=1) / np.sqrt(a.runs)
                    z[i, j] = (x.mean() - e) / s if s > 1e-12 else (0.0 if abs(x.mean() - e) <= 1e-9 * n else np.inf)
        sig = np.argwhere(z_diff > a.z)
        zi, zj = np.unravel_index(np.argmax(z_diff), z_diff.shape)
        res["simulator"] = {
            "runs_per_point": a.runs, "z": a.z, "seconds": round(time.perf_counter() - t1, 1),
            "slower_points_significant": int(len(sig)),
            "slower_points_mean_only": int(slower_mean),
            "largest_z_of_dsi_minus_best_baseline": round(float(z_diff.max()), 2),
            "largest_z_at": {"acceptance": float(acc[zi]), "drafter_ratio": float(ratios[zj])},
            "significant_examples": [{"acceptance": float(acc[x]), "drafter_ratio": float(ratios[y]),
                                      "z": round(float(z_diff[x, y]), 2)} for x, y in sig[:12]],
            "dsi_mean_vs_exact": {"max_abs_z": round(float(np.abs(z_dsi).max()), 2),
                                  "points_abs_z_over_4": int((np.abs(z_dsi) > 4).sum()),
                                  "share_abs_z_over_2": round(float((np.abs(z_dsi) > 2).mean()), 4)},
            "si_mean_vs_exact": {"max_abs_z": round(float(np.abs(z_si).max()), 2),
                                 "points_abs_z_over_4": int((np.abs(z_si) > 4).sum()),
                                 "share_abs_z_over_2": round(float((np.abs(z_si) > 2).mean()), 4)}}
        print(res["simulator"])
    write_result(a.out, res)


if __name__ == "__main__":
    main()
