"""Small speculative models (SSMs): a small causal LM that drafts for the base.

Training: `SSMDraft` wraps a stock Hugging Face causal LM (a hub id / directory, or one built from the
base's own config class with fewer / narrower layers), trained by distillation from the frozen base in
the one training loop. Decoding: `SSMDrafter` drafts a chain (classic speculative decoding) or any
rank-path tree (SpecInfer's expansion configurations <k1, ..., km> included) with its own KV cache,
which follows the accepted path without a re-prefill.
"""

from __future__ import annotations

import json
import weakref

import torch
from torch import nn

from ..decode.acceptance import Sampling, draw, uniforms, warp
from ..decode.cache import (cache_name, causal_allowed, check_tree_support, mark_valid, move_kept, reserved_mask,
                            slot_cache)
from ..decode.compiled import Fixed, compiled_method
from ..decode.tree import Tree, TreeView
from .base import Drafter, PromptState, Proposal, StepResult, closest_transform, rank_of, static_view

# A backlog longer than CATCH_UP tokens (a drafter an ensemble paused) is fed before the step's feed, in forwards of
# CATCH_UP_WIDTH tokens (SSMDrafter.catch_up), rather than by widening the step's feed (at most 16 tokens with the root).
CATCH_UP = 15
CATCH_UP_WIDTH = 128


class SSMError(ValueError):
    """An SSM that cannot draft for this base as configured."""


# --- the model ------------------------------------------------------------------------------------

def _ssm_config(base_config, c: dict):
    """The base's config class with the SSM's depth and width (same block type, same vocabulary)."""
    cfg = base_config.__class__.from_dict(base_config.to_dict())
    H = c.get("hidden_size") or base_config.hidden_size
    heads = c.get("num_attention_heads") or max(1, base_config.num_attention_heads * H // base_config.hidden_size)
    kv = c.get("num_key_value_heads") or max(1, min(heads, getattr(base_config, "num_key_value_heads", heads) or heads))
    if H % heads or heads % kv:
        raise SSMError(f"head.ssm: hidden_size {H} must divide by num_attention_heads {heads}, and that by "
                       f"num_key_value_heads {kv}")
    inter = c.get("intermediate_size") or int(round(base_config.intermediate_size * H / base_config.hidden_size))
    cfg.update({"hidden_size": H, "num_hidden_layers": c.get("num_layers", 2), "num_attention_heads": heads,
                "num_key_value_heads": kv, "intermediate_size": inter})
    if getattr(cfg, "head_dim", None) is not None:
        cfg.head_dim = H // heads
    # A new model's logits are its lm_head's product alone: no soft cap or scale inherited (a pretrained draft
    # model's own are applied in training: SSMDraft.logit_transform).
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, key, None) is not None and not isinstance(getattr(type(cfg), key, None), property):
            setattr(cfg, key, None if key == "final_logit_softcapping" else 1.0)
    if getattr(cfg, "dim_model_base", None):  # (MiniCPM3: logits_scaling is hidden_size / dim_model_base)
        cfg.dim_model_base = cfg.hidden_size
    for key in ("layer_types", "_name_or_path"):  # per-layer lists sized for the base's depth
        if hasattr(cfg, key) and key == "layer_types" and cfg.layer_types is not None:
            cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
    return cfg


def check_vocab(ssm, base, where: str) -> None:
    """Drafts are verified token id for token id: the vocabularies must be the same size (no truncation). And
    training must compute the draft model's logits as drafting does (it runs the model): its lm_head's product with
    what the model does after it (base.teacher_transform: a soft cap, a scale; SSMDraft.logit_transform). A bias, or
    a scale of a model type draftlab does not know, cannot be (found by review: a Phi-style lm_head bias left 20% of
    argmaxes agreeing)."""
    from ..base import teacher_transform

    try:
        teacher_transform(ssm.config, ssm.get_output_embeddings())
    except ValueError as e:
        raise SSMError(f"{where}: the draft model changes its logits after its lm_head's product ({e}) in a way "
                       "draftlab's training does not reproduce, so it would draft with logits it was not trained "
                       "on: pick a draft model without it, or build one from the recipe (head.ssm)") from None
    vs, vb = ssm.get_output_embeddings().weight.shape[0], base.get_output_embeddings().weight.shape[0]
    if vs != vb:
        raise SSMError(f"{where}: the draft model has a vocabulary of {vs} tokens and the base {vb}; an SSM must "
                       "share the base's tokenizer and vocabulary size (pick a smaller model of the base's family, "
                       "or build one from the recipe with head.ssm.num_layers / hidden_size)")


