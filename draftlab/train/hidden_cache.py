"""On-disk cache of the frozen base's final hidden states, so epochs after the first skip the base forward.

One file-backed tensor [total_tokens, H] in the base's dtype plus a per-example "done" byte, both
memory-mapped and shared by the processes of a node. The teacher distribution for distillation is
the base's lm_head applied to these same states, so no logits are stored: the cache costs
H values per token instead of V.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path

import numpy as np
import torch

from ..data import Examples, replace_text


def fingerprint(examples: list[dict], base_name: str, dtype: torch.dtype, layers: tuple = (),
                revision: str | None = None) -> str:
    """Identifies what the cached states are: every token id of every example, the base (its name or path, revision,
    and for a local directory its weight files: sizes and samples of their bytes, the same for every copy of them,
    wherever and whenever copied), the dtype and the layers read."""
    h = hashlib.sha256(f"{base_name}|{revision}|{dtype}|{tuple(layers)}|{len(examples)}".encode())
    for f in _weight_files(base_name):
        size = f.stat().st_size
        h.update(f"{f.name}|{size}".encode())
        with open(f, "rb") as fh:  # 16 samples of 64 KiB spread over the file: reads 1 MiB of a file of any size
            for i in range(16):
                fh.seek(size * i // 16)
                h.update(fh.read(1 << 16))
    if isinstance(examples, Examples):  # the same bytes as below, read from the flat ids without making lists
        for a, b in zip(examples.starts.tolist(), examples.ends.tolist()):
            h.update((b - a).to_bytes(4, "little"))
            h.update(memoryview(examples.ids[a:b].astype(np.int64)))
        return h.hexdigest()[:16]
    for e in examples:
        ids = e["input_ids"]
        h.update(len(ids).to_bytes(4, "little"))
        h.update(array("q", ids).tobytes())
    return h.hexdigest()[:16]


def _weight_files(base_name: str) -> list[Path]:
    """A local base directory's weight files (none for a hub id)."""
    d = Path(base_name)
    if not d.is_dir():
        return []
    return sorted(f for f in d.iterdir() if f.suffix in (".safetensors", ".bin", ".pt", ".pth") and f.is_file())


class HiddenCache:
    """Base hidden states per training example, written on first use and read afterwards."""

    def __init__(self, directory: str | Path, examples: list[dict], hidden_size: int, dtype: torch.dtype,
                 base_name: str, create: bool, layers: tuple = (), revision: str | None = None):
        d = Path(directory)
        self.lengths = (examples.lengths.tolist() if isinstance(examples, Examples)
                        else [len(e["input_ids"]) for e in examples])
        self.offsets = [0, *np.cumsum(self.lengths, dtype=np.int64).tolist()]
        self.hidden_size, self.dtype = hidden_size, dtype
        fp = fingerprint(examples, base_name, dtype, layers, revision)
        meta = {"fingerprint": fp, "examples": len(examples), "tokens": self.offsets[-1], "hidden_size": hidden_size,
                "dtype": str(dtype)}
        if create:
            d.mkdir(parents=True, exist_ok=True)
            old = d / "meta.json"
            if not old.is_file() or json.loads(old.read_text()) != meta:
                for f in ("hidden.bin", "done.bin"):
                    (d / f).unlink(missing_ok=True)
                replace_text(old, json.dumps(meta))  # (whole: a torn one would fail every later run)
        elif json.loads((d / "meta.json").read_text()) != meta:
            raise RuntimeError(f"{d}: hidden-state cache was made for other data or another base")
        total = max(1, self.offsets[-1] * hidden_size)
        self.data = torch.from_file(str(d / "hidden.bin"), shared=True, size=total, dtype=dtype)
        self.done = torch.from_file(str(d / "done.bin"), shared=True, size=max(1, len(examples)), dtype=torch.uint8)

    def get(self, indices: list[int], seq_len: int, device) -> torch.Tensor | None:
        """[B, seq_len, H] right-padded with zeros, or None if any example is not cached yet."""
        if not all(self.done[i] for i in indices):
            return None
        out = torch.zeros(len(indices), seq_len, self.hidden_size, dtype=self.dtype)
        for b, i in enumerate(indices):
            n = self.lengths[i]
            out[b, :n] = self.data[self.offsets[i] * self.hidden_size:self.offsets[i + 1] * self.hidden_size].view(n, -1)
        return out.to(device, non_blocking=True)

    def put(self, indices: list[int], hidden: torch.Tensor) -> None:
        """Store the real (unpadded) positions of each example; the done byte is set after the data."""
        hidden = hidden.detach().to("cpu", self.dtype)
        for b, i in enumerate(indices):
            if self.done[i]:
                continue
            n = self.lengths[i]
            self.data[self.offsets[i] * self.hidden_size:self.offsets[i + 1] * self.hidden_size] = hidden[b, :n].reshape(-1)
            self.done[i] = 1
