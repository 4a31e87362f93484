"""What the loop optimises and reports: the draft module with its loss in one module (so DDP / FSDP / DeepSpeed wrap
one forward), Medusa-2's joint objective with the base's LoRA adapter, the base features a draft trains on, and the
held-out evaluation."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from ..base import base_hidden, base_states
from ..data import collate
from ..losses import draft_losses


class DraftObjective(nn.Module):
    """The draft module plus its loss, so that DDP/FSDP wrap one forward that returns the loss."""

    def __init__(self, draft: nn.Module, loss_cfg, teacher_transform: tuple | None = None):
        super().__init__()
        self.draft = draft
        self.loss_cfg = loss_cfg
        self.teacher_transform = teacher_transform  # the base's logits from its hidden states (losses.lm_logits)

    def forward(self, hidden, input_ids, loss_mask, attention_mask=None, base_weight=None):
        if hasattr(self.draft, "objective"):  # drafters with their own training procedure (EAGLE-3's unrolled test)
            B, S, _ = hidden.shape
            return self.draft.objective(hidden.view(B, S, -1, self.draft.hidden_size), input_ids, loss_mask,
                                        attention_mask, base_weight, self.loss_cfg, self.teacher_transform)
        feats = self.draft.train_hidden(hidden, input_ids, attention_mask)
        c = self.loss_cfg
        return draft_losses(feats, [lm.weight for lm in self.draft.lm_heads], input_ids, loss_mask,
                            base_hidden=hidden, base_weight=base_weight, head_decay=c.head_decay,
                            distill_weight=c.distill_weight, chunk_size=c.chunk_size, topk=c.topk,
                            shifts=getattr(self.draft, "shifts", None), divergence=c.divergence,
                            teacher_transform=self.teacher_transform,
                            transform=getattr(self.draft, "logit_transform", None))


class JointObjective(DraftObjective):
    """Medusa-2: the heads and a LoRA adapter on the base in one module (so DDP / DeepSpeed wrap both).

    loss = base loss + heads_weight * heads loss, where the base loss is the KL from the original base (the
    adapter disabled, same step, no gradient) to the adapted one (self_distill), or CE on the data tokens; the
    heads read the adapted base's final state. While `heads_only` is set (the warm-up) the base runs without
    gradient and only the heads' loss counts. Checkpoints hold the trainable tensors only, not the frozen base."""

    def __init__(self, draft: nn.Module, loss_cfg, base, lora_cfg, teacher_transform: tuple | None = None):
        super().__init__(draft, loss_cfg, teacher_transform)
        self.base = base
        self.lora_cfg = lora_cfg
        self.heads_only = False
        self._register_state_dict_hook(JointObjective._trainable_only)

    @staticmethod
    def _trainable_only(module, state, prefix, local_metadata):
        frozen = {prefix + n for n, p in module.named_parameters() if not p.requires_grad}
        for k in [k for k in state if k in frozen]:
            del state[k]
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        frozen = {n for n, p in self.named_parameters() if not p.requires_grad}
        real = [k for k in missing if k not in frozen]
        if strict and (real or unexpected):
            raise RuntimeError(f"checkpoint does not match the model: missing {real[:5]}, unexpected {unexpected[:5]}")
        from torch.nn.modules.module import _IncompatibleKeys

        return _IncompatibleKeys(real, unexpected)  # the frozen base is not in checkpoints, by design

    def forward(self, hidden, input_ids, loss_mask, attention_mask=None, base_weight=None):
        from ..losses import head_loss

        c, lc = self.loss_cfg, self.lora_cfg
        with torch.no_grad() if self.heads_only else nullcontext():
            h = base_hidden(self.base, input_ids, attention_mask)  # the adapted base's final state [B, S, H]
        w = self.base.get_output_embeddings().weight
        heads = draft_losses(self.draft.train_hidden(h, input_ids, attention_mask), [lm.weight for lm in self.draft.lm_heads],
                             input_ids, loss_mask, base_hidden=h.detach(), base_weight=w if base_weight is not None else None,
                             head_decay=c.head_decay, distill_weight=c.distill_weight, chunk_size=c.chunk_size, topk=c.topk,
                             divergence=c.divergence, teacher_transform=self.teacher_transform)
        if self.heads_only:
            return heads
        sel = loss_mask[:, 1:].bool()  # the base predicts x_{t+1} at t
        if lc.self_distill:
            with torch.no_grad(), self.base.disable_adapter():
                teacher = base_hidden(self.base, input_ids, attention_mask)[:, :-1][sel]
        else:
            teacher = None
        own, _, _, _ = head_loss(h[:, :-1][sel], w, input_ids[:, 1:][sel], teacher, w, 1.0 if lc.self_distill else 0.0,
                                 c.chunk_size, c.topk, "fkl", self.teacher_transform, self.teacher_transform)
        base_loss = own / sel.sum().clamp(min=1)
        heads["base_loss"] = base_loss.detach()
        heads["loss"] = base_loss + lc.heads_weight * heads["loss"]
        return heads


def base_features(base, draft, input_ids, attention_mask=None) -> torch.Tensor:
    """What the draft trains on: the base's final hidden state [B, S, H], or for drafters that read several
    base layers (`draft.base_layers`) those layers' states and the final one, flattened to [B, S, (n+1) * H]."""
    layers = getattr(draft, "base_layers", None)
    if not layers:
        return base_hidden(base, input_ids, attention_mask)
    return base_states(base, input_ids, attention_mask, layers).flatten(2)


@torch.no_grad()
def evaluate(objective, base, examples, batch_size, pad_id, accelerator, base_weight, draft) -> dict:
    """Per-head loss, top-1 / top-k accuracy on the data tokens and top-1 agreement with the base (the draft's
    first choice equals the base's) on the held-out examples, sharded across ranks."""
    objective.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = examples[rank::world]
    sums = None
    # Every rank takes as many base and objective forwards as rank 0 (which has the most examples): with a sharded
    # base each base forward is a collective, and under ZeRO-3 each objective forward gathers the draft's
    # parameters, so a rank that ran out joins in with a stand-in example whose figures it drops.
    joint = isinstance(getattr(objective, "module", objective), JointObjective)  # it runs the (adapted) base itself
    for s in range(0, len(examples[0::world]), batch_size):
        stand_in = s >= len(mine)
        b = {k: v.to(accelerator.device) for k, v in collate(mine[s:s + batch_size] if not stand_in else
                                                                 (mine or examples)[:1], pad_id).items()}
        h = None if joint else base_features(base, draft, b["input_ids"], b["attention_mask"])
        with accelerator.autocast():
            out = objective(h, b["input_ids"], b["loss_mask"], b["attention_mask"], base_weight)
        if stand_in:
            continue
        part = torch.stack([out["loss_sum"], out["count"], out["top1"], out["topk"], out["agree1"]])  # [5, K]
        sums = part if sums is None else sums + part
    objective.train()
    if sums is None:
        sums = torch.zeros(5, objective_num_heads(objective), device=accelerator.device)
    sums = accelerator.reduce(sums, reduction="sum")
    n = sums[1].clamp(min=1)
    return {"eval_loss": (sums[0] / n).tolist(), "top1": (sums[2] / n).tolist(), "topk": (sums[3] / n).tolist(),
            "agree1": (sums[4] / n).tolist(), "eval_positions": sums[1].tolist()}


def objective_num_heads(objective) -> int:
    return getattr(objective, "module", objective).draft.num_heads
