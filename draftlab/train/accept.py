"""Accept length while training: what an evaluation says the export would decode at, and the best draft so far.

At every evaluation, on the first `train.accept_prompts` held-out examples (their prompt part, as boost-tuning's
tau takes them):
1. the base's greedy continuation of each prompt (`train.accept_max_new_tokens` tokens, cut after EOS): the text
   greedy decoding will walk. The base is frozen, so it is computed once per run; Medusa-2's adapter changes the
   base, so there it is recomputed from the adapted base at every evaluation;
2. the draft's rank vectors along those texts (the kind's `ranks`, as `search-tree` collects them): at each state
   greedy decoding verifies from, the rank of the true token at each depth, conditioned on the true path;
3. greedy decoding replayed on them (decode.search.replay_accept_length) along the kind's default tree (what
   the export decodes with, unless train.grow_tree gives a heads export its own) -> `expected_accept_length`, and
   along a chain as deep as the draft drafts -> `expected_accept_length_chain`. On the same texts this is the
   decoder's own accept length, exactly, for static trees and chains (tests/test_search.py shows it per kind;
   tests/test_train_accept.py on a trained export).
Every `train.measure_accept_every` evaluations the same prompts are also decoded (SpeculativeDecoder, greedy,
the kind's drafter with its default tree over the current draft) -> `measured_accept_length`. EAGLE-3's default
trees are dynamic (rebuilt every step from off-path nodes' scores too), which no replay of on-path ranks gives:
its chain is replayed (a top-1 dynamic tree as deep as its training-time test), and its default tree is measured
at every evaluation.

Processes: the prompts are cut across ranks (prompts[rank::world]) and the figures summed over all of them, so
every rank ends with the same numbers. A sharded (FSDP) base's forward is a collective: every rank runs as many
base forwards as the others (continuations run a fixed number of steps; a rank out of prompts runs stand-ins).
"""

from __future__ import annotations

import time

import torch

from ..base import stop_token_ids
from ..data import prompt_length
from ..decode.cache import cache_arg
from ..decode.search import replay_counts
from ..decode.tree import Tree
from ..drafters import kind_of, make_drafter, text_ranks

def accept_prompts(eval_ex: list[dict], n: int) -> list[list[int]]:
    """The prompt parts of the first n held-out examples."""
    return [ex["input_ids"][: prompt_length(ex)] for ex in eval_ex[:n]]


@torch.no_grad()
def greedy_continuation(base, prompt: list[int], max_new_tokens: int, eos: set) -> list[int]:
    """prompt + the base's greedy continuation (max_new_tokens tokens, cut after the first EOS). Always runs
    max_new_tokens forwards, so that ranks of a sharded base run as many collectives as each other."""
    from transformers import DynamicCache

    dev = base.get_output_embeddings().weight.device
    cache = DynamicCache(config=base.config)
    out = base(input_ids=torch.tensor([prompt], device=dev), **cache_arg(base, cache), use_cache=True,
               logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1)  # [1]
    new = [int(tok)]
    for _ in range(max_new_tokens - 1):
        out = base(input_ids=tok[:, None], **cache_arg(base, cache), use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1)
        new.append(int(tok))
    cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return prompt + new[:cut]


def rank_depth(draft) -> int:
    """How deep the draft drafts: the depth of its default chain (SSM, block drafters), else one level per head."""
    tree = kind_of(draft.kind).default_tree(draft)
    return max(tree.depth if isinstance(tree, Tree) else 0, draft.num_heads)


