"""Retrieval drafting: continuations of the text's last n-gram found earlier in the same text (prompt lookup) or in
a datastore of token sequences (e.g. the training data), merged into one trie per row. It costs no model
forward; its trees change every step and differ between rows. As an ensemble member it is SpecInfer's
"retrieval speculator"."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from ..decode.tree import TreeView
from .base import Drafter, PromptState, Proposal, StepResult


class NgramIndex:
    """End positions of every n-gram (min_n..max_n) of growing token sequences, newest last."""

    def __init__(self, min_n: int, max_n: int, per_key: int = 8):
        self.min_n, self.max_n, self.per_key = min_n, max_n, per_key
        self.seqs: list[list[int]] = []
        self.index: dict[tuple, list[tuple[int, int]]] = defaultdict(list)

    @classmethod
    def of(cls, seqs, min_n: int, max_n: int, per_key: int = 8) -> "NgramIndex":
        """An index of these sequences (copied: they grow as text is committed)."""
        idx = cls(min_n, max_n, per_key)
        for seq in seqs:
            idx.seqs.append(list(seq))
            idx.add(len(idx.seqs) - 1, 0)
        return idx

    def add(self, seq_id: int, start: int) -> None:
        """Index the n-grams of sequence seq_id that end at positions >= start."""
        seq = self.seqs[seq_id]
        for end in range(max(start, self.min_n - 1), len(seq)):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                hits = self.index[tuple(seq[end - n + 1: end + 1])]
                hits.append((seq_id, end))
                if len(hits) > self.per_key:
                    del hits[0]

    def continuations(self, context: list[int], length: int, limit: int, exclude: int | None = None) -> list[list[int]]:
        """Up to `limit` distinct continuations (newest first) of the longest n-gram that ends `context` and occurs in
        the index; `exclude` skips matches in that sequence ending at or after len(context) - 1 (the text itself)."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            found = _distinct((self.seqs[seq_id][end + 1: end + 1 + length]
                               for seq_id, end in reversed(self.index.get(tuple(context[-n:]), []))
                               if not (seq_id == exclude and end >= len(context) - 1)), limit)
            if found:
                return found
        return []


def _distinct(continuations, limit: int) -> list[list[int]]:
    """The first `limit` distinct non-empty continuations, in order."""
    found, seen = [], set()
    for cont in continuations:
        if cont and tuple(cont) not in seen:
            seen.add(tuple(cont))
            found.append(list(cont))
            if len(found) == limit:
                break
    return found


