"""EAGLE-3-style drafter: one decoder layer over features fused from three layers of the base.

Architecture (parameter names are the EAGLE-3 checkpoint's, so an export is what vLLM / SGLang load):
    g   = fc([h_low ; h_mid ; h_high])                  the base's residual stream entering three decoder layers
    x   = [input_layernorm(embed(token)) ; hidden_norm(g)]          2H wide; embed is the base's (frozen)
    a   = o_proj(attention(q_proj(x), k_proj(x), v_proj(x))) + g    RoPE at the token's position
    out = mlp(post_attention_layernorm(a)) + a                      fed back as the next step's g
    logits over the draft vocabulary = lm_head(norm(out)); draft id i is target id i + d2t[i]

EAGLE-3.1 options (the names SpecForge / speculators / vLLM read): fc_norm, an RMSNorm per base layer on its
features before the concatenation (weights fc_norm.{i}.weight); norm_output, the normalised out norm(out) is both
what lm_head reads and what the next step is fed (EAGLE-3 feeds out, before the norm). Both off: EAGLE-3.

Layer ids follow Hugging Face's output_hidden_states: id i is hidden_states[i], the input of decoder layer i
(what vLLM and SGLang capture as `hidden_states + residual` before layer i); the default (2, L // 2, L - 3).

Training-time test (EAGLE-3): the layer is unrolled `ttt_steps` times. Step 0 reads the base's fused features at
every position; step k reads step k-1's `out` at the same position and the embedding of the true token k
further on, so position s at step k predicts x_{s+k+2} from the real prefix up to s and its own k drafted
steps: it attends to step 0's keys at positions <= s and to its own keys of steps 1..k at slot s. Step k's
loss is the soft cross-entropy against the base's distribution at position s+k+1 restricted to the draft
vocabulary, weighted step_decay^k; positions whose base argmax is outside the draft vocabulary are masked.

Decoding (EAGLE-2 dynamic trees): from the root, expand the top_k children of the top_k most probable nodes
(cumulative draft log-probability) for `depth` levels, then keep the total_tokens most probable nodes. The
draft's KV cache holds one entry per committed position, computed from the base's true features when a step
is committed (tentative tree entries are dropped).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import Examples
from ..decode.compiled import compiled_method
from ..decode.tree import TreeView
from .base import Drafter, PromptState, Proposal, ReadsBase, StepResult, draft_rope, empty_fixed, gather_kept


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer (names as in its checkpoints' `midlayer.*`)."""

    def __init__(self, H: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm, self.hidden_norm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * H, heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, kv_heads * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * head_dim, H, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, inter, bias=False)
        self.mlp.up_proj = nn.Linear(H, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, H, bias=False)

    def qkv(self, embeds: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, H] embeddings and features -> q [B, h, T, d], k and v [B, kv, T, d] (RoPE applied)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, T, _ = g.shape
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(g)], dim=-1)
        a = self.self_attn
        q = a.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, attn: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Attention output [B, h, T, d] and the step's input features g -> out [B, T, H] (pre-norm, fed back)."""
        B, _, T, _ = attn.shape
        a = self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1)) + g
        m = self.mlp
        y = self.post_attention_layernorm(a)
        return m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y)) + a


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] != heads else t


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layer ids for a base of num_layers decoder layers: (2, L // 2, L - 3), what
    the EAGLE-3 code, vLLM and SGLang use. Six layers give (2, 3, 3), which repeat: the high one moves up to 4.
    Below six, (1, L // 2, L - 1)."""
    L = num_layers
    if L >= 6:
        return [2, L // 2, max(L - 3, L // 2 + 1)]
    return [min(1, L - 1), L // 2, L - 1]


class Eagle3Draft(ReadsBase, nn.Module):
    """The trainable EAGLE-3 drafter (see the module docstring)."""

    kind = "eagle3"
    needs_teacher = True  # trained towards the base's distribution whatever loss.distill_weight says

    def __init__(self, cfg: dict, base=None):
        super().__init__()
        self.cfg = dict(cfg)
        H, V, Vd = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]
        self.base_layers = tuple(cfg["layers"])
        self.num_heads = cfg["ttt_steps"]  # metrics are per unrolled step
        self.hidden_size, self.vocab_size = H, V
        self.fc = nn.Linear(len(self.base_layers) * cfg.get("target_hidden_size", H), H, bias=False)
        if cfg.get("fc_norm"):  # EAGLE-3.1: each base layer's features normalised on their own before fc
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.get("target_hidden_size", H), cfg["rms_norm_eps"])
                                         for _ in self.base_layers)
        self.norm_output = bool(cfg.get("norm_output"))
        self.midlayer = Eagle3Layer(H, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                    cfg["intermediate_size"], cfg["rms_norm_eps"])
        self.norm = RMSNorm(H, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))  # target id = draft id + d2t[draft id]
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        if base is not None:
            self.attach_base(base)

    @staticmethod
    def settings(head: dict, base) -> dict:
        """Shape of an EAGLE-3 drafter for this base, from the recipe's head.eagle section."""
        c, e = base.config, dict(head.get("eagle") or {})
        heads = c.num_attention_heads
        layers = e.get("layers") or default_layers(c.num_hidden_layers)
        L = c.num_hidden_layers
        if len(layers) != 3 or not 0 <= min(layers) <= max(layers) < L:
            raise ValueError(f"head.eagle.layers {list(layers)}: EAGLE-3 reads three of this base's layer inputs, "
                             f"hidden_states ids 0..{L - 1}")
        if len(set(layers)) != 3:
            warnings.warn(
                f"EAGLE-3 on this {L}-layer base reads layers {list(layers)}, which repeat: draftlab decodes such a "
                "draft, but vLLM and SGLang capture each layer once and cannot serve it (check says so); "
                + ("give head.eagle.layers three distinct ids" if L >= 3 else "three distinct ones need 3 layers"),
                stacklevel=2)
        V = base.get_output_embeddings().weight.shape[0]
        return {"hidden_size": c.hidden_size, "target_hidden_size": c.hidden_size, "num_attention_heads": heads,
                "num_key_value_heads": getattr(c, "num_key_value_heads", heads) or heads,
                "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
                "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps, "vocab_size": V,
                "draft_vocab_size": min(e.get("draft_vocab_size") or V, V), "layers": list(layers),
                "ttt_steps": e.get("ttt_steps", 7), "step_decay": e.get("step_decay", 0.8),
                "fc_norm": bool(e.get("fc_norm", False)), "norm_output": bool(e.get("norm_output", False)),
                "rope_parameters": draft_rope(base),
                "max_position_embeddings": getattr(c, "max_position_embeddings", 4096)}

    def engine_config(self) -> dict:
        """config.json of the EAGLE-3 checkpoint layout, with the keys vLLM's and SGLang's loaders read: a
        one-layer Llama (LlamaForCausalLMEagle3) with draft_vocab_size, target_hidden_size and the base layer
        ids it reads, in each engine's convention: at the top level as Hugging Face hidden_states indices (vLLM
        captures the input of decoder layer L), under eagle_config one less (SGLang captures the output of decoder
        layer L, hidden_states[L + 1]; for DeepSeek-V2/V3 and GLM4-MoE-Lite targets, since sglang PR #25454, only
        when the first id is 1, so the default layers of bases with six or more layers, which start at 2, read
        alike before and after it there; `draftlab check` says so for others). The base's RoPE theta and scaling
        are copied: the draft layer rotates positions as the base does, over its whole head (draft_rope)."""
        c = self.cfg
        rope = dict(c["rope_parameters"])
        ids = list(self.base_layers)
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_size": c["hidden_size"], "target_hidden_size": c["target_hidden_size"],
                "intermediate_size": c["intermediate_size"], "num_attention_heads": c["num_attention_heads"],
                "num_key_value_heads": c["num_key_value_heads"], "head_dim": c["head_dim"], "hidden_act": "silu",
                "rms_norm_eps": c["rms_norm_eps"], "vocab_size": c["vocab_size"],
                "draft_vocab_size": c["draft_vocab_size"], "max_position_embeddings": c["max_position_embeddings"],
                "rope_theta": rope.get("rope_theta", 10000.0),
                "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
                "rope_parameters": rope, "tie_word_embeddings": False, "attention_bias": False,
                "mlp_bias": False, "torch_dtype": str(self.fc.weight.dtype).removeprefix("torch."),
                "eagle_aux_hidden_state_layer_ids": ids, "fc_norm": bool(c.get("fc_norm")),
                "norm_output": bool(c.get("norm_output")),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}}

    @property
    def full_vocab(self) -> bool:
        return self.d2t.numel() == self.vocab_size

    def engine_state(self) -> dict:
        """The tensors of model.safetensors: the module's, without the vocabulary maps when the draft's vocabulary
        is the base's whole one. The engines take no map as the identity, and vLLM (since its PR #53458) builds no
        draft_id_to_target_id at full vocabulary, so an all-zero d2t in the file failed its load."""
        state = self.state_dict()
        return {k: v for k, v in state.items() if k not in ("d2t", "t2d")} if self.full_vocab else state

    def loaded_without_maps(self) -> None:
        """After loading a file without the vocabulary maps (engine_state): the identity, at full vocabulary."""
        self.d2t.zero_()
        self.t2d.fill_(True)

    def config(self) -> dict:
        return {"type": "eagle3", **self.cfg}

    # --- the EAGLE-3 / EAGLE-3.1 data path ------------------------------------------------------------------
    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Base features [..., n, H] -> g [..., H]: fc over their concatenation; with fc_norm (EAGLE-3.1) each
        layer's features pass their own RMSNorm first."""
        feats = feats.to(self.fc.weight.dtype)
        if hasattr(self, "fc_norm"):
            feats = torch.stack([norm(feats[..., i, :]) for i, norm in enumerate(self.fc_norm)], -2)
        return self.fc(feats.flatten(-2))

    def advance(self, attn: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The layer's output from its attention: the state carried to the next step (with norm_output, EAGLE-3.1,
        the normalised one; EAGLE-3 carries the state before the final norm)."""
        out = self.midlayer.finish(attn, g)
        return self.norm(out) if self.norm_output else out

    def head_input(self, state: torch.Tensor) -> torch.Tensor:
        """What lm_head reads from a carried state: norm(state), or the state itself when it is already normalised."""
        return state if self.norm_output else self.norm(state)

    @property
    def lm_heads(self):
        return [self.lm_head]

    # --- the base it reads: ReadsBase (attach_base, base, embed, rope) --------------------------------------
    @torch.no_grad()
    def init_from_base(self, base) -> None:
        """Attach the base; lm_head rows from the base's lm_head (for the draft vocabulary, once it is set)."""
        self.attach_base(base)
        self.lm_head.weight.copy_(base.get_output_embeddings().weight[self.draft_ids()].to(self.lm_head.weight.dtype))

    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id [Vd]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def fit_vocab(self, examples: list[dict]) -> None:
        """Draft vocabulary: the draft_vocab_size most frequent tokens the training examples supervise (loss_mask;
        a system prompt repeated in every conversation takes no place; as SpecForge counts), ties to the lower id;
        the full vocabulary when it is as large as the base's."""
        V, Vd = self.vocab_size, self.d2t.numel()
        if Vd == V:
            ids = torch.arange(V)
        else:
            counts = torch.zeros(V, dtype=torch.long)
            if isinstance(examples, Examples):  # counted from the flat arrays, no lists made, 4096 examples at a time
                for i in range(0, len(examples), 4096):
                    ids, mask, _ = examples[i:i + 4096].compact()
                    counts += torch.from_numpy(np.bincount(ids[mask.astype(bool)], minlength=V)[:V])
            else:
                for e in examples:
                    ids = torch.tensor(e["input_ids"])
                    mask = torch.tensor(e["loss_mask"], dtype=torch.bool) if "loss_mask" in e else None
                    counts += torch.bincount(ids if mask is None else ids[mask], minlength=V)[:V]
            ids = torch.sort(torch.argsort(-counts, stable=True)[:Vd]).values  # ties to the lower id
        self.d2t.copy_(ids - torch.arange(Vd))
        self.t2d.zero_()
        self.t2d[ids] = True
        if self._base is not None:
            self.init_from_base(self.base)

    # --- training: the unrolled objective ---------------------------------------------------------------
    def unroll(self, g: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, steps: int):
        """The training-time test's forward: yields step k's outputs [B, S, H] for k = 0..steps-1, from fused
        features g [B, S, H]. Step k at slot s reads the embedding of x_{s+k+1} at position s+k, attends to step
        0's keys at slots <= s (the real prefix) and to its own keys of steps 1..k at slot s.

        Written as one attention over step 0's keys and every later step's keys under a boolean mask (causal on
        the first block, diagonal on the others), so the fused kernel never materialises [B, h, S, S] scores."""
        B, S = input_ids.shape
        layer = self.midlayer
        ids_ext = torch.cat([input_ids, input_ids.new_zeros(B, steps + 1)], dim=1)
        eye = torch.eye(S, dtype=torch.bool, device=g.device)
        # The diagonal is always allowed, so a padded slot never has an empty row (its outputs are never used).
        first = (torch.ones_like(eye).tril()[None] & valid[:, None, :]) | eye  # [B, S, S]
        pos = torch.arange(S, device=g.device)[None].expand(B, S)
        keys, vals = [], []
        for k in range(steps):
            e = self.embed(ids_ext[:, 1 + k: 1 + k + S]).to(g.dtype)
            q, kk, vv = layer.qkv(e, g, *self.rope(g, pos + k))
            keys.append(_expand_kv(kk, layer.heads))
            vals.append(_expand_kv(vv, layer.heads))
            mask = torch.cat([first] + [eye[None].expand(B, S, S)] * k, -1)[:, None]  # [B, 1, S, (k+1) S]
            attn = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(vals, 2), attn_mask=mask)
            g = self.advance(attn, g)
            yield g

    def objective(self, states: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  attention_mask: torch.Tensor | None, base_weight: torch.Tensor, loss_cfg,
                  teacher_transform: tuple | None = None) -> dict:
        """Training-time test over states [B, S, n+1, H] (the n base layers and the final state): per step,
        soft cross-entropy towards the base restricted to the draft vocabulary, chunked over positions (the base's
        logits: losses.lm_logits with teacher_transform, elementwise, so restricting them first is the same)."""
        from ..losses import head_loss

        B, S = input_ids.shape
        n, steps = len(self.base_layers), self.cfg["ttt_steps"]
        g = self.fuse(states[:, :, :n])  # [B, S, H]
        final = states[:, :, n]  # the teacher's hidden state
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        rows = self.draft_ids()
        w_teacher = base_weight[rows]  # the base's lm_head restricted to the draft vocabulary [Vd, H]
        with torch.no_grad():  # the base's own argmax at every position, once: it must be draftable to be supervised
            flat = final.reshape(-1, final.shape[-1])
            draftable = torch.cat([self.t2d[(flat[s:s + 1024] @ base_weight.t().to(flat.dtype)).argmax(-1)]
                                   for s in range(0, flat.shape[0], 1024)]).view(B, S)
        out = {key: [] for key in ("loss_sum", "count", "top1", "topk", "agree1")}
        total = g.new_zeros((), dtype=torch.float32)
        for k, o in enumerate(self.unroll(g, input_ids, valid, steps)):
            shift = k + 2  # slot s at step k predicts x_{s+k+2}; its teacher is the base at position s+k+1
            sel = (loss_mask[:, shift:].bool() & valid[:, shift:] & draftable[:, shift - 1: S - 1]) if S > shift else None
            th = final[:, shift - 1: S - 1]
            if sel is None or not bool(sel.any()):
                total = total + 0.0 * (o.sum() + self.lm_head.weight.sum() + self.norm.weight.sum())
                for key in out:
                    out[key].append(total.new_zeros(()).detach())
                continue
            target = input_ids[:, shift:][sel]  # data tokens, as draft ids (-1: not in the draft vocabulary)
            at = torch.searchsorted(rows, target).clamp(max=rows.numel() - 1)
            target = torch.where(rows[at] == target, at, torch.full_like(at, -1))
            ls, h1, hk, ag = head_loss(self.head_input(o[:, : S - shift][sel]), self.lm_head.weight, target, th[sel],
                                       w_teacher, 1.0, loss_cfg.chunk_size, loss_cfg.topk, loss_cfg.divergence,
                                       teacher_transform)
            nsel = sel.sum()
            total = total + self.cfg["step_decay"] ** k * ls / nsel
            for key, v in zip(out, (ls.detach(), nsel.float(), h1, hk, ag)):
                out[key].append(v)
        res = {key: torch.stack(v) for key, v in out.items()}
        res["loss"] = total
        return res


