"""An ensemble's members' trees made into one tree per row, in tensor operations over rows and nodes (no Python loop
per row or node; a loop per tree depth), so the merge runs on the device and compiles into one call.

merge_trees (SpecInfer's merge): the members' trees side by side in one fixed layout (the root, then each member's
nodes in member order); equal prefixes shared (a node whose parent and token equal an earlier node's is that node,
its own column left as padding); where the nodes outnumber the node budget, the nodes ranked by their owners' summed
weights, then depth, then layout order, and the best `budget` kept, packed in layout order (a node scores no higher
than its parent, so the kept set is prefix-closed).
vote_chains (Minions' vote): the members' chains; at each depth the token whose members still alive weigh the most
(ties: the one whose first member comes first), the members that drafted another token dropped.

Both return, per merged node, each member's own node index (-1: not a node of that member's tree): the ensemble's
commit takes the deepest node of the accepted path a member holds and walks up that member's own tree from it.
Scores and votes are summed over members one after the other, in member order, as the host references sum them, so
the two break near-ties alike.
"""

from __future__ import annotations

import torch

from ..decode.tree import TreeView


_LAYOUTS: dict = {}


def merge_layout(sizes: tuple, members: tuple, n_members: int, device) -> tuple:
    """The constants of merge_trees' layout (the root, then each member's nodes 1..) for trees of sizes[k] + 1 nodes
    drafted by members[k], made once per shape: each column's member (the root's: 0, its owners set apart), its node
    index in that member's tree, what turns a member's parent index p > 0 into its column (p + shift), and the root's
    owners (0 for every member drafting, else -1) [n_members]."""
    key = (sizes, members, n_members, str(device))
    if key not in _LAYOUTS:
        starts = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        owner = torch.tensor([0] + [m for n, m in zip(sizes, members) for _ in range(n)], device=device)
        index = torch.tensor([0] + [i for n in sizes for i in range(1, n + 1)], device=device)
        shift = torch.tensor([0] + [s - 1 for n, s in zip(sizes, starts) for _ in range(n)], device=device)
        root = torch.tensor([0 if m in members else -1 for m in range(n_members)], device=device)
        _LAYOUTS[key] = (owner, index, shift, root)
    return _LAYOUTS[key]


def member_index(members: tuple, device) -> torch.Tensor:
    """members as an index tensor on device, made once per members and device (vote_chains' `index`): a call then
    copies nothing to the device."""
    key = ("index", members, str(device))
    if key not in _LAYOUTS:
        _LAYOUTS[key] = torch.tensor(members, device=device)
    return _LAYOUTS[key]


