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

import platform
import time
from dataclasses import dataclass, field

import torch

from .interface import Drafter, PromptState, Proposal, StepResult
from .acceptance import (Sampling, accept_sampling, sample, sampling_decision, tree_bounds, typical_decision, uniforms,
                         warp)
from .compiled import compiled_function
from .fuse import fuse_by_default, fuse_projections, fused as fused_groups, modules_of
from .cache import (SlotCache, StaticSlotCache, UnsupportedBaseError, cache_layers,  # noqa: F401
                    check_tree_support, compact_cache, keep_on_device, reserved_mask, static_slot_cache,
                    static_slots)
from .streams import derived_generator
from .switches import env_flag
from .tree import TreeView


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
    # Steps whose drafting ran inside the verification's call (chained_step): their drafting time is in "verify".
    chained_steps: int = 0

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


def hardware() -> str:
    """The machine timings are taken on, as run records and search files name it: the GPU, or the CPU and threads."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU x{torch.get_num_threads()} threads"


def _layers(out, layers) -> dict:
    return {l: out.hidden_states[l] for l in layers}


class Verifier:
    """The base's side of decoding one batch: prefill, then per step verify a proposal (one base forward over
    the tree), accept, keep the accepted path in the KV cache, emit tokens, and say what was decided.

    The plain decoder alternates it with a drafter in one process; the pipelined decoder runs it in its own
    process; under tensor parallelism every rank runs one and `sync` makes rank 0's proposal and decisions
    everyone's."""

    def __init__(self, base, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, eos, stop=None,
                 on_tokens=None, generator=None, hidden_layers=(), sync=None, static_nodes: int | None = None,
                 forward=None, cache=None, fused: bool | None = None, chain=None):
        """static_nodes: verify on the static-shape path (StaticSlotCache), every tree padded to this many nodes
        (the drafter's max_nodes); forward: what runs those verify forwards (a decode.compiled.Compiled, or the base);
        cache: the static cache of a finished earlier run, reused when it fits (decode.cache.static_slot_cache);
        fused: whether a compiled static path verifies in one call (fused_step; None: fused_default); chain:
        the compiled verify_keep_and_draft (chained_step) the fused path runs instead when verify is given a drafter
        that chains."""
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token (e.g. BOS)")
        self.base, self.sampling, self.generator, self.layers, self.sync = base, sampling, generator, hidden_layers, sync
        self.static_nodes, self.forward, self.target = static_nodes, forward, cache
        self.max_new, self.eos, self.stop, self.on_tokens = max_new_tokens, eos, stop, on_tokens
        self.device = base.get_output_embeddings().weight.device
        backend = getattr(forward, "backend", None)  # a compiled verify forward: acceptance compiles alike
        self.compiled = backend is not None
        rule = decide_and_keep if static_nodes else decide  # the static cache keeps the path in the same call
        self.decide = rule if backend is None else compiled_function(rule, backend, self.device.type)
        # The compiled static path verifies, decides and keeps in one call (see fused_step).
        self.fused = fused_step(backend, self.device.type, fused) if static_nodes and sync is None else None
        self.chain = chain if self.fused is not None else None
        self.res = Result(tokens=[[] for _ in prompts])
        self.live = torch.ones(len(prompts), dtype=torch.bool, device=self.device)
        self.live_host = [True] * len(prompts)  # the same on the host (rows end on the host, in _emit)
        self.prompts = prompts

    def prefill(self) -> tuple[PromptState, torch.Tensor]:
        """The prompts through the base (left-padded; each row's positions count its own tokens only): what the
        drafter begins from, and the root [B] (the base's first token, already emitted)."""
        t0 = time.perf_counter()
        dev, B = self.device, len(self.prompts)
        L = max(len(p) for p in self.prompts)
        ids = torch.zeros(B, L, dtype=torch.long, device=dev)
        valid = torch.zeros(B, L, dtype=torch.bool, device=dev)
        for b, p in enumerate(self.prompts):
            ids[b, L - len(p):] = torch.tensor(p, device=dev)
            valid[b, L - len(p):] = True
        # Room after the prompt for the output and two trees (holes are defragmented away): the base's static cache
        # holds it, and the drafters size theirs from it (PromptState.room).
        room = self.max_new + 2 * self.static_nodes if self.static_nodes else 0
        if self.static_nodes:
            self.target = static_slot_cache(self.base, B, static_slots(L + room), self.forward, reuse=self.target)
        else:
            self.target = SlotCache(self.base)
        out, pos = self.target.prefill(ids, valid, hidden=self.layers, bucket=self.sync is None, last=True)
        root = _pick_root(out.logits[:, -1], self.sampling, self.generator)  # [B]
        if self.sync is not None:
            root = self.sync.root(root)
        for b in range(B):
            self._emit(b, [int(root[b])])
        sync_device(dev)
        self.res.time_s["prefill"] += time.perf_counter() - t0
        return PromptState(ids, valid, pos, _layers(out, self.layers), room=room), root

    def verify(self, prop: Proposal, draft_s: float = 0.0, drafter: Drafter | None = None) -> StepResult:
        """Verify one step's proposal and commit its accepted tokens; the StepResult says what was decided
        (its bonus is the next root). draft_s: the drafting time of this step, for the report. drafter: one whose
        commit and next proposal may run in the verification's call (chained_step); when they did, the
        StepResult's `drafted` holds that call's drafter outputs (Drafter.chained turns them into the proposal)."""
        dev, target, res, live, sampling, generator = (self.device, self.target, self.res, self.live, self.sampling,
                                                       self.generator)
        if self.sync is not None:
            prop = self.sync.proposal(prop)
        if self.static_nodes:
            prop = pad_proposal(prop, min(prop.nodes or self.static_nodes, self.static_nodes))
        tokens, view = prop.tokens, prop.view
        B, N = tokens.shape
        t2 = time.perf_counter()
        valid_before = target.valid
        deterministic = sampling.greedy or sampling.typical
        # On the static path sampling decides on the device too (one graph where compiled), from uniforms drawn here:
        # one per node's try and one for the bonus (acceptance.accept_sampling).
        on_device = (deterministic or self.static_nodes is not None) and self.sync is None
        drawn = None
        if on_device and not deterministic:
            drawn = (uniforms(B, N + 1, generator=generator, device=dev), prop.q, prop.q_index,
                     *tree_bounds(view, rounded=self.compiled))
        fused = on_device and self.fused is not None
        chainer = drafter.chainer if fused and self.chain is not None and drafter is not None else None
        chain = chainer.chain_args() if chainer is not None else None
        drafted = None
        if fused:  # forward, rule and bookkeeping in one call (one graph): the verify time holds acceptance's kernels
            opened = target.open(tokens, hidden=self.layers)
            del opened["input_ids"]  # verify_and_keep gives the forward `tokens`: passed once, the call's signature
            # has no alias to find (decode.compiled._aliases)
            inputs = (self.base, opened, target.window, target.spans, target.dtype, self.layers, tokens, view.parents,
                      view.depth, view.valid, view.ancestors, live, target.next_pos, sampling, target.device_state(),
                      target.slots)
            if chain is not None:  # and the drafter's commit and next proposal: the verify time holds them too
                states, decided, drafted = self.chain(*inputs, chainer, chain, drawn=drawn)
                res.chained_steps += 1
            else:
                states, decided = self.fused(*inputs, drawn=drawn)
            states = dict(zip(self.layers, states))
        else:
            out = target.forward(tokens, view.ancestors, view.depth, hidden=self.layers)
            states = _layers(out, self.layers)
        sync_device(dev)
        t3 = time.perf_counter()
        start = target.length  # the committed slots: read after the forward, whose room a static cache may have made
        # by defragmenting (moving every row's valid slots to its front)
        if fused:
            bonus, length, keep, keep_valid, kept_pos, host, *next_pos = decided
        elif on_device:  # the rule and the step's bookkeeping in one call (one graph compiled)
            static = (target.device_state(), target.slots) if self.static_nodes else ()
            bonus, length, keep, keep_valid, kept_pos, host, *next_pos = self.decide(
                tokens, out.logits, view.parents, view.depth, view.valid, view.ancestors, live, target.next_pos,
                sampling, *static, drawn=drawn)
        else:
            if deterministic:
                last, bonus = typical_decision(tokens, out.logits, view, sampling)  # greedy at temperature 0
            else:
                paths, bonus = accept_sampling(tokens, out.logits, view, sampling, generator, prop.q, prop.q_index)
                last = torch.tensor([p[-1] for p in paths], device=dev)
            if self.sync is not None:
                last, bonus = self.sync.decision(last, bonus)
            length, keep, keep_valid, kept_pos, host = path_order(tokens, view.ancestors, view.depth, last, bonus,
                                                                  live, target.next_pos)
        host = host.tolist()  # the step's one device-to-host copy
        live_rows = [bool(h[0]) for h in host]
        paths = [h[3: 3 + h[1]] for h in host]
        M = max(h[1] for h in host)
        if on_device and self.static_nodes:  # the KV cache kept the paths in decide_and_keep
            target.kept(M, next_pos[0])
        else:  # paths that are prefixes of the node order (chains, root-only accepts) are already in place
            target.keep(start, keep[:, :M], keep_valid[:, :M], in_place=all(p == list(range(len(p))) for p in paths))
        res.steps += 1
        res.rows_per_step.append(sum(live_rows))
        res.tree_sizes.append(N)
        committed = 0
        for b, h in enumerate(host):
            if live_rows[b]:
                # Only what is emitted counts: accepted tokens past EOS or max_new_tokens are not committed.
                committed += self._emit(b, h[3 + N + 1: 3 + N + h[1]] + [h[2]])
        res.committed.append(committed)
        sync_device(dev)
        t4 = time.perf_counter()
        res.time_s["draft"] += draft_s
        res.time_s["verify"] += t3 - t2
        res.time_s["accept"] += t4 - t3
        return StepResult(tokens, paths, keep[:, :M], keep_valid[:, :M], length - 1, kept_pos[:, :M], valid_before,
                          bonus, live.clone(), time_s={"draft": draft_s, "verify": t3 - t2, "accept": t4 - t3},
                          host_tokens=[h[3 + N: 3 + N + h[1]] for h in host], host_live=list(self.live_host),
                          host_verified=live_rows,
                          states=states, full=(keep, keep_valid, kept_pos), drafted=drafted)

    @property
    def done(self) -> bool:
        return not any(self.live_host)

    def _end(self, b: int) -> None:
        self.live[b] = False
        self.live_host[b] = False

    def _emit(self, b: int, new: list[int]) -> int:
        """Append committed tokens to row b, ending the row at EOS, max_new_tokens or a stop match;
        returns how many tokens row b gained."""
        out = self.res.tokens[b]
        before = len(out)
        new = new[: self.max_new - before]
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[: i + 1]
                self._end(b)
                break
        out.extend(new)
        if self.stop is not None:
            cut = self.stop(b, out)
            if cut is not None:
                del out[max(cut, 0):]
                self._end(b)
        if len(out) >= self.max_new:
            self._end(b)
        if self.on_tokens is not None and len(out) > before:
            self.on_tokens(b, out[before:])
        return max(len(out) - before, 0)


