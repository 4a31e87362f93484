"""Fused projections: one matrix product where a layer's attention computes q, k and v of one input, and one where
its MLP computes gate and up.

A decoding step is many small matrix products: a Llama layer makes seven, three of them (q, k, v) and two more
(gate, up) of the same input. On a GPU each product is a kernel reading its weight; a 7B forward makes 225 of them,
and fused it makes 129, each reading a wider weight at once (gpt-fast's `wqkv`, vLLM's `QKVParallelLinear` do the
same). On a CPU the products of a small base are short, and their count is what a step pays for. Inductor does not
merge them by itself: three products of one input stay three.

`fuse_projections(model)` changes no weight and no result's law: the fused weight is the concatenation of the
originals, and each original `nn.Linear` keeps its `weight` as a view into it, so `state_dict`, `load_state_dict`
and in-place updates see the same parameters as before. Only the modules' class changes, and what they compute
only inside draftlab's compiled calls (decode.compiled.Compiled) where no gradient is recorded: there the first
projection (q, gate) computes the fused product and keeps it until the last one of its group (v, up) has taken its
slice; a projection called on another input than the first one's (cross-attention, a drafter reusing `k_proj` on
its context) computes its own product. Outside compiled calls (the eager path, the reference; HF `generate` on
the same model object) and with gradients enabled (training) every projection runs its own product, as before.

The fused products round like one wider product, which can differ from three narrower ones in the last bit (about
1e-7 in float32), as any change of kernel can: greedy tokens are the same except at near-ties.

A copy (`copy.deepcopy`) or a move (`.to(device, dtype)`) of a fused model copies the fused weight and the
originals separately: still correct, but the weights are held twice and an in-place update of an original no
longer reaches the fused one. `fuse_projections` on it again makes the originals views into the fused weight again;
the compiled decoder calls it before each `generate`, so a reload between runs is decoded as loaded.

Left alone: projections that are not plain float `nn.Linear`s alike (quantised, LoRA-wrapped), whose weights are
sharded (tensor parallelism's DTensors) or not in memory (an offloaded layer's, on the meta device), or whose module
carries a forward of its own (a tensor-parallel plan's, an accelerate hook's).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .switches import env_flag

# Whether fused modules run fused: on inside draftlab's compiled calls only (decode.compiled.Compiled), so the eager
# path, the reference, and anything else run on the same model object (HF generate in a benchmark) compute as before.
ACTIVE = [False]
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
PREFIX = {"q_proj": "fused_qkv", "gate_proj": "fused_gate_up"}  # their buffers: PREFIX_weight, PREFIX_bias


class _Group:
    """What the projections of one group share while a forward runs: the input the first one saw and its product."""

    def __init__(self, owner: nn.Module, prefix: str, bounds: list[int]):
        self.owner, self.prefix, self.bounds = owner, prefix, bounds
        self.x = self.y = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, getattr(self.owner, self.prefix + "_weight"), getattr(self.owner, self.prefix + "_bias"))


class FusedLinear(nn.Linear):
    """An `nn.Linear` of a fused group (its class is swapped in place): inside a compiled call (ACTIVE) where no
    gradient is recorded it returns its slice of the group's product, computed by the group's first projection, when
    called on that one's input; otherwise it is an `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, i = self.fused_group, self.fused_index
        if not ACTIVE[0] or torch.is_grad_enabled():
            return super().forward(x)
        if i == 0:
            group.x, group.y = x, group.product(x)
        elif group.x is not x:
            return super().forward(x)
        y = group.y[..., group.bounds[i]:group.bounds[i + 1]]
        if i == len(group.bounds) - 2:
            group.x = group.y = None
        return y


def _fusable(linears: list) -> bool:
    """Plain float `nn.Linear`s (not a quantised or adapter subclass) of one input size, device and dtype, with bias
    on all or none, whose weights are plain tensors in memory (not sharded DTensors, not on the meta device of an
    offloaded layer) and whose forward is their class's (not one a tensor-parallel plan or an accelerate hook put on
    the module)."""
    if not all(type(m) is nn.Linear and "forward" not in m.__dict__ for m in linears):
        return False
    w = [m.weight for m in linears]
    return (all(type(t.data) is torch.Tensor and t.is_floating_point() and t.dtype == w[0].dtype
                and t.device == w[0].device and t.device.type != "meta" for t in w)
            and len({m.in_features for m in linears}) == 1 and len({m.bias is None for m in linears}) == 1)


def _views(owner: nn.Module, prefix: str, linears: list) -> bool:
    """Whether a fused group's original weights (and biases) are still views into its fused ones."""
    fused_w, fused_b = getattr(owner, prefix + "_weight"), getattr(owner, prefix + "_bias")
    bounds = linears[0].fused_group.bounds
    for i, m in enumerate(linears):
        for t, whole in ((m.weight, fused_w), (m.bias, fused_b)):
            if t is None:
                continue
            row = t.numel() // t.shape[0]
            if (t.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr() or t.dtype != whole.dtype
                    or t.storage_offset() != whole.storage_offset() + bounds[i] * row):
                return False
    return True


