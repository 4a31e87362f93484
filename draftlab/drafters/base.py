"""What every drafter kind builds on: the decoder's interface (re-exported from decode/interface.py), the base's
embeddings and rotary table for modules that read them, and reading an export's weight files."""

from __future__ import annotations

from pathlib import Path

import torch

from ..decode.interface import Drafter, PromptState, Proposal, StepResult  # noqa: F401 (the interface, re-exported)
from ..decode.tree import TreeView


class ExportError(ValueError):
    """An export directory that is missing, malformed, or made for another base."""


def read_safetensors(path: Path) -> dict:
    """A safetensors file's tensors, or an ExportError naming the damaged file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"{path}: damaged or truncated safetensors file ({e}). Export again from the run "
                          "(rerunning `draftlab train RECIPE` on a finished run rewrites OUTPUT_DIR/export)") from None


@torch.no_grad()
def closest_transform(model, transform: tuple | None) -> tuple[tuple | None, bool]:
    """Of `transform` (base.teacher_transform's, from the model's config) and the bare product, the one with which
    losses.lm_logits of the model's final hidden states gives its own logits, on one forward of 16 tokens: the closer
    in log-probabilities, and whether it is within rounding (False: the model's code does something else to its
    logits). A soft cap barely moves logits far below it, so the closer one wins rather than the first that passes;
    which of two that both pass there is chosen matters as little. A config key the code does not read gives None."""
    from ..base import base_hidden
    from ..losses import lm_logits

    w = model.get_output_embeddings().weight
    ids = (torch.arange(1, 17) * 7919 % w.shape[0])[None].to(w.device)
    want = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float().to(w.device), -1)
    h = base_hidden(model, ids)[0].to(w.device, w.dtype)
    tol = 1e-4 if w.dtype == torch.float32 else 1e-2  # (in log-probability: one bf16 rounding of a logit is 4e-3 of it)
    errors = {t: float((torch.log_softmax(lm_logits(h, w, t), -1) - want).abs().max())
              for t in ([transform] if transform else []) + [None]}
    t = min(errors, key=errors.get)
    return t, errors[t] <= tol * max(1.0, float(want.abs().max()))


def base_context(base) -> int | None:
    """The base's context in tokens, past which it writes noise; None where its RoPE scaling is dynamic (NTK
    rescales past max_position_embeddings, which is then no limit) or its config names none."""
    return config_context(base.config)


def config_context(config) -> int | None:
    """base_context from the base's config (validate reads no weights): max_position_embeddings, None where a RoPE
    table's scaling is dynamic or the config names none."""
    c = config.get_text_config(decoder=True)
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    tables = [rope, *(v for v in rope.values() if isinstance(v, dict))]  # (one per layer type: Gemma 3)
    if any("dynamic" in (t.get("rope_type"), t.get("type")) for t in tables):
        return None
    return getattr(c, "max_position_embeddings", None)


