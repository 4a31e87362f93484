"""The contract between training and decoding: an export directory with draftlab.json and the draft's weights.

Heads: `draft.safetensors` (the heads module only). SSMs: the directory is also a Hugging Face model
directory (`config.json`, `model.safetensors`, the base's tokenizer), loadable on its own with
`AutoModelForCausalLM.from_pretrained`. `draftlab.json` names the draft kind and the base it was made for.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from pathlib import Path

import torch

from ..base import base_identity, same_embedding
from ..drafters import KINDS, kind_of
from ..drafters.base import ExportError, read_safetensors  # noqa: F401 (part of the contract, re-exported)

FORMAT_VERSION = 1
META = "draftlab.json"
ADAPTER_DIR = "adapter"
CHAT_TEMPLATE = "chat_template.jinja"  # the recipe's base.chat_template, when it set one


def tokenizer_fingerprint(tok) -> dict:
    """What serving must match of the tokenizer used in training: the vocabulary, the special ids and the chat
    template, as hashes (draftlab check compares them with the served tokenizer's)."""
    import hashlib

    def sha(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    vocab = json.dumps(sorted(tok.get_vocab().items()))
    special = {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    template = getattr(tok, "chat_template", None)
    return {"vocab_size": len(tok), "vocab_sha256": sha(vocab), **special,
            "chat_template_sha256": sha(template) if isinstance(template, str) else None}


def save_export(draft, base, out_dir: str | Path, base_name: str, default_tree: list | None = None,
                extra: dict | None = None, tokenizer=None, adapter=None, chat_template: str | None = None) -> Path:
    """Write the draft module's files and draftlab.json (last, atomically: its presence marks a complete export).
    adapter: a peft model whose adapter (Medusa-2's LoRA) goes to ADAPTER_DIR in peft's own format; the export then
    decodes against the base with that adapter. chat_template: the template training rendered conversations with
    where the recipe set one in place of the tokenizer's (CHAT_TEMPLATE; draftlab serves with it, an engine is
    given it with --chat-template)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)
    kind = kind_of(draft.kind)
    files = kind.save(draft, out)
    if tokenizer is not None:
        kind.with_tokenizer(draft, out, tokenizer)
    meta = {"format_version": FORMAT_VERSION, "head": draft.config(), "base": base_identity(base, base_name),
            "default_tree": default_tree, "files": files, **(extra or {})}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer_fingerprint(tokenizer)
    if chat_template is not None:
        (out / CHAT_TEMPLATE).write_text(chat_template, encoding="utf-8")
        meta["chat_template"] = CHAT_TEMPLATE
    if adapter is not None:
        shutil.rmtree(out / ADAPTER_DIR, ignore_errors=True)
        adapter.save_pretrained(out / ADAPTER_DIR)
        meta["adapter"] = ADAPTER_DIR
    (out / (META + ".tmp")).write_text(json.dumps(meta, indent=2))
    os.replace(out / (META + ".tmp"), out / META)
    readable_as_umask(out)
    return out


def readable_as_umask(out: Path) -> None:
    """Give the files under `out` the modes the process's umask gives new files: safetensors (0.8) writes its files
    owner-only (0600), so an engine serving an export as another user could not read the weights."""
    mask = os.umask(0)
    os.umask(mask)
    for f in out.rglob("*"):
        if f.is_file() and f.stat().st_mode & 0o777 == 0o600:
            f.chmod(0o666 & ~mask)


def use_chat_template(tok, export_dir: str | Path, meta: dict):
    """The tokenizer given the chat template training rendered with, where the export keeps one (save_export's
    chat_template); returned for chaining."""
    if meta.get("chat_template"):
        tok.chat_template = (Path(export_dir) / meta["chat_template"]).read_text(encoding="utf-8")
    return tok


def read_meta(export_dir: str | Path) -> dict:
    """draftlab.json of an export, checked for the format version and the files its kind needs."""
    d = Path(export_dir)
    if not (d / META).is_file():
        inside = f"; did you mean {d / 'export'} (the run's export)?" if (d / "export" / META).is_file() else ""
        raise ExportError(f"{d}: not a draftlab export (no {META}; training writes one to OUTPUT_DIR/export){inside}")
    try:
        meta = json.loads((d / META).read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{d / META}: not valid JSON ({e.msg}); export again from the run") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{d / META}: format_version {meta.get('format_version')}, this draftlab reads "
                          f"{FORMAT_VERSION}; re-export with a matching draftlab")
    kind = meta.get("head", {}).get("type")
    if kind not in KINDS:
        raise ExportError(f"{d / META}: draft kind {kind!r} is not one this draftlab knows ({', '.join(KINDS)})")
    missing = [f for f in KINDS[kind].files if not (d / f).is_file()]
    if missing:
        raise ExportError(f"{d}: incomplete {kind} export, missing {', '.join(missing)}; export again from the run")
    return meta


def apply_adapter(base, export_dir: str | Path, meta: dict):
    """The base an export decodes against: with a Medusa-2 adapter in the export, base + adapter merged (the
    adapted base, whose greedy output the decoder then reproduces, not the original base's); else base."""
    if not meta.get("adapter"):
        return base
    from peft import PeftModel

    d = Path(export_dir) / meta["adapter"]
    if not (d / "adapter_config.json").is_file():
        raise ExportError(f"{export_dir}: draftlab.json names the adapter directory {meta['adapter']!r}, which holds no "
                          "adapter_config.json; export again from the run")
    if any(type(w).__name__ == "DTensor" for w in base.parameters()):  # --tp: each rank merges into its shards
        return merge_into_shards(base, d)
    return PeftModel.from_pretrained(base, d).merge_and_unload().eval()


def merge_into_shards(base, adapter_dir: Path):
    """A LoRA adapter merged into a tensor-parallel base, each rank into its own shards: W += (B @ A) * scaling, as
    peft's merge_and_unload computes it, sliced as the weight is split (peft's merge multiplies whole LoRA tensors
    with the sharded weights, and fails). Plain LoRA on linear layers only (no DoRA, no per-layer ranks)."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("rank_pattern") or \
            cfg.get("alpha_pattern"):
        raise ExportError(f"{adapter_dir}: only a plain LoRA adapter (no DoRA, no per-layer ranks) is merged into a "
                          "base split with --tp; decode in one process, or with --device-map auto")
    scale = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    modules = dict(base.named_modules())
    for key in sorted(k for k in weights if k.endswith(".lora_A.weight")):
        name = key[: -len(".lora_A.weight")].removeprefix("base_model.model.")
        w = getattr(modules.get(name), "weight", None)
        if not isinstance(w, DTensor) or w.dim() != 2:
            raise ExportError(f"{adapter_dir}: the adapter's {name} is not a linear layer split by --tp; decode in "
                              "one process, or with --device-map auto")
        a, b = weights[key].to(w.device, w.dtype), weights[key.replace("lora_A", "lora_B")].to(w.device, w.dtype)
        delta = (b @ a) * scale
        if cfg.get("fan_in_fan_out"):
            delta = delta.T
        with torch.no_grad():  # the local slice of the whole delta (src_data_rank None: no communication)
            w.add_(distribute_tensor(delta, w.device_mesh, w.placements, src_data_rank=None))
    return base.eval()


VOCABULARY_ONLY = ("ssm", "lookup")  # drafts that read nothing of the base but its tokens


def _kinds(head: dict) -> list[str]:
    """The draft kinds of an export's head (an ensemble's members', recursively)."""
    if head["type"] != "ensemble":
        return [head["type"]]
    return [k for m in head["members"] for k in _kinds(m["head"])]


def reads_only_tokens(head: dict) -> bool:
    """Whether a draft reads nothing of the base but its tokens (an SSM, lookup, an ensemble of them)."""
    return all(k in VOCABULARY_ONLY for k in _kinds(head))


def check_base(meta: dict, base, where: str = "export") -> None:
    """Refuse a base whose shape differs from the one the draft was trained on, saying what differs: its vocabulary
    for a draft that reads only the base's tokens (an SSM, lookup, an ensemble of them: one small draft serves a
    family of bases that share a tokenizer), its shape too for one that reads the base's states or embeddings. A
    base of the same shape with other weights (its embedding's sample differs) is a warning."""
    want, have = meta["base"], base_identity(base)
    tokens_only = reads_only_tokens(meta["head"])
    shape = ("vocab_size",) if tokens_only else ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")
    diffs = [f"{k}: export has {want.get(k)!r}, base has {have[k]!r}" for k in shape if want.get(k) != have[k]]
    if diffs:
        raise ExportError(f"{where} was trained for base {want.get('name_or_path')!r}, which differs from the "
                          "base given: " + "; ".join(diffs) + ". Pass the base the draft was trained on.")
    if not tokens_only and None not in (want.get("embedding_sample"), have["embedding_sample"]) and \
            not same_embedding(want["embedding_sample"], have["embedding_sample"]):
        warnings.warn(f"{where} was trained for base {want.get('name_or_path')!r}; the base given has its shape but "
                      "other weights (its input embedding differs): the draft reads this base's states as if they "
                      "were that one's, and will be accepted little. Pass the base the draft was trained on.",
                      stacklevel=2)


def check_tokens(meta: dict, tokenizer, where: str = "export") -> None:
    """A draft that reads only the base's tokens (check_base compares no more of the base than its vocabulary size):
    a warning where the base's tokenizer maps ids otherwise than the training tokenizer (draftlab.json's
    fingerprint), as two families' tokenizers of one size do (Llama-2's and Mistral's 32,000). Decoding stays
    lossless; the drafts would be other tokens and rarely accepted."""
    recorded = (meta.get("tokenizer") or {}).get("vocab_sha256")
    if recorded is None or not reads_only_tokens(meta["head"]):
        return
    if tokenizer_fingerprint(tokenizer)["vocab_sha256"] != recorded:
        warnings.warn(f"{where} was trained with another tokenizer than the base's "
                      f"({getattr(tokenizer, 'name_or_path', '?')}): their vocabularies differ (draftlab.json's "
                      "tokenizer fingerprint), so its drafts would be other tokens and rarely accepted. Pass a base "
                      "of the draft's tokenizer (draftlab check --base says what differs).", stacklevel=2)


def load_export(export_dir: str | Path, base=None, device=None, dtype: torch.dtype | None = None):
    """Rebuild the draft module of an export (checking it against `base` when given); returns (module, meta)."""
    meta = read_meta(export_dir)
    if base is not None:
        check_base(meta, base, where=str(export_dir))
    draft = kind_of(meta["head"]["type"]).load(meta["head"], Path(export_dir), base)
    draft.requires_grad_(False).eval()
    if device is not None or dtype is not None:
        draft.to(device=device, dtype=dtype)
    return draft, meta


def _files_digest(path: str, part) -> str | None:
    """sha256 over a local directory's files in name order: each file's relative name and size, then what
    part(file, stat, hash) adds; None where path is no directory (a hub id)."""
    import hashlib

    d = Path(path)
    if not d.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(d)}\0{st.st_size}\0".encode())
        part(f, st, h)
    return h.hexdigest()[:16]


def files_fingerprint(path: str, content: bool = False) -> str | None:
    """A digest of a local model directory's files, or None for a hub id: what says its weights changed in place.
    content: every file's name and bytes (a draft export: a copy that did not keep modification times is the same
    export); else draftlab.json's and config.json's contents and every other file's name, size and modification
    time (a base, whose weights are too large to read for it)."""
    def part(f, st, h):
        if content or f.name in ("draftlab.json", "config.json"):
            with open(f, "rb") as r:
                for block in iter(lambda: r.read(1 << 24), b""):
                    h.update(block)
        else:
            h.update(str(st.st_mtime_ns).encode())

    return _files_digest(path, part)


def files_stat(path: str) -> str | None:
    """A digest of a local directory's files' names, sizes, modification and change times and inode numbers
    (reads no file): unchanged, the files hold what they held when it was taken, so their content digest then is
    theirs now (a copy, or a file rewritten in place, gets another: its change time moves)."""
    return _files_digest(path, lambda f, st, h: h.update(f"{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}"
                                                         .encode()))


def content_fingerprint(path: str, recorded: dict | None = None) -> str | None:
    """files_fingerprint(path, content=True), taken from `recorded` (a run.json or summary holding export_content
    and export_stat) when the files' stat digest is still the one recorded with it: a resumed eval or
    `export --eval` read the whole export again otherwise (4-10 GB for a 1-2B SSM in float32)."""
    recorded = recorded or {}
    if recorded.get("export_content") and recorded.get("export_stat") and \
            recorded["export_stat"] == files_stat(path):
        return recorded["export_content"]
    return files_fingerprint(path, content=True)
