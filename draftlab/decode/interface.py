"""The one interface between drafters and the decoder.

A decoding step, seen from a drafter:

    begin(prompt)            once per batch: the prompt tokens and whatever base states it asked for
    propose(root) -> tree    each step: a token tree below the base's chosen next token, per row
    commit(step)             after verification: which nodes were accepted, the base's states there,
                             and the bonus token (the next root), so its own state follows the text

Heads, small LMs, ensembles and lookups are implementations of this; the decoder never asks which. The decoder
owns the interface (it lives here, in decode/, so decode/ never imports drafters/); drafter kinds take it from
drafters/base.py, which re-exports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from .acceptance import Sampling
from .tree import TreeView


@dataclass
class Proposal:
    """One step's draft: a token tree per row (node 0 = the root) and, for sampled drafts, their q."""

    tokens: torch.Tensor  # [B, N] long
    view: TreeView  # parents, depths, ancestors, padding
    # Sampled drafts: q[b, j] [V] is a draft distribution, and node i of row b was drawn from
    # q[b, q_index[b, i]] (siblings drawn i.i.d. from it). q_index -1 marks a deterministic node
    # (a top-k candidate or a lookup: q is a point mass). None: every node is deterministic.
    q: torch.Tensor | None = None  # [B, Q, V] float
    q_index: torch.Tensor | None = None  # [B, N] long
    # The width the static path pads this proposal to (at most the drafter's max_nodes, the default): an ensemble
    # drafting with one member verifies at that member's width, not at the merged trees'.
    nodes: int | None = None


@dataclass
class PromptState:
    """What the base saw of the prompt: left-padded ids [B, L], their validity and positions, and the base's
    hidden states there for the layers the drafter named in `hidden_layers` (keyed by that index). room: the slots
    the run may write after the prompt (its max_new_tokens and two trees; 0 where not known). A drafter on the
    static path sizes its caches for L + room at once, as the base's is sized: a cache that grew during a run would
    give the next run of that length (reusing it) other shapes than the first, so both would compile."""

    ids: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, L, H]
    room: int = 0


@dataclass
class StepResult:
    """What verification decided for one step.

    keep [B, M]: accepted node indices per row, root first, padded; keep_valid marks the real entries of
    live rows (rows that ended are all False); last [B]: index into keep of each row's last accepted node.
    hidden: the base's states at the kept nodes, [B, M, H] per requested layer. valid_before [B, L]: the
    base cache's valid slots before this step; positions [B, M] of the kept nodes; bonus [B]: the base's
    token after the last accepted node (the next root).

    M is the step's longest path, so those shapes change from step to step. A drafter on the static path reads
    fixed-width ones instead (`fixed`): the base's states at every tree node, and keep, keep_valid and positions
    at the tree's full width N (their first M entries are the ones above, the rest are holes), so it can gather the
    kept states inside its own compiled call.
    """

    tokens: torch.Tensor
    paths: list[list[int]]
    keep: torch.Tensor
    keep_valid: torch.Tensor
    last: torch.Tensor
    positions: torch.Tensor
    valid_before: torch.Tensor
    bonus: torch.Tensor
    live: torch.Tensor  # [B] bool, after this step's tokens were emitted
    kept_hidden: dict[int, torch.Tensor] | None = None  # `hidden`, when the caller has it (else gathered from states)
    # Committed tokens after the end of `paths` (before the bonus) that the drafter did not propose itself: an
    # ensemble member whose tree covered only part of the accepted path gets the rest here, per row.
    extra: list[list[int]] | None = None
    time_s: dict = field(default_factory=dict)  # this step's draft / verify / accept seconds (adaptive drafters)
    # Host copies the decoder already made (its one device-to-host copy per step): each row's tokens along `paths`
    # and `live` as a list. Drafters read them through path_tokens() / live_rows(), which copy once if absent.
    host_tokens: list[list[int]] | None = None
    host_live: list[bool] | None = None
    # The rows this step verified (live before it), on the host: keep_valid's rows (None: read from keep_valid).
    host_verified: list[bool] | None = None
    # The base's states at every tree node, [B, N, H] per requested layer, and keep / keep_valid / positions at the
    # tree's full width N (see `fixed`).
    states: dict[int, torch.Tensor] | None = None
    full: tuple | None = None
    # The drafter's outputs when its commit and next proposal ran in the verification's call (Drafter.chain).
    drafted: tuple | None = None

    @property
    def hidden(self) -> dict[int, torch.Tensor]:
        if self.kept_hidden is None:
            B, M = self.keep.shape
            self.kept_hidden = {l: h.gather(1, self.keep[:, :, None].expand(B, M, h.shape[-1]))
                                for l, h in (self.states or {}).items()}
        return self.kept_hidden

    def fixed(self, W: int, layers: tuple) -> tuple:
        """The step at one width W (at least the longest possible path: a tree's depth + 1) for drafters of the
        static path: (states: the base's states at every node for each of `layers`, a tuple; keep, keep_valid and
        positions [B, W], the entries past a row's path holes). Slices only, no device work."""
        keep, keep_valid, positions = self.full
        return tuple(self.states[l] for l in layers), keep[:, :W], keep_valid[:, :W], positions[:, :W]

    def path_tokens(self) -> list[list[int]]:
        """Each row's tokens along its path (root first), on the host."""
        if self.host_tokens is None:
            tok = self.tokens.tolist()
            self.host_tokens = [[tok[b][n] for n in p] for b, p in enumerate(self.paths)]
        return self.host_tokens

    def verified_rows(self) -> list[bool]:
        """The rows this step verified (live before it; their paths' entries are keep_valid's), on the host."""
        if self.host_verified is None:
            self.host_verified = self.keep_valid[:, 0].tolist()
        return self.host_verified

    def live_rows(self) -> list[bool]:
        """`live` on the host."""
        if self.host_live is None:
            self.host_live = self.live.tolist()
        return self.host_live


