"""Fused projections (decode.fuse): one product for q/k/v and one for gate/up inside compiled calls, nothing changed
outside them."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from conftest import tiny_llama
from draftlab.decode import fuse
from draftlab.decode.fuse import FusedLinear, fuse_projections, fused


class Linears(TorchFunctionMode):
    """Counts F.linear calls."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func is F.linear
        return func(*args, **(kwargs or {}))


def logits(model, x, active: bool):
    fuse.ACTIVE[0] = active
    try:
        with torch.no_grad(), Linears() as count:
            return model(x).logits, count.n
    finally:
        fuse.ACTIVE[0] = False


def test_fusing_keeps_the_parameters_and_fuses_only_inside_compiled_calls():
    base = tiny_llama(layers=3)
    model = copy.deepcopy(base)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projections(model) == 6 and fused(model) == 6
    assert fuse_projections(model) == 0  # already fused
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    x = torch.randint(0, 64, (2, 9))
    ref, n_ref = logits(base, x, active=False)
    out, n = logits(model, x, active=False)  # outside a compiled call: the same products, bit for bit
    assert torch.equal(out, ref) and n == n_ref == 3 * 7 + 1
    out, n = logits(model, x, active=True)
    assert torch.allclose(out, ref, atol=1e-12) and n == 3 * 4 + 1  # q/k/v and gate/up: one product each
    attn = model.model.layers[0].self_attn
    assert attn.fused_qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()  # the originals are views into it
    with torch.no_grad():
        attn.v_proj.weight.mul_(2)  # an in-place update (load_state_dict) reaches the fused product
        base.model.layers[0].self_attn.v_proj.weight.mul_(2)
    ref, _ = logits(base, x, active=False)
    out, _ = logits(model, x, active=True)
    assert torch.allclose(out, ref, atol=1e-12)


def test_gradients_and_other_inputs_take_each_projections_own_product():
    model = tiny_llama(layers=1)
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    x, c = torch.randn(1, 3, 32, dtype=torch.float64), torch.randn(1, 3, 32, dtype=torch.float64)
    fuse.ACTIVE[0] = True
    try:
        with torch.no_grad():  # k and v of another input than q's (a drafter's context): their own products
            q, k, v = attn.q_proj(x), attn.k_proj(c), attn.v_proj(c)
        assert torch.allclose(k, F.linear(c, attn.k_proj.weight)) and torch.allclose(v, F.linear(c, attn.v_proj.weight))
        assert torch.allclose(q, F.linear(x, attn.q_proj.weight))
        y = attn.k_proj(x)  # gradients recorded (training): nn.Linear's own product, and its gradient
        y.sum().backward()
        assert attn.k_proj.weight.grad is not None and attn.q_proj.weight.grad is None
    finally:
        fuse.ACTIVE[0] = False


def test_a_copied_fused_model_computes_with_its_own_weights_and_fusing_it_again_makes_views_again():
    model = tiny_llama(layers=1)
    fuse_projections(model)
    twin = copy.deepcopy(model)
    attn = twin.model.layers[0].self_attn
    assert fused(twin) == 2 and attn.q_proj.fused_group.owner is attn  # its own group, not the original's
    x = torch.randint(0, 64, (1, 5))
    assert torch.allclose(logits(twin, x, True)[0], logits(model, x, True)[0])
    assert attn.fused_qkv_weight.data_ptr() != attn.q_proj.weight.data_ptr()  # the copy holds its weights twice
    assert fuse_projections(twin) == 2 and fuse_projections(twin) == 0
    assert attn.fused_qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.mul_(3)  # reaches the fused product again
    assert torch.allclose(logits(twin, x, True)[0], logits(twin, x, False)[0], atol=1e-12)
    assert not torch.allclose(logits(twin, x, True)[0], logits(model, x, True)[0])


def test_projections_that_are_not_plain_float_linears_alike_are_left_alone():
    class Quantised(nn.Linear):
        pass

    owner = nn.Module()
    owner.q_proj, owner.k_proj, owner.v_proj = nn.Linear(8, 8), Quantised(8, 4), nn.Linear(8, 4)
    owner.gate_proj, owner.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(6, 16, bias=False)  # other inputs
    assert fuse_projections(owner) == 0 and not isinstance(owner.q_proj, FusedLinear)
    owner.k_proj = nn.Linear(8, 4)  # with biases, all three
    assert fuse_projections(owner) == 1 and owner.fused_qkv_bias.shape == (16,)


