"""Ensembles of drafters behind the one drafter interface.

merge (SpecInfer): every active member drafts its own tree; the trees are merged into one trie per row (equal
    prefixes shared) and cut to a node budget, highest-priority nodes first; one base forward verifies it. With
    sampled drafts each member's candidates keep that member's q, so siblings drawn by different members stay
    separate nodes even when their tokens are equal (a shared node would have no single q).
vote (Minions): every active member drafts a chain of s tokens; the chains form a weighted trie (a node weighs the
    summed weights of the members whose chain passes through it) and one sequence is chosen from the root by
    taking, at each level, the heaviest child; that sequence alone is verified. Member weights follow their
    acceptance (reward / punish), and s adapts online (AdaptiveLength).
A Scheduler decides which members draft each step, so a useless member stops costing time; a member that sits out a
step is given the text it missed when it next drafts.

Members that are small LMs of one architecture and shape drafting one tree run as one grouped model (ssm.grouped_lm):
one forward per tree depth for all of them, their rows side by side, instead of one per member. A paused member of a
group still drafts (its rows cost next to nothing beside the others'); its tree is left out of the merge or vote.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from itertools import chain

import torch

from ..decode.cache import prefill_width
from ..decode.compiled import compiled_function, compiled_graphs
from ..decode.decoder import pad_proposal
from ..decode.search import held_along
from ..decode.tree import Tree
from ..decode.tree import TreeView
from .base import Drafter, PromptState, Proposal, StepResult
from .ssm import GroupError, SSMDrafter, group_key, grouped_lm
from .retrieval import padded_proposal
from .tree_merge import member_index, merge_layout, merge_row, merge_trees, vote_chains, vote_row


SCHEDULE_POLICIES = ("gain", "cost")
DECIDE_EVERY = 8  # the cost policy's steps between choices (each choice reads every kept row once per member count)


# Steps a schedule's history keeps: a server decodes for days, and the history's readers (benchmarks, tests) look at
# one run's steps; it is trimmed to this length when it reaches twice it, so appending stays O(1) per step.
HISTORY = 16384
# The ensemble's log of committed text keeps the steps some member has not followed yet; it is trimmed every
# LOG_KEEP steps.
LOG_KEEP = 256


def _note(history: list, entry) -> None:
    history.append(entry)
    if len(history) >= 2 * HISTORY:
        del history[:-HISTORY]


@dataclass
class Scheduler:
    """Which members draft. A member's gain is the number of accepted drafted tokens its own tree held, tracked as
    an exponential moving average (`decay`). Gains also weigh the members' nodes when a merged tree is cut to its
    budget. Two policies:

    gain (default): after `warmup` steps a member whose gain is below `min_share` of the best member's is paused; a
        paused member drafts again every `probe_every` steps, so one that starts to help comes back.
    cost: the members that draft are the first k of a ranking (by accepted length on the last `rank_window` rows
        where every member drafted or was scored, see `ranking`), with k chosen for the most tokens per second: the
        expected accepted length of those k, E[max over them of the accepted tokens their own trees held] + 1, over
        the steady-state seconds of a step with k members drafting, the fastest of the last `explore` x 3 steps timed
        with k. A step's seconds leave out those spent feeding members the text they missed (a member that drafts
        again after sitting out pays for the text it missed, whichever k it drafts in); steps that compiled are not
        timed; a step that the machine slowed is slower, never faster (a quantile of slow samples could price a k
        out for good: a k not chosen is not timed again).
        The lengths come from the last `cost_window` rows on which those k drafted or were scored: rows of steps
        with two members or more (the warm-up's, the exploration's, the probes'), and with `rank_on` text (greedy, SSM
        members) rows of the steps one member drafted alone, the others scored at the next probe on the text
        committed meanwhile (what their trees would have held there, from the ranks of the text's tokens under their
        logits: under greedy exactly what they would have held). With `rank_on` probes, or sampling, a lone member's
        steps add no rows, so every k, 1 included, is estimated on the same kind of rows. After `warmup` steps with
        every member, each k is timed `explore` steps, then the best k drafts (chosen again every 8 steps), and every
        member drafts on probe steps to keep the lengths of the members not drafting current: first `probe_every`
        steps apart, the interval doubling while the choice stands, up to where probes cost `probe_share` of the
        decoding time and never past `probe_max`: that bound is a probe's extra seconds (its mean timed seconds, plus
        the mean seconds a probe spends feeding the members that sat out the text they missed, less the chosen k's
        step seconds) divided by `probe_share` times the chosen k's step seconds. The feeding is the larger part on a
        CPU: a probe begins every member that sat out since the run began with a prefill over the text so far, and
        scores them on it. Between a choice and the next choice or probe the choice stands, and a step reuses it
        (active) without reading the records again.
        With one member the ensemble is that member: its tree alone is verified, and where it chains (SSMs on a
        compiled CPU path) the ensemble chains too.
    """

    min_share: float = 0.1
    decay: float = 0.9
    warmup: int = 8
    probe_every: int = 16
    policy: str = "gain"
    explore: int = 3
    cost_window: int = 256
    rank_window: int = 4096
    probe_share: float = 0.02
    probe_max: int = 4096
    rank_on: str = "text"
    gains: list[float] = field(default_factory=list)
    steps: int = 0
    history: list[list[bool]] = field(default_factory=list)  # who drafted, per step (the last HISTORY steps or more)
    # The cost policy's records: step seconds per member count, and per row the accepted tokens each member's own
    # tree held (None: it did not draft).
    seconds: list[list[float]] = field(default_factory=list)
    lengths: list[list] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # members, best first (ranking)
    row_updates: int = 0  # steps that added rows to `lengths`
    k: int = 0  # the cost policy's last choice (0: none yet)
    probed_k: int = 0  # its choice at the last probe
    interval: int = 0
    next_probe: int = 0
    next_choice: int = 0
    fed: list[float] = field(default_factory=list)  # seconds the last probes (every member drafting) spent feeding
    steady_until: int = 0  # the standing choice's last step + 1 (the next probe or choice), and who drafts until then
    steady_on: list[bool] = field(default_factory=list)
    rows: int = 0  # the batch size of the run: `seconds` and `fed` are its own (by_rows holds every batch size's)
    by_rows: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.policy not in SCHEDULE_POLICIES:
            raise ValueError(f"ensemble option policy={self.policy!r}: use gain (pause members that help little) or "
                             "cost (draft with the members that give the most tokens per second)")
        if not self.probe_share > 0:
            raise ValueError(f"ensemble option probe_share={self.probe_share}: the share of the decoding time probes "
                             "may take must be > 0 (a tiny share, e.g. 1e-9, leaves probe_max the only bound)")
        if self.rank_on not in ("text", "probes"):
            raise ValueError(f"ensemble option rank_on={self.rank_on!r}: use text (every member scored on the text "
                             "committed while it sat out, greedy) or probes (the rows where every member drafted)")
        for name in ("probe_every", "probe_max", "explore", "cost_window", "rank_window"):
            if getattr(self, name) < 1:  # (0 would probe every step, or keep every record for good)
                raise ValueError(f"ensemble option {name}={getattr(self, name)}: must be at least 1")
        if self.warmup < 0:
            raise ValueError(f"ensemble option warmup={self.warmup}: must be 0 or more")

    def reset(self, n: int, rows: int = 1) -> None:
        """A run of n members over `rows` rows. A step's seconds depend on the batch size: each batch size keeps its
        own (explored once, when first met), and the member count is chosen again from them; the lengths (what the
        members' trees held) are the same whatever the batch size, and stay."""
        if len(self.gains) != n:
            self.gains, self.by_rows, self.rows = [1.0] * n, {}, 0
            self.lengths, self.order, self.k, self.probed_k = [], [], 0, -1
            self.__dict__.pop("_memo", None)
            self.interval, self.next_probe, self.next_choice, self.steady_until = self._first_interval, 0, 0, 0
        if rows != self.rows:
            self.seconds, self.fed = self.by_rows.setdefault(rows, ([[] for _ in range(n + 1)], []))
            self.rows, self.k, self.steady_until = rows, 0, 0

    def active(self) -> list[bool]:
        if self.policy == "cost":
            if self.steps < self.steady_until:  # the choice stands (_count would return it unread)
                on = self.steady_on
            else:
                k = self._count()
                on = [False] * len(self.gains)
                for m in (self.order or self.ranking())[:k]:
                    on[m] = True
                if self.steady_until > self.steps:
                    self.steady_on = on
        elif self.steps < self.warmup:
            on = [True] * len(self.gains)
        else:
            best = max(self.gains)
            on = [g >= self.min_share * best or self.steps % self.probe_every == 0 for g in self.gains]
        _note(self.history, on)
        return on

    def _count(self) -> int:
        """The cost policy's member count for the next step (see the class docstring)."""
        n = len(self.gains)
        if self.steps < self.warmup:
            return n
        for k in range(1, n):
            if len(self.seconds[k]) < self.explore:
                return k
        if self.steps >= self.next_probe:  # the interval doubles while the choice stands from probe to probe
            self.interval = (min(2 * self.interval, self._probe_cap(n)) if self.k == self.probed_k else
                             self._first_interval)
            self.probed_k, self.next_probe = self.k, self.steps + self.interval
            return n
        if self.steps >= self.next_choice or not self.k:  # chosen again every DECIDE_EVERY steps
            self.order = self.ranking()
            rates = self.rates(self.order)
            self.k = max(rates, key=lambda k: (rates[k], -k)) if rates else n
            self.next_choice = self.steps + DECIDE_EVERY
        # Until the next probe or choice every step returns this k (the exploration is over and stays over: the step
        # seconds of each k are only ever trimmed to 3 x explore).
        self.steady_until = min(self.next_probe, self.next_choice)
        return self.k

    @property
    def _first_interval(self) -> int:
        """The probe interval after a change of choice: probe_every, never past probe_max."""
        return min(self.probe_every, self.probe_max)

    def _probe_cap(self, n: int) -> int:
        """The longest probe interval: probes then cost `probe_share` of the time (see the class docstring), at
        least `probe_every` and at most `probe_max` steps apart."""
        probe, step = self.seconds[n], self.seconds[self.k] if self.k else []
        if not probe or not step or self.k == n:
            return self.probe_max
        extra = sum(probe) / len(probe) + (sum(self.fed) / len(self.fed) if self.fed else 0.0) - min(step)
        return min(self.probe_max, max(self._first_interval, math.ceil(extra / (self.probe_share * min(step)))))

    def ranking(self) -> list[int]:
        """The cost policy's members, best first: by the accepted tokens each one's tree held over the last
        `rank_window` rows on which every member drafted or was scored (the warm-up's, the probes' and, with rank_on
        text, the lone steps' scored at a probe: one comparison for all, which changes only when rows are added, so a
        lone member is not swapped for another on noise), then by gain."""
        mean = self._over_rows("ranking", self._summed_lengths)
        return sorted(range(len(self.gains)), key=lambda m: (-mean[m], -self.gains[m], m))

    def _summed_lengths(self) -> list[float]:
        full = [row for row in self.lengths[-self.rank_window:] if None not in row]
        return [sum(row[m] for row in full) for m in range(len(self.gains))]

    def _over_rows(self, key, compute):
        """compute() once while the rows stay the same (they change only on steps with two members or more and at
        probes; a lone member's steps, nearly all of them, reuse the sums)."""
        memo = self.__dict__.setdefault("_memo", {})
        if memo.get("rows") != self.row_updates:
            memo.clear()
            memo["rows"] = self.row_updates
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def _held_by_k(self, order: tuple) -> tuple[list[float], list[int]]:
        """Per k: the summed max length of the first k of `order`, and the rows on which they all drafted."""
        held, rows = [0.0] * len(order), [0] * len(order)
        for row in self.lengths[-self.cost_window:]:  # one pass: the top k's max grows with k while they all drafted
            best = -1
            for i, m in enumerate(order):
                if row[m] is None:
                    break
                best = max(best, row[m])
                held[i] += best
                rows[i] += 1
        return held, rows

    def rates(self, order: list[int]) -> dict[int, float]:
        """Expected tokens per second with the first k members of `order` drafting, for each k measured so far."""
        held, rows = self._over_rows(tuple(order), lambda: self._held_by_k(tuple(order)))
        out = {}
        for i in range(len(order)):
            times = self.seconds[i + 1]
            if rows[i] and times:
                out[i + 1] = (held[i] / rows[i] + 1) / min(times)
        return out

    def update(self, gains: list[float | None], rows: list[list] | None = None, seconds: float | None = None,
               fed: float = 0.0) -> None:
        """One step: each member's gain (None: it did not draft); for the cost policy also, per live row, the
        accepted tokens each member's own tree held (kept from steps of two members or more), the step's seconds
        (None: not timed) and the seconds it spent feeding members the text they had missed (outside `seconds`)."""
        self.steps += 1
        k = 0  # members that drafted
        for m, g in enumerate(gains):
            if g is not None:
                self.gains[m] = self.decay * self.gains[m] + (1 - self.decay) * g
                k += 1
        if self.policy == "cost":
            if seconds is not None and k:
                self._timed(k, seconds)
                if k == len(gains) and self.steps > self.warmup:  # a probe (every member drafted past the
                    # warm-up): what it fed is its cost too (the warm-up's steps feed nothing)
                    self.fed.append(fed)
                    del self.fed[: -3 * self.explore]
            if k >= 2 and rows:  # a lone member's rows come from the text, if at all (add_rows)
                self.add_rows(rows)

    def update_one(self, m: int, gain: float, seconds: float | None) -> None:
        """update() for a step member m drafted alone, with no rows and nothing fed: the same records, read less (a
        lone member's steps are nearly all of them)."""
        if len(self.gains) == 1:
            return self.update([gain], None, seconds)
        self.steps += 1
        self.gains[m] = self.decay * self.gains[m] + (1 - self.decay) * gain
        if self.policy == "cost" and seconds is not None:
            self._timed(1, seconds)

    def _timed(self, k: int, seconds: float) -> None:
        """A step's seconds with k members drafting; the last 3 x explore are kept."""
        self.seconds[k].append(seconds)
        del self.seconds[k][: -3 * self.explore]

    def add_rows(self, rows: list[list]) -> None:
        """Rows for the cost policy: per row of a step, the accepted tokens each member's own tree held or, for a
        member that did not draft, would have held (None: not known)."""
        self.lengths += rows
        self.row_updates += 1
        keep = max(self.cost_window, self.rank_window)
        if len(self.lengths) > 2 * keep:  # trimmed now and then: appending stays O(1) per step
            del self.lengths[: -keep]


@dataclass
class VoteWeights:
    """Minions' member weights (weighted majority), updated once per verified batch.

    Each row's vote has one winner: the member whose chain the chosen sequence is (of members with equal chains,
    the heaviest, then the first). After the batch is verified, every member that won at least one row gets its
    acceptance ratio over the rows it won in this batch (accepted drafted tokens / drafted tokens); its weight is
    multiplied by `reward_factor` when the ratio > `reward_threshold` and by `punish_factor` when it is <
    `punish_threshold`, once per batch whatever the number of rows; then the weights are renormalised to sum to the
    number of members. Reading of the paper: the ratio is the batch's, not a running mean (a running mean would let
    old batches decide today's reward), and a batch of B rows is one verification, not B of them (B updates per
    step multiplied a weight by reward_factor**B and locked one member in).
    No weight falls below `weight_floor` (draftlab's, not the paper's): without one, a member that lost for
    thousands of batches had a weight of 1e-323 and, once it became the best, needed about as many batches to win a
    row again; a server runs for days.
    """

    reward_factor: float = 1.2
    punish_factor: float = 0.8
    reward_threshold: float = 0.6
    punish_threshold: float = 0.3
    weight_floor: float = 1e-3
    weights: list[float] = field(default_factory=list)
    updates: int = 0  # verified batches seen

    def reset(self, n: int) -> None:
        if len(self.weights) != n:
            self.weights, self.updates = [1.0] * n, 0

    def update(self, won: dict[int, tuple[int, int]]) -> None:
        """One verified batch: won[m] = (accepted, drafted) tokens summed over the rows member m won."""
        self.updates += 1
        for m, (accepted, drafted) in won.items():
            if drafted <= 0:
                continue
            rate = accepted / drafted
            if rate > self.reward_threshold:
                self.weights[m] *= self.reward_factor
            elif rate < self.punish_threshold:
                self.weights[m] *= self.punish_factor
        total = sum(self.weights)
        self.weights = [max(w * len(self.weights) / total, self.weight_floor) for w in self.weights]


ADAPTIVE_RULES = ("trend", "regression")
ADAPTIVE_METRICS = ("step", "verify")


@dataclass
class AdaptiveLength:
    """Minions' adaptive speculation length s.

    Each verification records a cost: the time per verified token (`metric` "verify": the verification alone, the
    paper's t_LLM / vl, for a pipeline that hides drafting; "step": drafting + verification + acceptance over the
    tokens the step committed, for decoders that draft and verify in turn, the default of the plain loop). Every
    `decision_threshold` records s may move by one decision, within [s_min, s_max]:

    rule "trend" (default, Minions): the trend of the cost over time, the least-squares slope against the
    verification index of the records since the previous decision and of the period before it. Cost falling since
    s last moved: s moves again the same way (by `s_reward`); rising: s moves back (by `s_punish`) and the direction
    turns; flat: s stays. The first decision has nothing to compare with and moves up by `s_reward`; at a bound the
    direction turns. Reading of the paper, which names the trend of t_LLM / vl over time and the reward / punish
    steps but not the direction: a rule "falling -> longer, rising -> shorter" whatever the last move was cannot come
    down to an optimum below s (at s above it, moving up costs more, moving back down then looks like an improvement
    and sends s up again), so the last move's direction is kept.
    rule "regression" (draftlab's earlier rule): a line cost = a + b * s fitted over the last `window` records
    (which span the recent lengths): b > 0 -> s -= s_punish, b < 0 -> s += s_reward; while the window holds one
    length only there is no slope, and s steps up by s_reward (down at s_max) to get a second point.
    """

    s: int = 4
    s_min: int = 1
    s_max: int = 12
    decision_threshold: int = 8
    window: int = 24
    s_reward: int = 1
    s_punish: int = 1
    metric: str = "step"
    rule: str = "trend"
    records: list[tuple[int, float]] = field(default_factory=list)  # (s, cost) per verification, oldest first
    since: int = 0
    direction: int = 1  # the trend rule's last move: +1 up, -1 down
    period: int = 0  # the trend rule: records of the period before the current one (0: none yet)
    history: list[int] = field(default_factory=list)  # s per step (the last HISTORY steps or more)
    count: int = 0  # verifications recorded

    def __post_init__(self):
        if self.rule not in ADAPTIVE_RULES:
            raise ValueError(f"ensemble option rule={self.rule!r}: use one of {', '.join(ADAPTIVE_RULES)} "
                             "(trend is Minions' rule)")
        if self.metric not in ADAPTIVE_METRICS:
            raise ValueError(f"ensemble option metric={self.metric!r}: use step (draft + verify time, the plain loop) "
                             "or verify (the verification alone, a pipeline)")
        if not 1 <= self.s_min <= self.s_max:
            raise ValueError(f"ensemble options s_min={self.s_min}, s_max={self.s_max}: need 1 <= s_min <= s_max")
        if self.decision_threshold < 2:
            raise ValueError(f"ensemble option decision_threshold={self.decision_threshold}: needs >= 2 records per "
                             "decision (a trend needs two points)")

    def record(self, time_s: dict, committed: float) -> None:
        """One verification: its seconds per phase and the tokens it verified (mean per row, the bonus included)."""
        t = time_s.get("verify", 0.0) if self.metric == "verify" else sum(time_s.values())
        keep = max(self.window, 2 * self.decision_threshold)
        self.records = (self.records + [(self.s, t / max(committed, 1e-9))])[-keep:]
        self.since += 1
        self.count += 1
        _note(self.history, self.s)
        if self.since >= self.decision_threshold:
            self.decide()

    def slope(self) -> float | None:
        """The regression rule's b in cost = a + b * s over the last `window` records; None for a single length."""
        recs = self.records[-self.window:]
        xs = [s for s, _ in recs]
        if len(set(xs)) < 2:
            return None
        ys = [c for _, c in recs]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)

    def trend(self) -> float | None:
        """The trend rule's slope of cost against time over this period and the one before; None before a move."""
        if not self.period:
            return None
        ys = [c for _, c in self.records[-(self.since + self.period):]]
        n = len(ys)
        mx, my = (n - 1) / 2, sum(ys) / n
        return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))

    def decide(self) -> None:
        """Move s by the rule (see the class docstring) and start a new period."""
        if self.rule == "regression":
            b = self.slope()
            if b is None:
                step = self.s_reward if self.s < self.s_max else -self.s_punish
            else:
                step = -self.s_punish if b > 0 else self.s_reward if b < 0 else 0
        else:
            b = self.trend()
            if b is not None and b > 0:
                self.direction = -self.direction  # the last move made it worse: go back
            if b is not None and b == 0:
                step = 0
            else:
                step = self.direction * (self.s_punish if b is not None and b > 0 else self.s_reward)
                if not self.s_min <= self.s + step <= self.s_max:  # at a bound: the other way
                    self.direction = -self.direction
                    step = -step
        self.s = min(self.s_max, max(self.s_min, self.s + step))
        self.period, self.since = self.since, 0  # the trend compares the next period with this one


