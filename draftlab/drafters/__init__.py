"""Everything that proposes tokens, behind the one interface the decoder consumes (`base.Drafter`).

Each draft kind is one entry of `KINDS`: how a recipe builds its trainable module, how an export stores
and reloads it, which drafter decodes with it and its default tree. Adding a kind touches this package
and the recipe schema, never the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..decode.tree import Tree
from .base import Drafter, PromptState, Proposal, StepResult

WEIGHTS = "draft.safetensors"


@dataclass(frozen=True)
class DraftKind:
    """How one kind of draft model is built, stored, reloaded and decoded with."""

    build: Callable  # (head section dict, base) -> trainable nn.Module, initialised from the base
    save: Callable  # (module, out_dir) -> list of files written
    load: Callable  # (export's head dict, export_dir, base or None) -> module
    drafter: Callable  # (module, Tree) -> Drafter
    default_tree: Callable  # (module) -> Tree
    files: tuple  # files an export of this kind must hold besides draftlab.json
    # (module, base, ids [1, S], depth) -> [S, depth] long: at state t (x_0..x_t committed, root x_{t+1}),
    # the rank of the true x_{t+d+2} among the draft's candidates at depth d+1 when the path above it is
    # the true one; V where the text has no such token. The tree search's statistics.
    ranks: Callable


# --- heads: draft.safetensors holds the heads module ------------------------------------------------

def _build_heads(head: dict, base):
    from .heads import build_heads

    return build_heads(head, base.config.hidden_size, base.get_output_embeddings().weight.shape[0], base=base)


def _save_heads(module, out: Path) -> list[str]:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, out / (WEIGHTS + ".tmp"), metadata={"format": "draftlab"})
    (out / (WEIGHTS + ".tmp")).replace(out / WEIGHTS)
    return [WEIGHTS]


def _load_heads(head: dict, export_dir: Path, base):
    from .heads import build_heads
    from ..export import ExportError, read_safetensors

    module = build_heads(head, head["hidden_size"], head["vocab_size"], base=None)
    if hasattr(module, "attach_base") and base is not None:
        module.attach_base(base)
    state = read_safetensors(export_dir / WEIGHTS)
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{export_dir / WEIGHTS}: weights do not match the head config in draftlab.json "
                          f"(missing {missing[:5]}, unexpected {unexpected[:5]}); re-export the run")
    return module


def _heads_tree(module) -> Tree:
    from ..decode.tree import default_tree

    return default_tree(module.num_heads)


def _heads_drafter(module, tree: Tree) -> Drafter:
    from .heads import HeadsDrafter

    return HeadsDrafter(module, tree)


def _rank_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rank of target [n] in logits [n, V] (0 = the top candidate)."""
    return (logits > logits.gather(1, target[:, None])).sum(-1)


@torch.no_grad()
def _heads_ranks(module, base, ids: torch.Tensor, depth: int) -> torch.Tensor:
    from ..base import base_hidden

    S, V = ids.shape[1], base.get_output_embeddings().weight.shape[0]
    h = base_hidden(base, ids, torch.ones_like(ids))
    feats = module.train_hidden(h.to(next(module.parameters()).dtype), ids, torch.ones_like(ids))
    ranks = torch.full((S, depth), V, dtype=torch.long, device=ids.device)
    for k in range(min(depth, module.num_heads)):
        n = S - (k + 2)  # head k at position t predicts x_{t+k+2}
        if n > 0:
            ranks[:n, k] = _rank_of(module.lm_heads[k](feats[k][0, :n]), ids[0, k + 2:])
    return ranks


HEADS = DraftKind(_build_heads, _save_heads, _load_heads, _heads_drafter, _heads_tree, (WEIGHTS,), _heads_ranks)


# --- SSM: the export directory is itself a Hugging Face model directory -------------------------------

def _build_ssm(head: dict, base):
    from .ssm import build_ssm

    return build_ssm(head, base)


def _save_ssm(module, out: Path) -> list[str]:
    module.lm.save_pretrained(out, safe_serialization=True)
    return ["config.json", "model.safetensors"]


def _load_ssm(head: dict, export_dir: Path, base):
    from transformers import AutoModelForCausalLM

    from ..export import ExportError
    from .ssm import SSMDraft, check_vocab

    try:
        lm = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ExportError(f"{export_dir}: the SSM's Hugging Face files do not load ({e}); re-export the run") from None
    if base is not None:
        check_vocab(lm, base, str(export_dir))
    return SSMDraft(lm, {k: head[k] for k in ("source", "init") if k in head})


def _ssm_drafter(module, tree: Tree) -> Drafter:
    from .ssm import SSMDrafter

    return SSMDrafter(module.lm, tree)


@torch.no_grad()
def _ssm_ranks(module, base, ids: torch.Tensor, depth: int) -> torch.Tensor:
    S, V = ids.shape[1], base.get_output_embeddings().weight.shape[0]
    at = torch.full((S + depth + 1,), V, dtype=torch.long, device=ids.device)
    at[: S - 1] = _rank_of(module.lm(input_ids=ids).logits[0, :-1], ids[0, 1:])  # at[j]: rank of x_{j+1}
    # Depth d+1 below root x_{t+1} is the SSM's prediction at position t+1+d, on the true path.
    return torch.stack([at[1 + d: 1 + d + S] for d in range(depth)], dim=1)


SSM_DEFAULT_CHAIN = 4
SSM = DraftKind(_build_ssm, _save_ssm, _load_ssm, _ssm_drafter, lambda m: Tree.chain(SSM_DEFAULT_CHAIN),
                ("config.json", "model.safetensors"), _ssm_ranks)

KINDS: dict[str, DraftKind] = {"medusa": HEADS, "hydra": HEADS, "ssm": SSM}


def kind_of(name: str) -> DraftKind:
    if name not in KINDS:
        raise ValueError(f"draft kind {name!r}: this draftlab knows {', '.join(KINDS)}")
    return KINDS[name]


def build_draft(head: dict, base):
    """The trainable draft module of a recipe's `head` section, initialised from the frozen base."""
    return kind_of(head["type"]).build(head, base)


def make_drafter(module, tree: Tree | None = None) -> Drafter:
    """The drafter that decodes with a draft module (its kind's default tree unless one is given)."""
    kind = kind_of(module.kind)
    return kind.drafter(module, tree if tree is not None else kind.default_tree(module))


__all__ = ["Drafter", "DraftKind", "KINDS", "PromptState", "Proposal", "StepResult", "build_draft", "kind_of",
           "make_drafter"]
