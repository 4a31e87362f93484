"""Filling a tree with draft tokens, per draft-module kind."""

from __future__ import annotations

import torch

from ..heads.hydra import causal_pattern
from .tree import TreeBuffers


def fill_tree(draft, base, buf: TreeBuffers, topk: list[int], root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Tree tokens [B, N]. root [B] is the base's chosen next token, hidden [B, H] the state that chose it."""
    if draft.kind == "medusa":
        return _fill_medusa(draft, buf, topk, root, hidden)
    if draft.kind == "hydra":
        return _fill_hydra(draft, buf, topk, root, hidden)
    raise ValueError(f"no tree drafting for draft kind {draft.kind!r}")


def _fill_medusa(draft, buf: TreeBuffers, topk: list[int], root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # Every Medusa head reads the same h_t, so all depths come from one call: [B, K, V].
    logits = draft.logits(hidden.to(next(draft.parameters()).dtype))
    kmax = max(topk, default=1)
    cand = logits[:, : len(topk)].topk(kmax, dim=-1).indices  # [B, D, kmax]
    depth, rank = buf.depth[1:], buf.rank[1:]
    return torch.cat([root[:, None], cand[:, depth - 1, rank]], dim=1)


def _fill_hydra(draft, buf: TreeBuffers, topk: list[int], root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # Depth by depth: head d runs once over every depth-d node that has children, each conditioned on
    # its own root path, and its top-k fills that node's children by rank.
    B, N = root.shape[0], buf.depth.numel()
    tokens = torch.zeros(B, N, dtype=torch.long, device=root.device)
    tokens[:, 0] = root
    for d, lv in enumerate(buf.levels):
        P = lv["parents"].numel()
        if P == 0:
            continue
        path_tokens = tokens[:, lv["paths"]]  # [B, P, d+1]
        h = hidden[:, None, :].expand(B, P, hidden.shape[-1])
        logits = draft.head_logits(d, h, path_tokens)  # [B, P, V]
        cand = logits.topk(topk[d], dim=-1).indices  # [B, P, k_d]
        tokens[:, lv["children"]] = cand[:, lv["child_parent"], lv["child_rank"]]
    return tokens


class DraftState:
    """What the draft module reads at each step: the base state of the last committed token, passed
    through the Hydra++ prefix layer (with its own KV cache, slot-aligned with the base's) if present."""

    def __init__(self, draft):
        self.draft = draft
        self.prefix = getattr(draft, "prefix_layer", None) is not None
        self.cache = None

    def start(self, hidden: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Prompt states [B, L, H] (left-padded; valid [B, L]) -> feature of the last position [B, H]."""
        if not self.prefix:
            return hidden[:, -1]
        from transformers import DynamicCache

        self.cache = DynamicCache()
        return self.draft.prefix(hidden, causal_pattern(valid), positions, self.cache)[:, -1]

    def advance(self, hidden: torch.Tensor, valid_before: torch.Tensor, new_valid: torch.Tensor,
                positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """States of the newly committed slots [B, M, H] -> feature of each row's last committed one [B, H]."""
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        if not self.prefix:
            return hidden[rows, last]
        B, M, _ = hidden.shape
        allowed = torch.cat([valid_before[:, None, :].expand(B, M, valid_before.shape[1]), causal_pattern(new_valid)],
                            dim=2)
        return self.draft.prefix(hidden, allowed, positions, self.cache)[rows, last]