def _held(paths: list[list[int]], live: list[bool]) -> float:
    """A member's gain in one step: the drafted tokens its own paths held (root excluded), a mean over the live rows
    (over every row once all have ended)."""
    held = [len(p) - 1 for p, ok in zip(paths, live) if ok] or [len(p) - 1 for p in paths]
    return sum(held) / len(held)


def _own_path(owners: list[list[int]], parents: list[int], m: int, path: list[int]) -> list[int]:
    """Member m's node indices along an accepted path of the merged tree, as far as its own tree holds it (root first;
    owners: a row's [node][member] indices, -1 where the node is not the member's; parents: the member's tree's parents
    in that row): the member's own path to the deepest node of `path` it holds, up its own parents. Not owners along
    the path: where the member's tree repeats a token under one parent, the merge shares the two nodes (owned as the
    later one), and the earlier one's children hang under the shared node too."""
    i = 0
    for n in path[1:]:  # the nodes a member holds on a path are a prefix of it (a node's parent is the member's too)
        if owners[n][m] < 0:
            break
        i = owners[n][m]
    own = [i]
    while i > 0:
        i = parents[i]
        own.append(i)
    return own[::-1]


def _host(x) -> list:
    """A tensor's values as lists (one copy to the host); a list as it is."""
    return x.tolist() if isinstance(x, torch.Tensor) else x


