"""Draft trees: static rank-path trees (the Medusa "choices" format) and per-step tree views.

A static `Tree` is a prefix-closed list of rank paths. Node 0 is the root: the token the base already
chose. The node for path (r1, ..., rd) holds the rank-rd candidate at depth d, below the node of
(r1, ..., r(d-1)); for heads "rank" is the head's top-k rank, for a small LM it is the rank among its
candidates at the parent (or, when sampling, the r-th of its samples there).

A `TreeView` is what verification and acceptance read for one step: per row, the parent of every
node, so trees may change from step to step and differ between rows (padded nodes are masked out
and never accepted). A static tree is the special case whose view is the same every step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch


class TreeError(ValueError):
    """A tree that is not a valid prefix-closed list of rank paths."""


def _literal(text: str, source: str) -> list:
    """Paths from JSON or Python literal text (tuples become lists); never evaluates code."""
    import ast

    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError) as e:
        raise TreeError(f"{source}: not a list of paths ({type(e).__name__}: {e}); expected e.g. [[0], [1], [0, 0]] "
                        "or [(0,), (1,), (0, 0)]") from None
    to_list = lambda v: [to_list(x) for x in v] if isinstance(v, (list, tuple)) else v
    return to_list(value)


def _write_json(path: str | Path, record: dict) -> None:
    """Write a tree file; its folder is created, as --out DIR/tree.json asks for a folder that may not exist yet."""
    from ..data import replace_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(record, indent=1))


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
    def expansion(ks) -> "Tree":
        """SpecInfer's expansion configuration <k1, ..., km>: every depth-(i-1) node gets its top-k_i children."""
        ks = [int(k) for k in ks]
        if not ks or any(k < 1 for k in ks):
            raise TreeError(f"expansion {ks}: needs one or more widths >= 1, e.g. 1,2,1")
        level, paths = [()], []
        for k in ks:
            level = [p + (r,) for p in level for r in range(k)]
            paths += level
        return Tree.from_paths([list(p) for p in paths], {"name": "expansion-" + "-".join(map(str, ks))})

    @staticmethod
    def parse(spec: str) -> "Tree":
        """A tree given on the command line: inline paths (JSON, or the Python tuple text Medusa and EAGLE write,
        e.g. "[(0,), (1,), (0, 0)]"), a tree file, or `FILE.py:NAME` for a list assigned in a Python file
        (Medusa's medusa_choices.py: `mc_sim_7b_63 = [...]`)."""
        text = spec.strip()
        if text.startswith(("[", "(")):
            return Tree.from_paths(_literal(text, "--tree"), {"name": "inline"}, source="--tree (inline)")
        if text.startswith("{"):  # a tree file's mapping, inline (it was looked up as a file name: walk-through)
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise TreeError(f"--tree {spec}: not a valid inline mapping ({e})") from None
            return Tree._from_data(data, "--tree (inline)")
        if ".py:" in text:
            path, name = text.rsplit(":", 1)
            return Tree._from_python(Path(path), name)
        return Tree.load(text)

    @staticmethod
    def _from_python(path: Path, name: str) -> "Tree":
        import ast

        if not path.is_file():
            raise TreeError(f"{path}: no such file")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return Tree.from_paths(_literal(ast.get_source_segment(path.read_text(), node.value), f"{path}:{name}"),
                                       {"name": name}, source=f"{path}:{name}")
        names = [t.id for n in ast.parse(path.read_text()).body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)]
        raise TreeError(f"{path}: no list named {name!r} (names assigned there: {', '.join(names) or 'none'})")

    @staticmethod
    def load(path: str | Path) -> "Tree":
        """Read a tree file: JSON or YAML (a bare list of paths or {'paths' | 'choices': [...], 'metadata': {...}}),
        or a text file holding a Python list of tuples."""
        import yaml

        import difflib

        p = Path(path)
        try:
            found = p.is_file()
        except OSError:  # (a name longer than the file system takes: ENAMETOOLONG)
            found = False
        if not found:
            names = ["default", "kind", "chain", "chain:N", "expansion:K1,K2,...", "dynamic:DEPTH,TOP_K,TOTAL_TOKENS"]
            close = difflib.get_close_matches(str(path).split(":")[0],
                                              ["default", "kind", "chain", "expansion", "dynamic"], n=1, cutoff=0.6)
            guess = f"did you mean {close[0]}? " if close and "/" not in str(path) else ""
            raise TreeError(f"{p}: no such tree file ({guess}give a JSON/YAML tree file, FILE.py:NAME, inline paths "
                            f"such as '[[0], [1], [0, 0]]', or one of {', '.join(names)})")
        text = p.read_text()
        if text.lstrip().startswith("[") and "(" in text:  # Python tuple text, as Medusa / EAGLE write choices
            return Tree.from_paths(_literal(text, str(p)), {"name": p.stem}, source=str(p))
        try:
            data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise TreeError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
        tree = Tree._from_data(data, str(p))
        if isinstance(tree, Tree) and not tree.metadata.get("name"):  # (reports named it "": walk-through)
            tree.metadata["name"] = p.stem
        return tree

    @staticmethod
    def _from_data(data, source: str) -> "Tree":
        """A tree file's contents: a list of paths, or {'paths' | 'choices': [...], 'metadata': {...}}, or
        {'dynamic': 'dynamic:DEPTH,TOP_K,TOTAL'} (a DynamicTree)."""
        if isinstance(data, dict) and "dynamic" in data:
            return DynamicTree.parse(str(data["dynamic"]).partition(":")[2])
        if isinstance(data, dict):
            paths = data.get("paths", data.get("choices"))
            if paths is None:
                raise TreeError(f"{source}: a mapping needs a 'paths' (or 'choices') list")
            return Tree.from_paths(paths, data.get("metadata"), source=source)
        return Tree.from_paths(data, source=source)

    def save(self, path: str | Path) -> None:
        """Write the tree file (JSON) with its metadata, creating its folder."""
        _write_json(path, {"paths": [list(p) for p in self.paths], "metadata": self.metadata})

    # --- derived structure --------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Nodes including the root (= tokens per verification forward)."""
        return len(self.paths) + 1

    @cached_property  # the paths are a frozen tuple; decoders read this every step
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

    def widths(self) -> list[int]:
        """Children per node, in node order (root first)."""
        w = [0] * self.size
        index = {p: i for i, p in enumerate(self.paths, start=1)}
        for p in self.paths:
            w[index.get(p[:-1], 0)] += 1
        return w


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree settings (the tree itself is rebuilt every step from the drafter's confidence):
    `depth` draft levels, the `top_k` best nodes of a level expanded into their `top_k` children, and the
    `total_tokens` most probable nodes (root included) kept for verification. The EAGLE code's `depth` counts one
    level fewer (its forwards after the first): its defaults (7, 10, 60) are depth 8 here; the default depth 7
    is the default ttt_steps, the levels training unrolls (docs/drafters.md)."""

    depth: int = 7
    top_k: int = 10
    total_tokens: int = 60

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise TreeError(f"dynamic tree {self.spec()}: needs depth >= 1, top_k >= 1 and total_tokens >= 2")

    @staticmethod
    def parse(arg: str) -> "DynamicTree":
        """'DEPTH,TOP_K,TOTAL_TOKENS' (the part after `dynamic:`)."""
        try:
            depth, top_k, total = (int(x) for x in arg.split(","))
        except ValueError:
            raise TreeError(f"--tree dynamic:{arg}: expected dynamic:DEPTH,TOP_K,TOTAL_TOKENS, e.g. dynamic:7,10,60") \
                from None
        return DynamicTree(depth, top_k, total)

    def spec(self) -> str:
        return f"dynamic:{self.depth},{self.top_k},{self.total_tokens}"

    def save(self, path: str | Path, metadata: dict | None = None) -> None:
        """A tree file holding these settings (what search-tree writes for eagle3 exports)."""
        _write_json(path, {"dynamic": self.spec(), "metadata": metadata or {}})

    @property
    def size(self) -> int:
        return self.total_tokens


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


@dataclass
class TreeView:
    """One step's tree, per row: what the verifier's mask and positions and the acceptance rules read.

    Nodes are in topological order (parent index < node index); node 0 is the root. Padded nodes
    (valid False) have parent -1, are nobody's parent, attend to themselves only and are never accepted.
    """

    parents: torch.Tensor  # [B, N] long, root and padding -1
    depth: torch.Tensor  # [B, N] long, root 0
    valid: torch.Tensor  # [B, N] bool
    ancestors: torch.Tensor  # [B, N, N] bool: node i may attend to node j (j is i or an ancestor of i)
    static: "TreeBuffers | None" = None  # set when every row has this one static tree

    @property
    def size(self) -> int:
        return self.parents.shape[1]

    @staticmethod
    def of_static(buf: "TreeBuffers", batch: int) -> "TreeView":
        """The view of a static tree for a batch: expanded, not copied."""
        N = buf.depth.numel()
        ex = lambda t: t[None].expand(batch, *t.shape)
        valid = torch.ones(N, dtype=torch.bool, device=buf.depth.device)
        return TreeView(ex(buf.parent), ex(buf.depth), ex(valid), ex(buf.mask), static=buf)

    @staticmethod
    def of_parents(parents: torch.Tensor, valid: torch.Tensor | None = None, check: bool = True,
                   max_depth: int | None = None) -> "TreeView":
        """Depths and ancestor sets from per-row parents [B, N] (topological order), by pointer doubling. check:
        refuse parents out of order (a host sync); a drafter whose trees are ordered by construction skips it.
        max_depth: a bound on the trees' depth when the caller knows one (fewer rounds), else N - 1."""
        B, N = parents.shape
        dev = parents.device
        idx = torch.arange(N, device=dev)
        if valid is None:
            valid = torch.ones(B, N, dtype=torch.bool, device=dev)
        parents = torch.where(valid, parents, torch.full_like(parents, -1))
        if check:
            bad = valid[:, 1:] & ~((parents[:, 1:] >= 0) & (parents[:, 1:] < idx[1:]))
            if bool(bad.any()) or bool((parents[:, 0] != -1).any()):
                raise TreeError("a proposal's nodes must be in topological order: node 0 is the root (parent -1) and "
                                "every other valid node's parent is an earlier node")
            if bool((valid & ~valid.gather(1, parents.clamp(min=0))).any()):
                raise TreeError("a proposal's padded node is the parent of a valid node")
        # After r rounds anc[b, i] holds i and its ancestors up to 2^r - 1 steps up, and jump[b, i] is the node 2^r
        # steps up (N: above the root, an empty row). A round adds the ancestors of the node 2^r steps up, so
        # bit_length(depth) rounds reach every ancestor, at O(B N^2) per round (no N^3 product).
        anc = torch.eye(N, dtype=torch.bool, device=dev).expand(B, N, N).clone()  # [B, N, N]
        jump = torch.where(parents >= 0, parents, N)  # [B, N]
        empty_row = anc.new_zeros(B, 1, N)
        above = jump.new_full((B, 1), N)
        for _ in range(max(1, min(N - 1, max_depth if max_depth is not None else N - 1).bit_length())):
            anc = anc | torch.cat([anc, empty_row], 1).gather(1, jump[:, :, None].expand(B, N, N))
            jump = torch.cat([jump, above], 1).gather(1, jump)
        depth = anc.sum(-1) - 1
        return TreeView(parents, depth, valid, anc)

    def children(self, b: int) -> list[list[int]]:
        """Row b's children of every node, in node order (the order acceptance tries siblings)."""
        if self.static is not None:
            return self.static.children
        par = self.parents[b].tolist()
        ok = self.valid[b].tolist()
        kids = [[] for _ in par]
        for i in range(1, len(par)):
            if ok[i]:
                kids[par[i]].append(i)
        return kids

    def path_to(self, b: int, node: int) -> list[int]:
        """Node indices from the root down to `node` in row b."""
        return torch.nonzero(self.ancestors[b, node]).flatten().tolist()