def rank_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rank of target [...] in logits [..., V] (0 = the top candidate), for the tree search's statistics.

    A target tied with other tokens is put at a uniformly random place among them (from a fixed seed: the same
    statistics every run). bfloat16 logits of 16 to 32 are 0.125 apart, so ties near the top are common, and topk
    orders tied tokens in an order of its own that changes with k: the decoder's tree holds the target at any of
    those places. Counting it first, as a strict count of greater logits does, made the statistics optimistic."""
    x = logits.gather(-1, target[..., None])
    above, tied = (logits > x).sum(-1), (logits == x).sum(-1) - 1
    u = torch.rand(tied.shape, generator=torch.Generator(device=logits.device).manual_seed(0), device=logits.device)
    return above + torch.minimum((u * (tied + 1)).long(), tied)


def rank_tree_tokens(root: torch.Tensor, logits: torch.Tensor, buf, topk: list[int]) -> torch.Tensor:
    """A static rank tree's tokens [B, N] from per-depth logits [B, >= D, V] (D = len(topk), topk the candidates each
    depth needs): the root, then each node's rank-th most likely token at its depth (buf: the tree's TreeBuffers).
    Tensor operations only (inside a drafter's compiled call)."""
    cand = logits[:, : len(topk)].topk(max(topk, default=1), dim=-1).indices  # [B, D, kmax]
    return torch.cat([root[:, None], cand[:, buf.depth[1:] - 1, buf.rank[1:]]], 1)


def static_view(views: dict, buf, B: int) -> TreeView:
    """The TreeView of a static tree (its buffers, Tree.buffers) for B rows, made once per batch size and kept in
    `views`, a drafter's own dict: a static tree's proposals all share it."""
    if B not in views:
        views[B] = TreeView.of_static(buf, B)
    return views[B]


def gather_kept(states: tuple, keep: torch.Tensor) -> torch.Tensor:
    """The base's states at the kept nodes, [B, W, n, H] (n: len(states)), from its states at every tree node (a
    tuple of [B, N, H], StepResult.fixed) and keep [B, W]. Tensor operations only (inside a drafter's compiled
    call)."""
    return torch.stack([h.gather(1, keep[:, :, None].expand(-1, -1, h.shape[-1])) for h in states], 2)


def empty_fixed(B: int, W: int, N: int, states_like: tuple, device) -> tuple:
    """A StepResult.fixed(W) of a tree of N nodes whose W entries are all holes: (states, keep, keep_valid,
    positions), laid out as the decoder's own (states_like: (dtype, H, layers)). A drafter that enters a commit in its
    next proposal's call gives its first proposal after the prompt this one, so every step is the same call."""
    dtype, H, layers = states_like
    states = tuple(torch.zeros(B, N, H, dtype=dtype, device=device) for _ in range(layers))
    zeros = torch.zeros(B, N, dtype=torch.long, device=device)
    return states, zeros[:, :W], zeros.bool()[:, :W], zeros[:, :W]


def rope_table(base) -> str | None:
    """The layer type whose rotary table a draft layer takes from a base with one table per layer type (Gemma 3: a
    local one for its sliding layers): the full-attention layers' (a draft layer attends over the whole text), or
    the one table a base without full-attention layers has; None where the base has one table for all layers."""
    import inspect

    emb = getattr(base.base_model, "rotary_emb", None)
    if emb is None or "layer_type" not in inspect.signature(emb.forward).parameters:
        return None
    return table_of(getattr(emb, "layer_types", None))


def table_of(layer_types) -> str:
    """Of a base's layer types, the one whose rotary table draft layers take (rope_table)."""
    types = list(layer_types or ["full_attention"])
    return "full_attention" if "full_attention" in types else types[0]


def rope_args(base) -> tuple:
    """What a draft layer passes the base's rotary embedding besides states and positions (rope_table)."""
    table = rope_table(base)
    return () if table is None else (table,)


def flat_rope(params: dict | None, table: str | None = None) -> dict:
    """RoPE parameters (rope_theta, rope_type, scaling) as one table: where a config holds one per layer type (Gemma
    3's rope_parameters), the `table` one (rope_table; default the full-attention layers', else the first)."""
    p = dict(params or {})
    if p and all(isinstance(v, dict) for v in p.values()):
        p = dict(p.get(table or "full_attention") or next(iter(p.values())))
    return p


def partial_factor(params: dict | None) -> float:
    """A RoPE table's partial_rotary_factor (1: the whole head)."""
    f = (params or {}).get("partial_rotary_factor")
    return 1.0 if f is None else float(f)


def partial_rotary(base) -> bool:
    """Whether the base rotates part of each head only (partial_rotary_factor < 1: Phi-2, StableLM, GLM-4,
    Qwen3-Next). A draft layer that reads the base rotates its whole head (Llama's layer, as the engines build it)."""
    c = base.config.get_text_config(decoder=True)
    p = flat_rope(getattr(c, "rope_parameters", None), rope_table(base))
    return partial_factor(p if "partial_rotary_factor" in p else vars(c)) < 1


def draft_rope(base) -> dict:
    """The RoPE parameters of a draft layer that reads the base (its config.json's, as engines read them): the base's
    theta and scaling over the whole head, without the base's partial_rotary_factor. A partial base whose scaling
    has a factor per rotated frequency (longrope: Phi-3.5 / Phi-4-mini) has none for a whole head: refused."""
    rope = base_rope(base)
    if partial_rotary(base) and any(isinstance(v, (list, tuple)) for v in rope.values()):
        raise ValueError(f"the base rotates part of each head with {rope.get('rope_type')} scaling, whose factors "
                         "are per rotated frequency: a draft layer that rotates its whole head (as the engines build "
                         "EAGLE-3 and DFlash drafts) has no scaling to take from it; draftlab does not draft such a "
                         "base with EAGLE-3 or DFlash (Hydra++, Medusa and SSMs work)")
    return {k: v for k, v in rope.items() if k != "partial_rotary_factor"}


def own_rotary(cfg: dict):
    """The rotary table a draft layer's config dict gives (rope_parameters, else rope_theta / rope_scaling), the way
    engines build a draft's attention: from its own config.json, not the base's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = ({"rope_parameters": cfg["rope_parameters"]} if cfg.get("rope_parameters") else
            {"rope_theta": cfg.get("rope_theta", 10000.0),
             **({"rope_scaling": cfg["rope_scaling"]} if cfg.get("rope_scaling") else {})})
    return LlamaRotaryEmbedding(config=LlamaConfig(
        hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096), **rope))


def base_rope(base) -> dict:
    """The base's RoPE parameters for a draft layer that rotates positions as the base does: the table rope_table
    names where the base has one per layer type."""
    c = base.config.get_text_config(decoder=True)
    return flat_rope(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or
                     {"rope_theta": getattr(c, "rope_theta", 10000.0), "rope_type": "default"}, rope_table(base))


class ReadsBase:
    """For draft modules that read the frozen base's embeddings and rotary table (EAGLE-3, DFlash): the base is held
    outside the module's parameters (not trained, not saved) and attached when the module is built or loaded."""

    _base = None
    _rope_args: tuple = ()

    _own_rotary: list = []

    def attach_base(self, base) -> None:
        self._base = [base]  # a list: not a submodule
        self._rope_args = rope_args(base)
        # A base that rotates part of each head: the draft's layer rotates its whole head from its own table (on the
        # base's device). A draft made before that (its config keeps the base's factor: GLM-4's 0.5, where the half
        # table was repeated) keeps the base's table, as it was trained.
        own = partial_rotary(base) and partial_factor(flat_rope(self.cfg.get("rope_parameters"))) == 1
        self._own_rotary = [own_rotary(self.cfg).to(base.get_input_embeddings().weight.device)] if own else []

    @property
    def base(self):
        if self._base is None:
            raise ValueError(f"a {self.kind} drafter needs its base attached (load_export(..., base=model))")
        return self._base[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The base's (frozen) input embeddings of ids."""
        with torch.no_grad():
            return self.base.get_input_embeddings()(ids)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        """The base's rotary (cos, sin) at positions, in x's dtype, over the whole head (Llama's rotate-half layout):
        a base whose table covers half a head (gpt-oss rotates each half by the same angles) has it repeated. A base
        that rotates part of each head only gives its theta and scaling to a table of the draft's own (own_rotary)."""
        if self._own_rotary:
            if self._own_rotary[0].inv_freq.device != x.device:  # (the draft moved since its base was attached)
                self._own_rotary[0].to(x.device)
            cos, sin = self._own_rotary[0](x, positions)
            return cos.to(x.dtype), sin.to(x.dtype)
        cos, sin = self.base.base_model.rotary_emb(x, positions, *self._rope_args)
        if 2 * cos.shape[-1] == self.cfg["head_dim"]:
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return cos.to(x.dtype), sin.to(x.dtype)