class SSMDraft(nn.Module):
    """A small causal LM as a trainable draft module: features for the chunked loss, its lm_head, and export."""

    kind = "ssm"
    num_heads = 1  # one next-token prediction: metrics keep their per-head shape
    shifts = (1,)  # position t is trained on token t+1 (heads: t+k+2)

    def __init__(self, lm, settings: dict | None = None):
        super().__init__()
        self.lm = lm
        self.settings = dict(settings or {})
        self.vocab_size = lm.get_output_embeddings().weight.shape[0]
        self.hidden_size = lm.config.hidden_size
        from ..base import teacher_transform

        # What the model does to its lm_head's product (a Gemma-2 draft's soft cap): training applies it too. Read
        # once: the loss asks at every step.
        self.logit_transform = teacher_transform(lm.config, lm.get_output_embeddings())

    def empty_like(self) -> "SSMDraft":
        """A module of this one's structure, its weights fresh (to be loaded over): from the model's config, so a
        pretrained SSM is not loaded from its files and probed again (ZeRO-3's gathered copies, at every accept
        estimate: review)."""
        copy = SSMDraft(type(self.lm)(self.lm.config).float(), self.settings)  # (its own class: remote code too)
        copy.logit_transform = self.logit_transform
        return copy

    @property
    def lm_heads(self):
        return [self.lm.get_output_embeddings()]

    def config(self) -> dict:
        c = self.lm.config
        return {"type": "ssm", "num_heads": 1, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "num_layers": c.num_hidden_layers, "model_type": c.model_type,
                "params": sum(p.numel() for p in self.lm.parameters()), **self.settings}

    def train_hidden(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask=None) -> list[torch.Tensor]:
        """The SSM's own final (normalised) states [B, S, Hs]; the base's states are only the teacher's."""
        return [self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state]

    @torch.no_grad()
    def init_from_base(self, base, how: str) -> None:
        """Initialise from the base: 'embeddings' (copy embeddings, lm_head and final norm; same width),
        'project' (the same, projected onto the embedding matrix's top principal directions; narrower),
        'truncate' (also copy the base's first layers), 'random' (keep the fresh initialisation)."""
        if how == "random":
            return
        Hs, Hb = self.hidden_size, base.config.hidden_size
        if how == "auto":
            how = "embeddings" if Hs == Hb else "project"
        if how in ("embeddings", "truncate") and Hs != Hb:
            raise SSMError(f"head.ssm.init={how}: the SSM is {Hs} wide and the base {Hb}; use init: project "
                           "(or random), or hidden_size equal to the base's")
        if how == "project" and Hs > Hb:
            raise SSMError(f"head.ssm.init=project: the SSM ({Hs} wide) is wider than the base ({Hb}); a projection "
                           "onto the base's embedding directions needs hidden_size <= the base's (or use init: random)")
        emb_b, emb_s = base.get_input_embeddings().weight, self.lm.get_input_embeddings().weight
        out_b, out_s = base.get_output_embeddings().weight, self.lm.get_output_embeddings().weight
        proj = None
        if how == "project":
            # Top right singular vectors of the base's embedding matrix: the directions it uses most.
            _, _, vh = torch.linalg.svd(emb_b.float() - emb_b.float().mean(0), full_matrices=False)
            proj = vh[:Hs].t()  # [Hb, Hs]
        for src, dst in ((emb_b, emb_s), (out_b, out_s)):
            dst.copy_((src.float() @ proj if proj is not None else src.float()).to(dst.dtype))
        if how == "truncate":
            n = self.lm.config.num_hidden_layers
            layers_b, layers_s = base.base_model.layers, self.lm.base_model.layers
            if n > len(layers_b):
                raise SSMError(f"head.ssm.init=truncate: the SSM has {n} layers, the base only {len(layers_b)}")
            for i in range(n):
                layers_s[i].load_state_dict({k: v.float() for k, v in layers_b[i].state_dict().items()})
            norm_b, norm_s = getattr(base.base_model, "norm", None), getattr(self.lm.base_model, "norm", None)
            if norm_b is not None and norm_s is not None:
                norm_s.load_state_dict(norm_b.state_dict())


