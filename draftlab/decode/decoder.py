"""Tree speculative decoding on stock Hugging Face causal LMs.

One step:  propose (draft fills the tree) -> verify (ONE base forward over the tree tokens, 4D mask,
explicit positions, KV cache) -> accept (greedy / lossless sampling / typical) -> keep only the
accepted path in the KV cache -> emit accepted tokens + the base's bonus token.

Batches: each row keeps its own set of valid cache slots. Rows accept different numbers of
tokens; the cache grows by the longest, and shorter rows leave masked-out holes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .acceptance import Sampling, accept_greedy, accept_sampling, accept_typical, warp
from .draft import DraftState
from .tree import Tree, TreeBuffers


class UnsupportedBaseError(ValueError):
    """The base architecture cannot run tree verification (4D masks / croppable KV cache)."""


@dataclass
class Result:
    """Generated token ids per row and what it cost."""

    tokens: list[list[int]]
    steps: int = 0  # base forwards after prefill (verification steps)
    committed: list[int] = field(default_factory=list)  # tokens committed per step (summed over live rows)
    rows_per_step: list[int] = field(default_factory=list)
    time_s: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "accept": 0.0})

    @property
    def accept_length(self) -> float:
        """Mean tokens committed per base forward per row, bonus token included."""
        rows = sum(self.rows_per_step)
        return sum(self.committed) / rows if rows else 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def sync_device(device) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def cache_layers(cache):
    """(keys, values) tensors of each layer of a DynamicCache, as a list of layer objects."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(l, "keys") for l in layers):
        raise UnsupportedBaseError("the KV cache of this base is not a per-layer key/value cache "
                                   "(DynamicCache); tree verification needs one")
    return layers


def compact_cache(cache, start: int, keep: torch.Tensor) -> None:
    """Move slots start+keep[b] to start.. for each row b, then crop to start + keep.shape[1]. keep [B, M]."""
    m = keep.shape[1]
    for layer in cache_layers(cache):
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [B, kv_heads, L, d]
            idx = (start + keep)[:, None, :, None].expand(t.shape[0], t.shape[1], m, t.shape[3])
            # Gather first (the source and destination slots overlap), write in place, crop as a view:
            # no copy of the committed prefix.
            t[:, :, start:start + m] = t.gather(2, idx)
            setattr(layer, name, t[:, :, :start + m])


