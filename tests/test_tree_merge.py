"""The ensemble's tensor merge and vote (drafters/tree_merge.py, the static path's) against their host references
(the eager path's: SpecInfer's trie merge with a node budget; Minions' weighted vote), on random trees with shared
prefixes, padded nodes, repeated sibling tokens, uneven weights and several rows; run eagerly and traced by dynamo
(backend eager: a shape per trial) and, for the merge, through inductor (one shape)."""

import random

import pytest
import torch

from draftlab.decode.tree import TreeView
from draftlab.drafters.tree_merge import member_index, merge_layout, merge_row, merge_trees, vote_chains, vote_row


def random_tree(rng, n, vocab):
    """A random tree of n nodes in topological order (tokens from a small vocab, so prefixes repeat), some nodes
    padded (a padded node's subtree padded too)."""
    parents, tokens, valid = [-1], [rng.randrange(vocab)], [True]
    for i in range(1, n):
        p = rng.randrange(i)
        parents.append(p), tokens.append(rng.randrange(vocab)), valid.append(valid[p] and rng.random() > 0.15)
    return tokens, [p if ok else -1 for p, ok in zip(parents, valid)], valid


def as_tensors(rows_trees):
    """Per member, rows of (tokens, parents, valid) -> tensors [B, N] and their view's depth."""
    tok = torch.tensor([t for t, _, _ in rows_trees])
    par = torch.tensor([p for _, p, _ in rows_trees])
    ok = torch.tensor([v for _, _, v in rows_trees])
    view = TreeView.of_parents(par, ok)
    return tok, view.parents, ok, view.depth


@pytest.mark.parametrize("compiled", [None, "eager", pytest.param("inductor", marks=pytest.mark.slow)])  # 15 s cold
@pytest.mark.parametrize("share", [True, False])
def test_the_tensor_merge_is_the_trie_merge(share, compiled):
    """inductor: one shape (three members of 6, 4 and 5 nodes, two rows, a budget that cuts), so one compile."""
    fn = torch.compile(merge_trees, backend=compiled, dynamic=False) if compiled else merge_trees
    rng = random.Random(int(share))
    for trial in range(12):
        B, M = rng.randint(1, 3), 4
        members = tuple(sorted(rng.sample(range(M), rng.randint(1, 3))))
        sizes = [rng.randint(2, 7) for _ in members]
        budget = rng.choice([2, 4, 8, 64])
        if compiled == "inductor":
            B, members, sizes, budget = 2, (0, 2, 3), [6, 4, 5], 8
        weights = [rng.choice([1.0, 0.5, 2.0, 0.25]) for _ in range(M)]
        rows = [[random_tree(rng, n, 3) for _ in range(B)] for n in sizes]  # rows[k][b]
        for b in range(B):  # one root per row
            for k in range(len(members)):
                rows[k][b][0][0] = rows[0][b][0][0]
        ts = [as_tensors(r) for r in rows]
        q_index = [torch.arange(n)[None].expand(B, n) - 1 for n in sizes] if not share else None
        offsets = tuple(sum(sizes[:k]) * 10 for k in range(len(sizes))) if not share else None
        tok, par, ok, depth, anc, own, q = fn(
            [t[0] for t in ts], [t[1] for t in ts], [t[2] for t in ts], [t[3] for t in ts],
            merge_layout(tuple(n - 1 for n in sizes), members, M, "cpu"), M,
            torch.tensor(weights, dtype=torch.float64), budget, share, max(sizes) - 1, q_index, offsets)
        view = TreeView.of_parents(par, ok)  # (checks the order: a parent before its child)
        assert torch.equal(depth, view.depth) and torch.equal(anc, view.ancestors)
        assert tok.shape[1] == 1 + min(budget, sum(n - 1 for n in sizes))
        for b in range(B):
            want_tok, want_par, want_own, want_q = merge_row(
                [r[b] for r in rows], members, M, weights, budget, share,
                None if share else [x[b].tolist() for x in q_index], offsets)
            cols = [c for c, v in enumerate(ok[b].tolist()) if v]  # the nodes (padding between them where shared)
            new = {c: j for j, c in enumerate(cols)}
            assert tok[b, cols].tolist() == want_tok, (trial, b)
            assert [new.get(p, -1) for p in par[b, cols].tolist()] == want_par, (trial, b)
            if len(cols) < tok.shape[1] and sum(sizes) - len(sizes) > budget:  # cut to the budget: packed
                assert cols == list(range(len(cols)))
            assert own[b, cols].tolist() == want_own, (trial, b)
            if not share:  # each node's q row is its one owner's, after that member's table's offset
                assert q[b, cols].tolist() == want_q
                assert want_q[1:] == [offsets[members.index(m)] + o[m] - 1
                                      for o in want_own[1:] for m in range(M) if o[m] >= 0]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("given_index", [False, True])