class NoDraft(Drafter):
    """Drafts nothing: every step verifies the root alone, so the decoder is plain decoding on the same path
    (static cache, compiled forward) as speculation; the fair baseline for a compiled speculative decoder."""

    max_nodes = 1

    def begin(self, prompt, sampling, generator) -> None:
        self.view = None

    def propose(self, root: torch.Tensor) -> Proposal:
        B = root.shape[0]
        if self.view is None or self.view.size != 1 or self.view.parents.shape[0] != B:
            one = torch.ones(B, 1, dtype=torch.bool, device=root.device)
            self.view = TreeView(torch.full((B, 1), -1, device=root.device), torch.zeros(B, 1, dtype=torch.long,
                                 device=root.device), one, one[:, :, None].clone())
        return Proposal(root[:, None], self.view)

    def commit(self, step: StepResult) -> None:
        pass

    def follow(self, committed) -> None:
        pass

    def describe(self) -> dict:
        return {"kind": "none (plain decoding)", "max_nodes": 1}


def pad_proposal(prop: Proposal, n: int) -> Proposal:
    """The proposal with n nodes per row: padded nodes (token 0, valid False, attending to themselves only) are
    never accepted, so acceptance reads the same tree; every verify forward then has one shape."""
    B, N = prop.tokens.shape
    if N == n:
        return prop
    if N > n:
        raise ValueError(f"a proposal of {N} nodes exceeds the drafter's max_nodes ({n})")
    v, dev = prop.view, prop.tokens.device
    pad = lambda t, value: torch.cat([t, torch.full((B, n - N, *t.shape[2:]), value, dtype=t.dtype, device=dev)], 1)
    anc = torch.zeros(B, n, n, dtype=torch.bool, device=dev)
    anc[:, :N, :N] = v.ancestors
    anc[:, N:, N:] = torch.eye(n - N, dtype=torch.bool, device=dev)
    view = TreeView(pad(v.parents, -1), pad(v.depth, 0), pad(v.valid, False), anc)
    q_index = None if prop.q_index is None else pad(prop.q_index, -1)
    return Proposal(pad(prop.tokens, 0), view, prop.q, q_index)