class Drafter(ABC):
    """Proposes token trees for the base to verify, and follows the committed text."""

    #: The decoder's path, set by SpeculativeDecoder before each begin: {"static": bool, "compile": backend or
    #: None}. Drafters that keep a KV cache of their own use it (decode.cache.slot_cache); None: eager.
    decode_path: dict | None = None
    #: Indices into the base's `hidden_states` tuple the drafter reads (-1: the final, normalised state).
    #: The decoder asks the base for them only when this is non-empty.
    hidden_layers: tuple[int, ...] = ()
    #: A compiled call given the drafter (the chained step) keys its signature on the shapes of the drafter's tensors.
    signature_holds = True

    @property
    @abstractmethod
    def max_nodes(self) -> int:
        """Most tokens (root included) one proposal may hold: the verification budget per row."""

    @abstractmethod
    def begin(self, prompt: PromptState, sampling: Sampling, generator: torch.Generator | None) -> None:
        """Start a batch from the prompt."""

    @abstractmethod
    def propose(self, root: torch.Tensor) -> Proposal:
        """A tree below root [B] (the base's next token, not yet in any cache) for every row."""

    @abstractmethod
    def commit(self, step: StepResult) -> None:
        """Follow the accepted path and the bonus token."""

    def follow(self, committed: list[list[int]]) -> None:
        """The text grew by these tokens per row (root first, bonus excluded) in a step this drafter did not
        propose for (an ensemble's scheduler paused it); its state must follow. Drafters that read the base's
        hidden states cannot skip a step and do not implement this."""
        raise NotImplementedError(f"{type(self).__name__} cannot skip a step")

    # --- the chained step (decode.decoder.verify_keep_and_draft) ------------------------------------------------
    # On the compiled static path, a drafter whose commit and next proposal are one call of tensor operations may have
    # the verifier run that call inside its own, right after acceptance: a step is then one compiled call instead of
    # two. The decoder then calls chain_args, the verifier's call runs chain, and the decoder calls chained(step)
    # instead of commit(step) + propose(step.bonus); all three together must do what those two do, with the same
    # tokens.

    @property
    def chainer(self) -> "Drafter":
        """The drafter whose chain_args / chain run in the next verification's call: this one (an ensemble drafting
        this step and the next with one member: that member, so the call's signature holds the member's buffers)."""
        return self

    def chain_args(self) -> tuple | None:
        """Before a verification: the host's share of the drafter's next commit (room in its caches) and the
        arguments `chain` takes after the step's own, or None where this step commits and proposes on its own (the
        default: drafters that do not chain, sampled drafts)."""
        return None

    def chain(self, states: tuple, full: tuple, tokens: torch.Tensor, bonus: torch.Tensor, last: torch.Tensor,
              *args):
        """Tensor operations only, inside the verifier's compiled call: commit the step (states: the base's states at
        every tree node for `hidden_layers`; full: keep, keep_valid and positions at the tree's width, as
        StepResult.full; tokens the verified tree; last each row's last accepted node) and draft below bonus.
        Returns what `chained` reads."""
        raise NotImplementedError(f"{type(self).__name__} does not chain")

    def chained(self, step: StepResult) -> Proposal:
        """After a chained step (`step.drafted` holds what `chain` returned): the host's share of the commit
        (counters, positions; the step's host copies of its paths, which `chain` could not read) and the next
        proposal."""
        raise NotImplementedError(f"{type(self).__name__} does not chain")

    def share_state(self, other: "Drafter") -> None:
        """Learn online together with `other`, a drafter of the same draft module decoding another batch at the
        same time (the pipeline's groups): what it adapts across steps (an ensemble's vote weights, schedule and
        speculation length) becomes one state both update. Drafters that learn nothing online ignore it."""

    def clock_choices(self) -> str | None:
        """What this drafter chooses by its own clock (a schedule's step times), if anything. Under tensor
        parallelism every rank runs its own drafter, and ranks whose clocks differ would draft different trees."""
        return None

    def compile_failed(self) -> str | None:
        """Why one of this drafter's compiled steps runs eagerly, if one does (a drafter made of others asks them
        too)."""
        from .compiled import method_failure

        return method_failure(self)

    def describe(self) -> dict:
        """What a report says about this drafter (kind, tree size, ...)."""
        return {"kind": type(self).__name__, "max_nodes": self.max_nodes}
