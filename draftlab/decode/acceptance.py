"""Acceptance rules over a verified tree: greedy (exact), lossless sampling, and Medusa's typical (lossy).

All take the tree tokens [B, N], the base's logits at every node [B, N, V] (logits at node i are the
base's distribution for the token after node i) and the step's `TreeView`, and return, per row, the
accepted node indices (starting with the root, 0) and the bonus token [B] the base adds after the
last accepted node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TreeView


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy. typical=True selects Medusa's typical acceptance (lossy, opt-in).

    posterior_threshold (epsilon) and posterior_alpha (alpha) set typical acceptance's threshold
    min(epsilon, alpha * exp(-H(p))). The defaults are Medusa's (FasterDecoding medusa_generate: epsilon 0.09,
    alpha 0.3); alpha None means sqrt(epsilon), the relation Medusa recommends and Hydra's epsilon sweep keeps,
    so sweeping epsilon alone reproduces it.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    typical: bool = False
    posterior_threshold: float = 0.09  # epsilon
    posterior_alpha: float | None = None  # alpha; None: sqrt(epsilon)

    def __post_init__(self):
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: the nucleus' probability mass, in (0, 1] (1: no cut)")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: the number of tokens kept, >= 0 (0: no cut)")
        if not 0 < self.posterior_threshold <= 1:
            raise ValueError(f"typical epsilon (posterior_threshold) = {self.posterior_threshold}: a probability "
                             "threshold in (0, 1] is needed, e.g. Medusa's 0.09")
        if self.posterior_alpha is not None and not self.posterior_alpha > 0:
            raise ValueError(f"typical alpha (posterior_alpha) = {self.posterior_alpha}: must be > 0; leave it unset "
                             "for sqrt(epsilon)")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 and not self.typical

    @property
    def typical_alpha(self) -> float:
        """alpha of the typical threshold: posterior_alpha, or sqrt(epsilon) when unset."""
        return self.posterior_threshold ** 0.5 if self.posterior_alpha is None else self.posterior_alpha


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The base's sampling distribution after temperature, top-k and top-p, [..., V] (float32)."""
    x = logits.float() / max(s.temperature, 1e-5)
    if s.top_k > 0:
        kth = x.topk(min(s.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if s.top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = sp.cumsum(-1) - sp >= s.top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Samples from the distributions q [..., V] by inverse CDF, given uniforms u [..., k] in [0, 1) (k draws per
    distribution, i.i.d. when u is): index i is drawn when cdf[i - 1] <= u * total < cdf[i], so a zero-probability
    token is never drawn. Tensor operations only (it runs inside compiled graphs, the uniforms drawn outside them
    from the role's own generator, by `uniforms`).

    The CDF is summed in float64 and u should be float64 too: float32 resolves 2^-24 of the total only, so a
    token whose mass lies below that next to a large one would get no interval or a rounded one (torch.multinomial
    on CPU draws none of 10,000 tokens of mass 1e-8 each after one of 1 - 1e-4)."""
    cdf = q.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u.double() * cdf[..., -1:]).contiguous(), right=True)
    return idx.clamp(max=q.shape[-1] - 1)


def uniforms(*shape: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """float64 uniforms in [0, 1) from a role's generator: draw's, and the acceptance rule's tries."""
    return torch.rand(*shape, generator=generator, device=device, dtype=torch.float64)


def sample(q: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k i.i.d. draws from each distribution of q [..., V]: [..., k] (draw, from the generator's uniforms)."""
    return draw(q, uniforms(*q.shape[:-1], k, generator=generator, device=q.device))


def _deepest(ok: torch.Tensor, view: TreeView) -> torch.Tensor:
    """Per row, the deepest node whose whole root path is ok (ties: the earliest node), [B] on the device."""
    # A node counts only if it and all its ancestors are ok: [B, N, N] & -> [B, N].
    full = ~(view.ancestors & ~ok[:, None, :]).any(-1) & view.valid
    N = ok.shape[1]
    order = torch.arange(N - 1, -1, -1, device=ok.device)
    score = torch.where(full, view.depth * N + order, torch.full_like(view.depth, -1))
    return score.argmax(-1)


def paths_to(view: TreeView, last: torch.Tensor) -> list[list[int]]:
    """Per row, the node indices from the root down to last[b] (one device-to-host copy)."""
    rows = torch.arange(last.shape[0], device=last.device)
    on = view.ancestors[rows, last]  # [B, N]: the nodes on each row's path
    return [[n for n, x in enumerate(r) if x] for r in on.tolist()]


def greedy_decision(tokens: torch.Tensor, logits: torch.Tensor, view: TreeView):
    """Greedy acceptance on the device: the last accepted node [B] (its root path is the accepted path) and the
    bonus token [B]. The accepted path is the longest root path whose every token is the base's argmax after
    its parent."""
    pred = logits.argmax(-1)  # [B, N]
    ok = tokens == pred.gather(1, view.parents.clamp(min=0))
    ok[:, 0] = True
    last = _deepest(ok, view)
    return last, pred.gather(1, last[:, None])[:, 0]


def accept_greedy(tokens: torch.Tensor, logits: torch.Tensor, view: TreeView):
    """Longest root path whose every token is the base's argmax after its parent: (paths, bonus [B])."""
    last, bonus = greedy_decision(tokens, logits, view)
    return paths_to(view, last), bonus


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What is left of p after a candidate drawn from q was rejected (unnormalised): max(p - q, 0)."""
    return (p - q).clamp(min=0.0)


def _renormalised(rest: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """rest normalised, or p itself when rest has no mass (see sample_residual for why that is sound)."""
    total = rest.sum()
    return rest / total if total > 0 else p


def sample_residual(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """A token from normalize(max(p - q, 0)), p and q [V], after a draft from q was rejected; from p if that is empty.

    With p and q both summing to 1, max(p - q, 0) has the same mass as max(q - p, 0), which is exactly the
    probability that the rejection happened. So the residual is empty only when p == q up to rounding (or a
    q whose mass exceeds 1 through rounding lies over p everywhere), and then the rejection had probability
    ~0: whatever is drawn in its place moves the law of the output by at most that probability. Drawing
    from p is the choice that is exact when p == q; raising (a draw from zeros) is not an option.
    A deterministic proposal x is q = one-hot(x): the residual is p without x.
    """
    p = p.float()
    return int(sample(_renormalised(residual(p, q.float()), p), 1, generator)[0])


def accept_sampling(tokens: torch.Tensor, logits: torch.Tensor, view: TreeView, s: Sampling,
                    generator: torch.Generator | None = None, q: torch.Tensor | None = None,
                    q_index: torch.Tensor | None = None):
    """Lossless multi-step speculative sampling over the tree (SpecInfer's recursive rejection): (paths, bonus [B]).

    At each accepted node the children are tried in node order. A child x drawn from a draft distribution
    q (q[b, q_index[b, x]]; siblings drawn i.i.d. from their own q) is accepted with probability
    min(1, p(x)/q(x)); on rejection p <- normalize(max(p - q, 0)) and the next child is tried. A child
    proposed deterministically (q_index -1: top-k candidates of heads, lookups) has q = a point mass on
    x, so it is accepted with probability p(x) and on rejection x is removed from p. When every child
    is rejected (or the node is a leaf) the bonus token is sampled from what remains of p. Each try
    is one exact rejection step towards the current p, so the committed tokens are distributed
    exactly as sampling from the base. A rejection that leaves no mass (possible only through rounding,
    with probability ~0) keeps p as it was, as `sample_residual` does.

    The rule runs on the device (sampling_decision), from one block of uniforms per step drawn from `generator`:
    [B, N + 1], one for each node's try (used if it is tried) and one for the bonus.
    """
    B, N = tokens.shape
    u = uniforms(B, N + 1, generator=generator, device=tokens.device)
    K, D = tree_bounds(view)
    last, bonus = sampling_decision(tokens, logits, view.parents, view.valid, s, u, q, q_index, K, D)
    return paths_to(view, last), bonus


def tree_bounds(view: TreeView, rounded: bool = False) -> tuple[int, int]:
    """Bounds on the most children of any node and on the depth of a step's trees (host numbers: the loop bounds of
    sampling_decision). A static tree's are exact, from its buffers. Per-row trees (a dynamic tree, a padded merge)
    cost one device-to-host copy; `rounded` rounds them up to powers of two, for a compiled rule: each pair of bounds
    is one compiled graph, and trees that change every step would otherwise compile anew at every new pair."""
    if view.static is not None:
        return max(1, max(len(c) for c in view.static.children)), int(view.static.depth.max())
    k, d = torch.stack([sibling_rank(view.parents, view.valid).max() + 1, view.depth.max()]).tolist()
    k, d = max(1, k), max(1, d)
    return (1 << (k - 1).bit_length(), 1 << (d - 1).bit_length()) if rounded else (k, d)


def sibling_rank(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each node's index among its siblings in node order, [B, N] (0 for the root and for padding)."""
    N = parents.shape[1]
    earlier = torch.ones(N, N, dtype=torch.bool, device=parents.device).tril(-1)  # [n, m]: m < n
    same = (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :] & earlier
    return same.sum(-1) * (valid & (parents >= 0))


def sampling_decision(tokens, logits, parents, valid, s: Sampling, u, q=None, q_index=None, K: int = 1, D: int = 1):
    """accept_sampling's rule on the device, tensor operations only (fixed shapes for given K, D): the last accepted
    node [B] and the bonus token [B].

    tokens [B, N], logits [B, N, V], parents / valid [B, N] (the TreeView's), uniforms u [B, N + 1] in [0, 1)
    (u[:, n] for node n's try, u[:, 0] for the bonus), q [B, Q, V] / q_index [B, N] as in Proposal (None: every
    node deterministic), K >= the most children of any node, D >= the trees' depth.

    The tries at different parents are independent of each other, so they run for every node at once: round k tries
    each node's k-th child (in node order) against what the node's earlier children left of its p, unless one of
    them was accepted. Then the accepted path is followed from the root (D gathers), and the bonus is drawn by
    inverse CDF from what is left of p at its last node. A node's p is only ever read at nodes on the path, so the
    work at the others is wasted but harmless: B N V per round, against the sequential rule's syncs per try."""
    B, N = tokens.shape
    p = warp(logits, s)  # [B, N, V]: each node's distribution for the token after it
    rows = torch.arange(B, device=tokens.device)
    node = torch.arange(N, device=tokens.device)[None]
    kid = valid & (parents >= 0)
    # children[b, v, k]: node v's k-th child, -1 past the last (a scatter into one spare slot for non-children).
    flat = torch.where(kid, parents * K + sibling_rank(parents, valid), N * K)
    children = torch.full((B, N * K + 1), -1, dtype=torch.long, device=tokens.device)
    children = children.scatter(1, flat, node.expand(B, N))[:, : N * K].view(B, N, K)
    accepted = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
    for k in range(K):
        c = children[:, :, k]
        tried = (c >= 0) & (accepted < 0)
        c = c.clamp(min=0)
        x = tokens.gather(1, c)  # [B, N]: the token each node tries
        px = p.gather(2, x[..., None])[..., 0]
        uu = u.gather(1, c)
        removed = p.scatter(2, x[..., None], 0.0)  # a point mass's residual: p without x
        if q is None:
            ok = uu < px
            rest = removed
        else:
            j = q_index.gather(1, c)
            qd = q.float().gather(1, j.clamp(min=0)[..., None].expand(B, N, q.shape[-1]))  # [B, N, V]
            ok = torch.where(j < 0, uu < px, uu * qd.gather(2, x[..., None])[..., 0] < px)
            rest = torch.where((j < 0)[..., None], removed, residual(p, qd))
        ok = tried & (px > 0) & ok
        total = rest.sum(-1, keepdim=True)
        rest = torch.where(total > 0, rest / total.clamp(min=torch.finfo(total.dtype).tiny), p)
        p = torch.where((tried & ~ok)[..., None], rest, p)
        accepted = torch.where(ok, c, accepted)
    last = torch.zeros(B, dtype=torch.long, device=tokens.device)
    for _ in range(D):
        nxt = accepted[rows, last]
        last = torch.where(nxt >= 0, nxt, last)
    bonus = draw(p[rows, last], u[:, :1])[:, 0]
    return last, bonus


def typical_threshold(probs: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Medusa's acceptance threshold min(epsilon, alpha * exp(-H(p))), H(p) = -sum p log(p + 1e-5); probs [..., V]."""
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)
    return torch.minimum(torch.full_like(entropy, s.posterior_threshold), s.typical_alpha * torch.exp(-entropy))


def accept_typical(tokens: torch.Tensor, logits: torch.Tensor, view: TreeView, s: Sampling,
                   generator: torch.Generator | None = None):
    """Medusa's typical acceptance (see typical_decision): (paths, bonus [B])."""
    last, bonus = typical_decision(tokens, logits, view, s)
    return paths_to(view, last), bonus


def typical_decision(tokens: torch.Tensor, logits: torch.Tensor, view: TreeView, s: Sampling):
    """Medusa's typical acceptance (lossy, opt-in), as the paper and FasterDecoding's default code define it.

    At temperature 0 it is greedy verification, exactly. At T > 0, with p = softmax(logits / T) (top-p and
    top-k do not enter this rule), a candidate x is accepted when p(x) > min(epsilon, alpha * exp(-H(p))),
    H(p) = -sum p log(p + 1e-5); of the deepest accepted paths the one with the largest sum of log p(x) is
    taken. The bonus token, which is the next step's first token (its root), is the base's argmax: Medusa
    decodes the first token of every step greedily and accepts it unconditionally (medusa_generate's default
    fast=True, whose generate_candidates takes the argmax), which guarantees one token per step. The rule is
    deterministic (no generator). On the device: the last accepted node [B] and the bonus token [B].
    """
    if s.temperature <= 0:
        return greedy_decision(tokens, logits, view)
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)  # [B, N, V]
    thresh = typical_threshold(probs, s)  # [B, N]
    par = view.parents.clamp(min=0)
    p_tok = probs.gather(1, par[..., None].expand(-1, -1, probs.shape[-1])).gather(-1, tokens[..., None])[..., 0]
    ok = p_tok > thresh.gather(1, par)  # [B, N]: node accepted given its parent was
    ok[:, 0] = True
    full = ~(view.ancestors & ~ok[:, None, :]).any(-1) & view.valid  # the whole root path accepted
    logp = torch.log(p_tok.clamp(min=1e-30))
    logp[:, 0] = 0.0
    path_ll = (view.ancestors.float() * logp[:, None, :]).sum(-1)  # [B, N] log-likelihood of each root path
    depth = torch.where(full, view.depth, torch.full_like(view.depth, -1))
    deepest = full & (depth == depth.max(-1, keepdim=True).values)
    best = torch.where(deepest, path_ll, torch.full_like(path_ll, float("-inf"))).argmax(-1)  # [B]
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return best, logits[rows, best].argmax(-1)
