"""DFlash-style block drafter: a few decoder layers that draft a whole block of tokens in one forward.

DFlash (Chen, Liang, Liu, arXiv 2602.06036). Architecture (parameter names are the DFlash checkpoint's, so an
export is what SGLang loads):
    c   = hidden_norm(fc([h_l1 ; ... ; h_ln]))          context features: n base layers, concatenated, projected
    x   = embed([x_a, MASK, ..., MASK])                  the block: the last verified token, then block_size - 1
                                                         mask tokens (the base's frozen embedding)
    per draft layer (the base's block type):
        q    = q_proj(input_layernorm(x))                                queries from the block only
        k, v = [k_proj(c) ; k_proj(input_layernorm(x))], likewise v      KV injection: the context enters every
                                                                         layer as keys / values
        x    = x + o_proj(attention(q, k, v))            the block sees the whole context and itself, both ways
        x    = x + mlp(post_attention_layernorm(x))
    logits at block positions 1..block_size-1 = lm_head(norm(x))        the base's lm_head (frozen, shared)

RoPE: context entry j at its own position, block position i at (anchor position) + i. Layer ids follow
draftlab's (and Hugging Face's output_hidden_states) indexing: id i is hidden_states[i], the input of decoder
layer i, i.e. the output of layer i - 1; DFlash's checkpoints name the layer whose output is read
(`target_layer_ids`), so an export writes id - 1.

Training: per sequence, `num_anchors` anchor positions a >= 1 are drawn at random among those whose token and
the token after it are supervised (draftlab's rule; docs/drafters.md); block j holds x_a and masks at positions
a..a+block_size-1, its queries see the context features at positions < a (what decoding has when x_a is the
base's newest token) and the whole block. Block position k
predicts x_{a+k} with weight exp(-(k - 1) / loss_decay_gamma), the loss normalised by the summed weights
(SpecForge's); the target is the data token (SpecForge), the base's distribution at position a+k-1 (speculators),
or a mix (loss.distill_weight), as for the heads and SSMs (EAGLE-3 always distils).

Decoding: the drafter keeps, per draft layer, the projected keys / values of the context at every committed
position (from the base's true features when a step is committed). Each step drafts the block below the root in
one forward; depth d of a tree holds position d's candidates (its top-k greedy, i.i.d. samples of its warped
distribution when sampling), so the default tree is the paper's chain of top-1s and any static rank-path tree
(the Medusa format, `draftlab search-tree`) applies as it does to Medusa heads.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..decode.acceptance import Sampling, sample, warp
from ..decode.cache import attention_window
from ..decode.compiled import compiled_method
from ..decode.tree import Tree, TreeView
from .base import (Drafter, PromptState, Proposal, ReadsBase, StepResult, draft_rope, empty_fixed, gather_kept,
                   rank_tree_tokens, static_view)
from .eagle import RMSNorm


def default_layers(num_base_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's target layers for a base of L decoder layers: as many as draft layers, spread evenly from the output
    of layer 1 to that of layer L - 3 (one draft layer: layer L // 2), as hidden_states ids (output of layer i = id
    i + 1). Bases too shallow for that range spread them over layers 0..L - 2, distinct while n <= L - 1."""
    L, n = num_base_layers, num_draft_layers
    if n == 1:
        out = [L // 2]
    else:
        start, end = 1, max(L - 3, 2)
        out = [round(start + i * (end - start) / (n - 1)) for i in range(n)]
    out = [min(max(i, 0), L - 2) + 1 for i in out]
    if len(set(out)) < n and n <= L - 1:
        out = [round(i * (L - 2) / (n - 1)) + 1 for i in range(n)]
    return out


def default_gamma(block_size: int) -> float:
    """The paper's decay of the loss weight over block positions: gamma 7 for blocks of 16, 5 for 10, 4 for 8;
    other sizes take the line through the 8 and 16 entries (at least 1)."""
    table = {8: 4.0, 10: 5.0, 16: 7.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0)


def blocks_attention(q, k, v, ctx_k, ctx_v, ctx_allowed, A: int) -> torch.Tensor:
    """Attention of A blocks of T queries side by side (q, k, v [B, h, A*T, d], q already scaled): each query over
    the context entries ctx_allowed [B, A*T, C] lets it see (ctx_k, ctx_v [B, h, C, d]) and over its own block, all
    of it -> [B, h, A*T, d].

    Through scaled_dot_product_attention over chunks of G blocks with G*T about C: a chunk's keys are the context
    and its own G blocks, masked to [allowed context ; same block]. The fused kernels keep no [A*T, C] scores or
    probabilities for backward (at the default 512 anchors x 16 over 2,048 tokens, batch 4, 32 heads: 8 GiB per
    layer in float32, what made a 5-layer drafter on a 7B base run out of an H200's memory); memory is linear in
    A*T and the arithmetic at most twice that of the context and own block alone (the chunk's other blocks are
    masked out)."""
    B, h, N, d = q.shape
    T, C = N // A, ctx_k.shape[2]
    G = max(1, min(A, -(-C // T)))  # blocks per chunk
    n = -(-A // G)  # chunks
    pad = n * G * T - N  # padding blocks: zero queries that see their own (zero) block only

    def chunks(t):  # [B, h, N, d] -> [B * n, h, G * T, d]
        return F.pad(t, (0, 0, 0, pad)).view(B, h, n, G * T, d).transpose(1, 2).reshape(B * n, h, G * T, d)

    def with_context(ctx, own):
        return torch.cat([ctx[:, None].expand(B, n, h, C, d).reshape(B * n, h, C, d), chunks(own)], -2)

    allowed = torch.cat([ctx_allowed, ctx_allowed.new_zeros(B, pad, C)], 1).view(B * n, G * T, C)
    block = torch.arange(G * T, device=q.device) // T
    own = (block[:, None] == block[None, :]).expand(B * n, G * T, G * T)
    mask = torch.cat([allowed, own], -1)[:, None]  # [B * n, 1, G * T, C + G * T]
    out = F.scaled_dot_product_attention(chunks(q), with_context(ctx_k, k), with_context(ctx_v, v), attn_mask=mask,
                                         scale=1.0)
    return out.view(B, n, h, G * T, d).transpose(1, 2).reshape(B, h, n * G * T, d)[:, :, :N]


class DFlashLayer(nn.Module):
    """One draft decoder layer (Llama / Qwen3 names; q_norm / k_norm with qk_norm, head.dflash.qk_norm's default, as
    the engines' DFlash layers always have)."""

    def __init__(self, H: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(H, heads * head_dim, bias=False)
        a.k_proj = nn.Linear(H, kv_heads * head_dim, bias=False)
        a.v_proj = nn.Linear(H, kv_heads * head_dim, bias=False)
        a.o_proj = nn.Linear(heads * head_dim, H, bias=False)
        if qk_norm:
            a.q_norm, a.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, inter, bias=False)
        self.mlp.up_proj = nn.Linear(H, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, H, bias=False)

    def _heads(self, t: torch.Tensor, n: int, norm: str) -> torch.Tensor:
        B, T, _ = t.shape
        t = t.view(B, T, n, self.head_dim)
        if hasattr(self.self_attn, norm):
            t = getattr(self.self_attn, norm)(t)
        return t.transpose(1, 2)  # [B, n, T, d]

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys and values [B, kv, T, d] (RoPE applied) of already normalised inputs x [B, T, H]."""
        from transformers.models.llama.modeling_llama import rotate_half

        a = self.self_attn
        k = self._heads(a.k_proj(x), self.kv_heads, "k_norm")
        v = self._heads(a.v_proj(x), self.kv_heads, "v_none")
        return k * cos[:, None] + rotate_half(k) * sin[:, None], v

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_allowed: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, blocks: int = 1) -> torch.Tensor:
        """Block states x [B, A*T, H] (A blocks of T tokens) -> the layer's output: queries from the blocks, keys /
        values from the context (ctx_k, ctx_v [B, kv, C, d], already rotated; ctx_allowed [B, A*T, C] says which
        entries each query sees) and from the query's own block, all of it (bidirectional).

        One softmax over the context's scores and the own block's. One block (decoding) computes its [T, C + T]
        scores directly; many blocks (training) go through blocks_attention, which keeps no [A*T, C] scores."""
        from transformers.models.llama.modeling_llama import rotate_half

        B, N, _ = x.shape
        A, h, d = blocks, self.heads, self.head_dim
        y = self.input_layernorm(x)
        q = self._heads(self.self_attn.q_proj(y), h, "q_norm")
        q = (q * cos[:, None] + rotate_half(q) * sin[:, None]) * (1.0 / math.sqrt(d))
        k, v = self.kv(y, cos, sin)
        if self.kv_heads != h:
            rep = h // self.kv_heads
            ctx_k, ctx_v = ctx_k.repeat_interleave(rep, dim=1), ctx_v.repeat_interleave(rep, dim=1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if A > 1:
            attn = blocks_attention(q, k, v, ctx_k, ctx_v, ctx_allowed, A)
        else:
            ctx = (q @ ctx_k.transpose(-1, -2)).masked_fill(~ctx_allowed[:, None], float("-inf"))  # [B, h, T, C]
            p = torch.softmax(torch.cat([ctx, q @ k.transpose(-1, -2)], -1), -1)
            C = ctx.shape[-1]
            attn = p[..., :C] @ ctx_v + p[..., C:] @ v
        x = x + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, N, -1))
        m = self.mlp
        y = self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))


class DFlashDraft(ReadsBase, nn.Module):
    """The trainable DFlash block drafter (see the module docstring)."""

    kind = "dflash"

    def __init__(self, cfg: dict, base=None):
        super().__init__()
        self.cfg = dict(cfg)
        H = cfg["hidden_size"]
        self.base_layers = tuple(cfg["layers"])
        self.block_size = cfg["block_size"]
        self.num_heads = self.block_size - 1  # metrics per block position 1..block_size-1
        self.hidden_size, self.vocab_size = H, cfg["vocab_size"]
        self.fc = nn.Linear(len(self.base_layers) * cfg.get("target_hidden_size", H), H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(
            DFlashLayer(H, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                        cfg["intermediate_size"], cfg["rms_norm_eps"], cfg.get("qk_norm", False))
            for _ in range(cfg["num_layers"]))
        self.norm = RMSNorm(H, cfg["rms_norm_eps"])
        if base is not None:
            self.attach_base(base)

    @staticmethod
    def settings(head: dict, base) -> dict:
        """Shape of a DFlash drafter for this base, from the recipe's head.dflash section."""
        c, e = base.config, dict(head.get("dflash") or {})
        heads = c.num_attention_heads
        n = e.get("num_layers", 5)  # (the recipe schema's defaults, for a head given without it)
        L = c.num_hidden_layers
        layers = e.get("layers") or default_layers(L, n)
        if not 1 <= min(layers) <= max(layers) <= L:
            raise ValueError(f"head.dflash.layers {list(layers)}: DFlash reads the outputs of this base's {L} decoder "
                             f"layers, hidden_states ids 1..{L}")
        if len(set(layers)) != len(layers):
            warnings.warn(
                f"DFlash on this {L}-layer base reads layers {list(layers)}, which repeat: draftlab decodes such a "
                "draft, but vLLM and SGLang capture each layer once and cannot serve it (check says so); "
                f"give head.dflash.num_layers at most {max(L - 1, 1)}, or distinct head.dflash.layers", stacklevel=2)
        elif list(layers) != sorted(layers):
            warnings.warn(f"head.dflash.layers {list(layers)} are not in ascending order: vLLM and SGLang capture "
                          "them in layer order, so served drafts would read other features (check says so); give them "
                          "in ascending order", stacklevel=2)
        if L in layers:
            warnings.warn(f"head.dflash.layers {list(layers)} read hidden_states {L}, the base's last layer after its "
                          "final norm: vLLM reads that layer's output before the norm and SGLang does not capture it, "
                          f"so no engine serves the draft as trained (check says so); give layers below {L}",
                          stacklevel=2)
        bs = e.get("block_size", 16)
        V = base.get_output_embeddings().weight.shape[0]
        mask = e.get("mask_token_id")
        if mask is None:
            mask = _default_mask_token(base, V)
        elif mask >= V:  # (an index error deep in the first step)
            raise ValueError(f"head.dflash.mask_token_id={mask}: the base's vocabulary has {V} tokens (ids 0..{V - 1}); "
                             "give one of its ids, or leave it unset for the pad / unk token")
        return {"hidden_size": c.hidden_size, "target_hidden_size": c.hidden_size, "num_attention_heads": heads,
                "num_key_value_heads": getattr(c, "num_key_value_heads", heads) or heads,
                "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
                "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps, "vocab_size": V,
                "qk_norm": e.get("qk_norm", True), "num_layers": n, "layers": list(layers), "block_size": bs,
                "mask_token_id": int(mask), "num_anchors": e.get("num_anchors", 512),
                "loss_decay_gamma": e.get("loss_decay_gamma") or default_gamma(bs),
                "rope_parameters": draft_rope(base),
                "max_position_embeddings": getattr(c, "max_position_embeddings", 4096),
                "model_type": getattr(c, "model_type", "llama"), "num_target_layers": c.num_hidden_layers}

    def config(self) -> dict:
        return {"type": "dflash", **self.cfg}

    @property
    def lm_heads(self):
        return []  # logits go through the base's own lm_head, frozen and not part of the draft

    # --- the base it reads: ReadsBase (attach_base, base, embed, rope) --------------------------------------
    def init_from_base(self, base) -> None:
        self.attach_base(base)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Block outputs [..., H] -> logits over the base's vocabulary through its (frozen) lm_head."""
        head = self.base.get_output_embeddings()
        if type(head.weight).__name__ == "DTensor":  # a base split with --tp: its lm_head gathers the vocabulary
            return head(self.norm(x).to(head.weight.dtype)).to(x.dtype)
        return self.norm(x) @ head.weight.t().to(x.dtype)

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """Base features [..., n, H] -> the context features c [..., H]."""
        return self.hidden_norm(self.fc(feats.flatten(-2).to(self.fc.weight.dtype)))

    def block_input(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """Anchor tokens [...] -> the block's input ids [..., block_size]: the anchor, then mask tokens."""
        masks = anchor_tokens.new_full((*anchor_tokens.shape, self.block_size - 1), self.cfg["mask_token_id"])
        return torch.cat([anchor_tokens[..., None], masks], -1)

    def draft(self, block_ids: torch.Tensor, block_pos: torch.Tensor, ctx_kv: list, ctx_allowed: torch.Tensor,
              blocks: int = 1) -> torch.Tensor:
        """The draft layers over `blocks` blocks side by side: ids / positions [B, blocks * block_size], per layer the
        context's (k, v), ctx_allowed [B, blocks * block_size, C] -> outputs [B, blocks * block_size, H]."""
        x = self.embed(block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rope(x, block_pos)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, ctx_allowed, cos, sin, blocks)
        return x

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list:
        """Context features c [B, C, H] at positions [B, C] -> per draft layer its (keys, values) [B, kv, C, d]."""
        cos, sin = self.rope(c, positions)
        return [layer.kv(c, cos, sin) for layer in self.layers]

    # --- training ---------------------------------------------------------------------------------------
    def anchors(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, valid: torch.Tensor):
        """Per row, up to num_anchors anchor positions drawn uniformly without replacement among a >= 1 with x_a and
        x_{a+1} supervised (SpecForge's rule; a >= 1 because decoding always has some context), sorted: [B, A] long
        and [B, A] bool (real anchors; rows with fewer candidates are padded)."""
        B, S = input_ids.shape
        sup = loss_mask.bool() & valid
        ok = torch.zeros(B, S, dtype=torch.bool, device=input_ids.device)
        ok[:, 1:S - 1] = sup[:, 1:S - 1] & sup[:, 2:]
        A = min(self.cfg["num_anchors"], max(int(ok.sum(-1).max()), 1))
        # Held-out evaluation draws the same anchors for a batch every time (seeded by the batch's tokens, so
        # batches draw different ones), so its figures compare across evaluations.
        gen = None if self.training else torch.Generator().manual_seed(int(input_ids.sum()))
        noise = torch.rand(B, S, generator=gen).to(input_ids.device)
        score = torch.where(ok, noise, torch.full_like(noise, -1.0))
        anchor = score.topk(A, -1).indices.sort(-1).values
        return anchor, ok.gather(1, anchor)

    def block_outputs(self, states: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor,
                      anchor: torch.Tensor) -> torch.Tensor:
        """The draft's outputs [B, A, block_size, H] for blocks at anchors [B, A] (all in one forward), from base
        features states [B, S, n, H]: block j sees the context at positions < anchor j and itself."""
        B, S = input_ids.shape
        A, T = anchor.shape[1], self.block_size
        c = self.context(states)  # [B, S, H]
        pos = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        kv = self.context_kv(c, pos)
        ids = self.block_input(input_ids.gather(1, anchor))  # [B, A, T]
        bpos = anchor[..., None] + torch.arange(T, device=anchor.device)  # [B, A, T]
        ctx_allowed = (pos[:, None, :] < anchor[:, :, None]) & valid[:, None, :]  # [B, A, S]
        ctx_allowed = ctx_allowed[:, :, None].expand(B, A, T, S).reshape(B, A * T, S)
        out = self.draft(ids.view(B, A * T), bpos.view(B, A * T), kv, ctx_allowed, A)
        return out.view(B, A, T, -1)

    def objective(self, states: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  attention_mask: torch.Tensor | None, base_weight: torch.Tensor | None, loss_cfg,
                  teacher_transform: tuple | None = None) -> dict:
        """Blocks at random anchors over states [B, S, n+1, H] (the n base layers and the final state): per block
        position k, the loss towards the data token / the base's distribution (loss.distill_weight), weighted
        exp(-(k - 1) / gamma)."""
        from ..losses import head_loss

        B, S = input_ids.shape
        n, T = len(self.base_layers), self.block_size
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        anchor, anchor_ok = self.anchors(input_ids, loss_mask, valid)
        out_h = self.block_outputs(states[:, :, :n], input_ids, valid, anchor)  # [B, A, T, H]
        final = states[:, :, n]  # the teacher's hidden state
        w = self.base.get_output_embeddings().weight
        teach = base_weight is not None
        gamma = self.cfg["loss_decay_gamma"]
        out = {key: [] for key in ("loss_sum", "count", "top1", "topk", "agree1")}
        total = out_h.new_zeros((), dtype=torch.float32)
        weight = total.new_zeros(())
        for k in range(1, T):
            at = anchor + k  # block position k predicts x_{a+k}
            inside = at < S
            at_c = at.clamp(max=S - 1)
            sel = anchor_ok & inside & loss_mask.bool().gather(1, at_c) & valid.gather(1, at_c)
            if not bool(sel.any()):
                total = total + 0.0 * out_h.sum()
                for key in out:
                    out[key].append(total.new_zeros(()).detach())
                continue
            h = self.norm(out_h[:, :, k][sel])
            target = input_ids.gather(1, at_c)[sel]
            th = final.gather(1, (at_c - 1)[..., None].expand(-1, -1, final.shape[-1]))[sel] if teach else None
            ls, h1, hk, ag = head_loss(h, w, target, th, base_weight, loss_cfg.distill_weight if teach else 0.0,
                                       loss_cfg.chunk_size, loss_cfg.topk, loss_cfg.divergence, teacher_transform)
            nsel = sel.sum()
            total = total + math.exp(-(k - 1) / gamma) * ls
            weight = weight + math.exp(-(k - 1) / gamma) * nsel
            for key, v in zip(out, (ls.detach(), nsel.float(), h1, hk, ag)):
                out[key].append(v)
        res = {key: torch.stack(v) for key, v in out.items()}
        res["loss"] = total / weight.clamp(min=1)  # SpecForge's normalisation: by the summed weights
        return res

    # --- engine layout ----------------------------------------------------------------------------------
    def engine_config(self) -> dict:
        """config.json of the DFlash checkpoint layout (a draft of the base's block type with dflash_config)."""
        c = self.cfg
        rope = dict(c["rope_parameters"])
        target_ids = [i - 1 for i in self.base_layers]  # the layer whose output is read
        qwen = c.get("model_type") == "qwen3"
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3" if qwen else "llama",
                "num_hidden_layers": c["num_layers"], "hidden_size": c["hidden_size"],
                "intermediate_size": c["intermediate_size"], "num_attention_heads": c["num_attention_heads"],
                "num_key_value_heads": c["num_key_value_heads"], "head_dim": c["head_dim"], "hidden_act": "silu",
                "rms_norm_eps": c["rms_norm_eps"], "vocab_size": c["vocab_size"],
                "max_position_embeddings": c["max_position_embeddings"],
                "rope_theta": rope.get("rope_theta", 10000.0),
                "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
                "tie_word_embeddings": False, "attention_bias": False, "torch_dtype":
                str(self.fc.weight.dtype).removeprefix("torch."), "block_size": c["block_size"],
                "num_target_layers": c["num_target_layers"],
                "dflash_config": {"mask_token_id": c["mask_token_id"], "target_layer_ids": target_ids,
                                  "block_size": c["block_size"]}}


SGLANG_MASK_TOKEN = "<|MASK|>"  # SGLang's dflash_config.mask_token when a config names none


def name_mask_token(out: Path, tokenizer) -> None:
    """Write the mask id's token string as dflash_config.mask_token in an export's config.json. SGLang resolves
    that string in the served tokenizer (default "<|MASK|>"): with mask_token_id set it refuses to start where the
    string sits at another id, and its runners that read only the string use that id, adding "<|MASK|>" to the
    tokenizer (a new id the draft never trained with) where it is absent. Naming the trained id's own token makes
    every reading land on it."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    dc = cfg["dflash_config"]
    i = int(dc["mask_token_id"])
    token = tokenizer.convert_ids_to_tokens(i) if i < len(tokenizer) else None
    if token is not None and tokenizer.get_vocab().get(token) == i:  # (else no string names it: check says so)
        dc["mask_token"] = token
        path.write_text(json.dumps(cfg, indent=2) + "\n")


def _default_mask_token(base, V: int) -> int:
    """The mask token when the recipe names none: the base config's pad / unk token id, else the last id. Its
    embedding only marks 'to be drafted' (block positions past the first are always masks), so any fixed id works."""
    c = base.config
    for name in ("pad_token_id", "unk_token_id"):
        t = getattr(c, name, None)
        if isinstance(t, int) and 0 <= t < V:
            return t
    return V - 1


# --- decoding -----------------------------------------------------------------------------------------------

def _lengths(step: StepResult) -> list[int]:
    """Each row's entries the step adds to the context cache (its path; none for a row that had ended), on the host."""
    return [len(p) if v else 0 for p, v in zip(step.paths, step.verified_rows())]


class DFlashDrafter(Drafter):
    """Drafts the block below the root in one forward and fills a static rank-path tree from it: depth d holds
    block position d's top-k (greedy) or i.i.d. samples of its warped distribution q_d (sampling; q given, so
    verification keeps the base's law). The context keys / values of every committed position are kept per
    draft layer, in a buffer that grows by doubling; on the static path the block reads a window of it (the
    first 256, 512, ... entries, whichever holds the committed ones; unused slots masked), so the block forward
    has a few shapes per run and runs compiled when the decoder compiles. On the static path a commit's entries
    (one width, padded with holes) are projected and written at the next proposal, in the block's call."""

    def __init__(self, module: DFlashDraft, tree: Tree):
        if tree.depth > module.block_size - 1:
            raise ValueError(f"the tree is {tree.depth} deep but a block of {module.block_size} drafts "
                             f"{module.block_size - 1} tokens; use a tree of depth <= {module.block_size - 1}")
        if tree.depth == 0:
            raise ValueError("a DFlash drafter needs a tree of depth >= 1 (e.g. --tree chain)")
        self.m, self.tree = module, tree
        self.hidden_layers = tuple(module.base_layers)
        self.device, self.dtype = module.fc.weight.device, module.fc.weight.dtype
        self.buf = tree.buffers(self.device)
        self.topk = tree.topk_per_depth()  # plain ints, read inside the compiled call (Tree.depth is not traceable)
        self.views: dict[int, TreeView] = {}
        self.kv = None

    @property
    def max_nodes(self) -> int:
        return self.tree.size

    def describe(self) -> dict:
        return {"kind": "dflash", "block_size": self.m.block_size, "tree_size": self.tree.size,
                "tree_depth": self.tree.depth, "tree": self.tree.metadata.get("name", "")}

    # --- the context cache ----------------------------------------------------------------------------------
    def _entries(self, feats: torch.Tensor, positions: torch.Tensor) -> list:
        """Each draft layer's context keys / values of base features feats [B, T, n, H] at positions [B, T]."""
        return self.m.context_kv(self.m.context(feats), positions)

    def _append(self, feats: torch.Tensor, positions: torch.Tensor, ok: torch.Tensor, lengths: list[int]) -> None:
        """Context entries (base features feats [B, T, n, H] at positions [B, T], valid ok [B, T], a prefix of each
        row's T) into the cache at each row's end; lengths: an upper bound of each row's valid count, on the host."""
        kv = self._entries(feats, positions)
        self._room(ok.shape[1], kv, ok)
        self.row_n = self._write(kv, ok, self.row_n)
        self._advance(lengths)

    def _write(self, kv: list, ok: torch.Tensor, row_n: torch.Tensor) -> torch.Tensor:
        """Entries kv (per layer (k, v) [B, kv_heads, W, d]) and ok [B, W] written at each row's slots row_n ..
        row_n + W (the holes past a row's path: the root's entries again, written over by the next commit); returns
        each row's new end. Tensor operations only (in the static path's compiled call)."""
        B, W = ok.shape
        _, H, S, D = self.kv[0][0].shape
        dev = ok.device
        at = row_n[:, None] + torch.arange(W, device=dev)  # [B, W]
        # Rows of the buffers seen as [B * H * S, D]: one index_copy_ per buffer (a scatter over the expanded
        # index cost the step about 3% more at batch 1 on a CPU).
        rows = torch.arange(B, device=dev)[:, None, None] * H + torch.arange(H, device=dev)[None, :, None]
        flat = (rows * S + at[:, None, :]).flatten()  # [B * H * W]
        for (kb, vb), (k, v) in zip(self.kv, kv):
            kb.view(-1, D).index_copy_(0, flat, k.to(kb.dtype).reshape(-1, D))
            vb.view(-1, D).index_copy_(0, flat, v.to(vb.dtype).reshape(-1, D))
        self.valid.view(-1).index_copy_(0, (torch.arange(B, device=dev)[:, None] * self.valid.shape[1] + at).flatten(),
                                        ok.flatten())
        return row_n + ok.sum(-1)

    def _advance(self, lengths: list[int]) -> None:
        """Each row's end moved by at most lengths[b] (its path's length: a row that ended adds none on the device);
        self.n, the largest, bounds every row's entries on the host without a sync. Rows keep their own ends: a
        shared one moved by the batch's longest path each step would leave holes in the other rows and fill the
        cache about twice as fast as the text with a few rows, regrowing it (and recompiling) in the run."""
        self.ends = [e + k for e, k in zip(self.ends, lengths)]
        self.n = max(self.ends)

    def _room(self, T: int, kv: list, ok: torch.Tensor) -> None:
        """Room in the cache for T more entries shaped like kv (per layer (k, v) [B, kv_heads, *, d]) and ok [B, *]:
        first for the prompt and the run (self.slots), then doubled (in 256-slot steps) when full, their committed
        entries copied."""
        if self.kv is None or self.n + T > self.valid.shape[1]:  # (self.n bounds every row's end)
            from ..decode.cache import static_buffer, static_slots

            cap = max(2 * (0 if self.kv is None else self.valid.shape[1]), static_slots(max(self.n + T, self.slots)))
            grown = []
            for i, (k, v) in enumerate(kv):
                kb = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
                vb = torch.zeros_like(kb)
                if self.kv is not None:
                    kb[:, :, : self.n], vb[:, :, : self.n] = self.kv[i][0][:, :, : self.n], self.kv[i][1][:, :, : self.n]
                grown.append((static_buffer(kb), static_buffer(vb)))  # written in place by the compiled commit
            valid = ok.new_zeros(ok.shape[0], cap)
            if self.kv is not None:
                valid[:, : self.n] = self.valid[:, : self.n]
            self.kv, self.valid = grown, static_buffer(valid)

    # --- the interface ----------------------------------------------------------------------------------------
    def begin(self, prompt: PromptState, sampling: Sampling, generator) -> None:
        self.sampling, self.generator = sampling, generator
        B, L = prompt.ids.shape
        self.kv, self.n, self.staged, self.ends = None, L, None, [L] * B
        self.row_n = torch.full((B,), L, dtype=torch.long, device=prompt.ids.device)  # each row's end
        self.slots = L + prompt.room  # the cache's first size (PromptState.room)
        feats = torch.stack([prompt.hidden[l] for l in self.hidden_layers], 2)  # [B, L, n, H]
        self.states_like = (feats.dtype, feats.shape[3], feats.shape[2])  # a step's base states (empty_fixed)
        valid = prompt.valid.bool()
        # The first L slots, the left padding's holes zeroed: a masked slot still enters attention's product (zero
        # weight times a NaN is NaN), and a padded position's states can be NaN where its attention saw no key.
        with torch.no_grad():
            kv = self._entries(feats, prompt.positions)
            self._room(0, kv, valid)
            for (kb, vb), (k, v) in zip(self.kv, kv):
                hole = ~valid[:, None, :, None]
                kb[:, :, :L], vb[:, :, :L] = k.masked_fill(hole, 0), v.masked_fill(hole, 0)
            self.valid[:, :L] = valid
        # The root's position: one past each row's last prompt position (prompts are left-padded).
        self.next_pos = prompt.positions[:, -1] + 1

    def _block(self, root: torch.Tensor, window: int | None = None, next_pos=None) -> torch.Tensor:
        """Logits [B, block_size - 1, V] of the block below root [B], in one forward over the context cache: its
        first `window` entries (the static path: a power of two times 256 holding the committed ones, so a few
        shapes per run), else the committed ones. next_pos: the root's positions (default: the drafter's)."""
        B, T = root.shape[0], self.m.block_size
        n = self.n if window is None else window
        ids = self.m.block_input(root)  # [B, T]
        next_pos = self.next_pos if next_pos is None else next_pos
        pos = next_pos[:, None] + torch.arange(T, device=root.device)
        ctx_allowed = self.valid[:, None, :n].expand(B, T, n)
        kv = [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]
        out = self.m.draft(ids, pos, kv, ctx_allowed)
        return self.m.logits(out[:, 1:]).float()

    @torch.no_grad()
    def propose(self, root: torch.Tensor) -> Proposal:
        B = root.shape[0]
        path = self.decode_path or {}
        greedy = self.sampling.temperature <= 0
        if path.get("static"):  # greedy: the tree's tokens come out of the compiled call
            out = self._static_block(root, path.get("compile"), greedy)
        else:
            out = self._block(root)
            out = rank_tree_tokens(root, out, self.buf, self.topk) if greedy else out
        if greedy:
            return Proposal(out, static_view(self.views, self.buf, B))
        logits = out[:, : len(self.topk)]  # [B, D, V]
        depth = self.buf.depth[1:]
        # Sampling: every depth-d node is an i.i.d. draw from q_d (its siblings too); q_d does not depend on the
        # drafted path (the block is drafted in parallel), so one row of q per depth serves all its nodes.
        q = warp(logits, self.sampling)  # [B, D, V]
        draws = sample(q, self.buf.depth.numel() - 1, self.generator)  # [B, D, nodes]
        node = torch.arange(1, self.buf.depth.numel(), device=root.device)
        tokens = torch.cat([root[:, None], draws[:, depth - 1, node - 1]], 1)
        q_index = torch.cat([torch.full((1,), -1, device=root.device, dtype=torch.long), depth - 1])
        return Proposal(tokens, static_view(self.views, self.buf, B), q=q, q_index=q_index[None].expand(B, -1))

    def _static_block(self, root: torch.Tensor, backend: str | None, greedy: bool = False) -> torch.Tensor:
        """The last commit's context entries and the block as one call (see _commit_block): the block's logits, or
        with greedy the tree's tokens; the first step after the prompt commits an empty (all holes) set of entries,
        so every step is the same call."""
        empty = self.staged is None  # its holes are written over by the next commit: n stays
        if empty:
            self.staged = empty_fixed(root.shape[0], self.tree.depth + 1, self.max_nodes, self.states_like,
                                      root.device)
        states, keep, ok, positions = self.staged
        self.staged = None
        W = ok.shape[1]
        self._room(W, self.kv, self.valid)
        window = attention_window(self.n + W, self.valid.shape[1], self.valid.device.type)
        fn = compiled_method(self, "_commit_block", backend) if backend else self._commit_block
        out, self.next_pos, self.row_n = fn(root, states, keep, positions, ok, self.row_n, window, greedy)
        # Each row's path (its entries are the first of the W written; the holes past it are written over by the
        # next commit), as the eager path and the base's cache keep: the cache grows with the text, not by the
        # tree's width every step.
        if not empty:
            self._advance(self.staged_lens)
        return out

    def _commit_block(self, root, states, keep, positions, ok, row_n, window: int, greedy: bool = False):
        """The static path's step, tensor operations only (compiled: one graph): the last commit's context entries
        (the base's states at every tree node gathered at keep [B, W]; the entries ok [B, W] leaves out are holes)
        projected and written to the cache at each row's end row_n [B] (_write), then the block (as _block, over
        the first `window` entries). Returns its logits (greedy: the tree's tokens), the root's positions and the
        rows' new ends."""
        row_n = self._write(self._entries(gather_kept(states, keep), positions), ok, row_n)
        next_pos = self.next_pos + ok.sum(-1)
        logits = self._block(root, window, next_pos)
        return (rank_tree_tokens(root, logits, self.buf, self.topk) if greedy else logits), next_pos, row_n

    # --- the chained step (Drafter.chain): _commit_block in the verifier's call ------------------------------------
    def chain_args(self) -> tuple | None:
        if not (self.decode_path or {}).get("static") or self.sampling.temperature > 0:
            return None  # sampled blocks draw their tree from the generator, outside any call
        W = self.tree.depth + 1
        self._room(W, self.kv, self.valid)
        return W, self.row_n, attention_window(self.n + W, self.valid.shape[1], self.valid.device.type)

    def chain(self, states, full, tokens, bonus, last, W: int, row_n, window: int):
        keep, ok, positions = [t[:, :W] for t in full]
        return self._commit_block(bonus, states, keep, positions, ok, row_n, window, True)

    def chained(self, step: StepResult) -> Proposal:
        tokens, self.next_pos, self.row_n = step.drafted
        self._advance(_lengths(step))  # (see _static_block)
        return Proposal(tokens, static_view(self.views, self.buf, tokens.shape[0]))

    @torch.no_grad()
    def commit(self, step: StepResult) -> None:
        if (self.decode_path or {}).get("static"):  # one width; they go in at the next proposal's call
            self.staged = step.fixed(self.tree.depth + 1, self.hidden_layers)
            self.staged_lens = _lengths(step)
            return
        feats = torch.stack([step.hidden[l] for l in self.hidden_layers], 2)  # [B, M, n, H] at the kept nodes
        ok = step.keep_valid
        self._append(feats, step.positions, ok, _lengths(step))
        self.next_pos = self.next_pos + ok.sum(-1)
