"""Hydra heads (sequentially dependent drafts) with the Hydra++ options: deeper MLPs and prefix attention.

Head k (0-based) predicts x_{t+k+2} from [h_t ; E(x_{t+1}) ; ... ; E(x_{t+k+1})]: the base's state
after x_t, the embedding of the base's own next token x_{t+1} (the tree root when decoding), and of
the k tokens drafted after it (teacher-forced from the sequence in training). E is the base's
frozen input embedding. With prefix attention, h_t is replaced by the output of one extra decoder
layer (the base's block type) run over the base's hidden states.
"""

from __future__ import annotations


import torch
from torch import nn

from ...decode.cache import cache_arg, cache_name, causal_allowed
from ..base import rope_args
from .medusa import ResBlock


class HydraError(ValueError):
    """The base cannot host Hydra heads as configured."""


class HydraHead(nn.Module):
    """in_proj([h ; k+1 embeddings]) -> num_layers residual blocks -> lm_head, with dropout (training only) on the
    input, before every further block and before the lm_head, where Hydra++'s reference heads have it."""

    def __init__(self, hidden_size: int, vocab_size: int, num_inputs: int, num_layers: int, dropout: float = 0.0):
        super().__init__()
        self.in_proj = nn.Linear(num_inputs * hidden_size, hidden_size)
        self.blocks = nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])
        self.drop = nn.Dropout(dropout)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        # Start as "h only": the head initially predicts what the base's lm_head would from h.
        with torch.no_grad():
            self.in_proj.weight.zero_()
            self.in_proj.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
            self.in_proj.bias.zero_()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.in_proj(self.drop(x))
        for i, block in enumerate(self.blocks):
            x = block(self.drop(x) if i else x)
        return self.drop(x)


