"""Per-head CE and teacher-distillation losses, computed in position chunks so memory stays linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(h, w, target, teacher_h, teacher_w, distill_weight: float, topk: int):
    # h [N, H], w [V, H], target [N]; logits live only for this chunk and are recomputed in backward.
    logits = (h @ w.t()).float()  # [N, V]
    logp = F.log_softmax(logits, dim=-1)
    loss = torch.zeros((), device=h.device, dtype=torch.float32)
    if distill_weight < 1:
        loss = loss + (1 - distill_weight) * F.nll_loss(logp, target, reduction="sum")
    if distill_weight > 0:
        with torch.no_grad():
            p_teacher = F.softmax((teacher_h @ teacher_w.t()).float(), dim=-1)  # [N, V]
        loss = loss - distill_weight * (p_teacher * logp).sum()
    with torch.no_grad():
        top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices  # [N, k]
        hit = top == target[:, None]
        top1, topk_hits = hit[:, 0].sum().float(), hit.any(-1).sum().float()
    return loss, top1, topk_hits


def head_loss(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, teacher_h: torch.Tensor | None = None,
              teacher_weight: torch.Tensor | None = None, distill_weight: float = 0.0, chunk_size: int = 512,
              topk: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed loss, top-1 hits and top-k hits over N rows; h [N, H] are the supervised positions only.

    distill_weight mixes CE on the data token (0) with soft CE against the teacher's
    distribution softmax(teacher_h @ teacher_weight^T) (1); the teacher is the frozen base.
    """
    total = h.new_zeros((), dtype=torch.float32)
    hits1 = h.new_zeros((), dtype=torch.float32)
    hitsk = h.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk_size):
        args = (h[s:s + chunk_size], weight, target[s:s + chunk_size],
                None if teacher_h is None else teacher_h[s:s + chunk_size], teacher_weight)
        if torch.is_grad_enabled() and h.requires_grad:
            out = checkpoint(_chunk_loss, *args, distill_weight, topk, use_reentrant=False)
        else:
            out = _chunk_loss(*args, distill_weight, topk)
        total, hits1, hitsk = total + out[0], hits1 + out[1], hitsk + out[2]
    return total, hits1, hitsk


def draft_losses(feats: list[torch.Tensor], lm_weights: list[torch.Tensor], input_ids: torch.Tensor,
                 loss_mask: torch.Tensor, base_hidden: torch.Tensor | None = None,
                 base_weight: torch.Tensor | None = None, head_decay: float = 0.8, distill_weight: float = 0.0,
                 chunk_size: int = 512, topk: int = 5) -> dict:
    """Weighted sum over heads of the mean per-head loss, plus per-head sums and hit counts.

    feats[k] [B, S, H]: position t of head k predicts input_ids[:, t+k+2], supervised where
    loss_mask is 1 there. For distillation the teacher for that target is the base's own
    prediction from position t+k+1.
    """
    S = input_ids.shape[1]
    total = input_ids.new_zeros((), dtype=torch.float32)
    out = {"loss_sum": [], "count": [], "top1": [], "topk": []}
    for k, (f, w) in enumerate(zip(feats, lm_weights)):
        shift = k + 2
        if S <= shift:
            for key in out:
                out[key].append(total.new_zeros(()))
            continue
        sel = loss_mask[:, shift:].bool()  # [B, S-shift]
        h = f[:, : S - shift][sel]  # [N, H]
        target = input_ids[:, shift:][sel]  # [N]
        th = base_hidden[:, shift - 1: S - 1][sel] if distill_weight > 0 else None
        loss_sum, h1, hk = head_loss(h, w, target, th, base_weight, distill_weight, chunk_size, topk)
        n = sel.sum()
        total = total + head_decay ** k * loss_sum / n.clamp(min=1)
        for key, v in zip(out, (loss_sum.detach(), n.float(), h1, hk)):
            out[key].append(v)
    out = {key: torch.stack(v) for key, v in out.items()}  # each [K]
    out["loss"] = total
    return out
