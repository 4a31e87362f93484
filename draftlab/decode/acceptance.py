"""Acceptance rules over a verified tree: greedy (exact), lossless sampling, and Medusa's typical (lossy).

All take tree tokens [B, N] and the base's logits at every node [B, N, V] (logits at node i are the
base's distribution for the token after node i), and return, per row, the accepted node indices
(starting with the root, 0) and the bonus token [B] the base adds after the last accepted node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TreeBuffers


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy. typical=True selects Medusa's typical acceptance (lossy, opt-in)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    typical: bool = False
    posterior_threshold: float = 0.09  # epsilon
    posterior_alpha: float = 0.3  # alpha ~ sqrt(epsilon)


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


def accept_greedy(tokens: torch.Tensor, logits: torch.Tensor, buf: TreeBuffers):
    """Longest root-to-leaf prefix whose every token is the base's argmax after its parent."""
    pred = logits.argmax(-1)  # [B, N]
    lp = buf.leaf_paths  # [P, D+1]
    child, parent = lp[:, 1:], lp[:, :-1]  # [P, D]
    match = (tokens[:, child.clamp(min=0)] == pred[:, parent.clamp(min=0)]) & (child >= 0)  # [B, P, D]
    accepted = match.long().cumprod(-1).sum(-1)  # [B, P]
    best = accepted.argmax(-1)  # [B]
    n = accepted.gather(1, best[:, None])[:, 0]  # [B]
    paths = [lp[best[b], : int(n[b]) + 1].tolist() for b in range(tokens.shape[0])]
    last = torch.tensor([p[-1] for p in paths], device=tokens.device)
    bonus = pred.gather(1, last[:, None])[:, 0]
    return paths, bonus


def accept_sampling(tokens: torch.Tensor, logits: torch.Tensor, buf: TreeBuffers, s: Sampling,
                    generator: torch.Generator | None = None):
    """Lossless multi-candidate speculative sampling (SpecInfer-style recursive rejection).

    The draft proposes each child deterministically (q = a point mass), so child x is accepted
    with probability min(1, p(x)/q(x)) = p(x); on rejection p becomes normalize(max(p - q, 0)),
    i.e. x is removed and p renormalised, and the next sibling is tried. If every child is
    rejected (or the node is a leaf) the bonus token is sampled from what remains of p. The
    committed tokens are therefore distributed exactly as sampling from the base.
    """
    B = tokens.shape[0]
    paths, bonus = [], torch.empty(B, dtype=torch.long, device=tokens.device)
    for b in range(B):
        node, path = 0, [0]
        while True:
            p = warp(logits[b, node], s)  # [V]
            nxt = None
            for c in buf.children[node]:
                x = int(tokens[b, c])
                px = p[x]
                u = torch.rand((), generator=generator, device=p.device)
                if px > 0 and u < px:
                    nxt = c
                    break
                p[x] = 0.0
                total = p.sum()
                if total <= 0:  # all mass was on rejected tokens (cannot happen unless p is degenerate)
                    break
                p = p / total
            if nxt is None:
                bonus[b] = torch.multinomial(p, 1, generator=generator)[0]
                break
            node = nxt
            path.append(node)
        paths.append(path)
    return paths, bonus


def accept_typical(tokens: torch.Tensor, logits: torch.Tensor, buf: TreeBuffers, s: Sampling,
                   generator: torch.Generator | None = None):
    """Medusa's typical acceptance (lossy): accept x if p(x) > min(eps, alpha * exp(-H(p)))."""
    probs = warp(logits, s) if s.temperature > 0 else torch.softmax(logits.float(), -1)  # [B, N, V]
    entropy = -(probs * torch.log(probs.clamp(min=1e-12))).sum(-1)  # [B, N]
    thresh = torch.minimum(torch.full_like(entropy, s.posterior_threshold), s.posterior_alpha * torch.exp(-entropy))
    lp = buf.leaf_paths
    child, parent = lp[:, 1:], lp[:, :-1]
    cp = child.clamp(min=0)
    pp = parent.clamp(min=0)
    p_tok = probs[:, pp].gather(-1, tokens[:, cp][..., None])[..., 0]  # [B, P, D] p_parent(child token)
    ok = (p_tok > thresh[:, pp]) & (child >= 0)
    accepted = ok.long().cumprod(-1).sum(-1)  # [B, P]
    best = accepted.argmax(-1)
    n = accepted.gather(1, best[:, None])[:, 0]
    paths = [lp[best[b], : int(n[b]) + 1].tolist() for b in range(tokens.shape[0])]
    last = torch.tensor([p[-1] for p in paths], device=tokens.device)
    last_probs = probs[torch.arange(tokens.shape[0], device=tokens.device), last]  # [B, V]
    if s.temperature > 0:
        bonus = torch.multinomial(last_probs, 1, generator=generator)[:, 0]
    else:
        bonus = last_probs.argmax(-1)
    return paths, bonus