def build_ssm(head: dict, base) -> SSMDraft:
    """The SSM of a recipe's `head` section (type: ssm): loaded from head.ssm.name_or_path or built from the
    base's config class, checked against the base's vocabulary, initialised as head.ssm.init says."""
    from transformers import AutoModelForCausalLM

    from ..base import check_model_path, pretrained_lm, teacher_transform

    c = dict(head.get("ssm") or {})
    if c.get("name_or_path"):
        check_model_path(c["name_or_path"], "head.ssm.name_or_path")  # (a missing directory, not a "bad hub id")
        try:
            lm = pretrained_lm(c["name_or_path"], dtype=torch.float32,
                               trust_remote_code=c.get("trust_remote_code", False))
        except OSError as e:
            raise SSMError(f"head.ssm.name_or_path={c['name_or_path']!r}: cannot load a causal LM ({e})") from None
        check_vocab(lm, base, f"head.ssm.name_or_path={c['name_or_path']!r}")
        # Its config alone decided (a key its code does not read, or a transform draftlab does not know, went
        # unnoticed): one forward says which logits it drafts with.
        found, ok = closest_transform(lm, teacher_transform(lm.config, lm.get_output_embeddings()))
        if not ok:
            raise SSMError(f"head.ssm.name_or_path={c['name_or_path']!r}: the draft model's own logits are not its "
                           "lm_head's product, nor that product with the scale or soft cap its config names (checked "
                           "on one forward of 16 tokens), so draftlab would train it on other logits than it drafts "
                           "with: pick another draft model, or build one from the recipe (head.ssm)")
        init = "random" if c.get("init", "auto") == "auto" else c["init"]  # a pretrained SSM keeps its weights
    else:
        lm = AutoModelForCausalLM.from_config(_ssm_config(base.config, c), dtype=torch.float32)
        check_vocab(lm, base, "head.ssm")
        init = c.get("init", "auto")
    lm.requires_grad_(True).train()
    module = SSMDraft(lm, {"source": c.get("name_or_path") or "config", "init": init})
    if c.get("name_or_path"):
        module.logit_transform = found
    module.init_from_base(base, init)
    return module


# --- several SSMs as one model ----------------------------------------------------------------------

class GroupError(ValueError):
    """Small LMs that cannot run as one grouped model (different architectures or shapes, an unsupported layer)."""


class GroupedLinear(nn.Module):
    """M linear layers as one: rows [M * B', ..., in] (member-major) -> one batched matmul per call."""

    def __init__(self, layers: list[nn.Linear]):
        super().__init__()
        self.weight = nn.Parameter(torch.stack([l.weight.detach().transpose(0, 1) for l in layers]),
                                   requires_grad=False)  # [M, in, out]
        bias = [l.bias for l in layers]
        self.bias = None if bias[0] is None else nn.Parameter(torch.stack([b.detach() for b in bias])[:, None],
                                                             requires_grad=False)  # [M, 1, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        M = self.weight.shape[0]
        xs = x.reshape(M, -1, x.shape[-1])
        y = torch.bmm(xs, self.weight) if self.bias is None else torch.baddbmm(self.bias, xs, self.weight)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class GroupedEmbedding(nn.Module):
    """M embedding tables as one: row r of the ids reads member r // B' (member-major rows)."""

    def __init__(self, tables: list[nn.Embedding]):
        super().__init__()
        w = torch.stack([t.weight.detach() for t in tables])  # [M, V, H]
        self.M, self.V = w.shape[0], w.shape[1]
        self.weight = nn.Parameter(w.reshape(-1, w.shape[-1]), requires_grad=False)  # [M * V, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        member = torch.arange(ids.shape[0], device=ids.device) // (ids.shape[0] // self.M)
        return nn.functional.embedding(ids + (member * self.V).view(-1, *([1] * (ids.dim() - 1))), self.weight)