def test_projections_with_a_forward_of_their_own_or_weights_not_in_memory_are_left_alone():
    owner = nn.Module()
    owner.gate_proj, owner.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
    owner.up_proj.forward = lambda x: x  # a tensor-parallel plan's or an accelerate hook's forward
    assert fuse_projections(owner) == 0
    with torch.device("meta"):  # an offloaded layer's weights
        owner.up_proj = nn.Linear(8, 16)
        owner.gate_proj = nn.Linear(8, 16)
    assert fuse_projections(owner) == 0


def test_a_fused_group_whose_projections_were_replaced_is_dropped_not_forced():
    class Grouped(nn.Linear):  # an ensemble's grouped copy of a fused member replaces the projections
        pass

    owner = nn.Module()
    owner.gate_proj, owner.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
    assert fuse_projections(owner) == 1
    owner.gate_proj, owner.up_proj = Grouped(8, 16), Grouped(8, 16)
    assert fuse_projections(owner) == 0 and fused(owner) == 0
    owner.gate_proj, owner.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
    assert fuse_projections(owner) == 1
    for m in (owner.gate_proj, owner.up_proj):  # fused by another copy of draftlab in the process: left to it
        m.__class__ = Grouped
    assert fuse_projections(owner) == 0 and fused(owner) == 1


def test_fusing_again_walks_the_modules_only_after_a_group_changed(monkeypatch):
    """The decoder fuses before every run: a model whose groups are as the last pass left them is not walked again
    (decode.fuse._unchanged); a replaced projection, a moved or reloaded weight, or a group that became fusable
    makes the next call walk it and fuse what needs fusing."""
    model = tiny_llama(layers=2)
    assert fuse_projections(model) == 4
    walks = []
    real = nn.Module.modules
    monkeypatch.setattr(nn.Module, "modules", lambda self: walks.append(1) or real(self))
    assert fuse_projections(model) == 0 and not walks
    attn = model.model.layers[1].self_attn
    attn.k_proj = nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False).to(torch.float64)
    assert fuse_projections(model) == 1 and len(walks) == 1 and type(attn.k_proj) is FusedLinear
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert fuse_projections(model) == 4 and len(walks) == 2
    assert fuse_projections(model) == 0 and len(walks) == 2
    owner = nn.Module()
    owner.gate_proj, owner.up_proj = nn.Linear(8, 16), nn.Linear(8, 16).half()  # not alike: left alone
    assert fuse_projections(owner) == 0 and fuse_projections(owner) == 0 and len(walks) == 3
    owner.up_proj.float()  # the same module, now alike: fused at the next call
    assert fuse_projections(owner) == 1 and fused(owner) == 1


def test_the_compiled_decoder_fuses_again_what_a_reload_left_stale():
    """A reload that replaces the parameters (load_state_dict(assign=True), a .to()) leaves the fused weight behind;
    the decoder fuses again at each generate, so its compiled calls decode the new weights."""
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder

    base = tiny_llama(layers=2)
    with torch.no_grad():
        base.lm_head.weight.mul_(4)
    dec = SpeculativeDecoder(base, NoDraft(), compile="eager")
    prompts = [[1, 5, 7, 9], [1, 3]]
    dec.generate(prompts, max_new_tokens=6)
    assert fused(base) == 4
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.dim() == 2 else v
           for k, v in base.state_dict().items()}
    base.load_state_dict(new, assign=True)
    eager = SpeculativeDecoder(base, NoDraft()).generate(prompts, max_new_tokens=12).tokens
    assert dec.generate(prompts, max_new_tokens=12).tokens == eager
    attn = base.model.layers[0].self_attn
    assert attn.fused_qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()


@pytest.mark.parametrize("device, env, on", [("cpu", "", True), ("cuda", "", False), ("cuda", "1", True),
                                             ("cpu", "0", False)])
def test_the_default_is_the_devices_unless_the_environment_says(device, env, on, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_FUSE_PROJECTIONS", env)
    assert fuse.fuse_by_default(device) is on