def path_order(tokens, ancestors, depth, last, bonus, live, next_pos):
    """The step's bookkeeping from the last accepted node last [B], all [B, N] wide (the caller cuts them to the
    longest path M): length [B], keep (the path's nodes in depth order, padded with the root), keep_valid (real
    entries of live rows), kept_pos (their positions), and host [B, 3 + 2N] (liveness, path length, bonus, the node
    order: the path first, then the other nodes, and the tokens in that order): what goes to the host."""
    B, N = tokens.shape
    on_path = ancestors[torch.arange(B, device=tokens.device), last]  # [B, N]
    length = on_path.sum(-1)
    # Each node's place in the order: a path node's is its depth (the path holds depths 0 .. length - 1 once each),
    # the others follow in node order. A scatter, not a sort (a sort costs several times more per step on a CPU).
    place = torch.where(on_path, depth, length[:, None] + (~on_path).long().cumsum(-1) - 1)
    order = torch.zeros_like(place).scatter(1, place, torch.arange(N, device=tokens.device)[None].expand(B, -1))
    host = torch.cat([live[:, None].long(), length[:, None], bonus[:, None], order, tokens.gather(1, order)], 1)
    in_path = torch.arange(N, device=tokens.device)[None] < length[:, None]  # [B, N]
    keep = order.masked_fill(~in_path, 0)
    kept_pos = next_pos[:, None] + torch.arange(N, device=tokens.device)[None]
    return length, keep, in_path & live[:, None], kept_pos, host


