"""The contract between training and decoding: draft.safetensors + draftlab.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .base import base_identity

FORMAT_VERSION = 1
WEIGHTS, META = "draft.safetensors", "draftlab.json"


class ExportError(ValueError):
    """An export directory that is missing, malformed, or made for another base."""


def save_export(draft, base, out_dir: str | Path, base_name: str, default_tree: list | None = None,
                extra: dict | None = None) -> Path:
    """Write the draft module's weights and metadata atomically (tmp files, then rename)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()
               if not k.startswith("base_")}  # frozen base tensors a head may hold by reference are not exported
    meta = {"format_version": FORMAT_VERSION, "head": draft.config(), "base": base_identity(base, base_name),
            "default_tree": default_tree, **(extra or {})}
    save_file(tensors, out / (WEIGHTS + ".tmp"), metadata={"format": "draftlab"})
    (out / (META + ".tmp")).write_text(json.dumps(meta, indent=2))
    os.replace(out / (WEIGHTS + ".tmp"), out / WEIGHTS)
    os.replace(out / (META + ".tmp"), out / META)
    return out


def read_meta(export_dir: str | Path) -> dict:
    """draftlab.json of an export, checked for the format version."""
    d = Path(export_dir)
    if not (d / META).is_file() or not (d / WEIGHTS).is_file():
        raise ExportError(f"{d}: not a draftlab export (needs {WEIGHTS} and {META}; training writes them to "
                          "OUTPUT_DIR/export)")
    meta = json.loads((d / META).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{d / META}: format_version {meta.get('format_version')}, this draftlab reads "
                          f"{FORMAT_VERSION}; re-export with a matching draftlab")
    return meta


def check_base(meta: dict, base, where: str = "export") -> None:
    """Refuse a base whose shape differs from the one the heads were trained on; say what differs."""
    want, have = meta["base"], base_identity(base)
    diffs = [f"{k}: export has {want.get(k)!r}, base has {have[k]!r}"
             for k in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers") if want.get(k) != have[k]]
    if diffs:
        raise ExportError(f"{where} was trained for base {want.get('name_or_path')!r}, which differs from the "
                          "base given: " + "; ".join(diffs) + ". Pass the base the heads were trained on.")


def load_export(export_dir: str | Path, base=None, device=None, dtype: torch.dtype | None = None):
    """Rebuild the draft module of an export (checking it against `base` when given); returns (module, meta)."""
    from .heads import build_draft

    meta = read_meta(export_dir)
    if base is not None:
        check_base(meta, base, where=str(export_dir))
    h = meta["head"]
    draft = build_draft(h, h["hidden_size"], h["vocab_size"], base=None)
    if hasattr(draft, "attach_base") and base is not None:
        draft.attach_base(base)
    state = load_file(Path(export_dir) / WEIGHTS)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("base_")]
    if missing or unexpected:
        raise ExportError(f"{export_dir}: weights do not match the head config (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]})")
    draft.requires_grad_(False).eval()
    if device is not None or dtype is not None:
        draft.to(device=device, dtype=dtype)
    return draft, meta
