"""Static draft trees: prefix-closed lists of top-k rank paths, and what verification derives from them.

Node 0 is the root: the token the base already chose. The node for path (r1, ..., rd) holds the
rank-rd candidate of draft depth d, below the node of (r1, ..., r(d-1)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


class TreeError(ValueError):
    """A tree that is not a valid prefix-closed list of rank paths."""


@dataclass(frozen=True)
class Tree:
    paths: tuple[tuple[int, ...], ...]  # non-root nodes in BFS order (by depth, then lexicographic)
    metadata: dict = field(default_factory=dict, compare=False)

    @staticmethod
    def from_paths(paths, metadata: dict | None = None, source: str = "tree") -> "Tree":
        """Validate and order a list of rank paths (the Medusa 'choices' format)."""
        if not isinstance(paths, (list, tuple)):
            raise TreeError(f"{source}: expected a list of paths like [[0], [1], [0, 0]], got {type(paths).__name__}")
        clean = []
        for p in paths:
            if not isinstance(p, (list, tuple)) or not p or not all(isinstance(r, int) and r >= 0 for r in p):
                raise TreeError(f"{source}: path {p!r} must be a non-empty list of non-negative integer ranks")
            clean.append(tuple(p))
        if len(set(clean)) != len(clean):
            dup = next(p for p in clean if clean.count(p) > 1)
            raise TreeError(f"{source}: path {list(dup)} appears twice")
        have = set(clean)
        for p in clean:
            if len(p) > 1 and p[:-1] not in have:
                raise TreeError(f"{source}: path {list(p)} has no parent {list(p[:-1])}; a tree must be "
                                "prefix-closed (add the parent path)")
        return Tree(tuple(sorted(clean, key=lambda p: (len(p), p))), dict(metadata or {}))

    @staticmethod
    def chain(depth: int) -> "Tree":
        """A single path: each head's top-1 only (plain speculative decoding)."""
        return Tree.from_paths([[0] * d for d in range(1, depth + 1)], {"name": f"chain-{depth}"})

    @staticmethod
    def load(path: str | Path) -> "Tree":
        """Read a tree file: JSON or YAML, either a bare list of paths or {'paths': [...], 'metadata': {...}}."""
        import yaml

        p = Path(path)
        if not p.is_file():
            raise TreeError(f"{p}: no such tree file")
        try:
            data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise TreeError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
        if isinstance(data, dict):
            paths = data.get("paths", data.get("choices"))
            if paths is None:
                raise TreeError(f"{p}: a mapping needs a 'paths' list")
            return Tree.from_paths(paths, data.get("metadata"), source=str(p))
        return Tree.from_paths(data, source=str(p))

    def save(self, path: str | Path) -> None:
        """Write the tree file (JSON) with its metadata."""
        Path(path).write_text(json.dumps({"paths": [list(p) for p in self.paths], "metadata": self.metadata}, indent=1))

    # --- derived structure --------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Nodes including the root (= tokens per verification forward)."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    def topk_per_depth(self) -> list[int]:
        """How many candidates each draft depth must provide (max rank + 1)."""
        k = [0] * self.depth
        for p in self.paths:
            k[len(p) - 1] = max(k[len(p) - 1], p[-1] + 1)
        return k

    def buffers(self, device=None) -> "TreeBuffers":
        return TreeBuffers.build(self, device)


@dataclass
class TreeBuffers:
    """Tensors derived from a tree, on one device."""

    depth: torch.Tensor  # [N] depth of each node (root 0)
    rank: torch.Tensor  # [N] rank within its depth's candidates (root 0)
    parent: torch.Tensor  # [N] parent index (root -1)
    mask: torch.Tensor  # [N, N] bool, node i may attend to node j (j is i or an ancestor)
    leaf_paths: torch.Tensor  # [P, D+1] node indices root->leaf, padded with -1
    children: list[list[int]]  # per node, children ordered by rank
    levels: list[dict]  # per depth d: parents at depth d, their root paths, and the children they fill

    @staticmethod
    def build(tree: Tree, device=None) -> "TreeBuffers":
        index = {(): 0}
        for i, p in enumerate(tree.paths, start=1):
            index[p] = i
        N = tree.size
        depth = [0] + [len(p) for p in tree.paths]
        rank = [0] + [p[-1] for p in tree.paths]
        parent = [-1] + [index[p[:-1]] for p in tree.paths]
        # Node indices from the root down to each node: its ancestors, which is all it may attend to.
        chains = []
        for i in range(N):
            chain, j = [], i
            while j >= 0:
                chain.append(j)
                j = parent[j]
            chains.append(chain[::-1])
        mask = torch.zeros(N, N, dtype=torch.bool)
        for i, chain in enumerate(chains):
            mask[i, chain] = True
        children = [[] for _ in range(N)]
        for i in range(1, N):
            children[parent[i]].append(i)
        children = [sorted(c, key=lambda n: rank[n]) for c in children]
        leaves = [i for i in range(N) if not children[i]]
        D = tree.depth
        lp = torch.full((len(leaves), D + 1), -1, dtype=torch.long)
        for r, leaf in enumerate(leaves):
            lp[r, : len(chains[leaf])] = torch.tensor(chains[leaf])
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
        levels = []
        for d in range(D):
            parents = [n for n in range(N) if depth[n] == d and children[n]]
            pos = {n: i for i, n in enumerate(parents)}
            kids = [c for n in parents for c in children[n]]
            levels.append({"parents": t(parents), "paths": t([chains[n] for n in parents]).reshape(len(parents), d + 1),
                           "children": t(kids), "child_parent": t([pos[parent[c]] for c in kids]),
                           "child_rank": t([rank[c] for c in kids])})
        return TreeBuffers(t(depth), t(rank), t(parent), mask.to(device), lp.to(device), children, levels)


DEFAULT_TREE_NODES = 24


def default_tree(num_heads: int, nodes: int = DEFAULT_TREE_NODES) -> Tree:
    """A sparse tree for `num_heads` heads: the top-`nodes` paths under a prior of per-rank acceptance.

    The prior (acceptance of rank r at depth d ~ 0.6^d * 0.5^r) stands in for measured statistics;
    `draftlab search-tree` replaces it with statistics of the actual heads.
    """
    from .search import grow_tree

    probs = [[0.6 ** (d + 1) * 0.5 ** r for r in range(8)] for d in range(num_heads)]
    return grow_tree(probs, nodes, name=f"default-{num_heads}h-{nodes}n")
