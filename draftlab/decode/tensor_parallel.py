"""A base too large for one device, under the same tree decoder.

Tensor parallel (`--tp`): launch one process per GPU with `torchrun` or `accelerate launch`; every process
loads the base with transformers' tensor-parallel plan (`DistributedConfig(tp_plan="auto")`: attention heads and MLP columns split
over the ranks, one all-reduce after attention and one after the MLP, logits gathered), so each holds 1/N of
the weights and 1/N of the KV cache (its own key/value heads). The tree decoder runs unchanged on every rank:
the 4D tree mask, explicit positions and KV-cache compaction act per head, and attention heads are what TP
splits. The drafter is replicated (it is small; heads read the base's hidden states, which every rank holds
whole after the all-reduce), and rank 0 is authoritative: its proposal is broadcast before every verification
(the ranks' shards must see one tree) and its acceptance decision after it, so the ranks' caches and outputs
cannot drift even where a GPU kernel is not bitwise reproducible.

Layer-wise placement (`--device-map auto`, one process): transformers/accelerate spread the decoder layers over
the visible GPUs (and CPU/disk if they must); each layer's KV cache lives on its device. Simpler than TP, but
the GPUs work one after another.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import replace

import torch

from .interface import Proposal
from .tree import TreeView


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def agree(obj):
    """Rank 0's value of a small picklable object on every rank (itself outside a distributed launch)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_launch(tp: bool) -> None:
    """Several processes without --tp would each decode everything; --tp in one process shards nothing."""
    n = world_size()
    if n > 1 and not tp:
        raise ValueError(f"launched as {n} processes (WORLD_SIZE={n}) but --tp was not given: every process would "
                         "decode the same prompts with a whole base. Pass --tp to split the base over them, or run "
                         "one process (use --device-map auto to spread layers over GPUs)")
    if tp and n == 1:
        raise ValueError("--tp splits the base over the processes of `torchrun --nproc-per-node N` or `accelerate "
                         "launch --num_processes N`; this is one process (WORLD_SIZE is unset or 1). Without GPUs, "
                         "accelerate starts N processes only with --multi_gpu as well; torchrun starts them anywhere")


class RankSync:
    """Makes rank `src`'s proposal and acceptance decisions every rank's (tensor-parallel decoding)."""

    def __init__(self, src: int = 0):
        import torch.distributed as dist

        self.dist, self.src = dist, src

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.broadcast(t, src=self.src)
        return t

    def root(self, root: torch.Tensor) -> torch.Tensor:
        return self._bcast(root.contiguous())

    def proposal(self, prop: Proposal) -> Proposal:
        tokens = prop.tokens
        shape = self._bcast(torch.tensor(tokens.shape, device=tokens.device))
        if tuple(shape.tolist()) != tuple(tokens.shape):
            raise RuntimeError(f"rank {rank()} drafted a tree of shape {tuple(tokens.shape)} but rank {self.src} one of "
                               f"{tuple(shape.tolist())}: the replicated drafter is not deterministic across ranks")
        tokens = self._bcast(tokens.contiguous())
        view = prop.view
        if view.static is None:  # a per-step tree (EAGLE dynamic trees, ensembles): rank src's shape
            parents = self._bcast(view.parents.contiguous())
            valid = self._bcast(view.valid.to(torch.uint8).contiguous()).bool()
            view = TreeView.of_parents(parents, valid)
        return replace(prop, tokens=tokens, view=view)  # (nodes, the static path's width, stays)

    def decision(self, last: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank src's last accepted node [B] and bonus token [B] (the trees are rank src's, so its last node's
        root path is the accepted path on every rank)."""
        both = self._bcast(torch.stack([last, bonus]).contiguous())
        return both[0], both[1]


def init_tp() -> torch.device:
    """Join the process group of a torchrun / accelerate launch (gloo on CPU, NCCL on CUDA); this rank's device."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(release)
    return device


def release() -> None:
    """Destroy this process's group, if it is still there (run at exit by init_tp's group). A gloo group left to the
    interpreter's teardown can abort the process ("terminate called without an active exception", SIGABRT: its
    worker threads outlive the interpreter), and an NCCL one warns. No barrier: a rank that exits on an error must
    not wait for the others."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_heads_divide(name_or_path: str, n: int, revision=None, trust_remote_code: bool = False) -> None:
    """Each rank holds whole attention heads: the query and key/value head counts must divide by the ranks.
    transformers splits the columns unevenly otherwise, and the first forward fails in a reshape."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads and (heads % n or kv % n):
        import math

        ok = [d for d in range(2, math.gcd(heads, kv) + 1) if math.gcd(heads, kv) % d == 0]  # (--tp needs 2 or more)
        raise ValueError(f"--tp over {n} processes: the base has {heads} attention heads and {kv} key/value heads, "
                         "which must both divide by the number of processes; " +
                         (f"use {', '.join(map(str, ok))} processes, or " if ok else "use ") +
                         "--device-map auto (layer-wise placement, one process)")


def load_tp_base(name_or_path: str, dtype: str, revision: str | None = None, trust_remote_code: bool = False):
    """The base with transformers' tensor-parallel plan over this launch's processes, and its tokenizer."""
    from .. import base as base_mod

    from transformers import DistributedConfig

    check_heads_divide(name_or_path, world_size(), revision, trust_remote_code)
    init_tp()
    model, tok = base_mod.load_base(name_or_path, dtype, None, revision, trust_remote_code,
                                    distributed_config=DistributedConfig(tp_size=world_size(), tp_plan="auto"))
    if getattr(model, "_tp_plan", None) in (None, {}) and not getattr(model.config, "base_model_tp_plan", None):
        raise base_mod.BaseModelError(f"{type(model).__name__} has no tensor-parallel plan in transformers; use "
                                      "--device-map auto (layer-wise placement) for this base")
    return model, tok


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
