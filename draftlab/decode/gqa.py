"""Grouped-query attention without copying the keys and values, inside draftlab's compiled calls on a CPU.

A base with grouped-query attention (Llama 3, Qwen, the test base: 8 query heads over 4 key/value heads) stores one key
and one value per key/value head. transformers' `sdpa` attention passes the grouping to
`scaled_dot_product_attention` (`enable_gqa=True`) only where no mask is given; with a mask, which every tree verify
has, it first copies each key and value head once per query head of its group (`repeat_kv`): a copy of the whole
attention window per layer and step, a fixed cost whatever the step's rows (on stories260K, most of plain decoding's
generated kernels). On a CPU, torch's attention kernel takes the grouping with a mask as well, and computes every query
row as before (the same products, in the same order), so the tokens do not change.

`install()` puts a function in front of transformers' `sdpa` entry (its attention registry, which every model that
looks `sdpa` up there reads; idempotent). It calls transformers' own function unchanged except inside draftlab's
compiled calls (decode.fuse.ACTIVE, set by decode.compiled.Compiled), on a CPU, for a module with grouped heads and a
mask, and nothing else asked of it (no dropout, no position bias, no softcap): there it attends with `enable_gqa`.
Outside those calls (the eager path, the reference; HF `generate` on the same model object in a benchmark) attention
is transformers' own. Not on a GPU, where attention with a mask and `enable_gqa` falls back to the unfused kernel.
DRAFTLAB_CPU_GQA=0 turns it off.
"""

from __future__ import annotations

import os

import torch.nn.functional as F

from . import fuse

_HF: list = []  # transformers' sdpa function, once installed
ON = [os.environ.get("DRAFTLAB_CPU_GQA", "1") not in ("0", "false", "no")]  # DRAFTLAB_CPU_GQA (the overview)


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                 **kwargs):
    """transformers' sdpa attention; inside draftlab's compiled calls on a CPU, with a mask over grouped heads, the
    grouping goes to the kernel instead of a copy of the keys and values (see the module's overview)."""
    if (not (fuse.ACTIVE[0] and ON[0]) or query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1
            or attention_mask is None or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions")):
        return _HF[0](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def install() -> bool:
    """Put grouped_sdpa in front of transformers' `sdpa` attention (once per process); whether it is there. Whether
    it attends with the grouping is ON's (DRAFTLAB_CPU_GQA, read at import), which each call reads."""
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