def _into(new: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """A fused weight: fused again into its old storage where it fits (so its address, which CUDA graphs recorded,
    stays), else new; marked as a tensor whose address does not change without a guard on its identity, as dynamo
    marks parameters (models of one shape keep sharing compiled variants)."""
    if old is not None and old.shape == new.shape and old.dtype == new.dtype and old.device == new.device:
        return old.copy_(new)
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(new, guard=False)
    return new


def fused(model: nn.Module) -> int:
    """How many groups of `model` are fused."""
    return sum(1 for m in model.modules() for prefix in PREFIX.values() if prefix + "_weight" in m._buffers)


def _unchanged(owner: nn.Module, names: tuple, linears: tuple) -> bool:
    """Whether a group the last pass of fuse_projections saw is as that pass left it: the same projection modules,
    fused with their weights still views into the fused ones, or not fused and still not fusable."""
    if any(owner._modules.get(name) is not m for name, m in zip(names, linears)):
        return False
    prefix = PREFIX[names[0]]
    if prefix + "_weight" in owner._buffers:
        return all(type(m) is FusedLinear and m.fused_group.owner is owner for m in linears) and _views(
            owner, prefix, linears)
    return not _fusable(linears)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of `model` (any module holding those `nn.Linear`s: Llama, Mistral, Qwen2
    and Qwen3 layers and their kin), in place; returns the number of groups fused. Groups already fused, or whose
    projections are not plain float `nn.Linear`s alike (quantised, LoRA-wrapped, split over devices), are left as
    they are. See the module's docstring.

    The compiled decoder calls it before every run, so it first checks the groups its last pass on `model` saw
    (_unchanged), which walks no modules: where every one is as it was left (nothing replaced a projection, moved
    or reloaded a weight since) it returns 0 at once. A layer added to the model since is found by the next pass that
    walks the modules (one that follows a change to a group it saw), not before."""
    seen = model.__dict__.get("_fuse_seen")
    if seen is not None and all(_unchanged(*group) for group in seen):
        return 0
    n, seen = 0, []
    for owner in list(model.modules()):
        for names in GROUPS:
            linears = [getattr(owner, name, None) for name in names]
            if all(isinstance(m, nn.Module) for m in linears):
                seen.append((owner, names, tuple(linears)))
            prefix = PREFIX[names[0]]
            before = (None, None)
            if prefix + "_weight" in owner._buffers:
                if any(type(m) is not FusedLinear and "fused_group" in getattr(m, "__dict__", {}) for m in linears):
                    continue  # fused by another copy of this module (another draftlab in the process): its own
                if all(type(m) is FusedLinear for m in linears) and _views(owner, prefix, linears):
                    continue
                for m in linears:  # copied or moved since it was fused (or replaced): fused again from the originals
                    if type(m) is FusedLinear:
                        m.__class__ = nn.Linear
                before = owner._buffers.pop(prefix + "_weight"), owner._buffers.pop(prefix + "_bias")
            if not _fusable(linears):
                continue
            with torch.no_grad():
                weight, bias = (_into(torch.cat([getattr(m, name) for m in linears]), old)
                                if getattr(linears[0], name) is not None else None
                                for name, old in zip(("weight", "bias"), before))
            bounds = [0]
            for m in linears:
                bounds.append(bounds[-1] + m.weight.shape[0])
            owner.register_buffer(prefix + "_weight", weight, persistent=False)
            owner.register_buffer(prefix + "_bias", bias, persistent=False)
            group = _Group(owner, prefix, bounds)
            for i, m in enumerate(linears):
                m.weight = nn.Parameter(weight[bounds[i]:bounds[i + 1]], requires_grad=m.weight.requires_grad)
                if bias is not None:
                    m.bias = nn.Parameter(bias[bounds[i]:bounds[i + 1]], requires_grad=m.bias.requires_grad)
                m.__class__ = FusedLinear  # its group in __dict__, not as a submodule: a copy.deepcopy copies both
                m.__dict__.update(fused_group=group, fused_index=i)
            n += 1
    model.__dict__["_fuse_seen"] = seen  # in __dict__, not a submodule list: state_dict and modules() never see it
    return n


def fuse_by_default(device_type: str) -> bool:
    """Whether the compiled path fuses its models' projections on this device type: DRAFTLAB_FUSE_PROJECTIONS=1 or 0
    says; by default on a CPU (measured: docs/benchmarks.md), not on a GPU, where two calls on an H200 disagreed
    (0.92x and 1.09x plain decoding's speed without it)."""
    flag = env_flag("DRAFTLAB_FUSE_PROJECTIONS")
    return device_type == "cpu" if flag is None else flag


def modules_of(obj, depth: int = 0, seen: set | None = None):
    """The `nn.Module`s an object holds in its attributes, lists, tuples and dicts (of at most 64 items), a few levels
    down (an ensemble's members' models), or itself if it is one: a drafter's modules."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        yield obj
        return
    items = (obj if isinstance(obj, (list, tuple)) else obj.values() if isinstance(obj, dict)
             else vars(obj).values() if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.Tensor)) else ())
    if isinstance(items, (list, tuple, type({}.values()))) and len(items) > 64:
        return  # data (a retrieval drafter's n-gram table), not modules
    for v in items:
        yield from modules_of(v, depth + 1, seen)