def flatten(seqs, dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences as one array of their tokens end to end (dtype) and an int64 array of their lengths."""
    seqs = list(seqs)  # (one pass over the tokens into the array: no per-sequence arrays at the build's peak)
    lengths = np.fromiter((len(q) for q in seqs), dtype=np.int64, count=len(seqs))
    return np.fromiter((t for q in seqs for t in q), dtype=dtype, count=int(lengths.sum())), lengths


_P, _MASK = 0x100000001B3, (1 << 64) - 1  # n-gram keys: a polynomial hash of the tokens (+1) modulo 2**64


class Datastore:
    """Token sequences to retrieve from (e.g. the training data's texts), indexed once, in flat arrays: the tokens
    (int32) and, per n-gram length, every n-gram's 64-bit key sorted with its end position (ties in position
    order): 4 + 12 x (max_n - min_n + 1) bytes a token. A dict of tuples (what NgramIndex keeps for the growing
    text) took 332 bytes a token on LIMA with the Llama 2 tokenizer, this 28 (benchmarks/lookup_memory.py).
    Answers NgramIndex.continuations' question the same way: of the newest `per_key` occurrences of the longest
    n-gram that ends the context (keys that collide are told apart by the tokens), the distinct continuations."""

    def __init__(self, tokens, starts, by_n: dict, min_n: int, max_n: int, per_key: int):
        self.tokens, self.starts, self.by_n = tokens, starts, by_n
        self.min_n, self.max_n, self.per_key = min_n, max_n, per_key

    @staticmethod
    def from_sequences(seqs: list[list[int]], min_n: int = 2, max_n: int = 4, per_key: int = 8) -> "Datastore":
        return Datastore.from_flat(*flatten(seqs, np.int64), min_n, max_n, per_key)

    @staticmethod
    def from_flat(tokens, lengths, min_n: int = 2, max_n: int = 4, per_key: int = 8) -> "Datastore":
        """From the sequences laid end to end (tokens) and their lengths, as `flatten` gives them."""
        given = np.asarray(tokens)
        tokens, lengths = given.astype(np.int64, copy=False), np.asarray(lengths, dtype=np.int64)
        total = int(lengths.sum())
        if total != len(tokens):
            raise ValueError(f"datastore: the lengths add up to {total} tokens, the sequences hold {len(tokens)}")
        starts = np.cumsum(lengths) - lengths
        offset = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)  # position within its sequence
        pos_type = np.int32 if total < 2 ** 31 else np.int64
        by_n, key = {}, np.zeros(total, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for n in range(1, max_n + 1):  # key of the n-gram ending at e, from the (n-1)-gram ending at e - 1
                shifted = np.zeros(total, dtype=np.uint64)
                shifted[1:] = key[:-1]
                key = shifted * np.uint64(_P) + (tokens + 1).astype(np.uint64)
                if n >= min_n:
                    ends = np.flatnonzero(offset >= n - 1)
                    order = np.argsort(key[ends], kind="stable")
                    by_n[n] = (key[ends][order], ends[order].astype(pos_type))
        kept = given if given.dtype == np.int32 else tokens.astype(np.int32)  # (an export's array is kept as it is)
        return Datastore(kept, starts, by_n, min_n, max_n, per_key)

    def continuations(self, context: list[int], length: int, limit: int, exclude: int | None = None) -> list[list[int]]:
        """As NgramIndex.continuations (exclude does not apply: the datastore holds no text being decoded)."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            found = _distinct(self._after(context[-n:], length), limit)
            if found:
                return found
        return []

    def _after(self, gram: list[int], length: int):
        """The continuations (up to `length` tokens, within their sequence) of the newest `per_key` occurrences of
        `gram`, newest first."""
        k = 0
        for t in gram:
            k = (k * _P + t + 1) & _MASK
        keys, ends = self.by_n[len(gram)]
        lo, hi = np.searchsorted(keys, np.uint64(k), "left"), np.searchsorted(keys, np.uint64(k), "right")
        hits = 0
        for e in ends[lo:hi][::-1].tolist():  # newest first
            if self.tokens[e - len(gram) + 1: e + 1].tolist() != gram:
                continue  # (another n-gram with the same key)
            hits += 1
            if hits > self.per_key:
                return
            nxt = int(np.searchsorted(self.starts, e, "right"))  # the next sequence: this one ends at its start
            end = int(self.starts[nxt]) if nxt < len(self.starts) else len(self.tokens)
            yield self.tokens[e + 1: min(end, e + 1 + length)].tolist()


class LookupDrafter(Drafter):
    """Prompt lookup and datastore retrieval. Per row: the continuations (up to `num_tokens` long, at most
    `max_matches` of them) of the longest n-gram (`max_ngram` down to `min_ngram` tokens, the root included) that
    ends the text and occurred before, in the text itself first and then in the datastore, merged into a trie.
    Deterministic drafts (q is a point mass)."""

    def __init__(self, num_tokens: int = 5, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 4,
                 datastore: Datastore | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.num_tokens, self.max_matches = num_tokens, max_matches
        self.min_ngram, self.max_ngram, self.datastore = min_ngram, max_ngram, datastore
        self.text: NgramIndex | None = None

    @property
    def max_nodes(self) -> int:
        return 1 + self.num_tokens * self.max_matches

    def describe(self) -> dict:
        return {"kind": "lookup", "num_tokens": self.num_tokens, "max_ngram": self.max_ngram,
                "max_matches": self.max_matches, "datastore": self.datastore is not None}

    def begin(self, prompt: PromptState, sampling, generator) -> None:
        rows = ([t for t, v in zip(row, ok) if v] for row, ok in zip(prompt.ids.tolist(), prompt.valid.tolist()))
        self.text = NgramIndex.of(rows, self.min_ngram, self.max_ngram, per_key=4 * self.max_matches)
        self.device = prompt.ids.device

    def _candidates(self, b: int, root: int) -> list[list[int]]:
        context = self.text.seqs[b] + [root]
        found = self.text.continuations(context, self.num_tokens, self.max_matches, exclude=b)
        if len(found) < self.max_matches and self.datastore is not None:
            more = self.datastore.continuations(context, self.num_tokens, self.max_matches - len(found))
            found += [c for c in more if c not in found]
        return found

    def propose(self, root: torch.Tensor) -> Proposal:
        rows = []
        for b, r in enumerate(root.tolist()):
            tokens, parents, children = [r], [-1], [{}]  # a trie: children[node] maps token -> node
            for cont in self._candidates(b, r):
                node = 0
                for t in cont:
                    if t not in children[node]:
                        children[node][t] = len(tokens)
                        tokens.append(t)
                        parents.append(node)
                        children.append({})
                    node = children[node][t]
            rows.append((tokens, parents))
        return padded_proposal(rows, self.device)

    def commit(self, step: StepResult) -> None:
        live, toks = step.live_rows(), step.path_tokens()
        for b in range(len(step.paths)):
            if live[b]:
                start = len(self.text.seqs[b])
                self.text.seqs[b] += toks[b]
                self.text.seqs[b] += step.extra[b] if step.extra is not None else []
                self.text.add(b, start)

    def follow(self, committed: list[list[int]]) -> None:
        for b, toks in enumerate(committed):
            start = len(self.text.seqs[b])
            self.text.seqs[b] += toks
            self.text.add(b, start)


def padded_proposal(rows: list[tuple[list[int], list[int]]], device) -> Proposal:
    """Per-row (tokens, parents) trees -> one Proposal, padded to the largest (padding masked, never accepted)."""
    N = max(len(t) for t, _ in rows)
    tok = torch.zeros(len(rows), N, dtype=torch.long)
    par = torch.full((len(rows), N), -1, dtype=torch.long)
    ok = torch.zeros(len(rows), N, dtype=torch.bool)
    for b, (t, p) in enumerate(rows):
        tok[b, : len(t)], par[b, : len(p)], ok[b, : len(t)] = torch.tensor(t), torch.tensor(p), True
    return Proposal(tok.to(device), TreeView.of_parents(par.to(device), ok.to(device)))
