"""Grouped-query attention inside compiled calls on a CPU (decode.gqa): the grouping goes to the attention kernel
instead of a copy of the keys and values, with the same outputs; transformers' own attention everywhere else."""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from conftest import tiny_llama
from draftlab.decode import fuse, gqa


class Attention(TorchFunctionMode):
    """Records, for each scaled_dot_product_attention call, whether it was given the grouping and its key heads."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((bool(kwargs.get("enable_gqa")), args[1].shape[1]))
        return func(*args, **kwargs)


def run(model, ids, mask, active: bool):
    fuse.ACTIVE[0] = active
    try:
        with torch.no_grad(), Attention() as seen:
            return model(input_ids=ids, attention_mask=mask).logits, seen.calls
    finally:
        fuse.ACTIVE[0] = False


@pytest.fixture
def tree():
    """A tiny grouped-query base (4 query heads over 2 key/value heads) and a tree-shaped additive 4D mask: two
    siblings at the end, the second not seeing the first."""
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()
    allowed[6, 5] = False
    mask = torch.zeros(2, 1, 7, 7).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert gqa.install()
    return model, ids, mask


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
def test_inside_compiled_calls_the_kernel_takes_the_grouping_and_computes_the_same(tree, packed, per_head):
    """Packed (a group's query heads as one head's rows, the default) or through enable_gqa, with one mask for every
    head or one per head (each head's own: here head 1 of each group does not see token 3)."""
    model, ids, mask = tree
    kv, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    if per_head:
        mask = mask.expand(-1, 2 * kv, -1, -1).clone()
        mask[:, 1::2, 4:, 3] = torch.finfo(torch.float32).min
    ref, outside = run(model, ids, mask, active=False)
    was, gqa.PACKED[0] = gqa.PACKED[0], packed
    try:
        got, inside = run(model, ids, mask, active=True)
    finally:
        gqa.PACKED[0] = was
    assert outside == [(False, 2 * kv)] * layers  # transformers' own: keys copied once per query head
    assert inside == [(not packed, kv)] * layers  # the kernel is given the key/value heads as they are
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    if per_head:  # the per-head mask is read per head: without it the outputs differ
        assert not torch.allclose(run(model, ids, mask[:, :1], active=True)[0], got, atol=1e-4)


def test_switched_off_or_without_a_mask_it_is_transformers_own(tree):
    model, ids, mask = tree
    was, gqa.ON[0] = gqa.ON[0], False  # DRAFTLAB_CPU_GQA=0
    try:
        assert run(model, ids, mask, active=True)[1] == [(False, 2 * model.config.num_key_value_heads)] * 2
    finally:
        gqa.ON[0] = was
    # no mask (a prompt's causal attention): transformers passes the grouping itself, without a mask
    assert all(g for g, _ in run(model, ids, None, active=True)[1])