def decide(tokens, logits, parents, depth, valid, ancestors, live, next_pos, sampling: Sampling, drawn=None):
    """The rule (greedy, typical acceptance, or with `drawn` speculative sampling) and the step's bookkeeping
    (path_order) in one function of tensors of fixed shapes, which the compiled path runs as one graph: the bonus
    token [B], then path_order's. drawn: sampling's (u, q, q_index, K, D), see acceptance.sampling_decision."""
    if drawn is None:
        last, bonus = typical_decision(tokens, logits, TreeView(parents, depth, valid, ancestors), sampling)
    else:
        last, bonus = sampling_decision(tokens, logits, parents, valid, sampling, *drawn)
    return (bonus, *path_order(tokens, ancestors, depth, last, bonus, live, next_pos))


def decide_and_keep(tokens, logits, parents, depth, valid, ancestors, live, next_pos, sampling: Sampling, state,
                    slots, drawn=None):
    """decide, then the static KV cache keeps each row's accepted path (decode.cache.keep_on_device; state: the
    cache's device_state, slots its valid slots), in the same graph: decide's values and the rows' next positions."""
    bonus, length, keep, keep_valid, kept_pos, host = decide(tokens, logits, parents, depth, valid, ancestors, live,
                                                             next_pos, sampling, drawn)
    kv, cumulative = state
    return bonus, length, keep, keep_valid, kept_pos, host, keep_on_device(kv, cumulative, slots, keep, keep_valid,
                                                                           length, next_pos)


