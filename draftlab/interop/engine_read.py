"""The engines' readings of a draft's served files, written from the files alone (config.json + safetensors), not with
draftlab's drafter modules: vLLM's Medusa heads, the EAGLE-3 draft layer as vLLM and SGLang compute it, and DFlash's
block as SGLang's and vLLM's (0.33.0, qwen3_dflash.py) DFlash models compute it. `draftlab check` (check.py)
compares draftlab's proposals with these; the loader rules they follow are listed there and in docs/interop.md."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..drafters.base import own_rotary  # (from the draft's own config.json, not the base's: a changed theta shows)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def vllm_medusa_logits(state: dict, cfg: dict, h: torch.Tensor) -> torch.Tensor:
    """[..., K, V] logits of vLLM's Medusa model (blocks.{k}.layers.{l}: x + SiLU(W x + b), the bias only with
    medusa_fc_bias; lm_heads.{k}) from the base's final hidden state h [..., H]."""
    out = []
    for k in range(cfg["num_heads"]):
        x = h
        for l in range(cfg["num_hidden_layers"]):
            b = state.get(f"blocks.{k}.layers.{l}.bias") if cfg.get("medusa_fc_bias") else None
            x = x + F.silu(F.linear(x, state[f"blocks.{k}.layers.{l}.weight"], b))
        out.append(F.linear(x, state[f"lm_heads.{k}.weight"]))
    return torch.stack(out, -2)


