"""FSDP for the frozen base (`distributed.strategy: fsdp`): its decoder layers sharded across ranks.

A 70B base in bf16 (140 GB) does not fit one GPU, and only the heads train, so only the base needs
sharding: each decoder layer is wrapped with FSDP2's `fully_shard` and gathered layer by layer during
the forward, then freed again. The embedding table, final norm and lm_head stay whole on every rank,
because the heads and the distillation teacher read them directly (a few GB even at 70B), and so does
the last decoder layer when a Hydra++ prefix layer is copied from it. The heads themselves stay
replicated under DDP: they are small, and checkpoints then hold the heads alone, never the base.

Loading never needs the whole model on more than one rank: rank 0 reads the checkpoint into CPU memory;
every rank builds the model on the meta device, shards it, allocates its shard, and receives its part
from rank 0.
"""

from __future__ import annotations

import torch

from ..base import DTYPES, BaseModelError, load_recipe_base, load_tokenizer


def load_sharded_base(b, accelerator, keep_last_layer: bool):
    """The frozen base of recipe section `b` with its decoder layers sharded over all ranks, and its tokenizer."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    full = None
    if accelerator.is_main_process:
        full, _ = load_recipe_base(b)
    accelerator.wait_for_everyone()  # the others wait while rank 0 reads (and maybe downloads) the checkpoint
    config = AutoConfig.from_pretrained(b.name_or_path, revision=b.revision, trust_remote_code=b.trust_remote_code)
    extra = {"attn_implementation": b.attn_implementation} if b.attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[b.dtype], trust_remote_code=b.trust_remote_code,
                                                 **extra)
    model.requires_grad_(False).eval()
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise BaseModelError(f"distributed.strategy=fsdp: {type(model).__name__} has no `.layers` of decoder "
                             "blocks to shard; use distributed.strategy=ddp or deepspeed for this base")
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for layer in layers[:-1] if keep_last_layer else layers:
        fully_shard(layer, mesh=mesh)
    # The root owns no sharded weights; wrapping it makes the layers non-root, so each frees its gathered
    # weights right after its forward (a root FSDP module would keep them).
    fully_shard(model, mesh=mesh, ignored_params={p for p in model.parameters() if not isinstance(p, DTensor)})
    model.to_empty(device=accelerator.device)
    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers outside the state dict (rotary inv_freq) were left uninitialised by to_empty.
    saved = set(model.state_dict())
    ref = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if name not in saved:
            if full is not None:
                buf.copy_(ref[name])
            dist.broadcast(buf, src=0)
    del full, ref
    return model, load_tokenizer(b.name_or_path, b.revision, b.trust_remote_code, b.chat_template)
