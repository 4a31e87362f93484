"""Tree-topology search from acceptance statistics (pure functions: statistics -> trees)."""

from __future__ import annotations

import heapq

from .tree import Tree


def node_probability(path: tuple[int, ...], probs: list[list[float]]) -> float:
    """P(every token on the path is accepted), under positional independence: prod_d probs[d][r_d]."""
    p = 1.0
    for d, r in enumerate(path):
        p *= probs[d][r] if d < len(probs) and r < len(probs[d]) else 0.0
    return p


def expected_accept_length(paths, probs: list[list[float]]) -> float:
    """Expected tokens committed per step (bonus included): 1 + sum of node acceptance probabilities.

    probs[d][r] is the probability that the depth-d draft's rank-r candidate is the base's next
    token, given the path above it was accepted. Each accepted node adds one token, and at most
    one child of a node can match, so the sum counts the accepted path exactly once.
    """
    return 1.0 + sum(node_probability(tuple(p), probs) for p in paths)


def grow_tree(probs: list[list[float]], max_nodes: int, name: str = "greedy") -> Tree:
    """Greedy growth (Hydra section 4): repeatedly add the frontier node that raises expected accept length most.

    Under positional independence a child is never more likely than its parent, so this picks the
    max_nodes most probable paths and is optimal for the node budget.
    """
    depth = len(probs)
    frontier = [(-node_probability((r,), probs), (r,)) for r in range(len(probs[0]))] if depth else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < max_nodes:
        negp, path = heapq.heappop(frontier)
        if -negp <= 0:
            break
        chosen.append(path)
        if len(path) < depth:
            for r in range(len(probs[len(path)])):
                child = path + (r,)
                heapq.heappush(frontier, (-node_probability(child, probs), child))
    tree = Tree.from_paths([list(p) for p in chosen],
                           {"name": name, "method": "greedy growth",
                            "expected_accept_length": round(expected_accept_length(chosen, probs), 4)})
    return tree