class AcceptEstimator:
    """The accept-length figures of one run's evaluations (see the module docstring)."""

    def __init__(self, recipe, base, tok, draft, eval_ex: list[dict], accelerator, sharded: bool):
        from ..config import accept_settings

        n, self.every = accept_settings(recipe)
        self.base, self.draft, self.accelerator, self.sharded = base, draft, accelerator, sharded
        self.adapted = recipe.lora is not None  # Medusa-2: the base changes with training
        self.prompts = accept_prompts(eval_ex, n)
        self.max_new_tokens = recipe.train.accept_max_new_tokens
        self.eos = set(stop_token_ids(base, tok))
        self.depth = rank_depth(draft)
        default = kind_of(draft.kind).default_tree(draft)
        self.tree = default if isinstance(default, Tree) else None  # None: dynamic, measured at every evaluation
        self.chain = Tree.chain(self.depth)
        self.texts: list | None = None  # this rank's (prompt length, continuation), computed once
        # Heads exports: the default tree is grown from the rank vectors of every prompt (train.grow_tree), kept
        # (gathered from all ranks, in prompt order) from the last evaluation.
        self.grows = recipe.train.grow_tree and draft.kind in ("medusa", "hydra") and self.tree is not None
        self.rows: list | None = None

    @property
    def active(self) -> bool:
        return bool(self.prompts)

    def _mine(self) -> list[int | None]:
        """This rank's prompt indices; with a sharded base padded with None (a stand-in) to as many as any rank
        has, since every base forward is a collective."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        mine = list(range(rank, len(self.prompts), world))
        if not self.sharded:
            return mine
        return mine + [None] * (len(range(0, len(self.prompts), world)) - len(mine))

    def _continuations(self) -> list:
        out = []
        for i in self._mine():
            p = self.prompts[i if i is not None else 0]
            seq = greedy_continuation(self.base, p, self.max_new_tokens, self.eos)
            out.append(None if i is None else (len(p), seq))
        return out

    def _sum(self, values: list[float]) -> list[float]:
        if self.accelerator.num_processes == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        return self.accelerator.reduce(t, reduction="sum").tolist()

    @torch.no_grad()
    def evaluate(self, modules, index: int, draft=None) -> dict:
        """The figures of this evaluation (every rank calls it; all get the same numbers). modules: the trained
        module(s) to put in eval mode meanwhile (dropout off, Medusa-2's LoRA dropout too); index: which
        evaluation this is (from its step, so a resumed run measures at the evaluations an uninterrupted one does);
        draft: the draft to read (under ZeRO-3 a gathered copy of the trained one; default: the trained one)."""
        if not self.active:
            return {}
        draft = draft if draft is not None else self.draft
        t0 = time.perf_counter()
        was = [m.training for m in modules]
        for m in modules:
            m.eval()
        try:
            rec = {}
            if self.texts is None or self.adapted:
                self.texts = self._continuations()
            rec.update(self._expected(draft))
            if self.every and (index % self.every == 0 or self.tree is None) and not self.sharded:
                rec["measured_accept_length"] = self._measured(draft)
            rec["accept_s"] = round(time.perf_counter() - t0, 3)  # what the figures cost this evaluation
        finally:
            for m, w in zip(modules, was):
                m.train(w)
        return rec

    def _expected(self, draft) -> dict:
        rows = []
        for item in self.texts:
            plen, seq = item if item is not None else (len(self.prompts[0]), self.prompts[0] + [0, 0])
            r = text_ranks(draft, self.base, seq, plen, self.depth)  # stand-ins run the same base forward
            if item is not None:
                rows.append(r)
        if self.grows:
            self.rows = self._gathered(rows)
        figures = []
        for tree in ([self.tree] if self.tree is not None else []) + [self.chain]:
            figures += list(replay_counts(tree, rows))
        sums = self._sum(figures + [float(sum(len(r) for r in rows))])
        rec = {"accept_states": int(sums[-1])}
        if not sums[-1]:  # no text gave a state to verify from (all ended at once): no figure, not a zero
            return rec
        names = (["expected_accept_length"] if self.tree is not None else []) + ["expected_accept_length_chain"]
        for k, name in enumerate(names):
            rec[name] = sums[2 * k] / max(sums[2 * k + 1], 1)
        return rec

    def _gathered(self, rows: list) -> list:
        """Every rank's rank vectors, in prompt order, on the CPU (each rank gets them all)."""
        mine = [(i, r.cpu()) for i, r in zip([i for i in self._mine() if i is not None], rows)]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            mine = gather_object(mine)
        return [r for _, r in sorted(mine, key=lambda x: x[0])]

    def _measured(self, draft) -> float:
        from ..decode.decoder import SpeculativeDecoder

        decoder = SpeculativeDecoder(self.base, make_drafter(draft))
        committed = rows = 0
        for i in self._mine():
            if i is None:
                continue
            r = decoder.generate([self.prompts[i]], max_new_tokens=self.max_new_tokens,
                                 eos_token_id=sorted(self.eos) or None)
            committed, rows = committed + sum(r.committed), rows + sum(r.rows_per_step)
        c, n = self._sum([float(committed), float(rows)])
        return c / max(n, 1)


def selection_value(record: dict) -> float | None:
    """What `train.export: best` ranks evaluations by: the default tree's expected accept length; where the default
    tree is dynamic (EAGLE-3) the measured one, on the evaluations that measure it."""
    v = record.get("expected_accept_length", record.get("measured_accept_length"))
    return None if v is None else float(v)


class BestDraft:
    """The best draft so far by selection_value: its step, value and trainable weights (on CPU, main process only).
    Registered for checkpointing, so each checkpoint holds the best as of its step and a resumed run exports
    what an uninterrupted one would."""

    def __init__(self, keep_weights: bool):
        self.keep_weights = keep_weights
        self.step: int | None = None
        self.value: float | None = None
        self.weights: dict | None = None
        self.record: dict | None = None  # that evaluation's figures: what the export's draftlab.json reports
        self.rows: list | None = None  # its rank vectors (AcceptEstimator.rows), that the export's tree grows from

    def offer(self, step: int, value: float | None, module, record: dict | None = None,
              rows: list | None = None) -> bool:
        """Keep module's trainable weights (and the evaluation's record and rank vectors) if value beats the best
        so far (ties keep the earlier); True if kept."""
        if value is None or (self.value is not None and value <= self.value):
            return False
        self.step, self.value, self.record, self.rows = step, value, dict(record or {}), rows
        if self.keep_weights:
            self.weights = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters()
                            if p.requires_grad}
        return True

    def restore(self, module) -> None:
        """Copy the kept weights into module (the same module offer() read)."""
        if not self.weights:
            return
        params = dict(module.named_parameters())
        missing = [n for n in self.weights if n not in params]
        if missing:
            raise RuntimeError(f"the best draft's weights do not match the module (missing {missing[:5]})")
        with torch.no_grad():
            for n, w in self.weights.items():
                params[n].copy_(w.to(params[n].device, params[n].dtype))

    def state_dict(self) -> dict:
        return {"step": self.step, "value": self.value, "weights": self.weights or {}, "record": self.record,
                "rows": self.rows}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.value, self.record = state.get("step"), state.get("value"), state.get("record")
        self.rows = state.get("rows")  # (None in a checkpoint of a draftlab from before: the kind's tree)
        self.weights = (state.get("weights") or None) if self.keep_weights else None
