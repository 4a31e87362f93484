"""Tree-topology search (Hydra section 4): statistics -> proposal trees -> the fastest on this machine.

Statistics are rank vectors: for each decoding state t of the base's own greedy text, R[t][d] is
the rank of the true next token among the depth-(d+1) draft's candidates (for Hydra, conditioned
on the true path above it, which is the path an accepting tree would have taken), or `miss`.
A node with rank path (r1..rd) is accepted at state t exactly when R[t][:d] == (r1..rd), so

    expected accept length(T) = 1 + sum over nodes n in T of P(R[:len(n)] == n)

with no independence assumption. Since P(child) <= P(parent), the N most probable paths form a
prefix-closed tree, and greedy growth that adds the best frontier node each time finds them: it is
optimal for the node budget. The positional-independence model (Sequoia-style),
P(n) = prod_d p_d(r_d), is kept for comparison.
"""

from __future__ import annotations

import heapq
from collections import Counter

import torch

from .tree import Tree


class RankStats:
    """Empirical path probabilities from rank vectors [T, D] (ranks >= max_rank count as misses)."""

    def __init__(self, ranks: torch.Tensor, max_rank: int):
        self.ranks = ranks.clamp(max=max_rank)  # [T, D]; max_rank means "not among the candidates"
        self.max_rank = max_rank
        self.depth = ranks.shape[1]
        self.n = ranks.shape[0]
        self.counts: Counter = Counter()
        for row in self.ranks.tolist():
            for d in range(self.depth):
                if row[d] >= max_rank:
                    break
                self.counts[tuple(row[: d + 1])] += 1

    def prob(self, path: tuple[int, ...]) -> float:
        return self.counts.get(tuple(path), 0) / max(self.n, 1)

    def marginals(self) -> list[list[float]]:
        """p_d(r): P(rank at depth d == r | the path above accepted), for the independence model."""
        out = []
        for d in range(self.depth):
            above = self.ranks[:, :d]
            ok = (above < self.max_rank).all(dim=1) if d else torch.ones(self.n, dtype=torch.bool)
            col = self.ranks[ok, d]
            n = max(int(ok.sum()), 1)
            out.append([float((col == r).sum()) / n for r in range(self.max_rank)])
        return out


def node_probability(path: tuple[int, ...], probs: list[list[float]]) -> float:
    """Positional independence: P(path accepted) = prod_d probs[d][r_d]."""
    p = 1.0
    for d, r in enumerate(path):
        p *= probs[d][r] if d < len(probs) and r < len(probs[d]) else 0.0
    return p


def expected_accept_length(paths, prob) -> float:
    """1 + sum of node acceptance probabilities; prob is a RankStats or per-depth rank probabilities."""
    f = prob.prob if isinstance(prob, RankStats) else (lambda p: node_probability(p, prob))
    return 1.0 + sum(f(tuple(p)) for p in paths)


def grow_tree(prob, max_nodes: int, name: str = "greedy") -> Tree:
    """Greedy growth: repeatedly add the frontier node with the largest acceptance probability."""
    if isinstance(prob, RankStats):
        f, depth, width = prob.prob, prob.depth, prob.max_rank
    else:
        f, depth, width = (lambda p: node_probability(p, prob)), len(prob), max((len(r) for r in prob), default=0)
    frontier = [(-f((r,)), (r,)) for r in range(width)] if depth else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < max_nodes:
        negp, path = heapq.heappop(frontier)
        if -negp <= 0:
            break
        chosen.append(path)
        if len(path) < depth:
            for r in range(width):
                child = path + (r,)
                heapq.heappush(frontier, (-f(child), child))
    return Tree.from_paths([list(p) for p in chosen], {
        "name": name, "method": "greedy growth",
        "expected_accept_length": round(expected_accept_length(chosen, prob), 4)})


def proposal_trees(prob, max_nodes: int) -> list[Tree]:
    """T1..TN: the greedy tree of every size (each a prefix of the next in growth order)."""
    full = grow_tree(prob, max_nodes)
    order = sorted(full.paths, key=lambda p: (-(prob.prob(p) if isinstance(prob, RankStats)
                                                else node_probability(p, prob)), len(p), p))
    trees = []
    for n in range(1, len(order) + 1):
        chosen = order[:n]
        trees.append(Tree.from_paths([list(p) for p in chosen], {
            "name": f"greedy-{n}", "expected_accept_length": round(expected_accept_length(chosen, prob), 4)}))
    return trees