def _in_order(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last dimension one term after the other, in order (the host references' sums, bit for bit:
    a reduction adds in another order, which can break a near-tie of scores the other way)."""
    total = x[..., 0]
    for k in range(1, x.shape[-1]):
        total = total + x[..., k]
    return total


def _tree(parents: torch.Tensor, valid: torch.Tensor, rounds: int) -> tuple:
    """A tree's parents, valid, depth and ancestors (TreeView.of_parents; rounds: a bound on its depth)."""
    v = TreeView.of_parents(parents, valid, check=False, max_depth=max(rounds, 1))
    return v.parents, v.valid, v.depth, v.ancestors


def merge_trees(tokens: list, parents: list, valid: list, depth: list, layout: tuple, n_members: int,
                weights: torch.Tensor, budget: int, share: bool, rounds: int, q_index: list | None = None,
                q_offsets: tuple | None = None):
    """Members' trees (per member: tokens, parents, valid, depth [B, N_m], node 0 the root; layout: merge_layout's for
    their sizes and members) -> the merged tree: tokens, parents, valid [B, W], W = 1 + min(budget, sum(N_m - 1)) (where
    every node fits the budget, each node stays in its column and a column shared away is padding; else the kept nodes
    are packed in column order); its depth and ancestors (TreeView's, in the same call); own [B, W, n_members] (member
    m's node index at each merged node, -1: none); and, when q_index is given (per tree, its nodes' rows in its q table,
    or None for a tree of deterministic nodes), q_index [B, W] into the tables side by side (q_offsets[k]: where tree
    k's table starts), else None. weights [n_members]: a member's weight in a node's score. share: equal prefixes are
    one node (not under lossless sampling, where a node keeps its drafter's q). rounds: a bound on the trees' depth (a
    round settles the nodes of one more depth)."""
    B, dev = tokens[0].shape[0], tokens[0].device
    N = 1 + sum(t.shape[1] - 1 for t in tokens)
    owner, index, shift, root_own = layout
    cat = lambda xs: torch.cat([xs[0][:, :1]] + [x[:, 1:] for x in xs], 1)  # the root, then each tree's nodes
    tok, ok, dep, par = cat(tokens), cat(valid), cat(depth), cat(parents)
    par = torch.where(par > 0, par + shift, 0)  # a parent's column (a root child's, and a padded node's: the root)
    idx = torch.arange(N, device=dev)
    canon = idx.expand(B, N)  # each column's node: the first column of equal prefix (itself where none is shared)
    if share:
        not_root = idx > 0
        pair_ok = ok[:, :, None] & ok[:, None, :] & not_root[:, None] & not_root[None, :]
        for _ in range(rounds):  # after round r, the columns of depth <= r point at their first equal column
            cp = canon.gather(1, par)
            same = pair_ok & (tok[:, :, None] == tok[:, None, :]) & (cp[:, :, None] == cp[:, None, :])
            first = torch.where(same, idx[None, :, None], N).amin(1)  # per column j: the first column i like it
            canon = torch.where(first < N, first, idx)
    head = ok & (canon == idx)  # the merged tree's nodes: a column that is the first of its kind
    # Owners: member m's node index at each node (the last of its columns there, when its tree repeats a token under
    # one parent: its own path to a node is then its own tree's, up its parents, not own along the merged path).
    M = n_members
    slot = torch.where(ok, canon * M + owner, N * M)
    own = torch.full((B, N * M + 1), -1, dtype=torch.long, device=dev)
    own = own.scatter_reduce(1, slot, index.expand(B, N), "amax")[:, :N * M].view(B, N, M)
    own[:, 0] = root_own  # the root: every drafting member's node 0
    parent = torch.where(idx == 0, -1, canon.gather(1, par))
    if N - 1 <= budget:  # (known from the shapes) every node is kept, in place: the columns shared away are padding
        out_tok, out_par, out_ok, out_own, dest, W = tok, torch.where(head, parent, -1), head, own, None, N
    else:  # the best `budget` nodes by (score desc, depth, column), packed in column order (parents first)
        score = _in_order(torch.where(own >= 0, weights, 0))  # the owners' summed weights, each owner once
        cand = head & (idx > 0)
        # A node's rank: the candidates ahead of it (every pair compared; no sort, which compiles to a call of its
        # own).
        s_i, s_j, d_i, d_j = score[:, :, None], score[:, None, :], dep[:, :, None], dep[:, None, :]
        later = (d_i < d_j) | ((d_i == d_j) & (idx[:, None] < idx))  # (depth, column) before j's
        ahead = cand[:, :, None] & ((s_i > s_j) | ((s_i == s_j) & later))
        kept = (cand & (ahead.sum(1) < budget)) | (idx == 0)
        W = 1 + budget
        new = kept.cumsum(1) - 1
        dest = torch.where(kept, new, W)
        out_tok = tok.new_zeros(B, W + 1).scatter(1, dest, tok)[:, :W]
        packed_parent = torch.where(idx == 0, -1, new.gather(1, parent.clamp(min=0)))
        out_par = par.new_full((B, W + 1), -1).scatter(1, dest, packed_parent)[:, :W]
        out_ok = ok.new_zeros(B, W + 1).scatter(1, dest, kept)[:, :W]
        out_own = own.new_full((B, W + 1, M), -1).scatter(1, dest[:, :, None].expand(B, N, M), own)[:, :W]
    tree = _tree(out_par, out_ok, rounds)
    if q_index is None:
        return out_tok, *tree, out_own, None
    q = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev)]
                  + [torch.full((B, n), -1, dtype=torch.long, device=dev) if qi is None
                     else torch.where(qi[:, 1:] >= 0, qi[:, 1:] + off, -1)
                     for n, qi, off in zip([t.shape[1] - 1 for t in tokens], q_index, q_offsets)], 1)
    out_q = q if dest is None else q.new_full((B, W + 1), -1).scatter(1, dest, q)[:, :W]
    return out_tok, *tree, out_own, out_q