def _depth_bound(member: Drafter) -> int:
    """A bound on the depth of a member's trees: its static tree's, a lookup's continuation length, else its nodes."""
    tree = getattr(member, "tree", None)
    if isinstance(tree, Tree):
        return tree.depth
    return getattr(member, "num_tokens", member.max_nodes - 1)


@dataclass
class MemberGroup:
    """Ensemble members (indices) drafting as one grouped model, and this step's proposal of the whole group."""

    members: list[int]
    drafter: SSMDrafter
    prop: Proposal | None = None


def ensemble_parts(options: dict, length: int = 4) -> tuple[Scheduler, VoteWeights, AdaptiveLength]:
    """Scheduler, vote weights and adaptive length from `name=value` options; each name is a field of one of
    them (min_share, decay, warmup, probe_every, policy, explore, cost_window, rank_window, probe_share, probe_max,
    rank_on; reward_factor, punish_factor, reward_threshold, punish_threshold, weight_floor; s_min, s_max,
    decision_threshold,
    window, s_reward, s_punish, metric, rule), typed as its default is. An unknown name is an error listing the known
    ones."""
    from dataclasses import fields

    parts = (Scheduler(), VoteWeights(), AdaptiveLength(s=length))
    state = ("steps", "since", "s", "updates", "direction", "period", "k", "probed_k", "row_updates", "interval",
             "next_probe", "next_choice", "count", "steady_until", "rows", "by_rows")  # running state
    known = {f.name: (i, type(getattr(parts[i], f.name))) for i, p in enumerate(parts) for f in fields(p)
             if not isinstance(getattr(p, f.name), list) and f.name not in state}
    for name, value in options.items():
        if name not in known:
            raise ValueError(f"ensemble option {name!r}: known options are {', '.join(sorted(known))}")
        i, typ = known[name]
        try:
            setattr(parts[i], name, typ(value))
        except ValueError:
            raise ValueError(f"ensemble option {name}={value!r}: expected a {typ.__name__}") from None
    parts[0].__post_init__()  # the schedule's policy and the adaptive length's choices (rule, metric, bounds) checked
    parts[2].__post_init__()
    return parts


