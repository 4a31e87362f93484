"""What every drafter kind builds on: the decoder's interface (re-exported from decode/interface.py), the base's
embeddings and rotary table for modules that read them, and reading an export's weight files."""

from __future__ import annotations

from pathlib import Path

import torch

from ..decode.interface import Drafter, PromptState, Proposal, StepResult  # noqa: F401 (the interface, re-exported)


class ExportError(ValueError):
    """An export directory that is missing, malformed, or made for another base."""


def read_safetensors(path: Path) -> dict:
    """A safetensors file's tensors, or an ExportError naming the damaged file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"{path}: damaged or truncated safetensors file ({e}). Export again from the run "
                          "(rerunning `draftlab train RECIPE` on a finished run rewrites OUTPUT_DIR/export)") from None


def pad_commit(W: int, *parts: torch.Tensor) -> tuple:
    """A commit's tensors [B, M, ...] (features, token ids or positions, valid) padded with zeros to W entries along
    dim 1: the padding is holes (not valid), so the commits of a static path all have one shape."""
    return tuple(torch.cat([t, t.new_zeros(t.shape[0], W - t.shape[1], *t.shape[2:])], 1) for t in parts)


def empty_commit(B: int, W: int, feats_like: tuple, device) -> tuple:
    """A commit of W entries per row that are all holes: (features [B, W, *shape] of feats_like's (dtype, shape),
    token ids or positions [B, W], valid [B, W] all False). A drafter that enters a commit in its next proposal's
    call gives its first proposal after the prompt this one, so every step is the same call."""
    dtype, shape = feats_like
    return (torch.zeros(B, W, *shape, dtype=dtype, device=device), torch.zeros(B, W, dtype=torch.long, device=device),
            torch.zeros(B, W, dtype=torch.bool, device=device))


class ReadsBase:
    """For draft modules that read the frozen base's embeddings and rotary table (EAGLE-3, DFlash): the base is held
    outside the module's parameters (not trained, not saved) and attached when the module is built or loaded."""

    _base = None

    def attach_base(self, base) -> None:
        self._base = [base]  # a list: not a submodule

    @property
    def base(self):
        if self._base is None:
            raise ValueError(f"a {self.kind} drafter needs its base attached (load_export(..., base=model))")
        return self._base[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The base's (frozen) input embeddings of ids."""
        with torch.no_grad():
            return self.base.get_input_embeddings()(ids)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        """The base's rotary (cos, sin) at positions, in x's dtype."""
        cos, sin = self.base.base_model.rotary_emb(x, positions)
        return cos.to(x.dtype), sin.to(x.dtype)
