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
  a task never waits for a server is k = ceil(t_target / (n t_draft)) (`min_lookahead`, the no-wait rule). A shorter
  one makes tasks wait but decides short stretches sooner; the default lookahead is the one of least expected
  latency with the n servers, waits included (`best_dsi_lookahead`, from `dsi_pool_time_per_token` per token or
  `dsi_expected_total` for a text: both exact expectations of the event simulator).
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

import numpy as np


def si_time_per_token(a: float, k: int, t_draft: float, t_target: float) -> float:
    """Expected SI time per generated token (after the first) with lookahead k."""
    if np.ndim(a) or np.ndim(t_draft):  # arrays (a grid)
        a = np.asarray(a, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = (1 - a) * (k * t_draft + t_target) / (1 - a ** (k + 1))
        return np.where(a >= 1, (k * t_draft + t_target) / (k + 1), out)
    if a >= 1:
        return (k * t_draft + t_target) / (k + 1)
    return (1 - a) * (k * t_draft + t_target) / (1 - a ** (k + 1))


def best_si_lookahead(a: float, t_draft: float, t_target: float, max_k: int = 64, n_tokens: int | None = None,
                      t_prefill: float | None = None) -> int:
    """SI's best lookahead for this configuration (k = 0 is non-SI): per token, or, with n_tokens, for that text
    (`si_expected_total`: a text has a use for n_tokens - 2 drafts at most, so no longer one is chosen; ties keep the
    shorter)."""
    if n_tokens is None:
        return min(range(0, max_k + 1), key=lambda k: si_time_per_token(a, k, t_draft, t_target))
    totals = si_expected_total(n_tokens, a, np.arange(min(max_k, max(n_tokens - 2, 1)) + 1), t_draft, t_target,
                               t_prefill)
    return int(np.flatnonzero(totals <= totals.min() * (1 + 1e-12))[0])


def dsi_time_per_token(a: float, k: int, t_draft: float, t_target: float) -> float:
    """Expected DSI time per generated token with lookahead k and enough target servers (see the module doc)."""
    if a >= 1:
        return t_draft
    if a <= 0:
        return t_target
    return (1 - a) * (a * k * t_draft / (1 - a ** k) + t_target)


def dsi_pool_time_per_token(a, k: int, t_draft, t_target: float, sp: int):
    """Expected DSI time per generated token with lookahead k and `sp` target servers, waits included (the
    simulator's model, away from the text's end; a and t_draft may be numpy arrays). Every stretch starts with
    all servers free (preemption frees them), so task m starts at S_m = max(m k t_d, S_{m-n} + t_t) (n = sp):
    S_m = max(m k t_d, r k t_d + q t_t) with m = q n + r. It decides with probability a^((m-1)k+1)(1 - a^k)
    (m >= 1; m = 0 with 1 - a), so with x = a^k and T = t_t, d = t_d:
    E[decision] = T + a (k d sum_{r<n} r x^(r-1) / sum_{r<n} x^r + T x^(n-1) / (1 - x^n)) when T > n k d
    (tasks wait), else T + a k d / (1 - x) (no task waits: `dsi_time_per_token`), over E[tokens] = 1 / (1 - a)."""
    a, d = np.asarray(a, dtype=float), np.asarray(t_draft, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = a ** k
        num = sum(r * x ** (r - 1) for r in range(1, sp))
        den = sum(x ** r for r in range(sp))
        wait = a * (k * d * num / den + t_target * x ** (sp - 1) / (1 - x ** sp))
        free = a * k * d / (1 - x)
        out = (1 - a) * (t_target + np.where(t_target > sp * k * d, wait, free))
    # a = 1: one endless stretch, tokens at the drafter's pace or, when tasks wait, at the pool's (n tasks of k
    # tokens per t_t)
    out = np.where(a >= 1, np.maximum(d, t_target / (sp * k)), np.where(a <= 0, t_target, out))
    return out if out.ndim else float(out)


def _dsi_starts(m_max: int, k: int, d, t_target: float, sp: int) -> list:
    """S_m for m = 0..m_max: when task m of a stretch starts (relative to the stretch), on the lookahead grid."""
    return [np.maximum(m * k * d, (m % sp) * k * d + (m // sp) * t_target) for m in range(m_max + 1)]


def dsi_expected_total(n_tokens: int, a, k: int, t_draft, t_target: float, sp: int, t_prefill: float | None = None):
    """Exact expected total time of `simulate_dsi` (finite server pool, waits and the text's end included): a
    recursion over the tokens left (a and t_draft may be numpy arrays, broadcast together). With R tokens left a
    stretch may use c = R - 1 drafts; it accepts j < c with probability a^j (1 - a), c with a^c; task m (ready at
    min(m k, c) t_d) decides when m k >= j, and starts at S_m (see `dsi_pool_time_per_token`; the last task, ready
    at c t_d, at max(c t_d, S_(m-n) + t_t))."""
    a, d = np.asarray(a, dtype=float), np.asarray(t_draft, dtype=float)
    shape = np.broadcast(a, d).shape
    a, d = np.broadcast_to(a, shape), np.broadcast_to(d, shape)
    m_top = math.ceil(max(n_tokens - 2, 0) / k)
    S = _dsi_starts(m_top, k, d, t_target, sp)
    # C[M] = sum_{m=1}^{M} P(decide at m) S_m for an uncut stretch; P = a^((m-1)k+1) (1 - a^k)
    C = [np.zeros(shape)]
    for m in range(1, m_top + 1):
        C.append(C[-1] + a ** ((m - 1) * k + 1) * (1 - a ** k) * S[m])
    E = [np.zeros(shape)]  # E[R]: expected time to generate R more tokens
    G = np.zeros(shape)  # sum_{j=0}^{c-1} a^j E[c - j] for the current c
    for R in range(1, n_tokens):
        c = R - 1
        if c == 0:
            dur = np.full(shape, float(t_target))
        else:
            M = math.ceil(c / k)
            last = c * d if M < sp else np.maximum(c * d, S[M - sp] + t_target)
            dur = t_target + C[M - 1] + a ** ((M - 1) * k + 1) * last
        E.append(dur + (1 - a) * G)
        G = E[-1] + a * G  # becomes the sum for c + 1
    total = (t_target if t_prefill is None else t_prefill) + E[n_tokens - 1]
    return total if total.ndim else float(total)


def si_expected_total(n_tokens: int, a, k, t_draft, t_target: float, t_prefill: float | None = None):
    """Exact expected total time of `simulate_si` with lookahead k (k = 0: non-SI), the text's end included; a, k
    and t_draft may be numpy arrays, broadcast together. With R tokens left a round drafts c = min(k, R - 1) and
    accepts j < c with probability a^j (1 - a), c with a^c; W carries sum_{j<c} a^j E[R - 1 - j] from one R to the
    next (O(1) per token, so every lookahead of a long text is cheap to weigh)."""
    a, d, k = np.broadcast_arrays(np.asarray(a, dtype=float), np.asarray(t_draft, dtype=float), np.asarray(k))
    E = np.zeros((n_tokens,) + a.shape)  # E[R]: expected time to generate R more tokens
    W, ak = np.zeros(a.shape), a ** k
    for R in range(1, n_tokens):
        c = np.minimum(k, R - 1)
        E[R] = c * d + t_target + a ** c * np.take_along_axis(E, (R - 1 - c)[None], 0)[0] + (1 - a) * W
        # (for R + 1: one more term while the round still drafts R, else the window slides past E[R - k])
        W = E[R] + a * W - np.where(R > k, ak * np.take_along_axis(E, np.maximum(R - k, 0)[None], 0)[0], 0.0)
    total = (t_target if t_prefill is None else t_prefill) + E[n_tokens - 1]
    return total if total.ndim else float(total)


def best_dsi_lookahead(a: float, t_draft: float, t_target: float, sp: int, n_tokens: int | None = None,
                       t_prefill: float | None = None) -> int:
    """The lookahead minimising DSI's expected latency with `sp` target servers, waits included (the default):
    the exact expected total of n_tokens tokens (`dsi_expected_total`) when n_tokens is given, else the expected
    time per token (`dsi_pool_time_per_token`). Per token the candidates are 1..`min_lookahead`: past it no task
    waits and a longer lookahead only delays decisions. For a whole text longer ones are tried too: the text's
    last task, off the lookahead grid, can wait at `min_lookahead` and not at a longer one (a = 1 and drafts of
    0.03 t_target on 7 servers, 50 tokens: 3.45 at 5, 3.44 from 6 on). Ties (to 1e-12) keep the one nearest
    `min_lookahead`, shorter ones first."""
    k_min = min_lookahead(t_draft, t_target, sp)
    if n_tokens is None:
        cost = lambda k: dsi_pool_time_per_token(a, k, t_draft, t_target, sp)  # noqa: E731
        longer = range(0)
    else:
        cost = lambda k: dsi_expected_total(n_tokens, a, k, t_draft, t_target, sp, t_prefill)  # noqa: E731
        longer = range(k_min + 1, n_tokens - 1)  # k >= n_tokens - 2 all act alike
    best, best_cost = k_min, cost(k_min)
    for k in [*range(k_min - 1, 0, -1), *longer]:
        c = cost(k)
        if c < best_cost * (1 - 1e-12):
            best, best_cost = k, c
    return best


def dsi_lookahead(rule: str, a: float | None, t_draft: float, t_target: float, sp: int,
                  n_tokens: int | None = None, t_prefill: float | None = None) -> int:
    """DSI's lookahead by rule: "expected" (`best_dsi_lookahead`; needs the acceptance rate a) or "no-wait"
    (`min_lookahead`, the smallest with which no task waits for a server)."""
    if rule == "no-wait":
        return min_lookahead(t_draft, t_target, sp)
    if rule != "expected":
        raise ValueError(f"lookahead rule {rule!r}: 'expected' or 'no-wait'")
    if a is None or not 0 <= a <= 1:
        raise ValueError(f"the 'expected' lookahead rule needs the acceptance rate, a probability (got {a})")
    return best_dsi_lookahead(a, t_draft, t_target, sp, n_tokens, t_prefill)


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
    si_lookahead: int | None = None  # None: SI's best for the text (best_si_lookahead with n_tokens)


def expected(c: Config) -> dict:
    """Expected TTFT / TPOT / total of non-SI, SI (c.si_lookahead, default its best for the text) and DSI (the given
    lookahead with the `sp` servers, waits included; whether `sp` is enough that no task waits): `exact_total`, the
    simulator's exact expectations for the text (its end included), and `total`, TTFT + TPOT per token in closed
    form (a long text's steady state). `speedup`: the pairwise ratios of the exact totals, which the lookaheads are
    chosen by (they were the closed form's, and contradicted the exact totals of a short text or a long lookahead:
    walk-through); `speedup_per_token`: those of the closed form at the same lookaheads (chosen for this text, not
    a long text's best)."""
    ttft = c.t_target if c.t_prefill is None else c.t_prefill
    k_si = config_si_lookahead(c)
    tpot = {"non_si": c.t_target, "si": si_time_per_token(c.acceptance, k_si, c.t_draft, c.t_target),
            "dsi": dsi_pool_time_per_token(c.acceptance, c.lookahead, c.t_draft, c.t_target, c.sp)}
    total = {m: ttft + (c.n_tokens - 1) * v for m, v in tpot.items()}
    exact = {"non_si": ttft + (c.n_tokens - 1) * c.t_target,
             "si": si_expected_total(c.n_tokens, c.acceptance, k_si, c.t_draft, c.t_target, c.t_prefill),
             "dsi": dsi_expected_total(c.n_tokens, c.acceptance, c.lookahead, c.t_draft, c.t_target, c.sp,
                                       c.t_prefill)}
    k_min = min_lookahead(c.t_draft, c.t_target, c.sp)
    return {"ttft": ttft, "tpot": tpot, "total": total, "exact_total": exact, "si_lookahead": k_si,
            "dsi_min_lookahead": k_min, "sp_sufficient": c.lookahead >= k_min,
            "speedup": speedups(exact), "speedup_per_token": speedups(total)}


def config_si_lookahead(c: Config) -> int:
    """SI's lookahead in configuration c: the one it gives, else SI's best for the text."""
    return c.si_lookahead if c.si_lookahead is not None else best_si_lookahead(
        c.acceptance, c.t_draft, c.t_target, n_tokens=c.n_tokens, t_prefill=c.t_prefill)


def speedups(total: dict) -> dict:
    """The pairwise speedups of three methods' latencies."""
    return {"dsi_vs_si": total["si"] / total["dsi"], "dsi_vs_non_si": total["non_si"] / total["dsi"],
            "si_vs_non_si": total["non_si"] / total["si"]}


def _pick(costs: dict, k_min, tol: float = 1e-12):
    """Per grid point, the lookahead of least cost (costs: k -> array); ties (to tol) keep the one nearest k_min,
    shorter first, as `best_dsi_lookahead` does. Returns (cost, lookahead) arrays."""
    ks = np.array(sorted(costs))
    c = np.stack([costs[k] for k in ks])
    low = c.min(0)
    near = c <= low * (1 + tol)
    kk = ks.reshape((-1,) + (1,) * low.ndim)
    score = np.where(near, 2 * np.abs(kk - k_min) + (kk > k_min), np.inf)
    return low, ks[score.argmin(0)]


def grid_expectations(acceptances, ratios, t_target: float, sp: int, n_tokens: int | None = None,
                      rule: str = "expected", si_max_k: int = 64) -> dict:
    """Expected non-SI, SI and DSI latency over acceptance x drafter-latency ratio (rows x columns), vectorised.
    n_tokens None: per token in closed form (DSI with the `sp` servers, waits included: `dsi_pool_time_per_token`;
    SI at its best lookahead up to si_max_k); else the exact expected totals of the event simulator for n_tokens
    tokens (`dsi_expected_total`, `si_expected_total`; SI at its best lookahead for the text). DSI's lookahead by
    rule, per point: "expected" (least expected latency, as `best_dsi_lookahead`) or "no-wait" (`min_lookahead`).
    Returns arrays {"non_si", "si", "dsi", "dsi_lookahead", "si_lookahead", "min_lookahead"}."""
    A = np.asarray(acceptances, dtype=float)[:, None]
    D = np.asarray(ratios, dtype=float)[None, :] * t_target
    shape = (A.shape[0], D.shape[1])
    k_min = np.broadcast_to(np.array([[min_lookahead(d, t_target, sp) for d in D[0]]]), shape)
    if n_tokens is None:
        dsi_cost = lambda k: dsi_pool_time_per_token(A, k, D, t_target, sp)  # noqa: E731
        si_cost = lambda k: np.broadcast_to(si_time_per_token(A, k, D, t_target), shape)  # noqa: E731
        ks, si_ks, non = range(1, int(k_min.max()) + 1), range(0, si_max_k + 1), np.full(shape, float(t_target))
    else:
        dsi_cost = lambda k: dsi_expected_total(n_tokens, A, k, D, t_target, sp)  # noqa: E731
        si_cost = lambda k: si_expected_total(n_tokens, A, k, D, t_target)  # noqa: E731
        top = max(n_tokens - 2, 1)  # lookaheads past the drafts a text can use act alike
        ks, si_ks = range(1, max(top, int(k_min.max())) + 1), range(0, top + 1)
        non = np.full(shape, float(t_target) * n_tokens)
    dsi_all = {k: np.broadcast_to(dsi_cost(k), shape) for k in ks}
    if rule == "no-wait":
        stack = np.stack([dsi_all[k] for k in ks])
        k_dsi = k_min
        dsi = np.take_along_axis(stack, (k_min - 1)[None], 0)[0]
    elif rule == "expected":
        if n_tokens is None:  # per token: 1..min_lookahead (past it no task waits; longer only delays decisions)
            dsi_all = {k: np.where(k <= k_min, v, np.inf) for k, v in dsi_all.items()}
        dsi, k_dsi = _pick(dsi_all, k_min)
    else:
        raise ValueError(f"lookahead rule {rule!r}: 'expected' or 'no-wait'")
    si, k_si = _pick({k: si_cost(k) for k in si_ks}, 0)
    return {"non_si": non, "si": si, "dsi": dsi, "dsi_lookahead": k_dsi, "si_lookahead": k_si, "min_lookahead": k_min}


def monte_carlo(c: Config, runs: int = 200, seed: int = 0) -> dict:
    """Mean totals of simulated runs (SI at `config_si_lookahead`, as `expected`; DSI with the finite server pool)."""
    rng = random.Random(seed)
    k_si = config_si_lookahead(c)
    si = [simulate_si(c.n_tokens, c.acceptance, k_si, c.t_draft, c.t_target, rng, c.t_prefill) for _ in range(runs)]
    dsi = [simulate_dsi(c.n_tokens, c.acceptance, c.lookahead, c.t_draft, c.t_target, c.sp, rng, c.t_prefill)
           for _ in range(runs)]
    non = (c.t_target if c.t_prefill is None else c.t_prefill) + (c.n_tokens - 1) * c.t_target
    mean = lambda xs: sum(xs) / len(xs)
    return {"total": {"non_si": non, "si": mean(si), "dsi": mean([d["time"] for d in dsi])},
            "dsi_wait": mean([d["waited"] for d in dsi])}


def heatmaps(t_target: float, sp: int, n_tokens: int, out: str, ratios=None, acceptances=None,
             lookahead_rule: str = "expected") -> dict:
    """The three pairwise speedup heatmaps over drafter latency (as a fraction of the target's) x acceptance rate,
    in closed form: DSI at its lookahead by `lookahead_rule` for `sp` servers ("expected": least expected time per
    token, waits included; "no-wait": the smallest with which no task waits), SI at its best lookahead. Writes a
    PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    ratios = ratios or [round(0.02 * i, 2) for i in range(1, 51)]
    acceptances = acceptances or [round(0.02 * i, 2) for i in range(0, 50)]
    ex = grid_expectations(acceptances, ratios, t_target, sp, rule=lookahead_rule)
    total = {m: t_target + (n_tokens - 1) * ex[m] for m in ("non_si", "si", "dsi")}
    grids = {"dsi_vs_si": (total["si"] / total["dsi"]).tolist(),
             "dsi_vs_non_si": (total["non_si"] / total["dsi"]).tolist(),
             "si_vs_non_si": (total["non_si"] / total["si"]).tolist()}
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
    rule = "least expected latency" if lookahead_rule == "expected" else "smallest with no waits"
    fig.suptitle(f"expected speedups, {sp} target servers, {n_tokens} tokens (DSI lookahead: {rule})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"png": out, "ratios": ratios, "acceptances": acceptances, "grids": grids}


def from_generate(report: dict) -> dict:
    """Simulator inputs from a `draftlab generate --json` (or eval) report: per-forward latencies from its time
    split and the i.i.d. acceptance rate that explains its accept length for its tree depth.

    The target's time per step is everything a step spends but drafting: the verify forward, and the acceptance
    and commit the step needs before the next draft (on the eager path they are calls of their own, on the fused
    compiled path inside the verify call; counting only `verify` left out a fifth of an eager step). `path` says
    which path the figures are from: a compiled run whose graphs fell back ran eagerly."""
    if report.get("chained_steps"):
        raise ValueError("the report's drafting ran inside its verification calls (the compiled path's chained step), "
                         "so its time split has no drafting time of its own; make the report with "
                         "DRAFTLAB_CHAINED_STEP=0 (the same tokens, drafting in calls of its own)")
    steps = max(report["steps"], 1)
    split = report.get("time_split_s", {})
    drafter = report.get("drafter") or {}
    depth = drafter.get("tree_depth", drafter.get("depth"))  # (a static tree's depth; EAGLE-3's dynamic tree's)
    if depth is None:
        raise ValueError(f"the report's drafter ({drafter.get('kind', 'unknown')}) names no tree depth, which the "
                         "acceptance rate is solved for; give --acceptance and the latencies instead")
    depth = max(int(depth), 1)
    t_target = sum(split.get(k, 0.0) for k in ("verify", "accept", "commit")) / steps
    t_draft = split.get("draft", 0.0) / steps / depth
    tau = report["accept_length"]  # E = (1 - a^(depth+1)) / (1 - a); solve for a by bisection
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        e = depth + 1 if mid >= 1 else (1 - mid ** (depth + 1)) / (1 - mid)
        lo, hi = (mid, hi) if e < tau else (lo, mid)
    failed = report.get("compile_failed")
    path = ("compiled" if not failed else f"eager (the compile fell back: {failed})") if report.get("compiled") \
        else "eager"
    return {"t_target": t_target, "t_draft": t_draft, "acceptance": round(lo, 4), "depth": depth, "path": path,
            "batch_size": report.get("batch_size"), "kind": drafter.get("kind")}


def drafts_ahead_note(kind: str | None) -> str | None:
    """What the model assumes of a drafter that a report's kind is not: one that drafts ahead of verification on
    its own tokens (an SSM: `draftlab dsi` takes those). Heads, EAGLE-3 and DFlash read the base's hidden states of
    the verified tokens (walk-through: a Medusa report was modelled without a word)."""
    if kind in (None, "ssm"):
        return None
    return (f"its drafter ({kind}) reads the base's hidden states of the verified tokens, so it cannot draft ahead of "
            "verification: the DSI figures describe a drafter that could, with these latencies (`draftlab dsi` "
            "takes ssm exports); its drafting time is taken per level of its tree"
            + (", though its heads draft every level in one forward" if kind in ("medusa", "hydra") else ""))