def test_the_tensor_vote_is_the_weighted_vote(compiled, given_index):
    """The vote over random chains is vote_row's, with the members' index made by the call or given (member_index,
    the ensemble's: one tensor per members and device)."""
    fn = torch.compile(vote_chains, backend="eager") if compiled else vote_chains
    rng = random.Random(3)
    for trial in range(5 if compiled else 20):  # compiled: most trials are a new shape, a new trace (about 1 s each)
        B, M = rng.randint(1, 3), 4
        members = tuple(sorted(rng.sample(range(M), rng.randint(1, 4))))
        weights = [rng.choice([1.0, 0.5, 1.5, 2.0]) for _ in range(M)]
        L = rng.randint(1, 4)
        tokens, valid, chains = [], [], {m: [] for m in members}
        for m in members:
            t = [[0] + [rng.randrange(2) for _ in range(L)] for _ in range(B)]
            n = [rng.randint(0, L) for _ in range(B)]  # a chain of n tokens, the rest padded
            v = [[True] + [i < n[b] for i in range(L)] for b in range(B)]
            tokens.append(torch.tensor(t)), valid.append(torch.tensor(v))
            chains[m] = [t[b][1:1 + n[b]] for b in range(B)]
        index = member_index(members, "cpu") if given_index else None
        tok, par, ok, depth, anc, own, winner = fn(tokens, valid, members, M,
                                                   torch.tensor(weights, dtype=torch.float64), index)
        view = TreeView.of_parents(par, ok)
        assert torch.equal(depth, view.depth) and torch.equal(anc, view.ancestors)
        for b in range(B):
            want, want_own, want_winner = vote_row([chains[m][b] for m in members], members, M, weights)
            n = int(ok[b].sum())
            assert tok[b, 1:n].tolist() == want and par[b, :n].tolist() == list(range(-1, n - 1)), (trial, b)
            assert own[b, :n].tolist() == want_own
            assert int(winner[b]) == want_winner, (trial, b)


def merged_paths(parents):
    """Every root-to-node path of a tree (parents, -1 at the root and at padding), node indices root first."""
    paths = {0: [0]}
    for n, p in enumerate(parents):
        if n and p >= 0:
            paths[n] = paths[p] + [n]
    return list(paths.values())


def test_a_members_own_path_is_a_path_of_its_own_tree():
    """Where a member's tree repeats a token under one parent, the merge shares the two nodes, and the ensemble's
    commit must still follow a path of the member's own tree: along every path of the merged tree, each member's own
    path (_own_path) is a chain of its tree's parent links with the path's tokens, as deep as the member holds it.
    Following the owners along the path instead fails on the smallest case (one member, tokens 9 5 5 7, node 3 a
    child of node 1: the path to 7 would be 0 2 3)."""
    from draftlab.drafters.ensemble import _own_path

    tok, par, ok = [9, 5, 5, 7], [-1, 0, 0, 1], [True] * 4
    m_tok, m_par, m_own, _ = merge_row([(tok, par, ok)], (0,), 1, [1.0], 8, True)
    assert m_tok == [9, 5, 7] and _own_path(m_own, par, 0, [0, 1, 2]) == [0, 1, 3]
    rng = random.Random(11)
    for trial in range(200):
        M = rng.randint(1, 3)
        members = tuple(range(M))
        trees = [random_tree(rng, rng.randint(2, 8), 2) for _ in members]  # 2 tokens: siblings repeat often
        for t in trees:
            t[0][0] = trees[0][0][0]
        budget = rng.choice([3, 64])
        weights = [rng.choice([1.0, 0.5, 2.0]) for _ in members]
        ts = [as_tensors([t]) for t in trees]
        out = merge_trees([t[0] for t in ts], [t[1] for t in ts], [t[2] for t in ts], [t[3] for t in ts],
                          merge_layout(tuple(len(t[0]) - 1 for t in trees), members, M, "cpu"), M,
                          torch.tensor(weights, dtype=torch.float64), budget, True, 8)
        layouts = [merge_row(trees, members, M, weights, budget, True)[:3],  # the host reference's tree
                   (out[0][0].tolist(), out[1][0].tolist(), out[5][0].tolist())]  # the tensor form's (padding
        for m_tok, m_par, m_own in layouts:  # between the nodes)
            for path in merged_paths(m_par):
                for m, (t_tok, t_par, _) in enumerate(trees):
                    own = _own_path(m_own, t_par, m, path)
                    held = next((d for d, n in enumerate(path) if m_own[n][m] < 0), len(path))
                    assert len(own) == held and own[0] == 0, (trial, path, m)
                    assert all(t_par[own[d]] == own[d - 1] for d in range(1, len(own))), (trial, path, m, own)
                    assert [t_tok[i] for i in own] == [m_tok[n] for n in path[:held]]


def test_near_ties_break_alike_on_the_host_and_in_tensors():
    """Five members whose weights sum to a near-tie: the tensor forms sum in member order, as the host references do
    (a reduction, in another order, broke the tie the other way)."""
    weights = [0.1, 0.1, 1.1, 0.3, 0.6]  # member 2 alone against members 0, 1, 3 and 4
    chains = [[2], [2], [1], [2], [2]]
    w = torch.tensor(weights, dtype=torch.float64)
    members = tuple(range(5))
    tokens = [torch.tensor([[9] + c]) for c in chains]
    valid = [torch.ones(1, 2, dtype=torch.bool) for _ in chains]
    tok, *_, winner = vote_chains(tokens, valid, members, 5, w)
    want, _, want_winner = vote_row(chains, members, 5, weights)
    assert tok[0, 1:].tolist() == want and int(winner[0]) == want_winner
    trees = [([9] + c, [-1, 0], [True, True]) for c in chains]
    want_tok = merge_row(trees, members, 5, weights, 1, True)[0]
    out = merge_trees(tokens, [torch.tensor([[-1, 0]])] * 5, valid, [torch.tensor([[0, 1]])] * 5,
                      merge_layout((1,) * 5, members, 5, "cpu"), 5, w, 1, True, 1)
    assert out[0][0].tolist() == want_tok