def held_along(have: set, ranks) -> int:
    """How many of the leading ranks (of a text's next tokens, from one state on) form a path of the tree whose paths
    `have` holds: the drafted tokens greedy verification accepts there."""
    d, path = 0, ()
    while d < len(ranks) and path + (ranks[d],) in have:
        path, d = path + (ranks[d],), d + 1
    return d


def simulate_accept_length(tree: Tree, ranks: torch.Tensor) -> float:
    """Monte-Carlo check: walk the tree along each rank vector as greedy verification would."""
    have = set(tree.paths)
    return sum(1 + held_along(have, row) for row in ranks.tolist()) / max(len(ranks), 1)


def replay_counts(tree: Tree, sequences: list[torch.Tensor]) -> tuple[int, int]:
    """(tokens committed, verification steps) of greedy decoding replayed on the rank vectors of whole texts: from
    each text's first state, accept along the tree, commit the accepted tokens plus the bonus, jump to the state
    after them (the bonus past the end of the text is not emitted). Counts, so that they add up across texts and
    processes."""
    have = set(tree.paths)
    committed = steps = 0
    for rows in sequences:
        rows = rows.tolist()
        i = 0
        while i < len(rows):
            n = min(1 + held_along(have, rows[i]), len(rows) - i)
            committed, steps, i = committed + n, steps + 1, i + n
    return committed, steps


def replay_accept_length(tree: Tree, sequences: list[torch.Tensor]) -> float:
    """Greedy decoding replayed on the rank vectors of whole texts (replay_counts). Unlike the per-state mean, this
    visits only the states the decoder visits (and stops where the text does), so on the calibration text it
    equals the decoder's own accept length exactly."""
    committed, steps = replay_counts(tree, sequences)
    return committed / max(steps, 1)


def geometric_sizes(max_nodes: int) -> list[int]:
    """1, 2, 4, ... up to max_nodes (included)."""
    sizes, s = [], 1
    while s < max_nodes:
        sizes.append(s)
        s *= 2
    return sizes + [max_nodes]


DEFAULT_TREE_NODES = 24


def default_tree(num_heads: int, nodes: int = DEFAULT_TREE_NODES) -> Tree:
    """A sparse tree for `num_heads` heads: the top-`nodes` paths under a prior of per-rank acceptance.

    The prior (acceptance of rank r at depth d ~ 0.6^d * 0.5^r) stands in for measured statistics;
    `draftlab search-tree` replaces it with statistics of the actual heads.
    """
    probs = [[0.6 ** (d + 1) * 0.5 ** r for r in range(8)] for d in range(num_heads)]
    return grow_tree(probs, nodes, name=f"default-{num_heads}h-{nodes}n")


def fitted_tree(prior: Tree, texts: list[torch.Tensor], max_rank: int = 10) -> tuple[Tree, dict]:
    """A tree of at most the prior's size grown from rank vectors of whole texts (RankStats over their states,
    greedy growth; as deep as the vectors), where it decodes better than the prior on texts it was not grown on:
    two-fold, the tree grown on the even texts replayed on the odd ones and the other way round, their counts
    pooled (at least two texts with states). (tree, what decided: the held-out accept lengths of both, the states,
    the choice)."""
    texts = [t for t in texts if len(t)]
    info = {"nodes": prior.size - 1, "texts": len(texts), "states": int(sum(len(t) for t in texts))}
    if len(texts) < 2:
        return prior, {**info, "source": "kind", "why": "fewer than two held-out texts to grow and check a tree on"}
    stats = lambda part: RankStats(torch.cat(part), max_rank)  # (as deep as the texts' rank vectors)
    fits = {"grown": [0, 0], "kind": [0, 0]}
    for grow_on, check_on in ((texts[0::2], texts[1::2]), (texts[1::2], texts[0::2])):
        for name, tree in (("grown", grow_tree(stats(grow_on), info["nodes"])), ("kind", prior)):
            c, s = replay_counts(tree, check_on)
            fits[name][0] += c
            fits[name][1] += s
    held = {k: round(c / max(s, 1), 4) for k, (c, s) in fits.items()}
    info["held_out_accept_length"] = held
    if held["grown"] <= held["kind"]:
        return prior, {**info, "source": "kind", "why": "the grown tree did not decode held-out texts better"}
    tree = grow_tree(stats(texts), info["nodes"], name=f"grown-{info['nodes']}n")
    return tree, {**info, "source": "grown"}