def extended_prompt(prompt: PromptState, extra: list[list[int]]) -> PromptState:
    """The prompt with tokens appended to each row (rows left-padded again; no base states)."""
    ids, valid = prompt.ids.tolist(), prompt.valid.tolist()
    rows = [[t for t, ok in zip(r, v) if ok] + e for r, v, e in zip(ids, valid, extra)]
    L = max(len(r) for r in rows)
    new = torch.tensor([[0] * (L - len(r)) + r for r in rows], dtype=prompt.ids.dtype)
    ok = torch.tensor([[False] * (L - len(r)) + [True] * len(r) for r in rows])
    dev = prompt.ids.device
    return PromptState(new.to(dev), ok.to(dev), ((ok.long().cumsum(-1) - 1).clamp(min=0)).to(dev),
                       room=max(prompt.room - max(len(e) for e in extra), 0))


class EnsembleDrafter(Drafter):
    """Several drafters as one (see the module docstring for the two modes)."""

    def __init__(self, members: list[Drafter], names: list[str] | None = None, mode: str = "merge",
                 node_budget: int = 64, scheduler: Scheduler | None = None, vote: VoteWeights | None = None,
                 adaptive: AdaptiveLength | None = None, length: int = 4, batch_members: bool = True):
        if mode not in ("merge", "vote"):
            raise ValueError(f"ensemble mode {mode!r}: use merge or vote")
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members, self.mode, self.node_budget = members, mode, node_budget
        self.names = names or [f"member{i}" for i in range(len(members))]
        self.scheduler = scheduler
        stuck = [n for n, m in zip(self.names, members) if type(m).follow is Drafter.follow]
        if scheduler is not None and stuck:
            raise ValueError(f"ensemble members {', '.join(stuck)} read the base's states of every step and cannot "
                             "sit out a step, which the ensemble's scheduler has members do: build the ensemble "
                             "with scheduler=None (every member drafts every step)")
        # The cost policy drafts with some members only, each on its own: a grouped model would draft every member's
        # rows whoever is paused, so drafting with fewer would save nothing.
        self.cost = scheduler is not None and scheduler.policy == "cost"
        if self.cost and mode != "merge":
            raise ValueError("the ensemble's cost schedule (policy=cost) chooses members for a merged tree: use mode "
                             "merge")
        self.plan: list[bool] | None = None  # the cost policy: who drafts at the next step (see _advance)
        self.solo: int | None = None  # the one member drafting this step alone (the cost policy), if any
        self._one_memo: tuple = (None, None)  # _one's last list and answer
        self.lap: float | None = None  # when the last step was committed (the cost policy's step seconds)
        self.graphs = 0  # graphs compiled in this process by then
        self.vote = vote or VoteWeights()
        self.adaptive = adaptive if mode == "vote" else None
        if self.adaptive is not None and not self.adaptive.s_min <= self.adaptive.s <= self.adaptive.s_max:
            a = self.adaptive
            raise ValueError(f"the adaptive length starts at {a.s} (--length), outside [s_min, s_max] = [{a.s_min}, "
                             f"{a.s_max}]: give a --length in that range, or the options s_min / s_max")
        self.hidden_layers = tuple(sorted({l for m in members for l in m.hidden_layers}))
        # Seconds spent in the members' own proposals and commits, and in the ensemble's bookkeeping (merging,
        # voting, weights, schedule): the latter is the ensemble's overhead.
        self.time_s = {"members": 0.0, "ensemble": 0.0}
        self.groups: list[MemberGroup] = []
        if mode == "vote":  # every member drafts a chain: of the adaptive length, or of `length` tokens
            self._set_length(self.adaptive.s if self.adaptive is not None else length)
        if batch_members and not self.cost:
            self.groups = self._group()
        self.grouped = {m for g in self.groups for m in g.members}
        self.fits = [m.max_nodes <= self.max_nodes for m in members]  # trees a step may verify alone (merge mode)

    def _group(self) -> list["MemberGroup"]:
        """Groups of two or more SSM members of one architecture, shape and tree, each run as one grouped model; a
        set of such members whose layers do not group drafts one by one, said in one line."""
        buckets: dict = {}
        for m, d in enumerate(self.members):
            if isinstance(d, SSMDrafter):
                key = (group_key(d.lm), d.tree.paths)
                buckets.setdefault(key, []).append(m)
        groups = []
        for ms in buckets.values():
            if len(ms) < 2:
                continue
            try:
                lm = grouped_lm([self.members[m].lm for m in ms])
            except GroupError as e:
                print(f"draftlab: ensemble members {', '.join(self.names[m] for m in ms)} draft one by one ({e})",
                      file=sys.stderr)
                continue
            groups.append(MemberGroup(ms, SSMDrafter(lm, self.members[ms[0]].tree)))
        return groups

    @property
    def max_nodes(self) -> int:
        if self.mode == "vote":
            return 1 + (self.adaptive.s_max if self.adaptive else self.length)
        return 1 + min(self.node_budget, sum(m.max_nodes - 1 for m in self.members))

    def clock_choices(self) -> str | None:
        if self.adaptive is not None:
            return "the ensemble's adaptive length (--adaptive) moves"
        return "the ensemble's cost schedule (policy=cost) chooses its members" if self.cost else None

    def compile_failed(self) -> str | None:
        parts = [*self.members, *(g.drafter for g in self.groups)]
        return super().compile_failed() or next((f for f in (m.compile_failed() for m in parts) if f), None)

    def describe(self) -> dict:
        d = {"kind": "ensemble", "mode": self.mode, "members": [m.describe() for m in self.members],
             "max_nodes": self.max_nodes}
        if self.groups:
            d["batched_members"] = [[self.names[m] for m in g.members] for g in self.groups]
        if self.cost:
            d.update(schedule="cost", members_drafting=self.scheduler.k or len(self.members))
        if self.mode == "vote":
            d.update(weights=[round(w, 3) for w in self.vote.weights], verified_batches=self.vote.updates)
        if self.adaptive is not None:
            d.update(speculation_length=self.adaptive.s, length_metric=self.adaptive.metric,
                     length_records=self.adaptive.count)
        return d

    # --- state --------------------------------------------------------------------------------------------
    def begin(self, prompt: PromptState, sampling, generator) -> None:
        self.sampling, self.start_args = sampling, (prompt, sampling, generator)
        # Under the cost policy a member begins (its prefill) when it first drafts in this run: a run that one member
        # drafts alone pays one prefill, not one per member. A member that sits out a step is given the text of the
        # steps it missed when it next drafts (_ready), not at every step.
        self.started = [i in self.grouped for i in range(len(self.members))]
        self.log: list[list[list[int]]] = []  # per step: the tokens it committed per row (root first, bonus excluded)
        self.log0, self.trim_at = 0, LOG_KEEP  # the step log[0] holds (steps every member has followed are dropped)
        self.text_s = 0.0  # seconds this step spent feeding members the text they missed (not the step's own cost)
        self.seen = [0] * len(self.members)  # per member: the steps of the log it has followed
        # The cost policy's text ranking (greedy, every member an SSM): per step one member drafted alone, that member
        # and the tokens its tree held per row; per such step, what the other members' trees would have held (member
        # -> row -> tokens), scored when they catch up with the text at a probe (_score).
        self.text = (self.cost and self.scheduler.rank_on == "text" and sampling.temperature <= 0
                     and all(isinstance(m, SSMDrafter) for m in self.members))
        self.lone: dict[int, tuple[int, list]] = {}
        self.would: dict[int, dict[int, dict[int, int]]] = {}
        if not self.cost:
            for i in range(len(self.members)):
                self._ready(i)
        for g in self.groups:  # the prompt once per member, member-major
            g.drafter.decode_path = self.decode_path
            k = len(g.members)
            g.drafter.begin(PromptState(prompt.ids.repeat(k, 1), prompt.valid.repeat(k, 1),
                                        prompt.positions.repeat(k, 1), room=prompt.room), sampling, generator)
        n = len(self.members)
        if self.scheduler is not None:
            self.scheduler.reset(n, prompt.ids.shape[0])
        self.vote.reset(n)
        # (self.plan stays: the members the schedule chose, at the last run's last step, for the step after it, which
        # is this run's first; dropped, a probe planned there would be lost and the schedule's history would hold a
        # step that never ran)
        self.solo, self.lap, self.text_s = None, None, 0.0

    def _ready(self, m: int, score: bool = False, narrow: bool = False) -> None:
        """Member m drafts this step: its begin if it has not begun in this run, then the text of the steps it sat out
        (a grouped member's group follows every step itself). An SSM is fed a long backlog now, in chunks (catch_up);
        narrow: all of it but the last token, so its feed is narrow (drafting alone, it chains). score: all of it too,
        and what the member's tree would have held at the lone steps it sat out is scored from it (_score)."""
        if m in self.grouped:
            return
        t0, first = time.perf_counter(), self.seen[m]
        missed, self.seen[m] = self.log[first - self.log0:], self.log0 + len(self.log)
        unseen = [list(chain.from_iterable(step[b] for step in missed)) for b in range(len(missed[0]))] if missed \
            else None
        member = self.members[m]
        score = score and unseen is not None
        if score:  # the tokens fed before the text it missed: what it had pending, or (begun now) the prompt
            skip = [len(p) for p in member.pending] if self.started[m] else self.start_args[0].valid.sum(-1).tolist()
            member.ranks = [[] for _ in unseen]
        if not self.started[m]:
            prompt, sampling, generator = self.start_args
            member.decode_path = self.decode_path
            if unseen is not None and not member.hidden_layers:
                # A member that reads no base states takes the text so far as its prompt (all but each row's last
                # token, which it feeds with the next root as after any step): one prefill instead of a prefill and
                # forwards over the backlog (a probe begins the members that sat out). The prompt grows only up to
                # the width the run's own prompt is prefilled at (compiled: padded to prefill_width), a shape the
                # run's first member compiled: a longer one would compile a prefill of its own late in some run, in
                # the middle of decoding. The rest is fed as any backlog is (catch_up: one compiled shape).
                room = prefill_width(prompt.ids.shape[1])
                take = [max(0, min(len(u) - 1, room - n)) for u, n in zip(unseen, prompt.valid.sum(-1).tolist())]
                prompt = extended_prompt(prompt, [u[:t] for u, t in zip(unseen, take)])
                unseen = [u[t:] for u, t in zip(unseen, take)]
            member.begin(replace(prompt, hidden={l: prompt.hidden[l] for l in member.hidden_layers}), sampling,
                         generator)
            self.started[m] = True
        if unseen is not None:
            member.follow(unseen)
        if isinstance(member, SSMDrafter) and (score or narrow or member.behind()):
            member.catch_up(1 if score or narrow else member.feed_width - 1)
        if score:
            self._score(m, first, member.ranks, skip)
            member.ranks = None
        self.text_s += time.perf_counter() - t0

    def _score(self, m: int, first: int, ranks: list[list[int]], skip: list[int]) -> None:
        """What member m's tree would have held at the lone steps of the log from `first` on, per row: from the ranks of
        the text's tokens under its logits as it was fed the text (SSMDrafter.record_ranks; the first skip[b] are of
        tokens before that text), the longest run of them from the step's root that is a path of its tree. Under
        greedy that is exactly what its tree would have held (up to ties and rounding of the logits); a run that
        reaches the last rank known is not scored."""
        tree = self.members[m].tree
        paths, depth = set(tree.paths), tree.depth
        for b, (r, k) in enumerate(zip(ranks, skip)):
            r, i = r[k:], 0
            for s, step in enumerate(self.log[first - self.log0:], start=first):
                if s in self.lone and self.lone[s][1][b] is not None:
                    d = held_along(paths, r[i:i + depth])  # an unknown rank (-1) is on no path
                    if d == depth or (i + d < len(r) and r[i + d] >= 0):
                        self.would.setdefault(s, {}).setdefault(m, {})[b] = d
                i += len(step[b])

    def _text_rows(self) -> None:
        """At a step every member drafts: the rows of the lone steps since the last one (the tokens the lone member's
        tree held, and what every other member's would have) go to the schedule, complete rows only."""
        n, rows = len(self.members), []
        for s, (m, held) in self.lone.items():
            would = self.would.get(s, {})
            for b, h in enumerate(held):
                row = [h if i == m else would.get(i, {}).get(b) for i in range(n)]
                if None not in row:
                    rows.append(row)
        self.lone, self.would = {}, {}
        if rows:
            self.scheduler.add_rows(rows)

    def share_state(self, other: Drafter) -> None:
        if isinstance(other, EnsembleDrafter):
            self.scheduler, self.vote, self.adaptive = other.scheduler, other.vote, other.adaptive
            if self.mode == "vote" and self.adaptive is not None:
                self._set_length(self.adaptive.s)

    def _set_length(self, s: int) -> None:
        self.length = s
        for m in self.members + [g.drafter for g in getattr(self, "groups", [])]:
            if hasattr(m, "set_tree"):
                m.set_tree(Tree.chain(s))
            elif hasattr(m, "num_tokens"):
                m.num_tokens, m.max_matches = s, 1
            else:
                raise ValueError(f"vote mode needs members that draft chains of a set length; {type(m).__name__} "
                                 "does not (use mode: merge)")

    # --- proposals ----------------------------------------------------------------------------------------
    def propose(self, root: torch.Tensor) -> Proposal:
        t0 = time.perf_counter()
        if self.adaptive is not None and self.length != self.adaptive.s:  # moved by a step of a sharing drafter
            self._set_length(self.adaptive.s)
        self._advance()
        if self.solo is not None:
            return self._propose_solo(root, t0)
        probe = self.text and all(self.on)  # every member catches up: the lone steps since the last probe are scored
        for i, on in enumerate(self.on):
            if on:
                self._ready(i, score=probe)
        if probe:
            self._text_rows()
        self.props = [m.propose(root) if on and i not in self.grouped else None
                      for i, (m, on) in enumerate(zip(self.members, self.on))]
        for g in self.groups:
            self._propose_group(g, root)
        t1 = time.perf_counter()
        prop = self._merged(root)
        self.time_s["members"] += t1 - t0
        self.time_s["ensemble"] += time.perf_counter() - t1
        return prop

    def _merged(self, root: torch.Tensor) -> Proposal:
        """The members' trees as one proposal: on the static path by tree_merge's tensor forms (over rows and nodes,
        in one call, compiled with the decode path's compiling), on the eager path by its host reference, row by row.
        self.owners [B][node][member]: each member's node index at each node (-1: none; on the static path a tensor on
        the host); self.parents: per member drafting, its tree's parents [B][node] (which the commit walks up,
        _own_path); vote mode: self.winner, each row's winner (-1: none), self.drafted, the nodes drafted per row."""
        ks = tuple(m for m, p in enumerate(self.props) if p is not None)
        props, n, dev = [self.props[m] for m in ks], len(self.members), root.device
        weights = self.vote.weights if self.mode == "vote" else \
            self.scheduler.gains if self.scheduler is not None else [1.0] * n
        # Only lossless sampling reads q. Typical acceptance shares equal tokens between members (one node, several
        # owners, so no single q), and its rule needs none.
        share = not self._lossless_sampling
        sampled = self.mode == "merge" and not share and any(p.q is not None for p in props)
        offsets = [0]
        for p in props:
            offsets.append(offsets[-1] + (p.q.shape[1] if sampled and p.q is not None else 0))
        path = self.decode_path or {}
        static = bool(path.get("static"))
        if static:  # every tree at its member's max_nodes (a lookup's width varies step by step): one shape, one graph
            props = [pad_proposal(p, self.members[m].max_nodes) for p, m in zip(props, ks)]
        q_index = [p.q_index if p.q is not None else None for p in props] if sampled else None
        if not static:
            prop = self._merged_on_host(root, ks, props, weights, share, q_index, tuple(offsets[:-1]))
        else:
            # (Host to device without a stream sync; the results back the same way, read at the commit, after the
            # step's one host copy has synchronised: no sync inside the step on a GPU.)
            backend, w = path.get("compile"), torch.tensor(weights, dtype=torch.float64).to(dev, non_blocking=True)
            tokens, valid = [p.tokens for p in props], [p.view.valid for p in props]
            if self.mode == "vote":
                fn = compiled_function(vote_chains, backend, dev.type) if backend else vote_chains
                tok, par, ok, depth, anc, self.owners, self.winner = fn(tokens, valid, ks, n, w,
                                                                        member_index(ks, dev))
                self.drafted, q = ok[:, 1:].sum(1).to("cpu", non_blocking=True), None
                self.winner = self.winner.to("cpu", non_blocking=True)
            else:
                fn = compiled_function(merge_trees, backend, dev.type) if backend else merge_trees
                tok, par, ok, depth, anc, self.owners, q = fn(
                    tokens, [p.view.parents for p in props], valid, [p.view.depth for p in props],
                    merge_layout(tuple(t.shape[1] - 1 for t in tokens), ks, n, dev), n, w, self.node_budget, share,
                    max(_depth_bound(self.members[m]) for m in ks), q_index, tuple(offsets[:-1]))
            self.owners = self.owners.to("cpu", non_blocking=True)
            self.parents = {m: p.view.parents.to("cpu", non_blocking=True) for m, p in zip(ks, props)}
            prop = Proposal(tok, TreeView(par, depth, ok, anc), q_index=q)
        if sampled:
            prop.q = torch.cat([p.q for p in props if p.q is not None], dim=1)
        return prop

    def _merged_on_host(self, root: torch.Tensor, ks: tuple, props: list, weights: list, share: bool,
                        q_index: list | None, offsets: tuple) -> Proposal:
        """The eager path's merge or vote: tree_merge's reference rules, row by row on the host."""
        n, B = len(self.members), root.shape[0]
        host = [(p.tokens.tolist(), p.view.parents.tolist(), p.view.valid.tolist()) for p in props]
        qi = None if q_index is None else [None if x is None else x.tolist() for x in q_index]
        rows = []
        for b, r in enumerate(root.tolist()):
            trees = [(t[b], par[b], ok[b]) for t, par, ok in host]
            if self.mode == "vote":
                picked, owners, winner = vote_row([[x for x, v in zip(t[1:], ok[1:]) if v] for t, _, ok in trees],
                                                  ks, n, weights)
                rows.append(([r] + picked, list(range(-1, len(picked))), owners, None, winner))
            else:
                rows.append((*merge_row(trees, ks, n, weights, self.node_budget, share,
                                        None if qi is None else [None if x is None else x[b] for x in qi], offsets),
                             -1))
        prop = padded_proposal([(t, p) for t, p, *_ in rows], root.device)
        W = prop.tokens.shape[1]
        self.owners = [o + [[-1] * n] * (W - len(o)) for _, _, o, _, _ in rows]
        self.parents = {m: par for m, (_, par, _) in zip(ks, host)}
        self.winner, self.drafted = [r[4] for r in rows], [len(r[0]) - 1 for r in rows]
        if q_index is not None:
            prop.q_index = torch.tensor([q + [-1] * (W - len(q)) for _, _, _, q, _ in rows], device=root.device)
        return prop

    def _advance(self) -> None:
        """Who drafts this step (self.on) and, under the cost policy, at the next step too (self.plan): the next
        verification's call may run the next step's drafting only when both are one and the same member (chainer)."""
        if self.scheduler is None:
            self.on = [True] * len(self.members)
        elif not self.cost:
            self.on = self.scheduler.active()
        else:
            self.on = self.plan if self.plan is not None else self.scheduler.active()
            self.plan = self.scheduler.active()
        self.solo = self._one(self.on)

    def _one(self, on: list[bool] | None) -> int | None:
        """The member that drafts alone under the cost policy, if one does (one whose tree is larger than the node
        budget drafts through the merge, which cuts it). A standing choice is one list (never changed) step after
        step: its answer is kept."""
        if self._one_memo[0] is on:
            return self._one_memo[1]
        m = on.index(True) if self.cost and on is not None and sum(on) == 1 else None
        solo = m if m is not None and self.fits[m] else None
        self._one_memo = (on, solo)
        return solo

    @property
    def chainer(self) -> Drafter:
        if self.solo is not None and self._one(self.plan) == self.solo:
            return self.members[self.solo].chainer
        return self

    def _propose_solo(self, root: torch.Tensor, t0: float) -> Proposal:
        """One member drafts: its tree is the proposal, verified at its own width."""
        member = self.members[self.solo]
        self._ready(self.solo, narrow=True)
        self.props = [None] * len(self.members)
        self.props[self.solo] = prop = member.propose(root)
        prop.nodes = member.max_nodes
        self.time_s["members"] += time.perf_counter() - t0
        return prop

    def _propose_group(self, g: "MemberGroup", root: torch.Tensor) -> None:
        """One proposal for the whole group (the root once per member), split into the active members' proposals."""
        g.prop = None
        if not any(self.on[m] for m in g.members):
            return
        B = root.shape[0]
        g.prop = p = g.drafter.propose(root.repeat(len(g.members)))
        view = TreeView.of_static(g.drafter.buf, B)
        for j, m in enumerate(g.members):
            if self.on[m]:
                rows = slice(j * B, (j + 1) * B)
                self.props[m] = Proposal(p.tokens[rows], view, None if p.q is None else p.q[rows],
                                         None if p.q_index is None else p.q_index[rows])

    @property
    def _lossless_sampling(self) -> bool:
        """Lossless speculative sampling (it needs each node's q, so sampled siblings are never shared)."""
        return self.sampling.temperature > 0 and not self.sampling.typical

    # --- following the text -------------------------------------------------------------------------------
    def commit(self, step: StepResult) -> None:
        if self.solo is not None:
            self._solo_step(step, chained=False)
            return
        t0 = time.perf_counter()
        inside = 0.0
        gains: list[float | None] = [None] * len(self.members)
        committed, live = step.path_tokens(), step.live_rows()
        owners = _host(self.owners)  # [B][node][member]: one copy, read along the accepted paths
        own = {}  # member -> its own nodes along each row's accepted path
        for m, p in enumerate(self.props):
            if p is None:
                continue
            parents = _host(self.parents[m])  # [B][node]: the member's own tree
            own[m] = paths = [_own_path(owners[b], parents[b], m, path) for b, path in enumerate(step.paths)]
            gains[m] = _held(paths, live)
        for m, member in enumerate(self.members):
            if m in self.grouped:
                continue
            if m in own:
                t1 = time.perf_counter()
                member.commit(self._member_step(step, self.props[m].tokens, own[m], committed))
                inside += time.perf_counter() - t1
        self._logged(committed, own)
        for g in self.groups:
            t1 = time.perf_counter()
            if g.prop is None:
                g.drafter.follow(committed * len(g.members))
            else:  # a paused member's rows keep their root only, and take the rest of the text as extra tokens
                paths = [p for m in g.members for p in own.get(m, [[0]] * len(committed))]
                g.drafter.commit(replace(self._member_step(step, g.prop.tokens, paths, committed * len(g.members)),
                                         host_live=live * len(g.members)))
            inside += time.perf_counter() - t1
        if self.cost:
            rows = [[len(own[m][b]) - 1 if m in own else None for m in range(len(self.members))]
                    for b in range(len(live)) if live[b]]
            self.scheduler.update(gains, rows, *self._lap())
        elif self.scheduler is not None:
            self.scheduler.update(gains)
        if self.mode == "vote":
            self._after_vote(step)
        self.time_s["members"] += inside
        self.time_s["ensemble"] += time.perf_counter() - t0 - inside

    def chained(self, step: StepResult) -> Proposal:
        return self._solo_step(step, chained=True)

    def _solo_step(self, step: StepResult, chained: bool) -> Proposal | None:
        """The step of one member drafting alone: it commits (or, chained, reads the next proposal its chain drafted
        in the verification's call); the others are given the step's text when they next draft (_ready)."""
        t0 = time.perf_counter()
        m = self.solo
        member, live = self.members[m], step.live_rows()
        prop = member.chained(step) if chained else member.commit(step)
        if self.text:
            self.lone[self.log0 + len(self.log)] = (m, [len(p) - 1 if ok else None for p, ok in zip(step.paths, live)])
        self._logged(step.path_tokens(), (m,))
        t1 = time.perf_counter()
        self.scheduler.update_one(m, _held(step.paths, live), self._lap()[0])
        self.time_s["members"] += t1 - t0
        if chained:
            self._advance()  # the next step's member is this one (the plan that let this step chain)
        self.time_s["ensemble"] += time.perf_counter() - t1
        if not chained:
            return None
        prop.nodes = member.max_nodes
        return prop

    def _logged(self, committed: list[list[int]], drafted) -> None:
        """The step's text in the log; the members that drafted it (and committed) have followed it."""
        self.log.append(committed)
        for m in drafted:
            self.seen[m] = self.log0 + len(self.log)
        if len(self.log) >= self.trim_at:  # now and then: the steps every member has followed are dropped
            low = min([self.seen[m] for m in range(len(self.members)) if m not in self.grouped],
                      default=self.log0 + len(self.log))
            del self.log[: low - self.log0]
            self.log0, self.trim_at = low, len(self.log) + LOG_KEEP

    def _lap(self) -> tuple[float | None, float]:
        """(The seconds since the last step was committed, less those spent feeding members the text they missed;
        the seconds spent feeding them: see Scheduler.) The first is None for a run's first step (its time holds the
        prefill) and for a step that compiled a graph (its time holds the compiling)."""
        now, last, graphs = time.perf_counter(), self.lap, compiled_graphs()
        compiled, self.lap, self.graphs = graphs != self.graphs, now, graphs
        fed, self.text_s = self.text_s, 0.0
        return None if last is None or compiled else now - last - fed, fed

    @property
    def winners(self) -> list[int | None]:
        """Vote mode: the member whose chain each row's proposal is (None where nothing was drafted)."""
        return [None if m < 0 else m for m in _host(self.winner)]

    @staticmethod
    def _member_step(step: StepResult, tokens: torch.Tensor, paths: list[list[int]], committed: list[list[int]]):
        """The step as a member sees it: its own tree's tokens and paths, and the committed tokens past them."""
        return replace(step, tokens=tokens, paths=paths, extra=[c[len(p):] for c, p in zip(committed, paths)],
                       host_tokens=[c[:len(p)] for c, p in zip(committed, paths)])

    def _after_vote(self, step: StepResult) -> None:
        """Once per verified batch: the winners' weights (VoteWeights) and the adaptive length."""
        rows = [b for b, v in enumerate(step.verified_rows()) if v]
        if not rows:
            return
        won: dict[int, tuple[int, int]] = {}
        drafted, winners = _host(self.drafted), _host(self.winner)
        for b in rows:
            m = winners[b]
            if drafted[b] and m >= 0:
                a, d = won.get(m, (0, 0))
                won[m] = (a + len(step.paths[b]) - 1, d + drafted[b])
        self.vote.update(won)
        if self.adaptive is not None:
            committed = sum(len(step.paths[b]) for b in rows) / len(rows)  # the verified length: accepted + bonus
            self.adaptive.record(step.time_s, committed)  # the next proposal drafts at the new length
