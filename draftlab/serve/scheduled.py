"""Decoding by a schedule file (what `search-tree --batch-sizes` writes, schedule.py): the tree, or plain decoding
steps, that each batch size gets, and a decoder that follows the file call by call (`--tree FILE` in generate and
eval). Kept apart from the search so that loading a decoder does not import it."""

from __future__ import annotations

import json
from pathlib import Path

from ..decode.tree import Tree


def tree_for_batch(path: str | Path, batch_size: int) -> Tree | None:
    """The tree a schedule file gives for a batch size: the entry of the largest scheduled batch size at or below
    it (the smallest entry below the schedule). None where that entry is plain decoding: the decoder then runs plain
    steps (drafter_for_batch gives it NoDraft), not a root-only tree, which drafters such as the SSM refuse. A tree
    file without a schedule gives its one tree."""
    data = json.loads(Path(path).read_text())
    if "schedule" not in data:
        return Tree.load(path)
    entries = sorted(data["schedule"], key=lambda e: e["batch_size"])
    entry = ([e for e in entries if e["batch_size"] <= batch_size] or entries[:1])[-1]
    if not entry["speculate"] or not entry["paths"]:
        return None
    return Tree.from_paths(entry["paths"], {"name": f"{Path(path).stem}@b{entry['batch_size']}", **entry},
                           source=str(path))


def drafter_for_batch(draft, path: str | Path, batch_size: int, **options):
    """The drafter for a draft module at a batch size by a schedule file: the module's drafter on the scheduled
    tree, or NoDraft (plain decoding steps) where the schedule says plain decoding wins. Every drafter kind;
    options go to drafters that take them (ensembles)."""
    from ..decode.decoder import NoDraft
    from ..drafters import make_drafter

    tree = tree_for_batch(path, batch_size)
    return NoDraft() if tree is None else make_drafter(draft, tree, **options)


def decoder_for_batch(base, draft, path: str | Path, batch_size: int, drafter_options: dict | None = None,
                      **options):
    """A SpeculativeDecoder of base with drafter_for_batch(draft, path, batch_size); options go to the decoder
    (sync, compile). Greedy outputs are plain greedy's whichever the schedule chose."""
    from ..decode.decoder import NoDraft, SpeculativeDecoder

    drafter = drafter_for_batch(draft, path, batch_size, **(drafter_options or {}))
    return SpeculativeDecoder(base, drafter, check_base=not isinstance(drafter, NoDraft), **options)


def is_schedule(path) -> bool:
    """Whether a --tree value names a tree file with a per-batch-size schedule."""
    try:
        return Path(path).is_file() and "schedule" in json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False


class ScheduledDecoder:
    """What `--tree FILE` gives when FILE holds a schedule: every generate() call decodes with the tree (or plain
    steps) its batch size gets (decoder_for_batch), one SpeculativeDecoder per distinct choice, made when first
    needed. warm_up too goes to the prompts' batch size; other attributes are those of the batch-size-1 decoder (a
    report on a run at another batch size reads for_batch(B), as run_generate does)."""

    def __init__(self, base, draft, path: str | Path, drafter_options: dict | None = None, **options):
        self.path, self._args = str(path), (base, draft, drafter_options, options)
        self._decoders, self._by_batch = {}, {}  # choice -> decoder; batch size -> decoder (the file read once each)

    @property
    def base(self):
        return self._args[0]

    def for_batch(self, batch_size: int):
        if batch_size not in self._by_batch:
            tree = tree_for_batch(self.path, batch_size)
            key = None if tree is None else tuple(map(tuple, tree.paths))
            if key not in self._decoders:
                base, draft, drafter_options, options = self._args
                self._decoders[key] = decoder_for_batch(base, draft, self.path, batch_size, drafter_options, **options)
            self._by_batch[batch_size] = self._decoders[key]
        return self._by_batch[batch_size]

    def generate(self, prompts, *args, **kwargs):
        return self.for_batch(len(prompts)).generate(prompts, *args, **kwargs)

    def warm_up(self, prompts, *args, **kwargs):
        return self.for_batch(len(prompts)).warm_up(prompts, *args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.for_batch(1), name)
