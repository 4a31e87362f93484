"""Heads as a drafter: Medusa / Hydra / Hydra++ heads fill a static tree from the base's own hidden state."""

from __future__ import annotations

import torch

from ...decode.cache import causal_allowed, mark_valid, reserved_mask
from ...decode.compiled import compiled_method
from ...decode.tree import Tree, TreeView
from ..base import Drafter, PromptState, Proposal, StepResult, gather_kept, rank_tree_tokens, static_view


class HeadsDrafter(Drafter):
    """Fills a static rank-path tree with the heads' top-k candidates (deterministic drafts, q = None).

    Medusa heads all read h_t, so every depth comes from one call; Hydra heads run depth by depth, each
    conditioned on its node's own root path. The state they read is the base's final hidden state at the
    last committed token, passed through the Hydra++ prefix layer (with its own KV cache, slot-aligned
    with the base's) when the heads have one.
    """

    hidden_layers = (-1,)
    kept_static = None  # the last static run's prefix-layer cache (_begin)

    def __init__(self, heads, tree: Tree):
        num_heads = getattr(heads, "num_heads", 0)
        if tree.depth > num_heads:
            raise ValueError(f"the tree is {tree.depth} deep but the draft module has {num_heads} heads; "
                             f"use a tree of depth <= {num_heads} (e.g. --tree chain) or more heads")
        self.heads, self.tree = heads, tree
        self.device = next(heads.parameters()).device
        self.dtype = next(heads.parameters()).dtype
        self.buf = tree.buffers(self.device)
        self.topk = tree.topk_per_depth()
        self.fill = self._fill_medusa if heads.kind == "medusa" else self._fill_hydra
        self.prefix = getattr(heads, "prefix_layer", None) is not None
        self.views: dict[int, TreeView] = {}
        self.hidden = self.cache = self.static = self.pending = None

    @property
    def max_nodes(self) -> int:
        return self.tree.size

    def describe(self) -> dict:
        return {"kind": self.heads.kind + ("++" if self.prefix else ""), "tree_size": self.tree.size,
                "tree_depth": self.tree.depth, "tree": self.tree.metadata.get("name", "")}

    # --- state -------------------------------------------------------------------------------------
    def begin(self, prompt: PromptState, sampling, generator) -> None:
        self._begin(prompt)
        # The state after the prompt is a view into the prompt's states; its own standard strides keep the compiled
        # fill from recompiling for every prompt length.
        self.hidden = self.hidden.clone(memory_format=torch.contiguous_format)

    def _begin(self, prompt: PromptState) -> None:
        hidden = prompt.hidden[-1]  # [B, L, H]
        # (the eager path's cache and slots too: tensors a drafter holds are part of its compiled calls' signature,
        # so an eager run's, left behind, would make the next static run's calls a new signature for every prompt)
        self.static = self.pending = self.cache = self.valid = None
        if not self.prefix:
            self.hidden = hidden[:, -1]
            return
        if self.decode_path and self.decode_path.get("static"):
            # The prefix layer on its own static cache, every commit fed at one width (the tree's depth + 1), so
            # its forward has one shape (compiled when the decoder compiles).
            from ...decode.cache import slot_cache
            from .hydra import PrefixModel

            if getattr(self, "_prefix_model", None) is None:
                self._prefix_model = PrefixModel(self.heads)
            B, L = prompt.valid.shape
            # the last static run's cache, emptied and reused (also after eager runs between: kept_static)
            self.static = self.kept_static = slot_cache(self._prefix_model, B, L + max(256, prompt.room),
                                                        self.decode_path, reuse=self.kept_static)
            self.hidden = self.static.prefill(hidden, prompt.valid, bucket=True)[0].last_hidden_state[:, -1]
            return
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.valid = prompt.valid.bool()  # the prefix layer's own cache slots: the base's committed text
        self.hidden = self.heads.prefix(hidden, causal_allowed(prompt.valid), prompt.positions, self.cache)[:, -1]

    def commit(self, step: StepResult) -> None:
        if self.static is not None:  # the prefix layer runs at the next proposal, in its call (see _commit_fill)
            states, keep, ok, _ = step.fixed(self.tree.depth + 1, self.hidden_layers)
            self.pending = (states, keep, ok, step.last)
            return
        hidden = step.hidden[-1]  # [B, M, H] base states of the kept nodes
        B, M, H = hidden.shape
        rows = torch.arange(B, device=hidden.device)
        if self.prefix:
            vb = self.valid
            allowed = torch.cat([vb[:, None, :].expand(B, M, vb.shape[1]), causal_allowed(step.keep_valid)], dim=2)
            hidden = self.heads.prefix(hidden, allowed, step.positions, self.cache)
            self.valid = torch.cat([vb, step.keep_valid], dim=1)
        self.hidden = hidden[rows, step.last]

    # --- proposals ---------------------------------------------------------------------------------
    def propose(self, root: torch.Tensor) -> Proposal:
        view = static_view(self.views, self.buf, root.shape[0])
        fill = self.fill
        backend = (self.decode_path or {}).get("compile")
        if self.pending is not None:
            return Proposal(self._commit_and_fill(root, backend), view)
        if backend:  # the whole fill (every head, every depth) as one graph of fixed shapes
            fill = compiled_method(self, "fill", backend)
        return Proposal(fill(root, self.hidden), view)

    def _commit_and_fill(self, root: torch.Tensor, backend: str | None) -> torch.Tensor:
        """Hydra++ on the static path: the last commit's prefix-layer forward and the fill as one call (compiled:
        one graph), its slots reserved up front and its masks built from the cache's committed slots and length
        (tensors), so every step has one shape."""
        states, keep, valid, last = self.pending
        self.pending = None
        cache = self.static
        window = cache.reserve(valid.shape[1])
        n = cache.cache.layers[0].cumulative_length.clone()  # committed slots (holes included) before these
        fn = compiled_method(self, "_commit_fill", backend) if backend else self._commit_fill
        tokens, self.hidden, cache.next_pos = fn(root, states, keep, valid, last, cache.slots, n, cache.next_pos,
                                                 window)
        cache.commit_reserved(valid.shape[1])
        return tokens

    def _commit_fill(self, root, states, keep, valid, last, slots, n, next_pos, window: int):
        """The prefix layer over the committed states (the base's states at every tree node, gathered at keep
        [B, W]; valid [B, W] marks real ones, the rest become holes) at slots n .. n + W, then the fill from its
        output at each row's last kept node. Tensor operations only: returns the tree's tokens, the heads' new state
        and the rows' next positions."""
        states = gather_kept(states, keep)[:, :, 0]  # [B, W, H]
        # The mask in the prefix layer's dtype (its attention takes a mask of its own dtype).
        mask = reserved_mask(causal_allowed(valid), slots, n, window, self.static.dtype)
        pos = next_pos[:, None] + (valid.long().cumsum(-1) - 1).clamp(min=0)
        h = self._prefix_model(inputs_embeds=states, attention_mask=mask, position_ids=pos,
                               cache=self.static.cache, use_cache=True).last_hidden_state
        mark_valid(slots, valid, n)
        hidden = h[torch.arange(h.shape[0], device=h.device), last]
        return self.fill(root, hidden), hidden, next_pos + valid.sum(-1)

    # --- the chained step (Drafter.chain): the commit and the fill in the verifier's call ---------------------------
    def chain_args(self) -> tuple | None:
        if not (self.decode_path or {}).get("static"):
            return None
        W = self.tree.depth + 1  # a number for the call (Tree.depth is host code, which dynamo does not trace)
        if self.static is None:  # no prefix layer: the fill reads the base's state at the last accepted node
            return (W,)
        cache = self.static
        window = cache.reserve(W)
        return W, cache.slots, cache.cache.layers[0].cumulative_length.clone(), cache.next_pos, window

    def chain(self, states, full, tokens, bonus, last, W: int, *args):
        keep, valid = [t[:, :W] for t in full[:2]]
        if not args:
            rows = torch.arange(keep.shape[0], device=keep.device)
            hidden = states[0][rows, keep[rows, last]]
            return self.fill(bonus, hidden), hidden
        return self._commit_fill(bonus, states, keep, valid, last, *args)

    def chained(self, step: StepResult) -> Proposal:
        tokens, self.hidden = step.drafted[:2]
        if self.static is not None:
            self.static.next_pos = step.drafted[2]
            self.static.commit_reserved(self.tree.depth + 1)
        return Proposal(tokens, static_view(self.views, self.buf, tokens.shape[0]))

    def _fill_medusa(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # Every Medusa head reads the same h_t, so all depths come from one call: [B, K, V].
        return rank_tree_tokens(root, self.heads.logits(hidden.to(self.dtype)), self.buf, self.topk)

    def _fill_hydra(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # Depth by depth: head d runs once over every depth-d node that has children, each conditioned on
        # its own root path, and its top-k fills that node's children by rank.
        B, N = root.shape[0], self.buf.depth.numel()
        tokens = torch.zeros(B, N, dtype=torch.long, device=root.device)
        tokens[:, 0] = root
        for d, lv in enumerate(self.buf.levels):
            P = lv["parents"].numel()
            if P == 0:
                continue
            path_tokens = tokens[:, lv["paths"]]  # [B, P, d+1]
            h = hidden[:, None, :].expand(B, P, hidden.shape[-1])
            logits = self.heads.head_logits(d, h, path_tokens)  # [B, P, V]
            cand = logits.topk(self.topk[d], dim=-1).indices  # [B, P, k_d]
            tokens[:, lv["children"]] = cand[:, lv["child_parent"], lv["child_rank"]]
        return tokens
