"""Tree speculative decoding on stock Hugging Face causal LMs, with any drafter.

One step:  propose (the drafter's tree) -> verify (ONE base forward over the tree tokens, 4D mask from
the step's parents, explicit positions, KV cache) -> accept (greedy / lossless sampling / typical) ->
keep only the accepted path in the KV cache -> emit accepted tokens + the base's bonus token -> the
drafter follows the accepted path.

Batches: each row keeps its own set of valid cache slots. Rows accept different numbers of tokens
(and may get trees of different shapes); the cache grows by the longest, and shorter rows leave
masked-out holes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..drafters.base import Drafter, PromptState, StepResult
from .acceptance import Sampling, accept_greedy, accept_sampling, accept_typical, typical_sample, warp
from .cache import SlotCache, UnsupportedBaseError, cache_layers, check_tree_support, compact_cache  # noqa: F401


@dataclass
class Result:
    """Generated token ids per row and what it cost."""

    tokens: list[list[int]]
    steps: int = 0  # base forwards after prefill (verification steps)
    committed: list[int] = field(default_factory=list)  # tokens committed per step (summed over live rows)
    rows_per_step: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)  # tokens verified per row per step (padding included)
    # Per phase: the drafter's proposal, the base's verification forward, acceptance (rule, KV-cache keep,
    # emitting tokens), and the drafter following the accepted path (its own cache, Hydra++'s prefix layer).
    time_s: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "accept": 0.0,
                                                  "commit": 0.0})

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


def _layers(out, layers) -> dict:
    return {l: out.hidden_states[l] for l in layers}


class SpeculativeDecoder:
    """Greedy, sampling and typical-acceptance decoding of a base with a drafter."""

    def __init__(self, base, drafter: Drafter, check_base: bool = True):
        if not isinstance(drafter, Drafter):
            raise TypeError(f"expected a Drafter, got {type(drafter).__name__}; wrap draft modules with "
                            "draftlab.drafters.make_drafter(module, tree)")
        self.base, self.drafter = base, drafter
        self.device = next(base.parameters()).device
        if check_base:
            check_tree_support(base)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: Sampling | None = None,
                 eos_token_id: int | list[int] | None = None, stop=None, on_tokens=None,
                 generator: torch.Generator | None = None) -> Result:
        """Decode a batch of prompt id lists. stop(row, tokens) -> cut index or None ends a row early;
        on_tokens(row, new_tokens) is called as tokens are committed (streaming)."""
        sampling = sampling or Sampling()
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        B = len(prompts)
        res = Result(tokens=[[] for _ in range(B)])
        dev, drafter = self.device, self.drafter
        layers = drafter.hidden_layers

        # Prefill: left-padded batch; each row's positions count its own tokens only.
        t0 = time.perf_counter()
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token (e.g. BOS)")
        L = max(len(p) for p in prompts)
        ids = torch.zeros(B, L, dtype=torch.long, device=dev)
        valid = torch.zeros(B, L, dtype=torch.bool, device=dev)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p, device=dev)
            valid[b, L - len(p):] = True
        target = SlotCache(self.base)
        out, pos = target.prefill(ids, valid, hidden=bool(layers))
        root = self._pick_root(out.logits[:, -1], sampling, generator)  # [B]
        drafter.begin(PromptState(ids, valid, pos, _layers(out, layers)), sampling, generator)
        sync_device(dev)
        res.time_s["prefill"] += time.perf_counter() - t0

        live = torch.ones(B, dtype=torch.bool, device=dev)
        for b in range(B):
            self._emit(res, b, [int(root[b])], live, max_new_tokens, eos, stop, on_tokens)
        while bool(live.any()):
            t1 = time.perf_counter()
            prop = drafter.propose(root)
            tokens, view = prop.tokens, prop.view  # [B, N]
            sync_device(dev)
            t2 = time.perf_counter()
            start, valid_before = target.length, target.valid
            out = target.forward(tokens, view.ancestors, view.depth, hidden=bool(layers))
            sync_device(dev)
            t3 = time.perf_counter()
            if sampling.typical:
                paths, bonus = accept_typical(tokens, out.logits, view, sampling, generator)
            elif sampling.temperature > 0:
                paths, bonus = accept_sampling(tokens, out.logits, view, sampling, generator, prop.q, prop.q_index)
            else:
                paths, bonus = accept_greedy(tokens, out.logits, view)
            # paths: per row, accepted node indices starting with 0 (the root, now committed to the cache).
            M = max(len(p) for p in paths)
            rows = [p + [0] * (M - len(p)) for p in paths]
            live_rows = live.tolist()
            keep = torch.tensor(rows, dtype=torch.long, device=dev)  # [B, M]
            keep_valid = torch.tensor([[lv] * len(p) + [False] * (M - len(p)) for p, lv in zip(paths, live_rows)],
                                      dtype=torch.bool, device=dev)
            kept_pos = target.next_pos[:, None] + torch.arange(M, device=dev)[None]
            # Paths that are prefixes of the node order (chains, root-only accepts) are already in place.
            target.keep(start, keep, keep_valid, in_place=all(p == list(range(len(p))) for p in paths))
            res.steps += 1
            res.rows_per_step.append(sum(live_rows))
            res.tree_sizes.append(tokens.shape[1])
            committed = 0
            host_tokens, host_bonus = tokens.tolist(), bonus.tolist()  # one device-to-host copy per step
            for b in range(B):
                if live_rows[b]:
                    new = [host_tokens[b][n] for n in paths[b][1:]] + [host_bonus[b]]
                    # Only what is emitted counts: accepted tokens past EOS or max_new_tokens are not committed.
                    committed += self._emit(res, b, new, live, max_new_tokens, eos, stop, on_tokens)
            res.committed.append(committed)
            sync_device(dev)
            t4 = time.perf_counter()
            if bool(live.any()):
                hidden = {l: h.gather(1, keep[:, :, None].expand(B, M, h.shape[-1]))  # [B, M, H]
                          for l, h in _layers(out, layers).items()}
                last = torch.tensor([len(p) - 1 for p in paths], device=dev)
                drafter.commit(StepResult(tokens, paths, keep, keep_valid, last, kept_pos, valid_before, bonus,
                                          live.clone(), hidden, time_s={"draft": t2 - t1, "verify": t3 - t2,
                                                                        "accept": t4 - t3}))
            root = bonus
            sync_device(dev)
            res.time_s["draft"] += t2 - t1
            res.time_s["verify"] += t3 - t2
            res.time_s["accept"] += t4 - t3
            res.time_s["commit"] += time.perf_counter() - t4
        return res

    def _pick_root(self, logits: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
        if sampling.temperature <= 0:
            return logits.argmax(-1)
        if sampling.typical:  # Medusa samples every token it emits from the typical-truncated distribution
            return typical_sample(logits, sampling, generator)
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
