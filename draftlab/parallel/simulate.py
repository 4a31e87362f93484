"""Expected latency of non-speculative inference (non-SI), speculative inference (SI) and distributed speculative
inference (DSI, Timor et al.), offline: `draftlab simulate`.

The model (times in any unit, per forward):
- t_target: one target forward (a verification of any number of drafted tokens costs one forward);
  t_draft: one drafter forward (one drafted token); acceptance: every drafted token is accepted with
  probability `acceptance`, independently (i.i.d. geometric acceptance); the first token comes from the
  prefill, so TTFT = t_prefill (default t_target) for all three and TPOT covers the remaining tokens.
- non-SI: one target forward per token.
- SI with lookahead k: draft k tokens (k t_draft; with R tokens left, R - 1 at most), verify them (t_target);
  commit the accepted ones and the target's own next token. Expected time per token
  (1 - a) (k t_draft + t_target) / (1 - a^(k+1)). Its best lookahead is chosen per configuration (the fair
  baseline).
- DSI with lookahead k and SP degree n: the drafter never waits. From the last verified token on, a
  verification task is sent to a free target server at once (0 drafts: it yields the target's next token, as
  non-SI would) and again after every k drafted tokens (verifying all drafts so far); the drafter keeps
  drafting as if everything is accepted. When a task finishes and finds the first rejected draft (or confirms
  all its drafts, its own next token then being the correction of the first later rejection), every task and
  draft built past that point is preempted and drafting restarts from the corrected token. With J accepted
  drafts before the first rejection, the deciding task is the one sent after ceil(J / k) blocks, so with enough
  servers the expected time per token is (1 - a) (a k t_draft / (1 - a^k) + t_target). Tasks are sent every
  k t_draft and last t_target, so ceil(t_target / (k t_draft)) of them overlap: the smallest lookahead with which
  a task never waits for a server is k = ceil(t_target / (n t_draft)) (`min_lookahead`).
- The end of the text: with R tokens still to generate a stretch has a use for R - 1 drafts at most (the target's
  token after them is the R-th), so the drafter stops there and the stretch's last task verifies those R - 1
  drafts, sent once they are drafted (off the lookahead grid unless k divides R - 1); its token completes the
  text. Being off the grid, that one task can wait for a server at `min_lookahead`, never past the time the grid
  would have sent it.

This formalisation is draftlab's reading of the DSI paper's algorithm (drafting never blocks on verification,
preemption on rejection, a target-only task at every restart so DSI is never slower than non-SI); the Monte Carlo
simulator implements it event by event, with a finite server pool, and the closed forms are its infinite-pool
expectations (tested against each other).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass


def si_time_per_token(a: float, k: int, t_draft: float, t_target: float) -> float:
    """Expected SI time per generated token (after the first) with lookahead k."""
    if a >= 1:
        return (k * t_draft + t_target) / (k + 1)
    return (1 - a) * (k * t_draft + t_target) / (1 - a ** (k + 1))


def best_si_lookahead(a: float, t_draft: float, t_target: float, max_k: int = 64) -> int:
    """SI's best lookahead for this configuration (k = 0 is non-SI)."""
    return min(range(0, max_k + 1), key=lambda k: si_time_per_token(a, k, t_draft, t_target))


def dsi_time_per_token(a: float, k: int, t_draft: float, t_target: float) -> float:
    """Expected DSI time per generated token with lookahead k and enough target servers (see the module doc)."""
    if a >= 1:
        return t_draft
    if a <= 0:
        return t_target
    return (1 - a) * (a * k * t_draft / (1 - a ** k) + t_target)


def min_lookahead(t_draft: float, t_target: float, sp: int) -> int:
    """The smallest lookahead with which no DSI verification task waits for one of `sp` target servers (a text's
    last task, sent off the grid as soon as its drafts exist, can still wait a little: see the module doc)."""
    return max(1, math.ceil(t_target / (sp * t_draft) - 1e-12))