class Eagle3Drafter(Drafter):
    """EAGLE-2 dynamic trees drafted by an EAGLE-3 module (see the module docstring). Deterministic drafts
    (top-k), so sampling verification treats every node as a point mass: lossless."""

    def __init__(self, module: Eagle3Draft, depth: int = 5, top_k: int = 8, total_tokens: int = 32):
        if depth < 1 or top_k < 1 or total_tokens < 2:
            raise ValueError("EAGLE trees need depth >= 1, top_k >= 1 and total_tokens >= 2")
        self.m, self.depth, self.top_k, self.total = module, depth, top_k, total_tokens
        self.hidden_layers = tuple(module.base_layers)
        self.device = module.fc.weight.device
        self.dtype = module.fc.weight.dtype
        self.draft_rows = module.draft_ids()
        self.k = self.v = self.valid = self.out = None  # the draft's KV cache (empty until begin's prompt)
        self.staged = None  # the static path's last commit, entered at the next proposal
        self.n = 0

    @property
    def max_nodes(self) -> int:
        return self.total

    def describe(self) -> dict:
        return {"kind": "eagle3", "depth": self.depth, "top_k": self.top_k, "total_tokens": self.total}

    # --- the draft's KV cache over committed positions -----------------------------------------------------
    def _attend(self, q, k_new, v_new, allowed_new: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Attention of new entries [B, h, T, d] over the committed cache (valid slots) and the new ones (keys and
        values [B, kv_heads, T_new, d], allowed_new [B, T, T_new]); the new keys are not added to the cache. The
        cache is read in place (no copy of it per call): scores over both parts share one softmax, and the query
        heads of one kv head are rows of one product with it (not a broadcast product, which copies the keys once
        per query head). full: read the whole preallocated buffer (slots past the committed ones are not valid),
        so the shapes do not change from step to step (the compiled path)."""
        B, h, T, d = q.shape
        kvh = k_new.shape[1]
        g = h // kvh  # query heads per kv head
        qf = q.reshape(B, kvh, g * T, d) * (1.0 / math.sqrt(d))  # [B, kvh, g * T, d]

        def scores_over(k, allowed):  # [B, kvh, g, T, S], masked where allowed [B, T, S] is False
            return (qf @ k.transpose(-1, -2)).view(B, kvh, g, T, -1).masked_fill(~allowed[:, None, None],
                                                                                float("-inf"))
        scores = scores_over(k_new, allowed_new)
        n = self.k.shape[2] if full and self.k is not None else self.n
        if n:
            scores = torch.cat([scores_over(self.k[:, :, :n], self.valid[:, None, :n].expand(B, T, n)), scores], -1)
        p = torch.softmax(scores, -1)
        out = p[..., n:].reshape(B, kvh, g * T, k_new.shape[2]) @ v_new
        if n:
            out = out + p[..., :n].reshape(B, kvh, g * T, n) @ self.v[:, :, :n]
        return out.reshape(B, h, T, d)

    def _append(self, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor) -> None:
        """Committed entries into the preallocated cache (doubled, in 256-slot steps, when full)."""
        T = k.shape[2]
        self._room(T, k, v, ok)
        self.k[:, :, self.n: self.n + T] = k
        self.v[:, :, self.n: self.n + T] = v
        self.valid[:, self.n: self.n + T] = ok
        self.n += T

    def _room(self, T: int, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor) -> None:
        """Room in the cache for T more entries shaped like k, v [B, kv_heads, *, d] and ok [B, *]: first for the
        prompt and the run (self.slots), then doubled (in 256-slot steps) when full, their committed entries copied."""
        if self.k is None or self.n + T > self.k.shape[2]:
            from ..decode.cache import static_buffer, static_slots

            cap = max(2 * (0 if self.k is None else self.k.shape[2]), static_slots(max(self.n + T, self.slots)))

            def grown(old, new):  # [B, kv_heads, cap, d] holding old's committed entries
                buf = new.new_zeros(new.shape[0], new.shape[1], cap, new.shape[3])
                if old is not None:
                    buf[:, :, : self.n] = old[:, :, : self.n]
                return static_buffer(buf)  # written in place by the compiled commit (under CUDA graphs too)
            self.k, self.v = grown(self.k, k), grown(self.v, v)
            valid = ok.new_zeros(ok.shape[0], cap)
            if self.valid is not None:
                valid[:, : self.n] = self.valid[:, : self.n]
            self.valid = static_buffer(valid)

    def _entries(self, feats: torch.Tensor, next_tokens: torch.Tensor, ok: torch.Tensor, full: bool = False):
        """One layer pass for committed entries (features feats [B, T, n, H], the token after each [B, T], valid
        ok [B, T]) over the cache: their outputs [B, T, H] and keys / values. Tensor operations only."""
        from ..decode.cache import causal_allowed

        g = self.m.fuse(feats)
        pos = self.next_pos[:, None] + (ok.long().cumsum(-1) - 1).clamp(min=0)
        return self._step(g, next_tokens, pos, causal_allowed(ok), full)

    def _step(self, g, tokens, positions, allowed_new, full: bool = False):
        """One layer pass for new entries: g [B, T, H] features, tokens [B, T] target ids, positions [B, T]."""
        e = self.m.embed(tokens).to(self.dtype)
        q, k, v = self.m.midlayer.qkv(e, g, *self.m.rope(g, positions))
        return self.m.advance(self._attend(q, k, v, allowed_new, full), g), k, v

    def _commit_entries(self, feats: torch.Tensor, next_tokens: torch.Tensor, ok: torch.Tensor) -> None:
        """Append committed entries (base features feats [B, T, n, H], the token after each [B, T]); keep each row's
        last valid output as the state the next tree starts from (eager: the prompt, and every commit off the
        static path)."""
        out, k, v = self._entries(feats, next_tokens, ok)
        self._append(k, v, ok)
        self.out, self.next_pos = self._last_out(out, ok, self.out), self.next_pos + ok.sum(-1)

    @staticmethod
    def _last_out(out: torch.Tensor, ok: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        """Each row's output at its last valid entry (a row with none keeps prev)."""
        B, T = ok.shape
        last = (ok.long() * torch.arange(1, T + 1, device=ok.device)).argmax(-1)  # each row's last valid entry
        new = out[torch.arange(B, device=ok.device), last]
        return new if prev is None else torch.where(ok.any(-1)[:, None], new, prev)

    def _commit_tree(self, root, states, keep, ok, tokens, bonus, last, n):
        """The static path's step, tensor operations only (compiled: one graph): the last commit's entries (the
        base's states at every tree node gathered at keep [B, W], each with the token after it; the entries ok
        [B, W] leaves out are holes) through the layer over the whole buffer and written to it at slots n .. n + W
        (n a tensor), then the tree from the new state. Returns the tree (as _tree) and the state."""
        out, k, v = self._entries(gather_kept(states, keep), _next_tokens(tokens, keep, bonus, last), ok, full=True)
        at = n + torch.arange(ok.shape[1], device=ok.device)
        self.k.index_copy_(2, at, k.to(self.k.dtype))
        self.v.index_copy_(2, at, v.to(self.v.dtype))
        self.valid.index_copy_(1, at, ok)
        out, next_pos = self._last_out(out, ok, self.out), self.next_pos + ok.sum(-1)
        return (*self._tree(root, True, out, next_pos), out, next_pos)

    # --- the interface ---------------------------------------------------------------------------------------
    def begin(self, prompt: PromptState, sampling, generator) -> None:
        self.k = self.v = self.valid = self.out = self.staged = None
        self.n = 0  # committed entries in the cache
        self.slots = prompt.ids.shape[1] + prompt.room  # the cache's first size (PromptState.room)
        self.next_pos = torch.zeros(prompt.ids.shape[0], dtype=torch.long, device=self.device)
        self.pending = (torch.stack([prompt.hidden[l] for l in self.hidden_layers], 2), prompt.ids, prompt.valid)
        feats = self.pending[0]
        self.states_like = (feats.dtype, feats.shape[3], feats.shape[2])  # a step's base states (empty_fixed)

    @torch.no_grad()
    def propose(self, root: torch.Tensor) -> Proposal:
        if self.pending is not None:  # the prompt's entries: (features at j, token j+1), the last one's token is the root
            feats, ids, ok = self.pending
            nxt = torch.cat([ids[:, 1:], root[:, None]], 1)
            self._commit_entries(feats, nxt, ok)
            self.pending = None
        path = self.decode_path or {}
        if path.get("static"):
            tokens, parents, depth, ancestors = self._static_step(root, path.get("compile"))
        else:
            tokens, parents, depth, ancestors = self._tree(root, False, self.out, self.next_pos)
        return Proposal(tokens, TreeView(parents, depth, torch.ones_like(parents, dtype=torch.bool), ancestors))

    def _static_step(self, root: torch.Tensor, backend: str | None):
        """The last commit's entries and this step's tree as one call (see _commit_tree); the first step after the
        prompt commits an empty (all holes) set of entries, so every step is the same call."""
        empty = self.staged is None  # its holes are written over by the next commit: n stays
        if empty:
            B, dev = root.shape[0], root.device
            zeros = torch.zeros(B, dtype=torch.long, device=dev)
            self.staged = (empty_fixed(B, self.depth + 1, self.max_nodes, self.states_like, dev),
                           torch.zeros(B, self.max_nodes, dtype=torch.long, device=dev), zeros, zeros)
        (states, keep, ok, _), tokens, bonus, last = self.staged
        self.staged = None
        W = ok.shape[1]
        self._room(W, self.k, self.v, self.valid)
        n = torch.tensor(self.n, device=self.device)
        fn = compiled_method(self, "_commit_tree", backend) if backend else self._commit_tree
        tokens, parents, depth, ancestors, self.out, self.next_pos = fn(root, states, keep, ok, tokens, bonus, last, n)
        self.n += 0 if empty else W
        return tokens, parents, depth, ancestors

    def _tree(self, root: torch.Tensor, full: bool, out: torch.Tensor, next_pos: torch.Tensor):
        """The step's tree: drafted, reranked and viewed (tokens, parents, depths, ancestors), tensor operations
        only. out / next_pos: the state to draft from."""
        tokens, parents = self._rerank(*self._draft(root, full, out, next_pos))
        view = TreeView.of_parents(parents, check=False, max_depth=self.depth)
        return tokens, view.parents, view.depth, view.ancestors

    def _draft(self, root: torch.Tensor, full: bool, out: torch.Tensor, next_pos: torch.Tensor):
        """The dynamic tree's candidates: (tokens, parents, scores) [B, n] of every drafted node, root first, level
        by level. Tensor operations only, their shapes fixed by depth and top_k (and, with full, by the cache's
        buffer): on the compiled path this whole function is part of one graph. out / next_pos: the state to
        draft from (the committed output and the root's positions)."""
        B, dev = root.shape[0], root.device
        logp = torch.log_softmax(self.m.lm_head(self.m.head_input(out)).float(), -1)  # [B, Vd] below the root
        # Nodes per row: token, parent, score, and (for expanded ones) the output that feeds their children.
        score0, idx0 = logp.topk(min(self.top_k, logp.shape[-1]), -1)  # [B, k]
        tok = [root[:, None], self.draft_rows[idx0]]
        par = [torch.full((B, 1), -1, device=dev), torch.zeros_like(idx0)]
        scr = [torch.zeros(B, 1, device=dev), score0]
        # The last level's nodes: the first one's node id, their tokens and scores; each one's parent is tree entry
        # parent_first + (its index // kids) (level 1: the root, which has no entry).
        first, f_tok, f_score = 1, tok[1], score0
        parent_first = kids = 0
        n_nodes = 1 + idx0.shape[1]
        kk = vv = None  # keys / values of the tree entries forwarded so far (never added to the cache)
        ent_anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)  # entry i may attend to entry j
        parent_out = None  # outputs of the forwarded tree entries [B, T, H], in entry order
        for d in range(1, self.depth):
            # Expand the top_k most probable nodes of depth d (the previous level's children).
            k_exp = min(self.top_k, f_score.shape[1])
            exp_score, pick = f_score.topk(k_exp, -1)  # [B, k_exp]
            exp_nodes = first + pick  # node ids to forward
            T_prev = ent_anc.shape[1]
            # Their g: the parent's output (root's = committed state; others = their entry's output).
            if d == 1:
                g = out[:, None].expand(B, k_exp, -1)
                anc_rows = torch.zeros(B, k_exp, 0, dtype=torch.bool, device=dev)
            else:
                slot = parent_first + pick // kids  # each one's parent's entry
                g = parent_out.gather(1, slot[..., None].expand(-1, -1, parent_out.shape[-1]))
                anc_rows = ent_anc.gather(1, slot[..., None].expand(-1, -1, T_prev)) | \
                    torch.nn.functional.one_hot(slot, T_prev).bool()
            allowed_new = torch.cat([anc_rows, torch.eye(k_exp, dtype=torch.bool, device=dev)[None].expand(B, -1, -1)],
                                    -1)  # [B, k_exp, T_prev + k_exp]
            positions = next_pos[:, None] - 1 + d  # a depth-d node is the entry at (root position) - 1 + d
            emb = self.m.embed(f_tok.gather(1, pick)).to(self.dtype)
            q, k_, v_ = self.m.midlayer.qkv(emb, g, *self.m.rope(g, positions.expand(B, k_exp)))
            kk = k_ if kk is None else torch.cat([kk, k_], 2)
            vv = v_ if vv is None else torch.cat([vv, v_], 2)
            o = self.m.advance(self._attend(q, kk, vv, allowed_new, full), g)  # [B, k_exp, H]
            pad = torch.zeros(B, T_prev, k_exp, dtype=torch.bool, device=dev)
            ent_anc = torch.cat([torch.cat([ent_anc, pad], 2), allowed_new], 1)
            parent_out = o if d == 1 else torch.cat([parent_out, o], 1)
            # Children of each expanded node.
            lp = torch.log_softmax(self.m.lm_head(self.m.head_input(o)).float(), -1)  # [B, k_exp, Vd]
            sc, ix = lp.topk(min(self.top_k, lp.shape[-1]), -1)  # [B, k_exp, k]
            f_score = (exp_score[..., None] + sc).flatten(1)  # [B, k_exp * k]
            f_tok = self.draft_rows[ix].flatten(1)
            parent_first, kids = T_prev, ix.shape[-1]
            tok.append(f_tok), scr.append(f_score)
            par.append(exp_nodes[..., None].expand(-1, -1, kids).flatten(1))
            first, n_nodes = n_nodes, n_nodes + f_tok.shape[1]
        return torch.cat(tok, 1), torch.cat(par, 1), torch.cat(scr, 1)

    def _rerank(self, tok, par, scr) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the total_tokens - 1 most probable drafted nodes (a node never beats its parent: prefix-closed), in
        (depth, node) order, on the device for all rows at once: ties go to the shallower, then the earlier node."""
        B, n = tok.shape
        keep = min(self.total, n) - 1
        # _draft numbers the nodes level by level, so node order is (depth, node) order: one stable sort by score
        # (descending) breaks ties towards the shallower, then the earlier node, and the chosen ones go back into
        # node order.
        o = torch.sort(scr[:, 1:], dim=1, descending=True, stable=True).indices
        chosen = (o[:, :keep] + 1).sort(dim=1).values  # [B, keep] node ids (root excluded), in (depth, node) order
        order = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=tok.device), chosen], 1)  # [B, keep + 1]
        new = torch.full((B, n), -1, dtype=torch.long, device=tok.device)
        new.scatter_(1, order, torch.arange(keep + 1, device=tok.device)[None].expand(B, -1))
        parents = new.gather(1, par.gather(1, order).clamp(min=0))
        parents[:, 0] = -1
        # Ordered by construction: (depth, node) order, and a node's parent is kept before it (prefix-closed).
        return tok.gather(1, order), parents

    # --- the chained step (Drafter.chain): _commit_tree in the verifier's call -------------------------------------
    def chain_args(self) -> tuple | None:
        if not (self.decode_path or {}).get("static") or self.pending is not None:
            return None
        self._room(self.depth + 1, self.k, self.v, self.valid)
        return (torch.tensor(self.n, device=self.device),)

    def chain(self, states, full, tokens, bonus, last, n):
        keep, ok = [t[:, : self.depth + 1] for t in full[:2]]
        return self._commit_tree(bonus, states, keep, ok, tokens, bonus, last, n)

    def chained(self, step: StepResult) -> Proposal:
        tokens, parents, depth, ancestors, self.out, self.next_pos = step.drafted
        self.n += self.depth + 1
        return Proposal(tokens, TreeView(parents, depth, torch.ones_like(parents, dtype=torch.bool), ancestors))

    @torch.no_grad()
    def commit(self, step: StepResult) -> None:
        # Entries for the committed positions from the base's true features: (feature at node, next token), the
        # last one's next token being the bonus. Tentative tree entries were never added to the cache.
        if (self.decode_path or {}).get("static"):  # at one width; they go in at the next proposal's call
            self.staged = (step.fixed(self.depth + 1, self.hidden_layers), step.tokens, step.bonus, step.last)
            return
        feats = torch.stack([step.hidden[l] for l in self.hidden_layers], 2)  # [B, M, n, H]
        nxt = _next_tokens(step.tokens, step.keep, step.bonus, step.last)
        self._commit_entries(feats, nxt, step.keep_valid)


def _next_tokens(tokens: torch.Tensor, keep: torch.Tensor, bonus: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The token after each kept node [B, W]: kept node i + 1's, and after the last one (last [B]) the bonus (past
    it: whatever keep's padding points at, holes). Tensor operations only."""
    nxt = torch.cat([tokens.gather(1, keep[:, 1:]), bonus[:, None]], 1)
    return nxt.scatter(1, last[:, None], bonus[:, None])