class EngineEagle3:
    """An EAGLE-3 draft computed from config.json + model.safetensors the engines' way: features of the layers the
    engine captures (each once, in layer order) through fc; x = [input_layernorm(embed) ; hidden_norm(g)], residual
    g; RoPE from the draft's own config; logits over the draft vocabulary, draft id i = target id i + d2t[i]."""

    def __init__(self, tensors: dict, cfg: dict, base, captured: list[int], eagle31: bool = True):
        """eagle31: the engine reads EAGLE-3.1's switches (`fc_norm`, `norm_output`), as vLLM 0.33.0's
        llama_eagle3.py does; False: an older vLLM's, which read neither (at vLLM 00bd149: it ran the layer as
        EAGLE-3 whatever they said, and had no fc_norm weights)."""
        self.t = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
        if not eagle31:
            if cfg.get("fc_norm"):
                raise ValueError("fc_norm is set, and this engine's EAGLE-3 has no such weights: it would fail to load "
                                 "fc_norm.{i}.weight (an EAGLE-3.1 switch it does not read)")
            cfg = {k: v for k, v in cfg.items() if k != "norm_output"}  # not read: the layer runs as EAGLE-3's
        self.cfg, self.base, self.layers = cfg, base, sorted(set(captured))
        n_in = self.t["fc.weight"].shape[1] // cfg.get("target_hidden_size", cfg["hidden_size"])
        self.layers = [l for l in self.layers if 0 <= l < base.config.num_hidden_layers]  # captured before layer l
        if len(self.layers) != n_in:
            raise ValueError(f"fc reads {n_in} base layers and the engine captures {len(self.layers)} "
                             f"{self.layers}: it would fail to run the draft")
        self.rotary = own_rotary(cfg)
        Vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
        self.targets = torch.arange(Vd) + self.t.get("d2t", torch.zeros(Vd, dtype=torch.long)).long()
        self.eps = cfg["rms_norm_eps"]

    def fuse(self, hidden_states: tuple) -> torch.Tensor:
        """fc over the captured layers' states [S, H] each -> g [S, H]."""
        feats = [hidden_states[l][0].float() for l in self.layers]
        if self.cfg.get("fc_norm"):
            feats = [_rms(f, self.t[f"fc_norm.{i}.weight"], self.eps) for i, f in enumerate(feats)]
        return torch.cat(feats, -1) @ self.t["fc.weight"].t()

    def step(self, g: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer over entries (features g [T, H], token after each [T]) at positions 0..T-1, causal: the state
        each entry hands on (norm_output: normalised)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        t, c, p, T = self.t, self.cfg, "midlayer.", g.shape[0]
        emb = self.base.get_input_embeddings()(tokens).float()
        x = torch.cat([_rms(emb, t[p + "input_layernorm.weight"], self.eps), _rms(g, t[p + "hidden_norm.weight"], self.eps)], -1)
        h, kv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // h
        q, k, v = ((x @ t[p + f"self_attn.{n}_proj.weight"].t()).view(T, -1, hd).transpose(0, 1)[None] for n in "qkv")
        cos, sin = self.rotary(x[None], torch.arange(T)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(T, -1)
        res = a @ t[p + "self_attn.o_proj.weight"].t() + g
        y = _rms(res, t[p + "post_attention_layernorm.weight"], self.eps)
        out = (F.silu(y @ t[p + "mlp.gate_proj.weight"].t()) * (y @ t[p + "mlp.up_proj.weight"].t())) \
            @ t[p + "mlp.down_proj.weight"].t() + res
        return _rms(out, t["norm.weight"], self.eps) if c.get("norm_output") else out

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        s = state if self.cfg.get("norm_output") else _rms(state, self.t["norm.weight"], self.eps)
        return s @ self.t["lm_head.weight"].t()


def dflash_layers(cfg: dict, n: int, engine: str) -> tuple[list[int], str]:
    """The hidden_states indices an engine feeds a DFlash draft of an n-layer base, and the key it took them from.
    Both capture each layer once, in layer order, whatever the order given (their models append the captured states
    as their layer loop passes them), reading dflash_config.target_layer_ids as layer outputs (id + 1). vLLM (0.33.0)
    reads a top-level eagle_aux_hidden_state_layer_ids first (as they are), and after dflash_config's a top-level
    target_layer_ids, else its default (2, n // 2, n - 3); SGLang refuses to start without dflash_config's
    (ValueError here)."""
    dc = cfg.get("dflash_config") or {}
    if engine == "vllm" and cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids, key = [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]], "eagle_aux_hidden_state_layer_ids"
    elif dc.get("target_layer_ids") is not None:
        ids, key = [int(i) + 1 for i in dc["target_layer_ids"]], "dflash_config.target_layer_ids"
    elif engine == "vllm" and cfg.get("target_layer_ids") is not None:
        ids, key = [int(i) + 1 for i in cfg["target_layer_ids"]], "target_layer_ids"
    elif engine == "vllm":
        ids, key = [2, n // 2, n - 3], "its default (no layer ids in config.json)"
    else:
        raise ValueError("config.json has no dflash_config.target_layer_ids: SGLang refuses to start a DFlash draft "
                         "without them; export again")
    return sorted(set(ids)), key


def last_layer_problem(engine: str, n: int) -> str:
    """Why an engine does not give a DFlash draft hidden_states[n] (the last decoder layer's output after the base's
    final norm, as draftlab and Hugging Face read it)."""
    if engine == "vllm":
        return (f"hidden_states {n}, the last decoder layer's output, is read before the base's final norm, where "
                f"draftlab reads it after (Hugging Face's hidden_states[{n}])")
    return (f"hidden_states {n} is never captured: SGLang's models take the state before each decoder layer "
            f"(0..{n - 1}), and none after the last")


class EngineDFlash:
    """A DFlash draft computed from config.json + model.safetensors the way an engine reads them: the base layers as
    dflash_layers gives them (layer outputs, ascending; z-lab's reference code keeps the order given, the engines
    do not), concatenated, through fc and hidden_norm: the context, which every layer takes as extra keys / values;
    the block [root, mask_token_id x (block_size - 1)] embedded with the base's embeddings, attending to the context
    and to all of itself; RoPE from the draft's own config; logits through the base's lm_head. vLLM (0.33.0) drafts
    a block num_speculative_tokens + 1 long (it reads no block_size; the check passes block_size - 1, as
    docs/interop.md's command does). hidden_states[n] (the last layer, after the final norm) is refused: neither
    engine gives it (last_layer_problem). Written from the files alone: draftlab's DFlash module is not used."""

    def __init__(self, tensors: dict, cfg: dict, base, engine: str = "sglang"):
        dc = cfg.get("dflash_config") or {}
        mask = dc.get("mask_token_id", cfg.get("mask_token_id") if engine == "vllm" else None)
        if mask is None:
            raise ValueError("config.json has no dflash_config.mask_token_id: the engine cannot build the draft; "
                             "export again")
        self.t = {k: v.float() for k, v in tensors.items() if v.is_floating_point()}
        self.cfg, self.base, self.eps = cfg, base, cfg["rms_norm_eps"]
        n, H = base.config.num_hidden_layers, base.config.hidden_size
        self.layers, key = dflash_layers(cfg, n, engine)
        if any(not 0 <= i <= n for i in self.layers):
            raise ValueError(f"{key} gives hidden_states {self.layers}, outside the base's 0..{n}: the engine "
                             "would fail to capture them")
        if n in self.layers:
            raise ValueError(last_layer_problem(engine, n) + ": no draftlab draft is served as trained with it "
                             f"(retrain with head.dflash.layers below {n}, or fix the layer ids if aux-layer-ids says "
                             "they are wrong)")
        if any(f"layers.{i}.self_attn.q_norm.weight" not in self.t for i in range(cfg["num_hidden_layers"])):
            raise ValueError("the draft's layers have no q/k norms, which the engines' DFlash layers always apply "
                             "(vLLM and SGLang load unit weights in their place, so every block would be drafted "
                             "otherwise than trained); train it with head.dflash.qk_norm: true, the default since "
                             "2026-11-30")
        if self.t["fc.weight"].shape[1] != len(self.layers) * H:
            raise ValueError(f"fc reads {self.t['fc.weight'].shape[1] // H} base layers and the engine captures "
                             f"{len(self.layers)} (hidden_states {self.layers}): it would fail to run the draft")
        self.block, self.mask = int(cfg.get("block_size") or dc["block_size"]), int(mask)
        self.rotary = own_rotary(cfg)

    def context(self, hidden_states: tuple) -> torch.Tensor:
        """The context features [S, H] of a text from the base's hidden_states (each [1, S, H])."""
        feats = torch.cat([hidden_states[l][0].float() for l in self.layers], -1)
        return _rms(feats @ self.t["fc.weight"].t(), self.t["hidden_norm.weight"], self.eps)

    def block_logits(self, ctx: torch.Tensor, root: int) -> torch.Tensor:
        """Logits [block_size - 1, V] of the block below `root`, with context ctx [c, H] at positions 0..c-1."""
        from transformers.models.llama.modeling_llama import rotate_half

        t, c, T, cfg = self.t, ctx.shape[0], self.block, self.cfg
        nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
        x = self.base.get_input_embeddings()(torch.tensor([root] + [self.mask] * (T - 1))).float()
        cos, sin = (r[0] for r in self.rotary(x[None], torch.arange(c + T)[None]))  # [c + T, hd]
        rot = lambda z, a, b: z * a + rotate_half(z) * b
        split = lambda z, n: z.view(z.shape[0], n, hd).transpose(0, 1)  # [n, len, hd]
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            y = _rms(x, t[p + "input_layernorm.weight"], self.eps)
            both = torch.cat([ctx, y])  # the context's keys / values, then the block's own
            q = split(y @ t[p + "self_attn.q_proj.weight"].t(), nh)
            k = split(both @ t[p + "self_attn.k_proj.weight"].t(), kvh)
            v = split(both @ t[p + "self_attn.v_proj.weight"].t(), kvh)
            q = _rms(q, t[p + "self_attn.q_norm.weight"], self.eps)  # per head, as the engines' layers always do
            k = _rms(k, t[p + "self_attn.k_norm.weight"], self.eps)
            q, k = rot(q, cos[c:], sin[c:]), rot(k, cos, sin)
            k, v = k.repeat_interleave(nh // kvh, 0), v.repeat_interleave(nh // kvh, 0)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # no mask: context and block, both ways
            x = x + a.transpose(0, 1).reshape(T, -1) @ t[p + "self_attn.o_proj.weight"].t()
            y = _rms(x, t[p + "post_attention_layernorm.weight"], self.eps)
            x = x + (F.silu(y @ t[p + "mlp.gate_proj.weight"].t()) * (y @ t[p + "mlp.up_proj.weight"].t())) \
                @ t[p + "mlp.down_proj.weight"].t()
        return _rms(x[1:], t["norm.weight"], self.eps) @ self.base.get_output_embeddings().weight.float().t()
