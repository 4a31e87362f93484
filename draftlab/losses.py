"""Draft losses: CE on data tokens and distillation towards the frozen base, computed in position chunks
so memory stays linear (no [B, S, K, V] fp32 tensor; one chunk's logits at a time, recomputed in backward).

Divergences (DistillSpec compares them; the best depends on task and decoding mode), with p the base's
distribution and q the draft's:
- fkl: forward KL(p || q), optimised as the soft cross-entropy -sum p log q (same gradient; the value
  differs by the teacher's entropy, a constant);
- rkl: reverse KL(q || p) = sum q (log q - log p), mode-seeking;
- tvd: total variation distance 1/2 sum |p - q|, which bounds how often greedy/sampled drafts are
  rejected (the acceptance rate of speculative sampling is 1 - TVD(p, q));
- jsd: Jensen-Shannon divergence 1/2 KL(p || m) + 1/2 KL(q || m), m = (p + q) / 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DIVERGENCES = ("fkl", "rkl", "tvd", "jsd")


def divergence_sum(logq: torch.Tensor, teacher_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Summed divergence over rows between the teacher's softmax and the draft's log-probs logq [N, V]."""
    logp = F.log_softmax(teacher_logits.float(), dim=-1).detach()
    p = logp.exp()
    if kind == "fkl":
        return -(p * logq).sum()
    q = logq.exp()
    if kind == "rkl":
        return (q * (logq - logp)).sum()
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum()
    if kind == "jsd":
        logm = torch.log((0.5 * (p + q)).clamp(min=1e-30))
        return 0.5 * ((p * (logp - logm)).sum() + (q * (logq - logm)).sum())
    raise ValueError(f"loss.divergence={kind!r}: use one of {', '.join(DIVERGENCES)}")


def lm_logits(h: torch.Tensor, w: torch.Tensor, transform: tuple | None = None) -> torch.Tensor:
    """A base's logits from its final hidden states h [N, H] and lm_head weight w [V, H], in float32: the product,
    then what the base does after it (transform (scale, softcap), base.teacher_transform's: times scale, then
    Gemma-2's soft cap cap * tanh(z / cap))."""
    z = (h @ w.t()).float()
    if transform is not None:
        scale, cap = transform
        z = z * scale if scale != 1 else z
        z = torch.tanh(z / cap) * cap if cap else z
    return z


def _chunk_loss(h, w, target, teacher_h, teacher_w, distill_weight: float, topk: int, kind: str,
                teacher_transform=None, transform=None):
    # h [N, H], w [V, H], target [N]; logits live only for this chunk and are recomputed in backward.
    logits = lm_logits(h, w, transform)  # [N, V]
    logp = F.log_softmax(logits, dim=-1)
    loss = torch.zeros((), device=h.device, dtype=torch.float32)
    if distill_weight < 1:
        loss = loss + (1 - distill_weight) * F.nll_loss(logp, target, reduction="sum")
    teacher = None
    if teacher_h is not None:
        with torch.no_grad():
            teacher = lm_logits(teacher_h, teacher_w, teacher_transform)  # [N, V]
    if distill_weight > 0:
        loss = loss + distill_weight * divergence_sum(logp, teacher, kind)
    with torch.no_grad():
        top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices  # [N, k]
        hit = top == target[:, None]
        top1, topk_hits = hit[:, 0].sum().float(), hit.any(-1).sum().float()
        agree = (top[:, 0] == teacher.argmax(-1)).sum().float() if teacher is not None else torch.zeros_like(top1)
    return loss, top1, topk_hits, agree