def verify_and_keep(model, inputs: dict, window: int, spans: tuple | None, dtype: torch.dtype, layers: tuple, tokens,
                    parents, depth, valid, ancestors, live, next_pos, sampling: Sampling, state, slots, drawn=None):
    """A whole verification on the static path as one function of fixed shapes, which the compiled path runs as one
    graph (on a GPU one CUDA graph): the base's forward over the tree's tokens (inputs: StaticSlotCache.open's, less
    the input ids; its mask over the attention window, within the base's sliding windows or chunks (spans:
    cache.layer_spans), and its positions built here, from the cache's valid slots and write pointer), then
    decide_and_keep. Returns the base's states at every tree node for `layers` (a tuple), and decide_and_keep's
    values."""
    written = state[1][0]  # the first layer's write pointer: the committed slots, before the forward moves it
    pos = next_pos[:, None] + depth
    out = model(**inputs, input_ids=tokens, position_ids=pos,
                attention_mask=reserved_mask(ancestors, slots, written, window, dtype, pos, spans))
    return tuple(out.hidden_states[l] for l in layers), decide_and_keep(
        tokens, out.logits, parents, depth, valid, ancestors, live, next_pos, sampling, state, slots, drawn)


def verify_keep_and_draft(model, inputs: dict, window: int, spans: tuple | None, dtype: torch.dtype, layers: tuple,
                          tokens, parents, depth, valid, ancestors, live, next_pos, sampling: Sampling, state, slots,
                          drafter: Drafter, args: tuple, drawn=None):
    """verify_and_keep, then the drafter's commit of the accepted paths and its next proposal below the bonus token
    (Drafter.chain, with the arguments Drafter.chain_args prepared), as one function: on the compiled path a whole
    speculative step is one call (one graph). Returns verify_and_keep's values and the drafter's outputs."""
    states, decided = verify_and_keep(model, inputs, window, spans, dtype, layers, tokens, parents, depth, valid,
                                      ancestors, live, next_pos, sampling, state, slots, drawn)
    bonus, length, keep, keep_valid, kept_pos = decided[:5]
    return states, decided, drafter.chain(states, (keep, keep_valid, kept_pos), tokens, bonus, length - 1, *args)


def chained_step(backend: str | None, device: str, on: bool | None = None):
    """The compiled verify_keep_and_draft for a compiled verify forward's backend, if `on`; on=None is the device
    type's default, DRAFTLAB_CHAINED_STEP=1 / 0 sets it everywhere: on for a CPU, off for a GPU, where only Medusa
    heads have run it (1.12x their split step on an H200; a drafter whose buffers inductor does not graph would take
    the whole verify call off CUDA graphs). The verifier runs it only where the fused step runs (fused_step) and
    the drafter chains (Drafter.chain_args). Its signature holds the drafter's buffers' shapes
    (decode.compiled._signature)."""
    if on is None:
        flag = env_flag("DRAFTLAB_CHAINED_STEP")
        on = device == "cpu" if flag is None else flag
    if backend is None or not on:
        return None
    return compiled_function(verify_keep_and_draft, backend, device, graphs=True, skip_guards=True,
                             keep_outputs=True)  # its outputs are the next step's inputs