class HydraHeads(nn.Module):
    kind = "hydra"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 prefix_attention: bool = False, base=None, dropout: float = 0.0):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.prefix_attention = num_heads, num_layers, prefix_attention
        self.dropout = dropout
        self.heads = nn.ModuleList(HydraHead(hidden_size, vocab_size, k + 2, num_layers, dropout)
                                   for k in range(num_heads))
        self.prefix_layer = None
        self._base = None  # a plain list entry, not a submodule: the frozen base is neither trained nor exported
        self._rope_args: tuple = ()  # see attach_base
        if base is not None:
            self.attach_base(base)

    @property
    def lm_heads(self):
        return [h.lm_head for h in self.heads]

    def config(self) -> dict:
        return {"type": "hydra", "num_heads": self.num_heads, "num_layers": self.num_layers,
                "prefix_attention": self.prefix_attention, "dropout": self.dropout, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size}

    # --- the base this module reads from --------------------------------------------------------
    def attach_base(self, base) -> None:
        """Keep a reference to the frozen base (embeddings, rotary) and build the prefix layer's shape."""
        self._base = [base]
        self._rope_args = rope_args(base)
        if self.prefix_attention and self.prefix_layer is None:
            backbone = base.base_model
            layers = getattr(backbone, "layers", None)
            if layers is None or not hasattr(backbone, "rotary_emb"):
                raise HydraError(f"{type(base).__name__}: prefix attention needs a Llama-style backbone "
                                 "(`.layers` and `.rotary_emb`); set head.prefix_attention=false for this base")
            self.prefix_layer = replica_of(layers[-1], base.config).float().requires_grad_(True)

    @property
    def base(self):
        if self._base is None:
            raise HydraError("Hydra heads need the base model attached (load_export(..., base=model))")
        return self._base[0]

    @torch.no_grad()
    def init_from_base(self, base) -> None:
        """lm_heads from the base's; the prefix layer from its last layer, with output projections zeroed
        so the layer starts as the identity on the residual stream."""
        self.attach_base(base)
        w = base.get_output_embeddings().weight
        for head in self.heads:
            head.lm_head.weight.copy_(w.to(head.lm_head.weight.dtype))
        if self.prefix_layer is not None:
            for name, p in self.prefix_layer.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.zero_()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.base.get_input_embeddings()(ids)

    # --- prefix attention -------------------------------------------------------------------------
    def prefix(self, hidden: torch.Tensor, allowed: torch.Tensor, position_ids: torch.Tensor, cache=None):
        """The extra decoder layer over base states [B, T, H]; allowed [B, T, L_past+T] is its attention pattern."""
        dtype = next(self.prefix_layer.parameters()).dtype  # (Phi-3 packs q, k, v in one qkv_proj)
        x = hidden.to(dtype)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=x.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        rot = self.base.base_model.rotary_emb(x, position_ids, *self._rope_args)
        out = self.prefix_layer(x, attention_mask=mask[:, None], position_ids=position_ids,
                                **cache_arg(self.prefix_layer, cache), use_cache=cache is not None,
                                position_embeddings=rot)
        return out[0] if isinstance(out, tuple) else out

    def context(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Training: the heads' h for every position of a right-padded batch, [B, S, H]."""
        if self.prefix_layer is None:
            return hidden
        B, S, _ = hidden.shape
        valid = torch.ones(B, S, dtype=torch.bool, device=hidden.device) if attention_mask is None else attention_mask
        pos = torch.arange(S, device=hidden.device)[None].expand(B, S)
        return self.prefix(hidden, causal_allowed(valid), pos)

    # --- heads --------------------------------------------------------------------------------------
    def head_features(self, k: int, h: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """h [..., H] and the embeddings of the k+1 path tokens [..., k+1, H] -> head k's features [..., H]."""
        x = torch.cat([h, path_emb.flatten(-2)], dim=-1)
        return self.heads[k].features(x.to(self.heads[k].in_proj.weight.dtype))

    def head_logits(self, k: int, h: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        """Decoding: logits [..., V] of head k for paths [..., k+1] (root first) below state h [..., H]."""
        return self.heads[k].lm_head(self.head_features(k, h, self.embed(path_tokens)))

    def train_hidden(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask=None) -> list[torch.Tensor]:
        """Per-head features [B, S, H], teacher-forced: position t of head k sees x_{t+1..t+k+1}."""
        h = self.context(hidden, attention_mask)
        emb = self.embed(input_ids)  # [B, S, H]
        B, S, H = emb.shape
        # shifted[j][:, t] = E(x_{t+1+j}), zero past the end (those positions are never supervised).
        pad = emb.new_zeros(B, self.num_heads + 1, H)
        ext = torch.cat([emb, pad], dim=1)
        shifted = [ext[:, 1 + j: 1 + j + S] for j in range(self.num_heads)]
        return [self.head_features(k, h, torch.stack(shifted[: k + 1], dim=2)) for k in range(self.num_heads)]


class PrefixModel(nn.Module):
    """Hydra++'s prefix layer as a one-layer model over base hidden states, for the static-shape decode path: a
    StaticSlotCache runs it (compiled when the decoder compiles) with the same calls as a base, `inputs_embeds`
    being the base's hidden states. Its config is the base's with one layer, so the cache holds one layer."""

    def __init__(self, heads: "HydraHeads"):
        import copy

        super().__init__()
        cfg = copy.copy(heads.base.config)
        cfg.num_hidden_layers = 1
        # It attends over the whole text, in training as in decoding (its masks are draftlab's): no sliding window.
        cfg.layer_types, cfg.sliding_window = ["full_attention"], None
        self.config = cfg
        self.layer = heads.prefix_layer
        self.rotary, self.rope_args = heads.base.base_model.rotary_emb, heads._rope_args
        self.cache_kw = cache_name(self.layer)  # (resolved here: the decoder may compile forward)

    def forward(self, inputs_embeds, attention_mask, position_ids, cache=None, use_cache=True,
                output_hidden_states=False):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        x = inputs_embeds.to(next(self.layer.parameters()).dtype)
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, **{self.cache_kw: cache},
                         use_cache=use_cache, position_embeddings=self.rotary(x, position_ids, *self.rope_args))
        return BaseModelOutputWithPast(last_hidden_state=out[0] if isinstance(out, tuple) else out)


def replica_of(layer, config):
    """A plain copy of one of the base's decoder layers with its own one-layer KV cache (layer_idx 0): built fresh
    from its class rather than deep-copied, so a tensor-parallel layer's DTensor shards (gathered whole here) and
    a device map's hooks do not come along. Its attention is the base's where that takes a float mask (eager,
    sdpa), else sdpa: the layer attends under an explicit 4D mask (a tree's in decoding) in float32, which flash
    attention (a base loaded with attn_implementation flash_attention_2 for training) takes neither of."""
    import copy

    from torch.distributed.tensor import DTensor

    if getattr(config, "_attn_implementation", None) not in (None, "eager", "sdpa"):
        config = copy.copy(config)  # (the base's own layers keep theirs)
        config._attn_implementation = "sdpa"
    try:
        fresh = type(layer)(config, 0)
    except TypeError as e:
        raise HydraError(f"cannot build a {type(layer).__name__}(config, layer_idx) for the prefix layer ({e}); set "
                         "head.prefix_attention=false for this base") from None
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in layer.state_dict().items()}
    ref = next(iter(state.values()))
    if ref.device.type == "meta":  # offloaded by a device map: an export's weights will be loaded over it
        return fresh.to(ref.dtype)
    fresh.load_state_dict(state)
    return fresh.to(device=ref.device, dtype=ref.dtype)
