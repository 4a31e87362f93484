"""Grouped-query attention without copying the keys and values, inside draftlab's compiled calls on a CPU.

A base with grouped-query attention (Llama 3, Qwen, the test base: 8 query heads over 4 key/value heads) stores one key
and one value per key/value head. transformers' `sdpa` attention passes the grouping to
`scaled_dot_product_attention` (`enable_gqa=True`) only where no mask is given; with a mask, which every tree verify
has, it first copies each key and value head once per query head of its group (`repeat_kv`): a copy of the whole
attention window per layer and step, a fixed cost whatever the step's rows (on stories260K, most of plain decoding's
generated kernels). On a CPU draftlab gives the kernel the key/value heads as they are, with each group's query heads
packed as the rows of one head (G query heads of N rows: one head of G * N rows, each under its own mask row). torch's
CPU attention kernel works in blocks of up to 32 query rows per head, and a block's fixed cost is most of a small
call's: packed, a tree of 5 nodes over 8 query heads and 4 key/value heads is 4 blocks rather than 8. Against the
grouping passed as `enable_gqa=True` (which the kernel takes with a mask too, and which DRAFTLAB_CPU_GQA_PACKED=0 uses
instead) a Llama-3-8B-shaped layer's attention over 5 query rows took 1.04 against 1.81 ms on one thread
(benchmarks/attention_packing.py). Every row is the same dot products and softmax as before; blocks of another
size can round the last bit differently (about 1e-7 in float32), so greedy tokens are the same except at near-ties.

`install()` puts a function in front of transformers' `sdpa` entry (its attention registry, which every model that
looks `sdpa` up there reads; idempotent). It calls transformers' own function unchanged except inside draftlab's
compiled calls (decode.fuse.ACTIVE, set by decode.compiled.Compiled), on a CPU, for a module with grouped heads and a
mask, and nothing else asked of it (no dropout, no position bias, no softcap): there it attends as above (a mask
given per query head is packed alike; a mask of another head count goes to the kernel with `enable_gqa`).
Outside those calls (the eager path, the reference; HF `generate` on the same model object in a benchmark) attention
is transformers' own. Not on a GPU, where attention with a mask and `enable_gqa` falls back to the unfused kernel.
DRAFTLAB_CPU_GQA=0 turns it off.
"""

from __future__ import annotations

import torch.nn.functional as F

from . import fuse
from .switches import env_flag

_HF: list = []  # transformers' sdpa function, once installed
ON = [env_flag("DRAFTLAB_CPU_GQA") is not False]  # DRAFTLAB_CPU_GQA (the overview)
# DRAFTLAB_CPU_GQA_PACKED (the overview): the query heads of a group packed as one head's rows, or enable_gqa
PACKED = [env_flag("DRAFTLAB_CPU_GQA_PACKED") is not False]


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                 **kwargs):
    """transformers' sdpa attention; inside draftlab's compiled calls on a CPU, with a mask over grouped heads, the
    grouping goes to the kernel instead of a copy of the keys and values (see the module's overview)."""
    if (not (fuse.ACTIVE[0] and ON[0]) or query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1
            or attention_mask is None or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions")):
        return _HF[0](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                      is_causal=is_causal, **kwargs)
    B, H, N, D = query.shape
    kv = key.shape[1]
    mask_heads = attention_mask.shape[1] if attention_mask.dim() == 4 else 0
    if mask_heads:
        attention_mask = attention_mask[..., : key.shape[-2]]  # as transformers' own (a mask past the keys' length)
    if not PACKED[0] or mask_heads not in (1, H):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    # A key/value head's query heads as one head of G * N query rows (head j * G + g's row i is row g * N + i, the
    # order of transformers' repeat_kv), each row under its own mask row.
    G = H // kv
    mask = (attention_mask.repeat(1, 1, G, 1) if mask_heads == 1 else
            attention_mask.reshape(attention_mask.shape[0], kv, G * N, attention_mask.shape[-1]))
    out = F.scaled_dot_product_attention(query.reshape(B, kv, G * N, D), key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, H, N, out.shape[-1]).transpose(1, 2).contiguous(), None  # (values may be of another size)


def install() -> bool:
    """Put grouped_sdpa in front of transformers' `sdpa` attention (once per process); whether it is there. Whether
    it attends with the grouping is ON's (DRAFTLAB_CPU_GQA, read at import), which each call reads as it runs, or as
    it is traced: a compiled call keeps the value its graph was compiled with (decode.compiled does not watch it)."""
    if _HF:
        return True
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    current = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if current is None:
        return False
    _HF.append(current)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = grouped_sdpa
    return True