def simulate_si(n_tokens: int, a: float, k: int, t_draft: float, t_target: float, rng: random.Random,
                t_prefill: float | None = None) -> float:
    """Total time of one SI run of n_tokens tokens (Monte Carlo)."""
    t, done = (t_target if t_prefill is None else t_prefill), 1
    while done < n_tokens:
        d = min(k, n_tokens - done - 1)  # drafts the text has a use for: the target's token after them ends it
        j = 0
        while j < d and rng.random() < a:
            j += 1
        t += d * t_draft + t_target
        done += j + 1
    return t


def simulate_dsi(n_tokens: int, a: float, k: int, t_draft: float, t_target: float, sp: int, rng: random.Random,
                 t_prefill: float | None = None, accepts=None) -> dict:
    """One DSI run of n_tokens tokens, event by event with `sp` target servers (Monte Carlo). accepts: the number
    of drafts accepted before the first rejection on each stretch, in order, instead of draws with acceptance a
    (to replay a run of the process runtime; a stretch that would run past the text's end is cut there). Returns the
    total time, the tasks started (preempted ones included), the tasks that waited for a free server and how long
    they waited in all, and the tasks preempted (started after their stretch's deciding task, cut off by its
    decision)."""
    t, done, waited = (t_target if t_prefill is None else t_prefill), 1, 0.0
    tasks = waits = preempted = 0
    accepts = iter(accepts) if accepts is not None else None
    servers = [t] * sp  # when each server is next free
    heapq.heapify(servers)
    while done < n_tokens:
        # A stretch commits its accepted drafts and the target's token after them, so the text has a use for one
        # draft fewer than the tokens it still needs (`cap`): the drafter stops there and the stretch's last task
        # verifies them all, its own token completing the text.
        cap = n_tokens - done - 1
        # Accepted drafts before the first rejection on this stretch (drafts past the text's end are never made).
        if accepts is not None:
            j = min(next(accepts), cap)
        else:
            j = 0
            while j < cap and rng.random() < a:
                j += 1
        # Task m verifies min(m k, cap) drafts and goes out once they are drafted, at t + min(m k, cap) t_draft
        # (m = 0, 1, ...; the drafter never waits for a server, a task does); task m decides this stretch when
        # m k >= j (at j = cap it confirms every draft and its token ends the text). Later tasks that start before
        # the decision are preempted then.
        m_decide, m_last = math.ceil(j / k), math.ceil(cap / k)
        finish = None
        for m in range(m_last + 1):
            ready = t + min(m * k, cap) * t_draft
            if finish is not None and ready >= finish:
                break
            free = heapq.heappop(servers)
            start = max(ready, free)
            if finish is not None and start >= finish:  # still queued at the decision: never sent
                heapq.heappush(servers, free)
                break
            late = start - ready if start - ready > 1e-9 * max(t_target, 1e-30) else 0.0  # not rounding noise
            tasks, waits, waited = tasks + 1, waits + (late > 0), waited + late
            preempted += m > m_decide
            heapq.heappush(servers, start + t_target)
            if m == m_decide:
                finish = start + t_target
        # Preemption frees every server at `finish`.
        servers = [finish] * sp
        t = finish
        done += j + 1
    return {"time": t, "waited": waited, "tasks": tasks, "waits": waits, "preempted": preempted}


@dataclass
class Config:
    t_target: float
    t_draft: float
    acceptance: float
    lookahead: int
    sp: int
    n_tokens: int
    t_prefill: float | None = None


def expected(c: Config) -> dict:
    """Closed-form expected TTFT / TPOT / total of non-SI, SI (its best lookahead) and DSI (given lookahead;
    enough servers assumed, and whether `sp` is enough), with the pairwise speedups."""
    ttft = c.t_target if c.t_prefill is None else c.t_prefill
    k_si = best_si_lookahead(c.acceptance, c.t_draft, c.t_target)
    tpot = {"non_si": c.t_target, "si": si_time_per_token(c.acceptance, k_si, c.t_draft, c.t_target),
            "dsi": dsi_time_per_token(c.acceptance, c.lookahead, c.t_draft, c.t_target)}
    total = {m: ttft + (c.n_tokens - 1) * v for m, v in tpot.items()}
    k_min = min_lookahead(c.t_draft, c.t_target, c.sp)
    return {"ttft": ttft, "tpot": tpot, "total": total, "si_lookahead": k_si, "dsi_min_lookahead": k_min,
            "sp_sufficient": c.lookahead >= k_min,
            "speedup": {"dsi_vs_si": total["si"] / total["dsi"], "dsi_vs_non_si": total["non_si"] / total["dsi"],
                        "si_vs_non_si": total["non_si"] / total["si"]}}


