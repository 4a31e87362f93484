"""Filling a tree with draft tokens, per draft-module kind."""

from __future__ import annotations

import torch

from .tree import TreeBuffers


def fill_tree(draft, base, buf: TreeBuffers, topk: list[int], root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Tree tokens [B, N]. root [B] is the base's chosen next token, hidden [B, H] the state that chose it."""
    if draft.kind == "medusa":
        return _fill_medusa(draft, buf, topk, root, hidden)
    if draft.kind == "hydra":
        return draft.fill_tree(base, buf, topk, root, hidden)
    raise ValueError(f"no tree drafting for draft kind {draft.kind!r}")


def _fill_medusa(draft, buf: TreeBuffers, topk: list[int], root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # Every Medusa head reads the same h_t, so all depths come from one call: [B, K, V].
    logits = draft.logits(hidden.to(next(draft.parameters()).dtype))
    kmax = max(topk, default=1)
    cand = logits[:, : len(topk)].topk(kmax, dim=-1).indices  # [B, D, kmax]
    depth, rank = buf.depth[1:], buf.rank[1:]
    return torch.cat([root[:, None], cand[:, depth - 1, rank]], dim=1)