def head_loss(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, teacher_h: torch.Tensor | None = None,
              teacher_weight: torch.Tensor | None = None, distill_weight: float = 0.0, chunk_size: int = 512,
              topk: int = 5, divergence: str = "fkl", teacher_transform: tuple | None = None,
              transform: tuple | None = None):
    """Summed loss, top-1 hits, top-k hits and top-1 agreement with the teacher over N rows; h [N, H] are the
    supervised positions only.

    distill_weight mixes CE on the data token (0) with the divergence towards the teacher's
    distribution softmax(teacher_h @ teacher_weight^T) (1), with teacher_transform the base's own logits
    (lm_logits); the teacher is the frozen base. transform: the same for h's logits (a base's own loss). Agreement
    (the draft's top-1 equals the teacher's) is counted whenever a teacher is given.
    """
    if distill_weight > 0 and teacher_h is None:
        raise ValueError("distillation needs the teacher's hidden states and weight")
    sums = [h.new_zeros((), dtype=torch.float32) for _ in range(4)]
    for s in range(0, h.shape[0], chunk_size):
        args = (h[s:s + chunk_size], weight, target[s:s + chunk_size],
                None if teacher_h is None else teacher_h[s:s + chunk_size], teacher_weight)
        if torch.is_grad_enabled() and h.requires_grad:
            out = checkpoint(_chunk_loss, *args, distill_weight, topk, divergence, teacher_transform, transform,
                             use_reentrant=False)
        else:
            out = _chunk_loss(*args, distill_weight, topk, divergence, teacher_transform, transform)
        sums = [a + b for a, b in zip(sums, out)]
    return tuple(sums)


def draft_losses(feats: list[torch.Tensor], lm_weights: list[torch.Tensor], input_ids: torch.Tensor,
                 loss_mask: torch.Tensor, base_hidden: torch.Tensor | None = None,
                 base_weight: torch.Tensor | None = None, head_decay: float = 0.8, distill_weight: float = 0.0,
                 chunk_size: int = 512, topk: int = 5, shifts: tuple[int, ...] | None = None,
                 divergence: str = "fkl", teacher_transform: tuple | None = None,
                 transform: tuple | None = None) -> dict:
    """Weighted sum over heads of the mean per-head loss, plus per-head sums and hit counts.

    feats[k] [B, S, H]: position t of head k predicts input_ids[:, t + shifts[k]] (heads: k+2, an SSM: 1),
    supervised where loss_mask is 1 there. The teacher for that target is the base's own prediction from
    position t + shifts[k] - 1 (its logits: losses.lm_logits with teacher_transform; the heads': with transform, a
    draft model's own). With base_weight given, the teacher is also used for the agreement count.
    """
    S = input_ids.shape[1]
    shifts = shifts or tuple(k + 2 for k in range(len(feats)))
    teach = base_weight is not None and base_hidden is not None
    total = input_ids.new_zeros((), dtype=torch.float32)
    out = {"loss_sum": [], "count": [], "top1": [], "topk": [], "agree1": []}
    for k, (f, w) in enumerate(zip(feats, lm_weights)):
        shift = shifts[k]
        sel = loss_mask[:, shift:].bool() if S > shift else None  # [B, S-shift]
        if sel is None or not bool(sel.any()):
            # Nothing to supervise for this head here (short sequence, answer cut by max_len): an exact zero that
            # still reaches its parameters, so backward works and DDP sees every parameter used.
            total = total + 0.0 * (f.sum() + w.sum())
            for key in out:
                out[key].append(total.new_zeros(()).detach())
            continue
        h = f[:, : S - shift][sel]  # [N, H]
        target = input_ids[:, shift:][sel]  # [N]
        th = base_hidden[:, shift - 1: S - 1][sel] if teach else None
        loss_sum, h1, hk, agree = head_loss(h, w, target, th, base_weight if teach else None, distill_weight,
                                            chunk_size, topk, divergence, teacher_transform, transform)
        n = sel.sum()
        total = total + head_decay ** k * loss_sum / n.clamp(min=1)
        for key, v in zip(out, (loss_sum.detach(), n.float(), h1, hk, agree)):
            out[key].append(v)
    out = {key: torch.stack(v) for key, v in out.items()}  # each [K]
    out["loss"] = total
    return out