def monte_carlo(c: Config, runs: int = 200, seed: int = 0) -> dict:
    """Mean totals of simulated runs (SI at its best lookahead, DSI with the finite server pool)."""
    rng = random.Random(seed)
    k_si = best_si_lookahead(c.acceptance, c.t_draft, c.t_target)
    si = [simulate_si(c.n_tokens, c.acceptance, k_si, c.t_draft, c.t_target, rng, c.t_prefill) for _ in range(runs)]
    dsi = [simulate_dsi(c.n_tokens, c.acceptance, c.lookahead, c.t_draft, c.t_target, c.sp, rng, c.t_prefill)
           for _ in range(runs)]
    non = (c.t_target if c.t_prefill is None else c.t_prefill) + (c.n_tokens - 1) * c.t_target
    mean = lambda xs: sum(xs) / len(xs)
    return {"total": {"non_si": non, "si": mean(si), "dsi": mean([d["time"] for d in dsi])},
            "dsi_wait": mean([d["waited"] for d in dsi])}


def heatmaps(t_target: float, sp: int, n_tokens: int, out: str, ratios=None, acceptances=None) -> dict:
    """The three pairwise speedup heatmaps over drafter latency (as a fraction of the target's) x acceptance rate,
    DSI at its smallest sufficient lookahead for `sp` servers, SI at its best lookahead. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    ratios = ratios or [round(0.02 * i, 2) for i in range(1, 51)]
    acceptances = acceptances or [round(0.02 * i, 2) for i in range(0, 50)]
    grids = {k: [[0.0] * len(ratios) for _ in acceptances] for k in ("dsi_vs_si", "dsi_vs_non_si", "si_vs_non_si")}
    for i, a in enumerate(acceptances):
        for j, r in enumerate(ratios):
            td = r * t_target
            e = expected(Config(t_target, td, a, min_lookahead(td, t_target, sp), sp, n_tokens))
            for key in grids:
                grids[key][i][j] = e["speedup"][key]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, g) in zip(axes, grids.items()):
        lo, hi = min(map(min, g)), max(map(max, g))  # red below 1 (slower), green above
        norm = TwoSlopeNorm(vmin=min(lo, 0.99), vcenter=1.0, vmax=max(hi, 1.01))
        im = ax.imshow(g, origin="lower", aspect="auto", cmap="RdYlGn", norm=norm,
                       extent=[ratios[0], ratios[-1], acceptances[0], acceptances[-1]])
        ax.set_title(key.replace("_", " ").replace("vs", "vs.") + " (speedup)")
        ax.set_xlabel("drafter latency / target latency")
        ax.set_ylabel("acceptance rate")
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"expected speedups, {sp} target servers, {n_tokens} tokens (DSI at its smallest sufficient lookahead)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"png": out, "ratios": ratios, "acceptances": acceptances, "grids": grids}


def from_generate(report: dict) -> dict:
    """Simulator inputs from a `draftlab generate --json` (or eval) report: per-forward latencies from its time
    split and the i.i.d. acceptance rate that explains its accept length for its tree depth."""
    steps = max(report["steps"], 1)
    split = report.get("time_split_s", {})
    depth = max(int((report.get("drafter") or {}).get("depth", 1)), 1)
    t_target = split.get("verify", 0.0) / steps
    t_draft = split.get("draft", 0.0) / steps / depth
    tau = report["accept_length"]  # E = (1 - a^(depth+1)) / (1 - a); solve for a by bisection
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        e = depth + 1 if mid >= 1 else (1 - mid ** (depth + 1)) / (1 - mid)
        lo, hi = (mid, hi) if e < tau else (lo, mid)
    return {"t_target": t_target, "t_draft": t_draft, "acceptance": round(lo, 4), "depth": depth}