def fused_default() -> bool:
    """Whether the compiled static path fuses its verify step by default: yes, on every device and for every rule,
    unless DRAFTLAB_FUSED_STEP=0. Measured on an H200 at 7B shape: plain decoding 1.08x the split calls, the oracle
    drafter 1.19-1.43x, sampled plain decoding 1.10x; sampled steps joined once their law held through the fused and
    chained call there (tests/test_gpu_law.py, run by benchmarks/gpu_check.sh; passed on an H200 on 2026-11-30)."""
    flag = env_flag("DRAFTLAB_FUSED_STEP")
    return True if flag is None else flag


def fused_step(backend: str | None, device: str, on: bool | None = None):
    """The compiled verify_and_keep for a compiled verify forward's backend (None: not compiled, no fused step), if
    `on` (None: fused_default). Under CUDA graphs it returns clones of its outputs (keep_outputs): the next step
    reads them after the next replay. Its signature holds the base and the cache, so guards are evaluated once per
    signature (decode.compiled)."""
    if on is None:
        on = fused_default()
    if backend is None or not on:
        return None
    return compiled_function(verify_and_keep, backend, device, graphs=True, skip_guards=True,
                             keep_outputs=True)  # its outputs are the next step's inputs


def _pick_root(logits: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
    """The base's first token after the prompt [B]: argmax when greedy, a sample from the warped p otherwise."""
    if sampling.temperature <= 0 or sampling.typical:
        # Typical acceptance: Medusa decodes the first token of every step greedily (see accept_typical).
        return logits.argmax(-1)
    probs = warp(logits, sampling)
    return sample(probs, 1, generator)[:, 0]


def eos_set(eos_token_id) -> set:
    return set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))