class SpeculativeDecoder:
    """Greedy, sampling and typical-acceptance decoding of a base with a draft module over a static tree."""

    def __init__(self, base, draft, tree: Tree, check_base: bool = True):
        self.base, self.draft, self.tree = base, draft, tree
        self.device = next(base.parameters()).device
        num_heads = getattr(draft, "num_heads", 0)
        if tree.depth > num_heads:
            raise ValueError(f"the tree is {tree.depth} deep but the draft module has {num_heads} heads; "
                             f"use a tree of depth <= {num_heads} (e.g. --tree chain) or more heads")
        self.buf: TreeBuffers = tree.buffers(self.device)
        self.topk = tree.topk_per_depth()
        if check_base:
            check_tree_support(base)

    # --- the three parts of a step ------------------------------------------------------------
    @torch.no_grad()
    def propose(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Tree tokens [B, N]: node 0 = root, node (.., r) at depth d = the draft's rank-r token for depth d."""
        from .draft import fill_tree

        return fill_tree(self.draft, self.base, self.buf, self.topk, root, hidden)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, valid: torch.Tensor, next_pos: torch.Tensor, cache):
        """ONE base forward over all tree tokens. Returns logits [B, N, V] and final hidden states [B, N, H]."""
        B, N = tokens.shape
        dtype = next(self.base.parameters()).dtype
        allowed = torch.cat([valid[:, None, :].expand(B, N, valid.shape[1]),
                             self.buf.mask[None].expand(B, N, N)], dim=2)  # [B, N, L+N]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        pos = next_pos[:, None] + self.buf.depth[None, :]  # [B, N]
        out = self.base(input_ids=tokens, attention_mask=mask[:, None], position_ids=pos, past_key_values=cache,
                        use_cache=True, output_hidden_states=True)
        return out.logits, out.hidden_states[-1]

    # --- the loop -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: Sampling | None = None,
                 eos_token_id: int | list[int] | None = None, stop=None, on_tokens=None,
                 generator: torch.Generator | None = None) -> Result:
        """Decode a batch of prompt id lists. stop(row, tokens) -> cut index or None ends a row early;
        on_tokens(row, new_tokens) is called as tokens are committed (streaming)."""
        from transformers import DynamicCache

        sampling = sampling or Sampling()
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        B = len(prompts)
        res = Result(tokens=[[] for _ in range(B)])
        dev = self.device

        # Prefill: left-padded batch; each row's positions count its own tokens only.
        t0 = time.perf_counter()
        L = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token (e.g. BOS)")
        ids = torch.zeros(B, L, dtype=torch.long, device=dev)
        valid = torch.zeros(B, L, dtype=torch.bool, device=dev)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p, device=dev)
            valid[b, L - len(p):] = True
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.base.config)
        out = self.base(input_ids=ids, attention_mask=valid.long(), position_ids=pos, past_key_values=cache,
                        use_cache=True, output_hidden_states=True)
        next_pos = valid.sum(-1)  # [B]
        root = self._pick_root(out.logits[:, -1], sampling, generator)  # [B]
        state = DraftState(self.draft)
        hidden = state.start(out.hidden_states[-1], valid, pos)  # [B, H]
        sync_device(dev)
        res.time_s["prefill"] += time.perf_counter() - t0

        live = torch.ones(B, dtype=torch.bool, device=dev)
        for b in range(B):
            self._emit(res, b, [int(root[b])], live, max_new_tokens, eos, stop, on_tokens)
        while bool(live.any()):
            t1 = time.perf_counter()
            tokens = self.propose(root, hidden)  # [B, N]
            sync_device(dev)
            t2 = time.perf_counter()
            start = cache.get_seq_length()
            logits, tree_hidden = self.verify(tokens, valid, next_pos, cache)
            sync_device(dev)
            t3 = time.perf_counter()
            if sampling.typical:
                paths, bonus = accept_typical(tokens, logits, self.buf, sampling, generator)
            elif sampling.temperature > 0:
                paths, bonus = accept_sampling(tokens, logits, self.buf, sampling, generator)
            else:
                paths, bonus = accept_greedy(tokens, logits, self.buf)
            # paths: per row, accepted node indices starting with 0 (the root, now committed to the cache).
            M = max(len(p) for p in paths)
            keep = torch.zeros(B, M, dtype=torch.long, device=dev)
            keep_valid = torch.zeros(B, M, dtype=torch.bool, device=dev)
            for b, p in enumerate(paths):
                keep[b, : len(p)] = torch.tensor(p, device=dev)
                keep_valid[b, : len(p)] = bool(live[b])
            compact_cache(cache, start, keep)
            last = torch.tensor([len(p) - 1 for p in paths], device=dev)  # [B] index into keep
            kept_hidden = tree_hidden.gather(1, keep[:, :, None].expand(B, M, tree_hidden.shape[-1]))  # [B, M, H]
            kept_pos = next_pos[:, None] + torch.arange(M, device=dev)[None]
            hidden = state.advance(kept_hidden, valid, keep_valid, kept_pos, last)
            valid = torch.cat([valid, keep_valid], dim=1)
            next_pos = next_pos + keep_valid.sum(-1)
            root = bonus
            res.steps += 1
            n_live = int(live.sum())
            res.rows_per_step.append(n_live)
            committed = 0
            for b in range(B):
                if not live[b]:
                    continue
                new = [int(tokens[b, n]) for n in paths[b][1:]] + [int(bonus[b])]
                # Only what is emitted counts: accepted tokens past EOS or max_new_tokens are not committed.
                committed += self._emit(res, b, new, live, max_new_tokens, eos, stop, on_tokens)
            res.committed.append(committed)
            sync_device(dev)
            t4 = time.perf_counter()
            res.time_s["draft"] += t2 - t1
            res.time_s["verify"] += t3 - t2
            res.time_s["accept"] += t4 - t3
        return res

    def _pick_root(self, logits: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
        if sampling.temperature <= 0:
            return logits.argmax(-1)
        probs = warp(logits, sampling)
        return torch.multinomial(probs.float(), 1, generator=generator)[:, 0]

    @staticmethod
    def _emit(res: Result, b: int, new: list[int], live, max_new: int, eos: set, stop, on_tokens) -> int:
        """Append committed tokens to row b, ending the row at EOS, max_new_tokens or a stop match;
        returns how many tokens row b gained."""
        out = res.tokens[b]
        before = len(out)
        new = new[: max_new - before]
        for i, t in enumerate(new):
            if t in eos:
                new = new[: i + 1]
                live[b] = False
                break
        out.extend(new)
        if stop is not None:
            cut = stop(b, out)
            if cut is not None:
                del out[max(cut, 0):]
                live[b] = False
        if len(out) >= max_new:
            live[b] = False
        if on_tokens is not None and len(out) > before:
            on_tokens(b, out[before:])
        return max(len(out) - before, 0)


_CHECKED: dict[int, bool] = {}


@torch.no_grad()
def check_tree_support(base) -> None:
    """Probe once per model that a 4D tree mask and cache compaction give the same logits as plain decoding."""
    from transformers import DynamicCache

    if _CHECKED.get(id(base)):
        return
    dev = next(base.parameters()).device
    dtype = next(base.parameters()).dtype
    arch = type(base).__name__
    V = base.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (1, 4), generator=g).to(dev)
    sib = torch.randint(0, V, (1, 2), generator=g).to(dev)
    try:
        ref = base(input_ids=torch.cat([ids, sib[:, 1:]], 1)).logits[0, -1].float()
        cache = DynamicCache(config=base.config)
        base(input_ids=ids, past_key_values=cache, use_cache=True)
        # Two siblings at the same position: the second must not see the first.
        mask = torch.zeros(1, 1, 2, 6, dtype=dtype, device=dev)
        mask[0, 0, 1, 4] = torch.finfo(dtype).min
        got = base(input_ids=sib, attention_mask=mask, position_ids=torch.tensor([[4, 4]], device=dev),
                   past_key_values=cache, use_cache=True).logits[0, 1].float()
        cache_layers(cache)
    except UnsupportedBaseError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here means the architecture cannot take the tree
        raise UnsupportedBaseError(f"{arch} cannot run tree verification: a forward with a 4D attention mask "
                                   f"and explicit position ids failed ({type(e).__name__}: {e}). Use a "
                                   "Llama-family base, or attn_implementation='eager'/'sdpa'.") from None
    tol = 1e-3 if dtype == torch.float32 or dtype == torch.float64 else 5e-2
    err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
    if not err < tol:
        raise UnsupportedBaseError(f"{arch} ignores custom 4D attention masks (tree logits differ from plain "
                                   f"decoding by {err:.3g}); its attention implementation "
                                   f"({base.config._attn_implementation!r}) may build its own mask. Try "
                                   "attn_implementation='eager' or 'sdpa'.")
    _CHECKED[id(base)] = True