def vote_chains(tokens: list, valid: list, members: tuple, n_members: int, weights: torch.Tensor,
                index: torch.Tensor | None = None):
    """Members' chains (tokens, valid [B, N_m]; a chain is its valid nodes in node order) -> the chosen chain:
    tokens, parents, valid [B, L + 1] (L: the longest chain); its depth and ancestors; own
    [B, L + 1, n_members] (a member whose chain is the chosen one up to a node owns it at index depth); the winner
    per row [B] (of the members alive at the chain's end, the heaviest, then the first; -1 where nothing was
    drafted). weights [n_members]: the members' votes. index: members as a tensor on the device (member_index's: a call
    then copies nothing to the device; made here when not given)."""
    B, dev, K = tokens[0].shape[0], tokens[0].device, len(tokens)
    index = torch.tensor(members, device=dev) if index is None else index
    L = max(t.shape[1] - 1 for t in tokens)

    def packed(x, ok, fill):  # valid nodes first, in node order; [B, L]
        x, ok = x[:, 1:], ok[:, 1:]
        order = (~ok).to(torch.uint8).argsort(dim=1, stable=True)
        x = torch.where(ok.gather(1, order), x.gather(1, order), fill)
        return torch.nn.functional.pad(x, (0, L - x.shape[1]), value=fill)
    c = torch.stack([packed(t, v, 0) for t, v in zip(tokens, valid)], 1)  # [B, K, L]
    cv = torch.stack([packed(v, v, False) for v in valid], 1)
    w = weights[index]  # [K]
    kidx = torch.arange(K, device=dev)
    alive = torch.ones(B, K, dtype=torch.bool, device=dev)
    going = torch.ones(B, dtype=torch.bool, device=dev)
    out_tok, out_ok, owned = [tokens[0][:, 0]], [going], [alive]
    for d in range(L):
        has = alive & cv[:, :, d]
        t = c[:, :, d]
        same = t[:, :, None] == t[:, None, :]
        votes = _in_order(torch.where(same & has[:, None, :], w, 0))  # per member: the votes for its token
        votes = torch.where(has, votes, -torch.inf)
        top = votes.amax(1, keepdim=True)
        first = torch.where(votes == top, kidx, K).amin(1, keepdim=True).clamp(max=K - 1)
        pick = t.gather(1, first)[:, 0]
        going = going & has.any(1)
        alive = torch.where(going[:, None], has & (t == pick[:, None]), alive)
        out_tok.append(torch.where(going, pick, 0)), out_ok.append(going), owned.append(alive & going[:, None])
    out_tok, out_ok = torch.stack(out_tok, 1), torch.stack(out_ok, 1)
    drafted = out_ok[:, 1:].sum(1)  # [B]
    last = torch.stack(owned, 1).gather(1, drafted[:, None, None].expand(B, 1, K))[:, 0]  # alive at the chain's end
    heavy = torch.where(last, w, -torch.inf)
    winner = torch.where(heavy == heavy.amax(1, keepdim=True), kidx, K).amin(1)
    winner = torch.where(drafted > 0, index[winner.clamp(max=K - 1)], -1)
    depth = torch.arange(L + 1, device=dev)
    own_k = torch.where(torch.stack(owned, 1), depth[None, :, None], -1)  # [B, L + 1, K]
    own = torch.full((B, L + 1, n_members), -1, dtype=torch.long, device=dev)
    own[:, :, index] = own_k
    parents = torch.where(out_ok, depth - 1, -1)
    return out_tok, *_tree(parents, out_ok, L), own, winner


# --- the reference: one row on the host (the eager path's; tests hold the tensor forms to it) -------------------

def merge_row(trees: list[tuple[list[int], list[int], list[bool]]], members: tuple, n_members: int, weights: list,
              budget: int, share: bool, q_index: list | None = None, q_offsets: tuple | None = None):
    """merge_trees' rule for one row on the host: trees[k] = (tokens, parents, valid) of members[k]'s tree (node 0
    the root) -> the merged tree's tokens, parents, own (per node, each member's node index or -1) and, given q_index
    (per tree, its nodes' q rows, or None) and q_offsets, each node's q row (-1: none); the nodes packed in order."""
    tokens, parents, depth, child = [trees[0][0][0]], [-1], [0], {}
    owners = [[0 if m in members else -1 for m in range(n_members)]]
    qrow = [-1]
    for k, (m, (tok, par, ok)) in enumerate(zip(members, trees)):
        local = {0: 0}
        for i in range(1, len(tok)):
            if not ok[i]:
                continue
            mp, key = local[par[i]], (local[par[i]], tok[i])
            if share and key in child:
                node = child[key]
            else:
                node = len(tokens)
                tokens.append(tok[i]), parents.append(mp), depth.append(depth[mp] + 1)
                owners.append([-1] * n_members), qrow.append(-1)
                child.setdefault(key, node)
            owners[node][m] = i
            if q_index is not None and q_index[k] is not None and q_index[k][i] >= 0:
                qrow[node] = q_offsets[k] + q_index[k][i]
            local[i] = node
    if len(tokens) - 1 > budget:
        score = [sum(weights[m] for m, i in enumerate(o) if i >= 0) for o in owners]
        kept = sorted(range(1, len(tokens)), key=lambda n: (-score[n], depth[n], n))[:budget]
        order = [0] + sorted(kept)
        new = {n: j for j, n in enumerate(order)}
        tokens, qrow, owners = [tokens[n] for n in order], [qrow[n] for n in order], [owners[n] for n in order]
        parents = [-1] + [new[parents[n]] for n in order[1:]]
    return tokens, parents, owners, qrow


def vote_row(chains: list[list[int]], members: tuple, n_members: int, weights: list):
    """vote_chains' rule for one row on the host: chains[k] = members[k]'s chain (its valid tokens in order) -> the
    chosen chain's tokens (root excluded), own (per node, root first) and the winner (-1: nothing drafted)."""
    tokens, alive, d = [], dict(zip(members, chains)), 0
    owners = [[0 if m in members else -1 for m in range(n_members)]]
    while True:
        votes: dict[int, float] = {}
        for m, c in alive.items():
            if d < len(c):
                votes[c[d]] = votes.get(c[d], 0.0) + weights[m]
        if not votes:
            break
        pick = max(votes, key=lambda t: (votes[t], -min(m for m, c in alive.items() if d < len(c) and c[d] == t)))
        alive = {m: c for m, c in alive.items() if d < len(c) and c[d] == pick}
        tokens.append(pick), owners.append([d + 1 if m in alive else -1 for m in range(n_members)])
        d += 1
    winner = max(alive, key=lambda m: (weights[m], -m)) if tokens else -1
    return tokens, owners, winner