class SpeculativeDecoder:
    """Greedy, sampling and typical-acceptance decoding of a base with a drafter. sync: a
    draftlab.decode.tensor_parallel.RankSync when the base is tensor-parallel over several processes."""

    def __init__(self, base, drafter: Drafter, check_base: bool = True, sync=None, compile: bool | str = False,
                 static: bool | None = None, fused: bool | None = None, chained: bool | None = None,
                 fuse: bool | None = None):
        """compile: the fast path, verify forwards of one shape (static KV cache, trees padded to the drafter's
        max_nodes) through torch.compile (CUDA graphs on a GPU); True is the inductor backend (or the one
        DRAFTLAB_COMPILE_BACKEND names), a string names another torch.compile backend. static: the static
        shapes without compiling (default: as compile). The eager path (both False) is the reference; all give
        the same tokens. fused: whether the compiled path verifies, decides and keeps in one call (fused_step;
        default: fused_default, on unless DRAFTLAB_FUSED_STEP=0). chained: whether that call also runs the
        drafter's commit and next proposal, for drafters that can (chained_step; default: the device's). fuse: whether the compiled path
        computes the base's and the drafter's q/k/v and gate/up projections as one product each (decode.fuse, which
        changes the modules' class in place; default: the device's, decode.fuse.fuse_by_default; never under tensor
        parallelism)."""
        if not isinstance(drafter, Drafter):
            raise TypeError(f"expected a Drafter, got {type(drafter).__name__}; wrap draft modules with "
                            "draftlab.drafters.make_drafter(module, tree)")
        self.base, self.drafter, self.sync = base, drafter, sync
        if sync is not None and drafter.clock_choices():
            raise ValueError(f"{drafter.clock_choices()} by its own clock, which under --tp differs from rank to rank "
                             "(so would the trees): use a fixed length / the gain policy with --tp")
        self.device = base.get_output_embeddings().weight.device
        if check_base:
            check_tree_support(base)
        self.static = bool(compile) if static is None else static
        if compile and not self.static:
            raise ValueError("compile needs the static-shape path (static=True)")
        self.forward = self.step = self.chain = None
        self.fused_models: list = []  # models whose projections the compiled calls fuse (decode.fuse)
        if compile:
            from .compiled import compile_backend, compiled_forward

            self.forward = compiled_forward(base, compile_backend(compile))
            if sync is None and (fuse_by_default(self.device.type) if fuse is None else fuse):
                models = [base, *modules_of(drafter)]
                for m in models:
                    fuse_projections(m)
                self.fused_models = [m for m in models if fused_groups(m)]
            self.step = fused_step(self.forward.backend, self.device.type, fused) if sync is None else None
            if self.step is not None:
                self.chain = chained_step(self.forward.backend, self.device.type, chained)

    def warm_up(self, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> None:
        """A call outside any timing: a compiled decoder runs the real batch (it compiles for those shapes); an
        eager one a short call on the first prompt (allocator, kernels). kwargs go to generate."""
        if self.forward is not None:
            self.generate(prompts, max_new_tokens=max_new_tokens, **kwargs)
        else:
            self.generate(prompts[:1], max_new_tokens=min(max_new_tokens, 8), **kwargs)

    @property
    def compile_s(self) -> float:
        """Seconds the base's compiled calls (its verify forward, the fused verify step, the chained step) spent
        compiling so far (0 on the eager path)."""
        return sum(c.warmup_s for c in (self.forward, self.step, self.chain) if c is not None)

    @property
    def compile_failed(self) -> str | None:
        """Why the base's verify forward (or the fused verify step, or the chained step), or a compiled step of the
        drafter's (an ensemble's members' included), runs eagerly, if one does."""
        return next((c.failed_for(self.base) for c in (self.forward, self.step, self.chain)
                     if c is not None and c.failed_for(self.base)), None) or self.drafter.compile_failed()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: Sampling | None = None,
                 eos_token_id: int | list[int] | None = None, stop=None, on_tokens=None,
                 generator: torch.Generator | None = None) -> Result:
        """Decode a batch of prompt id lists. stop(row, tokens) -> cut index or None ends a row early;
        on_tokens(row, new_tokens) is called as tokens are committed (streaming). generator: the verifier draws
        from it; the drafter from a stream of its own, seeded by the generator's first draw (see streams)."""
        sampling = sampling or Sampling()
        drafter = self.drafter
        for m in self.fused_models:  # fused again where a copy, a move or a reload since has left two weights
            fuse_projections(m)
        drafter.decode_path = {"static": self.static, "compile": self.forward.backend if self.forward else None}
        drafter_gen = None if generator is None else derived_generator(generator, "drafter")
        # The static path reuses the last run's cache (one at a time: generate is not re-entrant per decoder).
        cache, self._cache = getattr(self, "_cache", None), None
        verifier = Verifier(self.base, prompts, max_new_tokens, sampling, eos_set(eos_token_id), stop, on_tokens,
                            generator, drafter.hidden_layers, self.sync,
                            static_nodes=drafter.max_nodes if self.static else None, forward=self.forward, cache=cache,
                            fused=self.step is not None, chain=self.chain)
        t0 = time.perf_counter()
        prompt, root = verifier.prefill()
        drafter.begin(prompt, sampling, drafter_gen)
        sync_device(self.device)
        verifier.res.time_s["prefill"] = time.perf_counter() - t0  # the drafter's begin included
        prop = None
        while not verifier.done:
            t1 = time.perf_counter()
            if prop is None:  # else the last verification's call drafted it (chained_step)
                prop = drafter.propose(root)
                sync_device(self.device)
            step = verifier.verify(prop, time.perf_counter() - t1, drafter)
            t4 = time.perf_counter()
            prop = None
            if not verifier.done:
                if step.drafted is not None:
                    prop = drafter.chained(step)
                else:
                    drafter.commit(step)
            root = step.bonus
            sync_device(self.device)
            verifier.res.time_s["commit"] += time.perf_counter() - t4
        if self.static:
            self._cache = verifier.target
        return verifier.res