class GroupedParams(nn.Module):
    """M copies of a module whose parameters are vectors over the last dimension (RMS norms): the members' vectors
    stacked [M, 1, H] replace them in one copy of the module, which then runs on rows [M, B' * ..., H]."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        import copy

        self.inner = copy.deepcopy(modules[0])
        for name, p in list(modules[0].named_parameters(recurse=False)):
            delattr(self.inner, name)
            self.inner.register_buffer(name, torch.stack([getattr(m, name).detach() for m in modules])[:, None])
        self.M = len(modules)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.inner(x.reshape(self.M, -1, x.shape[-1]), *args, **kwargs)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def group_key(lm) -> tuple:
    """What small LMs must share to run as one grouped model: class, config (but where it was loaded from) and the
    shapes of their parameters."""
    cfg = {k: v for k, v in lm.config.to_dict().items() if k != "_name_or_path"}
    return (type(lm).__name__, json.dumps(cfg, sort_keys=True, default=str),
            tuple((n, tuple(p.shape)) for n, p in lm.named_parameters()))


_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # first member -> [(weak refs to all, group)]


@torch.no_grad()
def grouped_lm(lms: list) -> nn.Module:
    """One causal LM that runs M small LMs of one architecture and shape side by side: a batch of M * B rows,
    member-major (rows m * B .. m * B + B - 1 are member m's), each row through its own member's weights, one call
    per layer kind instead of M. Built from a copy of the first member whose linear layers, embeddings and norms
    hold all members' weights (batched matmuls); checked against the members' own logits once, so an architecture
    whose layers do not group raises GroupError instead of drafting wrongly. Made once per list of members."""
    import copy

    first = lms[0]
    for refs, group in _GROUPS.get(first, []):
        if len(refs) == len(lms) and all(r() is lm for r, lm in zip(refs, lms)):
            return group
    if len({group_key(lm) for lm in lms}) > 1:
        raise GroupError("the members differ in architecture or shape")
    group = copy.deepcopy(first).eval()
    named = [dict(lm.named_modules()) for lm in lms]
    for name, mod in list(group.named_modules()):
        own = list(mod.named_parameters(recurse=False))
        if not own:
            continue
        parts = [n[name] for n in named]
        if isinstance(mod, nn.Linear):
            new = GroupedLinear(parts)
        elif isinstance(mod, nn.Embedding):
            new = GroupedEmbedding(parts)
        elif all(p.dim() == 1 for _, p in own) and not any(True for _ in mod.children()):
            new = GroupedParams(parts)
        else:
            raise GroupError(f"layer {name} ({type(mod).__name__}) has no grouped form")
        parent, _, attr = name.rpartition(".")
        setattr(group.get_submodule(parent) if parent else group, attr, new)
    # The check: every member's logits on its own rows, within float rounding.
    V = first.get_output_embeddings().weight.shape[0]
    dev = next(first.parameters()).device
    ids = torch.randint(0, V, (len(lms), 6), generator=torch.Generator().manual_seed(0)).to(dev)
    try:
        got = group(input_ids=ids).logits.float()
    except Exception as e:  # noqa: BLE001 - any failure means the layers do not group
        raise GroupError(f"a grouped forward failed ({type(e).__name__}: {e})") from None
    ref = torch.cat([lm(input_ids=ids[m:m + 1]).logits.float() for m, lm in enumerate(lms)])
    err = ((got - ref).abs().max() / (ref.abs().max() + 1e-6)).item()
    tol = 1e-4 if next(first.parameters()).dtype in (torch.float32, torch.float64) else 3e-2
    if not err < tol:
        raise GroupError(f"grouped logits differ from the members' by {err:.3g}")
    from ..decode.cache import mark_tree_support

    mark_tree_support(group)  # each member passed the tree probe, and the group computes what they compute
    _GROUPS.setdefault(first, []).append(([weakref.ref(lm) for lm in lms], group))
    return group


# --- decoding -------------------------------------------------------------------------------------

class SSMDrafter(Drafter):
    """Drafts a static-shape tree with a small LM: at every node its top-k (greedy) or k i.i.d. samples from
    q = its warped distribution (sampling), as many as the tree gives that node children.

    Per step: one forward over the tokens committed since the last step (the root included), then one
    forward per tree depth over the nodes that have children. Leaves are never forwarded: an accepted
    leaf is fed with the next root. The tentative tree slots of the accepted path are kept in its KV
    cache and the rest dropped, as in the base.
    """

    kept_static = None  # the last static run's cache (begin)

    def __init__(self, lm, tree: Tree):
        self.lm = lm
        self.device = next(lm.parameters()).device
        check_tree_support(lm)
        self.cache_kw = cache_name(lm)  # (resolved here: _forward runs inside a compiled function)
        self.shapes: dict = {}
        self.feed_width = 2  # static path: tokens fed per step (see propose)
        self.set_tree(tree)
        self.target = None
        # Per row, when a list (an ensemble's text ranking sets it): the rank of the next token of the text under the
        # SSM's logits at every real position that begin and catch_up feed (see record_ranks); None: not recorded.
        self.ranks: list[list[int]] | None = None

    def set_tree(self, tree: Tree) -> None:
        """Draft this tree from the next step on (the KV cache is unaffected; an adaptive ensemble changes chain
        lengths between steps)."""
        if tree.depth == 0:
            raise ValueError("an SSM needs a tree of depth >= 1 (e.g. --tree chain or --tree expansion:2,1)")
        key = tree.paths
        if key not in self.shapes:
            self.shapes[key] = self._shape(tree)
        self.tree, shape = tree, self.shapes[key]
        self.shape = shape  # (a dict: a compiled call's signature does not walk it, see decode.compiled._held)
        self.buf, self.internal, self.slot, self.slot_of, self.levels, self.q_index = (
            shape["buf"], shape["internal"], shape["slot"], shape["slot_of"], shape["levels"], shape["q_index"])
        self.views: dict[int, TreeView] = shape["views"]

    def _shape(self, tree: Tree) -> dict:
        buf = tree.buffers(self.device)
        # Per depth d: the nodes with children (buf.levels[d]["parents"]); those below the root are forwarded at
        # depth d, attending to their ancestors among the nodes forwarded so far (in the cache's tentative tail).
        kids = buf.children
        internal = [n for n in range(1, tree.size) if kids[n]]  # forwarded tree nodes, in forward order
        depth = buf.depth.tolist()
        levels = []
        for d, lv in enumerate(buf.levels):
            fwd = [n for n in lv["parents"].tolist() if n > 0]
            upto = [n for n in internal if depth[n] <= d]
            levels.append({**lv, "k": int(lv["child_rank"].max()) + 1, "forward": fwd,
                           "allowed": buf.mask[fwd][:, upto] if fwd else None,  # [n_d, done + n_d]
                           "fwd_depth": buf.depth[fwd] - 1 if fwd else None})  # the root sits at next_pos - 1
        # Sampling: q rows are the root's distribution, then one per forwarded node (in forward order), and node
        # n was drawn from its parent's row.
        q_row = {n: i for i, n in enumerate([0] + internal)}
        parent = buf.parent.tolist()
        q_index = torch.tensor([-1] + [q_row[parent[n]] for n in range(1, tree.size)], device=self.device)
        slot = {n: i for i, n in enumerate(internal)}
        # The chained step's commit reads each node's tentative slot on the device (-1: the root and the leaves).
        slot_of = torch.tensor([slot.get(n, -1) for n in range(tree.size)], device=self.device)
        # The tree's paths as compiled calls are given them: a Fixed keeps its signature.
        return {"buf": buf, "internal": internal, "slot": slot, "slot_of": slot_of, "levels": levels,
                "q_index": q_index, "views": {}, "paths": Fixed(tree.paths)}

    @property
    def max_nodes(self) -> int:
        return self.tree.size

    def describe(self) -> dict:
        return {"kind": "ssm", "tree_size": self.tree.size, "tree_depth": self.tree.depth,
                "tree": self.tree.metadata.get("name", ""), "forwards_per_step": len(self.levels)}

    def begin(self, prompt: PromptState, sampling: Sampling, generator) -> None:
        self.sampling, self.generator = sampling, generator
        self.feed_width = 2  # a feed the last run widened would cost this run's every step, at other shapes
        # On the static path: room for the prompt and the run (prompt.room, at least 256 slots; rounded up to 256),
        # grown when needed (a run whose length it was not told).
        # The last static run's cache is emptied and reused, also after eager runs between (kept_static): a new one
        # per run would cost each run its allocation (and on a GPU its CUDA graphs' recording).
        self.target = slot_cache(self.lm, prompt.ids.shape[0], prompt.ids.shape[1] + max(256, prompt.room),
                                 self.decode_path, reuse=self.kept_static)
        if self.decode_path and self.decode_path.get("static"):
            self.kept_static = self.target
        # (its logits: for the statistics of a search, else none are read; the first draft runs from the root)
        out, _ = self.target.prefill(prompt.ids, prompt.valid, bucket=True, last=self.ranks is None)
        if self.ranks is not None:
            self.record_ranks(out.logits, prompt.ids, prompt.valid, None)
        B = prompt.ids.shape[0]
        self.pending = [[] for _ in range(B)]  # committed tokens not yet in the SSM's cache, per row
        self.live = [True] * B

    def _children(self, logits: torch.Tensor, k: int, dist: list) -> torch.Tensor:
        """[B, P, V] logits -> [B, P, k] children: top-k, or k i.i.d. samples from q (kept in dist)."""
        if self.sampling.temperature <= 0:
            return logits.topk(k, dim=-1).indices
        q = warp(logits, self.sampling)  # [B, P, V]
        dist.append(q)
        return draw(q, self._uniforms(q.shape[0], q.shape[1], k))

    def _level_uniforms(self, B: int) -> list | None:
        """A sampled tree's uniforms for one call of _draft (a list per level, in the eager loop's order), drawn from
        the drafter's generator before the call; None when the tree is top-k."""
        if self.sampling.temperature <= 0:
            return None
        return [self._uniforms(B, len(lv["parents"]), lv["k"]) for lv in self.levels]

    def _uniforms(self, B: int, P: int, k: int) -> torch.Tensor:
        """Uniforms for k draws from each of P distributions per row, from the drafter's own generator."""
        return uniforms(B, P, k, generator=self.generator, device=self.device)

    @torch.no_grad()
    def propose(self, root: torch.Tensor) -> Proposal:
        B, dev = root.shape[0], self.device
        # 1. Feed what was committed since the last step (an accepted leaf, tokens other drafters proposed: host lists),
        # then the root (on the device), left-padded: one host-to-device copy, no sync.
        if self.behind():  # a long backlog (a member an ensemble paused): fed in chunks first
            self.catch_up(self.feed_width - 1)
        P = 1 + max(len(p) for p in self.pending)
        if self._fused():
            # One feed width for every step (an accepted leaf + the root: 2), widened only when a step needs
            # more (an ensemble's other members' tokens): to that width up to 8 (a merged tree's steps need 3-5;
            # wider than needed costs every later step), past it to the widest (CATCH_UP + 1), so the compiled
            # forward sees a few shapes, not one per backlog length.
            self.feed_width = P = max(P if P <= 8 else CATCH_UP + 1, self.feed_width)
        pad = [P - 1 - len(p) for p in self.pending]
        head = torch.tensor([[0] * n + p for n, p in zip(pad, self.pending)], dtype=torch.long)
        # A finished row's tokens are fed as holes.
        okh = torch.tensor([[False] * n + [live] * (P - n) for n, live in zip(pad, self.live)], dtype=torch.bool)
        ids, okh = torch.cat([head.to(dev, non_blocking=True), root[:, None]], 1), okh.to(dev, non_blocking=True)
        tokens = torch.zeros(B, self.tree.size, dtype=torch.long, device=dev)
        tokens[:, 0] = root
        if self._fused():
            tokens, q = self._fused_call(ids, okh, tokens)
            prop = Proposal(tokens, self._view(B))
            if q is not None:
                prop.q, prop.q_index = q, self.q_index[None].expand(B, -1)
            return prop
        logits = self.target.append(ids, okh).logits[:, -1:]  # [B, 1, V] at the root
        self.start = self.target.length
        # 2. Depth by depth: the children of every depth-d node that has some, then forward those of them that
        # have children of their own. Logits of depth d's nodes are in level order (the root's for d = 0).
        dist: list = []
        for d, lv in enumerate(self.levels):
            if d > 0:
                out = self.target.forward(tokens[:, lv["forward"]], lv["allowed"][None].expand(B, -1, -1),
                                          lv["fwd_depth"][None].expand(B, -1))
                logits = out.logits  # [B, n_d, V]: every node with children at depth d > 0 is forwarded
            cand = self._children(logits, lv["k"], dist)  # [B, n_d, k]
            tokens[:, lv["children"]] = cand[:, lv["child_parent"], lv["child_rank"]]
        prop = Proposal(tokens, self._view(B))
        if dist:
            prop.q, prop.q_index = torch.cat(dist, dim=1), self.q_index[None].expand(B, -1)  # [B, 1 + internal, V]
        return prop

    def _view(self, B: int) -> TreeView:
        return static_view(self.views, self.buf, B)

    def _fused(self) -> bool:
        """On the static path the feed and the tree's levels run as one call (compiled: one graph) instead of one
        forward call each; sampled drafts take their uniforms from the generator before the call."""
        return bool((self.decode_path or {}).get("static"))

    def _fused_call(self, ids: torch.Tensor, ok: torch.Tensor, tokens: torch.Tensor):
        """The feed and the tree's levels in one call: the feed's and the internal nodes' slots reserved up front,
        masks built from the cache's committed slots and length (tensors), so the call's shapes are the same every
        step; the feed is committed, the nodes stay tentative (commit keeps the accepted ones). Returns the tree's
        tokens and, when sampling, q [B, 1 + internal, V]. Sampled children are drawn from uniforms taken from the
        generator level by level before the call, in the order and shapes the eager loop takes them, so both paths
        draw the same tokens."""
        cache, P = self.target, ids.shape[1]
        window = cache.reserve(P + len(self.internal))
        n = cache.cache.layers[0].cumulative_length.clone()  # committed slots (holes included) before the feed
        path = self.decode_path
        fn = compiled_method(self, "_draft", path["compile"]) if path.get("compile") else self._draft
        us = self._level_uniforms(ids.shape[0])
        tokens, q, cache.next_pos = fn(ids, ok, tokens, cache.slots, n, cache.next_pos, window, self.shape["paths"],
                                       us, self.sampling if us is not None else None)
        cache.commit_reserved(P)
        self.start = cache.length
        return tokens, q

    def _forward(self, ids, allowed, depth, slots, n, next_pos, window: int):
        """The SSM over ids [B, N] at positions next_pos + depth, writing the slots from n (a tensor) on: each sees
        the committed valid slots and the tentative ones allowed [B or 1, N, T] marks. Tensor operations only."""
        pos = next_pos[:, None] + depth
        mask = reserved_mask(allowed, slots, n, window, next(self.lm.parameters()).dtype, pos, self.target.spans)
        return self.lm(input_ids=ids, attention_mask=mask, position_ids=pos, **{self.cache_kw: self.target.cache},
                       use_cache=True).logits

    def _draft(self, ids, ok, tokens, slots, n, next_pos, window: int, paths, us=None, sampling=None):
        """The feed ids [B, P] (ok marks real tokens; left-padded), committed at slots n .. n + P, then the children
        of every level (the root's from the feed's last logits; top-k, or with `sampling` draws from q by the
        level's uniforms us[d]) and forwards of the nodes with children, written tentatively after the feed in
        forward order (the internal nodes). Tensor operations only: returns the tree's tokens, q (sampling) and the
        rows' next positions after the feed. window, paths (the tree, read through self.levels) and sampling are
        arguments so that the compiled call's signature holds them: a new tree or sampling compiles anew."""
        P = ids.shape[1]
        logits = self._forward(ids, causal_allowed(ok), (ok.long().cumsum(-1) - 1).clamp(min=0), slots, n, next_pos,
                               window)[:, -1:]
        mark_valid(slots, ok, n)  # the cache's valid slots now hold the feed's real tokens
        next_pos = next_pos + ok.sum(-1)
        n = n + P
        dist = []
        for d, lv in enumerate(self.levels):
            if d > 0:
                logits = self._forward(tokens[:, lv["forward"]], lv["allowed"][None], lv["fwd_depth"][None], slots, n,
                                       next_pos, window)
            if sampling is None:
                cand = logits.topk(lv["k"], dim=-1).indices  # [B, n_d, k]
            else:
                dist.append(warp(logits, sampling))
                cand = draw(dist[-1], us[d])
            tokens[:, lv["children"]] = cand[:, lv["child_parent"], lv["child_rank"]]
        return tokens, torch.cat(dist, dim=1) if dist else None, next_pos

    # --- the chained step (Drafter.chain): commit, feed and the next tree in the verifier's call -------------------
    def chain_args(self) -> tuple | None:
        """On the static path, with a feed of the usual width (an accepted leaf and the root) and room for this
        step's feed and tree whatever the verification keeps: the cache's state and the step's window (and the
        uniforms of a sampled tree, drawn now as the split path's propose would draw them). Else None: this step
        commits and proposes on its own (a cache that must be defragmented or grown first, a feed widened for other
        drafters' tokens)."""
        if not self._fused() or self.feed_width != 2:
            return None
        cache, I = self.target, len(self.internal)
        # The commit keeps at most I of the I tentative slots; the feed and the next tree follow the kept ones.
        if cache.n + cache.tentative + 2 + I > cache.max_len:
            return None
        window = cache.reserve(2 + I)  # the window for the longest keep (keeping fewer, they are written earlier)
        us = self._level_uniforms(cache.batch)
        # (the cache's state as one Fixed, and the paths as one: their signatures are kept, not walked each step)
        return (cache.device_state(), cache.slots, cache.next_pos, self.tree.depth, window, self.shape["paths"], us,
                self.sampling if us is not None else None)

    def chain(self, states, full, tokens, bonus, last, state, slots, next_pos, D: int, window: int, paths, us,
              sampling):
        """commit's and propose's device work, tensor operations only: the accepted path's tentative slots are kept
        (the internal nodes on it, a prefix of it below the root), then the feed (the last accepted node if it is a
        leaf, which was never forwarded, and the bonus token: the next root) and the next tree run as _draft.
        Liveness is the step's before its tokens were emitted: a row that ends in this step feeds its last tokens
        (the split path feeds holes); either way a row that ended is never read again."""
        keep, valid = full[0], full[1]
        kv, cumulative = state
        B = keep.shape[0]
        rows = torch.arange(B, device=keep.device)
        live = valid[:, 0]
        I = len(self.internal)
        if I:  # the path's internal nodes (at depths 1 .. D - 1: a node at the tree's depth has no children)
            slot = self.slot_of[keep[:, 1:D]]  # [B, D - 1]
            on = (torch.arange(1, D, device=keep.device)[None] <= last[:, None]) & (slot >= 0)
            pad = (0, I - (D - 1))
            n = cumulative[0] - I  # the tentative tree slots start here (the feed was committed before them)
            # The write pointer goes past the longest row's kept slots, every row counted (as commit's keep does).
            next_pos = move_kept(kv, cumulative, slots, n, nn.functional.pad(slot.clamp(min=0) * on, pad),
                                 nn.functional.pad(on & live[:, None], pad), n + on.sum(-1).max(), next_pos)
        node = keep[rows, last]
        leaf = (last > 0) & (self.slot_of[node] < 0)
        ids = torch.stack([tokens[rows, node] * leaf, bonus], 1)
        ok = torch.stack([leaf & live, live], 1)
        tree = torch.zeros_like(tokens)  # (the verified tree is this drafter's: its width is the tree's)
        tree[:, 0] = bonus
        return self._draft(ids, ok, tree, slots, cumulative[0].clone(), next_pos, window, paths, us, sampling)

    def chained(self, step: StepResult) -> Proposal:
        tokens, q, next_pos = step.drafted
        # The slots the chained commit kept, holes included: as many as the longest row's (see chain).
        m = max(sum(n in self.slot for n in path[1:]) for path in step.paths)
        self.target.kept(m + 2, next_pos, tentative=len(self.internal))  # the kept slots, the feed; the tree's
        self.start = self.target.length
        B = tokens.shape[0]
        self.pending, self.live = [[] for _ in range(B)], step.live_rows()
        prop = Proposal(tokens, self._view(B))
        if q is not None:
            prop.q, prop.q_index = q, self.q_index[None].expand(B, -1)
        return prop

    def behind(self) -> bool:
        """On the static path, a backlog longer than CATCH_UP tokens: fed in chunks (catch_up) before a step's feed."""
        return self._fused() and max(len(p) for p in self.pending) > CATCH_UP

    @torch.no_grad()
    def catch_up(self, keep: int = 1) -> None:
        """Feed all but the last `keep` pending tokens of every row now, CATCH_UP_WIDTH tokens per forward (left-padded
        with holes; on the static path always that width, one compiled shape), and feed keep + 1 tokens from the next
        step on. A member that followed the text for many steps (an ensemble's scheduler paused it) catches up in forwards
        of one shape instead of widening its feed for good, and drafting alone again it chains (feed width 2)."""
        static = self._fused()
        if static:
            self.feed_width = keep + 1
        while max(len(p) for p in self.pending) > keep:
            chunk = [p[: max(0, min(CATCH_UP_WIDTH, len(p) - keep))] for p in self.pending]
            self.pending = [p[len(c):] for p, c in zip(self.pending, chunk)]
            W = CATCH_UP_WIDTH if static else max(len(c) for c in chunk)
            ids = torch.tensor([[0] * (W - len(c)) + c for c in chunk], dtype=torch.long)
            ok = torch.tensor([[False] * (W - len(c)) + [True] * len(c) for c in chunk], dtype=torch.bool)
            out = self.target.append(ids.to(self.device, non_blocking=True), ok.to(self.device, non_blocking=True))
            if self.ranks is not None:
                self.record_ranks(out.logits, ids, ok, [p[0] if p else -1 for p in self.pending])

    def record_ranks(self, logits: torch.Tensor, ids: torch.Tensor, ok: torch.Tensor, after: list[int] | None) -> None:
        """Append to self.ranks, per row, the rank under logits [B, W, V] at each real position of ids [B, W] (rows
        left-padded, ok marks real tokens) of the token that follows it in the text: the row's next id, and past its
        last one after[b] (-1 or None: not known, recorded as -1). Rank r: r tokens have a higher logit (0: top-1).
        Under greedy these are what the SSM's tree would hold there: an ensemble's text ranking (EnsembleDrafter)."""
        B, dev = ids.shape[0], logits.device
        last = torch.tensor(after if after is not None else [-1] * B, dtype=torch.long, device=ids.device)
        nxt = torch.cat([ids[:, 1:], last[:, None]], 1).to(dev)
        rank = rank_of(logits, nxt.clamp(min=0)).masked_fill(nxt < 0, -1)
        for row, r, v in zip(self.ranks, rank.tolist(), ok.tolist()):
            row += [x for x, real in zip(r, v) if real]

    def follow(self, committed: list[list[int]]) -> None:
        for b, toks in enumerate(committed):
            if self.live[b]:
                self.pending[b] += toks  # in place: a paused member's backlog is not copied every step

    @torch.no_grad()
    def commit(self, step: StepResult) -> None:
        # Tentative slots hold the forwarded tree nodes; keep those on the accepted path (all of it but a
        # leaf at its end), in order. The root was committed when it was fed. The paths and the rows' liveness
        # are the decoder's host copies; the slots to keep go to the device in one copy.
        live, toks = step.live_rows(), step.path_tokens()
        kept, self.pending = [], []
        for b, path in enumerate(step.paths):
            nodes = path[1:]
            kept.append([self.slot[n] for n in nodes if n in self.slot])
            leaf = toks[b][-1:] if nodes and nodes[-1] not in self.slot else []
            extra = step.extra[b] if step.extra is not None else []
            self.pending.append(leaf + extra if live[b] else [])
        self.live = live
        M = max((len(k) for k in kept), default=0)
        keep = torch.tensor([k + [0] * (M - len(k)) for k in kept], dtype=torch.long)
        keep_valid = torch.tensor([[live[b]] * len(k) + [False] * (M - len(k)) for b, k in enumerate(kept)],
                                  dtype=torch.bool)
        self.target.keep(self.start, keep.to(self.device, non_blocking=True),
                         keep_valid.to(self.device, non_blocking=True),
                         in_place=all(k == list(range(len(k))) for k in kept))

