"""Converters between draftlab exports and the formats other tools read and write.

Import: FasterDecoding Medusa heads (`medusa_lm_head.pt` / `.safetensors`: `{h}.{l}.linear.weight|bias` for the
residual blocks and `{h}.{L}.weight` for each head's lm_head; config `medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`), Medusa-2 checkpoints (the same keys under `medusa_head.` inside the model's own
shards, whose directory is then the base), and vLLM Medusa checkpoints (`blocks.{h}.layers.{l}.weight|bias`,
`lm_heads.{h}.weight`).

Export: `vllm-medusa` (what vLLM's Medusa model loads: the names above plus a config with model_type medusa,
num_heads, num_hidden_layers, hidden_size, vocab_size, truncated_vocab_size and medusa_fc_bias), `medusa` (the
FasterDecoding layout), `hf` (an SSM as a plain Hugging Face directory with the tokenizer). Every export gets a
model card. Hydra heads have no engine format: no serving engine implements sequentially dependent heads.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import torch

from .export import content_fingerprint, files_fingerprint, load_export, read_meta, readable_as_umask, save_export

FORMATS = ("vllm-medusa", "medusa", "hf")
_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")  # FasterDecoding residual blocks
_LINEAR = re.compile(r"^(\d+)\.(\d+)\.weight$")  # FasterDecoding: head h's final lm_head is its layer L
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


class ConvertError(ValueError):
    """A checkpoint or export that cannot be converted as asked; says which key or field and why."""


# --- import ---------------------------------------------------------------------------------------

def _read(path: Path, keep=lambda k: True) -> dict:
    """The tensors of a .safetensors / .pt / .bin file whose names pass `keep` (others are never read)."""
    from safetensors import SafetensorError, safe_open

    try:
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as f:
                return {k: f.get_tensor(k) for k in f.keys() if keep(k)}
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (SafetensorError, OSError) as e:
        raise ConvertError(f"{path}: damaged or unreadable weights file ({e})") from None
    except Exception as e:  # noqa: BLE001 - pickle / zip errors of a foreign file
        raise ConvertError(f"{path}: not a readable PyTorch state dict ({type(e).__name__}: {e})") from None
    return {k: v for k, v in state.items() if keep(k)}


def _is_head_key(k: str) -> bool:
    k = k.removeprefix("medusa_head.").removeprefix("medusa_heads.")
    return bool(_BLOCK.match(k) or _LINEAR.match(k) or _VLLM_BLOCK.match(k) or _VLLM_HEAD.match(k))


HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def hub_checkpoint(repo_id: str) -> Path:
    """The snapshot directory of a hub repository holding Medusa heads, downloaded into the hub cache (offline: read
    from it). Only what the import reads: the config and the head file, or, where the repository has none (Medusa-2,
    whose heads sit inside the model), the model's shards."""
    from huggingface_hub import snapshot_download

    from ..base import hub_offline

    def fetch(patterns):
        return Path(snapshot_download(repo_id, allow_patterns=["config.json", *patterns]))

    try:
        folder = fetch(list(HEAD_FILES))
        if not any((folder / n).is_file() for n in HEAD_FILES):
            folder = fetch(["model*.safetensors", "model.safetensors.index.json"])
            if not any(folder.glob("model*.safetensors")):
                folder = fetch(["pytorch_model*.bin", "pytorch_model.bin.index.json"])
    except Exception as e:  # noqa: BLE001 - the hub client's many errors (offline, no such repository, auth)
        why = ("HF_HUB_OFFLINE is set and it is not in the hub cache" if hub_offline() else
               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise ConvertError(f"{repo_id}: no such file or directory here, and as a hub id it could not be read ({why}); "
                           "give a local directory or weights file, or download it first (`hf download ID`)") from None
    return folder


def find_medusa_tensors(src: str | Path) -> tuple[dict, dict, Path | None]:
    """(head tensors under FasterDecoding or vLLM names, the checkpoint's config, and the checkpoint directory when
    the heads sit inside a model's own shards (Medusa-2: that directory is the base) else None). src: a directory, a
    weights file, or a hub id (hub_checkpoint)."""
    from ..base import looks_like_path

    if not Path(src).expanduser().exists() and not looks_like_path(str(src)) and str(src).count("/") == 1:
        src = hub_checkpoint(str(src))
    src = Path(src).expanduser()
    if not src.exists():
        raise ConvertError(f"{src}: no such file or directory")
    folder = src if src.is_dir() else src.parent
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if src.is_file():
        files = [src]
    else:
        heads = [src / n for n in HEAD_FILES if (src / n).is_file()]
        files = heads[:1] or sorted(src.glob("model*.safetensors")) or sorted(src.glob("pytorch_model*.bin"))
        if not files:
            raise ConvertError(f"{src}: no medusa_lm_head.pt / .safetensors and no model shards to read heads from")
    tensors, inside_model = {}, False
    for f in files:
        shard = f.name.startswith(("model", "pytorch_model"))
        # A shard also holds the base's weights: only head-shaped names are read (a 7B shard is never loaded whole).
        for k, v in _read(f, _is_head_key if shard else (lambda k: True)).items():
            inside_model = inside_model or (shard and k.startswith("medusa_head."))
            tensors[k.removeprefix("medusa_head.").removeprefix("medusa_heads.")] = v
    return tensors, config, (folder if inside_model else None)


def parse_medusa(tensors: dict, where: str, config: dict | None = None) -> tuple[list[list[tuple]], list[torch.Tensor],
                                                                               str]:
    """Per head, its blocks [(weight, bias or None)] and its lm_head weight, from FasterDecoding or vLLM names.
    Heads are counted from the tensors (published configs can name fewer heads than the file holds). vLLM's layout
    is read as vLLM's loader reads it (`config`): with `original_lm_head` every head shares lm_heads.0, and block
    biases count only with `medusa_fc_bias` (vLLM builds none otherwise and passes over the tensors)."""
    config = config or {}
    blocks: dict = {}
    heads: dict = {}
    layout = None
    lin: dict = {}
    for k, v in tensors.items():
        if m := _BLOCK.match(k):
            h, l, kind = int(m[1]), int(m[2]), m[3]
            blocks.setdefault(h, {}).setdefault(l, {})[kind] = v
            layout = layout or "medusa"
        elif m := _VLLM_BLOCK.match(k):
            h, l, kind = int(m[1]), int(m[2]), m[3]
            blocks.setdefault(h, {}).setdefault(l, {})[kind] = v
            layout = layout or "vllm-medusa"
        elif m := _VLLM_HEAD.match(k):
            heads[int(m[1])] = v
            layout = layout or "vllm-medusa"
        elif m := _LINEAR.match(k):
            lin.setdefault(int(m[1]), {})[int(m[2])] = v
        elif k == "token_map":
            raise ConvertError(f"{where}: key 'token_map' (a truncated draft vocabulary) is not supported; export the "
                               "heads with the full vocabulary")
        else:
            raise ConvertError(f"{where}: key {k!r} is not a Medusa head weight (expected {{h}}.{{l}}.linear.weight/"
                               "bias and {h}.{L}.weight, or blocks.{h}.layers.{l}.weight and lm_heads.{h}.weight)")
    for h, layers in lin.items():  # FasterDecoding: the lm_head is the Linear after the L residual blocks
        L = max(layers)
        if L != len(blocks.get(h, {})):
            raise ConvertError(f"{where}: head {h} has a Linear at index {L} but {len(blocks.get(h, {}))} residual "
                               f"blocks; its lm_head must come right after the blocks (key {h}.{L}.weight)")
        heads[h] = layers[L]
    if layout == "vllm-medusa" and config.get("original_lm_head") and set(heads) == {0}:
        heads = {h: heads[0] for h in sorted(set(blocks) | {0})}  # one lm_head, the base's, shared by every head
    if missing := sorted(set(blocks) - set(heads)):
        raise ConvertError(f"{where}: heads {missing} have residual blocks but no lm_head weight (vLLM's layout with "
                           "one lm_head shared by every head says so with original_lm_head: true in config.json)")
    if layout == "vllm-medusa" and not config.get("medusa_fc_bias"):
        for layers in blocks.values():
            for parts in layers.values():
                parts.pop("bias", None)  # (as vLLM serves it: no bias parameters to load them into)
    K = len(heads)
    if K == 0:
        raise ConvertError(f"{where}: no Medusa lm_head weights found")
    if sorted(heads) != list(range(K)):
        raise ConvertError(f"{where}: heads {sorted(heads)} are not numbered 0..{K - 1}")
    out = []
    for h in range(K):
        layers = blocks.get(h, {})
        if sorted(layers) != list(range(len(layers))):
            raise ConvertError(f"{where}: head {h} has residual blocks {sorted(layers)}, not 0..{len(layers) - 1}")
        rows = []
        for l in range(len(layers)):
            if "weight" not in layers[l]:
                raise ConvertError(f"{where}: head {h} block {l} has a bias but no weight")
            rows.append((layers[l]["weight"], layers[l].get("bias")))
        out.append(rows)
    if len({len(r) for r in out}) != 1:
        raise ConvertError(f"{where}: heads have different numbers of residual blocks ({[len(r) for r in out]})")
    return out, [heads[h] for h in range(K)], layout or "medusa"


def import_medusa(src: str | Path, out: str | Path, base: str | None = None, dtype: str = "float32") -> dict:
    """Convert a FasterDecoding / Medusa-2 / vLLM Medusa checkpoint into a draftlab export."""
    from ..base import load_base
    from ..drafters.heads import MedusaHeads

    tensors, config, medusa2_base = find_medusa_tensors(src)
    blocks, lm, layout = parse_medusa(tensors, str(src), config)
    if medusa2_base is not None and not Path(src).expanduser().exists():  # (a hub id: the base is that repository)
        medusa2_base = src
    base_name = base or (str(medusa2_base) if medusa2_base else config.get("base_model_name_or_path"))
    if not base_name:
        raise ConvertError(f"{src}: no --base given and the checkpoint names no base_model_name_or_path; pass "
                           "--base with the model the heads were trained on")
    model, _ = load_base(base_name, dtype)
    H, V = model.config.hidden_size, model.get_output_embeddings().weight.shape[0]
    K, L = len(lm), len(blocks[0])
    for h in range(K):
        if tuple(lm[h].shape) != (V, H):
            raise ConvertError(f"{src}: head {h}'s lm_head is {tuple(lm[h].shape)}, the base {base_name!r} needs "
                               f"({V}, {H}) (vocab, hidden); is this the base the heads were trained on?")
        for l, (w, b) in enumerate(blocks[h]):
            if tuple(w.shape) != (H, H) or (b is not None and tuple(b.shape) != (H,)):
                raise ConvertError(f"{src}: head {h} block {l} has shape {tuple(w.shape)}, the base is {H} wide")
    heads = MedusaHeads(H, V, K, L)
    with torch.no_grad():
        for h in range(K):
            for l, (w, b) in enumerate(blocks[h]):
                lin = heads.blocks[h][l].linear
                lin.weight.copy_(w.float())
                lin.bias.copy_(b.float() if b is not None else torch.zeros(H))  # vLLM without medusa_fc_bias: no bias
            heads.lm_heads[h].weight.copy_(lm[h].float())
    stated = config.get("medusa_num_heads", config.get("num_heads"))
    info = {"path": str(src), "layout": layout, "medusa2": medusa2_base is not None, "config_num_heads": stated,
            "num_heads": K, "num_layers": L}
    save_export(heads, model, out, base_name, extra={"imported_from": info})
    return {"export": str(out), "base": base_name, **info}


# --- export to engines ----------------------------------------------------------------------------

HYDRA_REFUSAL = ("Hydra / Hydra++ heads are sequentially dependent (each head reads the embeddings of the tokens "
                 "drafted before it, and Hydra++ runs a prefix attention layer): no serving engine implements them, and "
                 "written as Medusa weights they would load and then draft wrongly. Serve them with `draftlab generate` / "
                 "`draftlab eval`, or train Medusa heads (head.type: medusa) for vLLM / TensorRT-LLM / FasterDecoding.")


def vllm_medusa_state(heads) -> tuple[dict, dict]:
    """Tensors and config.json in vLLM's Medusa layout (block biases kept: medusa_fc_bias true)."""
    state = {}
    for h in range(heads.num_heads):
        for l, block in enumerate(heads.blocks[h]):
            state[f"blocks.{h}.layers.{l}.weight"] = block.linear.weight.detach().contiguous()
            state[f"blocks.{h}.layers.{l}.bias"] = block.linear.bias.detach().contiguous()
        state[f"lm_heads.{h}.weight"] = heads.lm_heads[h].weight.detach().contiguous()
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": heads.hidden_size,
              "vocab_size": heads.vocab_size, "truncated_vocab_size": heads.vocab_size, "num_heads": heads.num_heads,
              "num_hidden_layers": heads.num_layers, "medusa_fc_bias": True, "max_paths": 64, "topk": 10}
    return state, config


def medusa_state(heads, base_name: str) -> tuple[dict, dict]:
    """Tensors and config.json in the FasterDecoding layout. Its MedusaModel builds each head's residual blocks as
    ONE module repeated num_layers times, so only heads whose blocks are all equal can be represented."""
    state = {}
    for h in range(heads.num_heads):
        first = heads.blocks[h][0].linear
        for l, block in enumerate(heads.blocks[h]):
            if l and not (torch.equal(block.linear.weight, first.weight) and torch.equal(block.linear.bias, first.bias)):
                raise ConvertError(
                    f"head {h} has {heads.num_layers} distinct residual blocks, and FasterDecoding's MedusaModel shares "
                    "one block across a head's layers (`[ResBlock(h)] * medusa_num_layers`): loading would keep one of "
                    "them and draft wrongly. Export --to vllm-medusa (distinct layers), or train with head.num_layers: 1")
            state[f"{h}.{l}.linear.weight"] = block.linear.weight.detach().contiguous()
            state[f"{h}.{l}.linear.bias"] = block.linear.bias.detach().contiguous()
        state[f"{h}.{heads.num_layers}.weight"] = heads.lm_heads[h].weight.detach().contiguous()
    return state, {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
                   "base_model_name_or_path": base_name}


def fasterdecoding_note(num_heads: int) -> str | None:
    """What FasterDecoding's current loader does with a heads-only directory of num_heads heads (None: nothing to
    say): its MedusaModel.from_pretrained takes the config with AutoConfig, which needs the base's whole config and
    weights in the directory, and otherwise builds medusa_num_heads = 5 whatever the config says, loading the file
    with strict=False (its older loader read medusa_num_heads)."""
    if num_heads == 5:
        return None
    span = lambda a, b: f"head {a}" if a == b else f"heads {a}..{b}"  # (0-based head indices)
    one = num_heads == 4
    what = (f"{span(num_heads, 4)} keep{'s' * one} {'its' if one else 'their'} random initialisation: decode there "
            f"with a tree no deeper than {num_heads} (mc_sim_7b_63 is 4 deep)" if num_heads < 5
            else f"{span(5, num_heads - 1)} {'is' if num_heads == 6 else 'are'} not loaded: trees deeper than 5 lose "
            f"{'it' if num_heads == 6 else 'them'}")
    return (f"FasterDecoding's current MedusaModel.from_pretrained builds 5 heads for a heads-only directory whatever "
            f"medusa_num_heads says (its older loader reads it), and these are {num_heads}: {what}.")


VLLM_MEDUSA_NOTE = ("vLLM releases that ship a Medusa model (`vllm/model_executor/models/medusa.py`, 0.32.0 the "
                    "last) load this layout; vLLM 0.33.0 and 0.34.0 have none (no `medusa` speculative method), so "
                    "they serve these heads no longer (checked 2026-12-03).")


def serving_note(fmt: str, head: dict) -> str | None:
    """What serving an export in `fmt` should know (the model card and stderr say it), or None."""
    if fmt == "vllm-medusa":
        return VLLM_MEDUSA_NOTE
    return fasterdecoding_note(head["num_heads"]) if fmt == "medusa" else None


def params_text(n: int) -> str:
    """78K, 1.2M, 6.7B: a parameter count as a card says it (0.1M read 78K as 100K; walk-through)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def model_card(meta: dict, fmt: str, eval_dir: str | None, license_id: str, base_model: str | None = None) -> str:
    """README.md for an exported draft: what it is, its base, how it was trained, what it was measured to do.
    base_model: the base's hub id for the card's metadata, where the export names a local directory (the hub reads
    base_model as a model id; a path there was wrong metadata: walk-through)."""
    from ..base import looks_like_path

    head, base, tr = meta["head"], meta["base"], meta.get("training") or {}
    local = looks_like_path(base["name_or_path"])
    if base_model:
        front = f"base_model: {base_model}"
    elif local:
        front = (f"# base_model: the base's hub id (the export names a local directory, {base['name_or_path']}; "
                 "`draftlab export --base-model ID` writes it)")
    else:
        front = f"base_model: {base['name_or_path']}"
    kind = {"medusa": f"{head['num_heads']} Medusa heads ({head['num_layers']} residual block(s) each)",
            "ssm": f"a small draft LM ({head.get('num_layers')} layer{'s' * (head.get('num_layers') != 1)}, "
                   f"{params_text(head.get('params', 0))} parameters)"
            }.get(head["type"], head["type"])
    lines = ["---", f"license: {license_id}", front,
             "tags: [speculative-decoding, draftlab, " + ("medusa" if head["type"] == "medusa" else "draft-model") + "]",
             "---", "", f"# Draft model for `{base['name_or_path']}`", "",
             f"{kind[0].upper() + kind[1:]} for speculative decoding of `{base['name_or_path']}` "
             f"({base['model_type']}, hidden size {base['hidden_size']}, vocabulary {base['vocab_size']}), written by "
             f"draftlab in the `{fmt}` layout. Greedy speculative decoding with it reproduces the base's own greedy "
             "output; it changes speed, not text.", ""]
    if meta.get("adapter"):  # Medusa-2: the heads read the hidden states of the base with its LoRA adapter
        lines[-2] = lines[-2].replace("the base's own greedy output", "the adapted base's greedy output (below)")
        lines += ["**Medusa-2: trained with a LoRA adapter on the base**, in `adapter/` (peft's format). The heads "
                  "read the adapted base's hidden states: serve them with the adapter merged into the base (peft's "
                  "`merge_and_unload`), and that merged model as the target. The outputs are then the adapted "
                  "base's, not the original base's; with the original base as the target the heads draft from "
                  "states they were not trained on.", ""]
    note = serving_note(fmt, head)
    if note:
        lines += [note, ""]
    lines += ["## Training", ""]
    recipe = tr.get("recipe") or {}
    if recipe:
        data = recipe.get("data", {})
        lines += [f"- data: `{data.get('path')}` ({data.get('format')}, max_len {data.get('max_len')})",
                  f"- steps: {tr.get('steps')}; loss: distill_weight {recipe.get('loss', {}).get('distill_weight')}, "
                  f"divergence {recipe.get('loss', {}).get('divergence', 'fkl')}; lr {recipe.get('train', {}).get('lr')}",
                  "- recipe: the `training.recipe` field of draftlab.json in the draftlab export"]
        ev = tr.get("eval") or {}
        if ev.get("agree1"):
            lines.append("- held-out top-1 agreement with the base: " + ", ".join(f"{x:.3f}" for x in ev["agree1"]))
    elif meta.get("imported_from"):
        lines.append(f"- imported from `{meta['imported_from']['path']}` ({meta['imported_from']['layout']} layout)")
    else:
        lines.append("- unknown (the export records no training run)")
    lines += ["", "## Measured", ""]
    summary = Path(eval_dir) / "summary.json" if eval_dir else None
    if summary is not None and summary.is_file():
        s = json.loads(summary.read_text())
        o = s["overall"]
        se = (s.get("slices") or {}).get("all_records") or {}  # standard errors over the questions (eval/slices.py)
        pm = lambda f: f" ± {se[f + '_se']}" if se.get(f + "_se") is not None else ""
        lines += [f"`{eval_command(s)}` on {s['hardware']}, {o['answers']} answer"
                  f"{'s' if o['answers'] != 1 else ''}" + (" (± a standard error over the questions)" if pm(
                      "accept_length") else "") + ":", "",
                  f"- accept length {o['accept_length']}{pm('accept_length')} (tokens per verification forward, bonus "
                  f"included), {o['tokens_per_s']} tokens/s, tree of {s['tree_size']} tokens, batch size 1"]
        if head["type"] == "medusa" and fmt in ("vllm-medusa", "medusa") and s["tree_size"] > head["num_heads"] + 1:
            # (the figures read as the engine's, which drafts otherwise: walk-through)
            lines.append(f"- measured with draftlab's decoder and its {s['tree_size']}-token tree; an engine that "
                         "drafts one top-1 chain (vLLM's Medusa) accepts fewer tokens per step, so measure there "
                         f"(`--tree chain` gives draftlab's chain figure)")
        if "speedup" in o:
            lines.append(f"- {o['speedup']}x{pm('speedup')} draftlab's eager plain decoding of the same base in the "
                         "same run"
                         + (f"; {o['speedup_vs_compiled_plain']}x its compiled plain decoding (the fastest plain "
                            "decoding measured)" if "speedup_vs_compiled_plain" in o else ""))
        if "identical_share" in o:
            lines.append(f"- answers identical to plain greedy decoding: {100 * o['identical_share']:.0f}%")
    else:
        lines += ["Not measured with this export. Measure with `draftlab eval mt-bench EXPORT --questions "
                  "question.jsonl` and pass `--eval RUN_DIR` to `draftlab export` to record it here."]
    lines += ["", f"License: {license_id} (the base model's license governs its use)." , ""]
    return "\n".join(lines)


def eval_command(s: dict) -> str:
    """The `draftlab eval mt-bench` command line of an eval summary's settings (those that change its figures)."""
    words = ["draftlab eval mt-bench", s["export"], "--questions", s["questions"]]
    words += [w for c in s.get("category") or [] for w in ("--category", c)]  # (--category; "categories" holds figures)
    words += ["--limit", str(s["limit"])] if s.get("limit") else []
    words += ["--tree", s["tree"]] if s.get("tree") else []
    words += ["--max-new-tokens", str(s["max_new_tokens"]), "--temperature", str(s["temperature"])]
    words += ["--top-p", str(s["top_p"])] if s.get("top_p", 1.0) < 1 else []
    words += ["--top-k", str(s["top_k"])] if s.get("top_k") else []
    words += ["--typical"] if s.get("typical") else []
    words += ["--compile"] if s.get("compiled") else []
    words += ["--dtype", s["dtype"]] if s.get("dtype") else []
    words += ["--system", json.dumps(s["system"])] if s.get("system") is not None else []
    return " ".join(words)


def export_to(export_dir: str | Path, fmt: str, out: str | Path, eval_dir: str | None = None,
              license_id: str = "other", base_model: str | None = None) -> dict:
    """Write an export in an engine's format (see FORMATS) with a model card; returns what was written.
    base_model: the base's hub id for the card (see model_card)."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ConvertError(f"--to {fmt!r}: use one of {', '.join(FORMATS)}")
    if eval_dir is not None:
        summary = Path(eval_dir) / "summary.json"
        if not summary.is_file():  # (was a card saying "not measured")
            raise ConvertError(f"--eval {eval_dir}: no summary.json there; give the run directory `draftlab eval "
                               "mt-bench ... --out DIR` wrote, or leave --eval out")
        s = json.loads(summary.read_text())  # (else the card gives another's figures)
        content = "export_content" in s  # (summaries before 2026-12-03 know the files by modification time)
        measured = s.get("export_content" if content else "export_files")
        now = content_fingerprint(str(export_dir), s) if content else files_fingerprint(str(export_dir))
        if measured is not None and measured != now:
            raise ConvertError(f"--eval {eval_dir} measured other files than {export_dir} holds now (retrained, or "
                               "another export" + ("" if content else ", or a copy that did not keep the files' "
                               "modification times") + "): run `draftlab eval mt-bench` on this export, or leave "
                               "--eval out")
    meta = read_meta(export_dir)
    kind = meta["head"]["type"]
    if kind == "hydra":
        raise ConvertError(HYDRA_REFUSAL)
    if kind in ("eagle3", "dflash"):  # (the generic refusals below sent these from --to hf to --to medusa and back)
        raise ConvertError(f"{export_dir} holds a {kind} draft, already in the layout vLLM and SGLang load "
                           "(config.json + model.safetensors): give the directory itself to the engine as its draft "
                           f"model, after `draftlab check {export_dir}`; there is nothing to convert (docs/interop.md)")
    if kind in ("lookup", "ensemble"):
        raise ConvertError(f"{export_dir} holds a {kind} drafter, which only draftlab decodes (`draftlab generate`, "
                           "`draftlab eval`); no engine format holds it")
    if fmt == "hf" and kind != "ssm":
        raise ConvertError(f"--to hf writes a standalone model; {export_dir} holds {kind} heads, which run on top of "
                           "their base. Use --to vllm-medusa or --to medusa")
    if fmt != "hf" and kind != "medusa":
        raise ConvertError(f"--to {fmt} is a Medusa heads format; {export_dir} holds a {kind}. Use --to hf")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    if fmt == "hf":
        for f in Path(export_dir).iterdir():
            if f.is_file() and f.name not in ("draftlab.json", "README.md"):
                shutil.copy(f, out / f.name)
                files.append(f.name)
    else:
        heads, _ = load_export(export_dir)
        if fmt == "vllm-medusa":
            state, config = vllm_medusa_state(heads)
            save_file(state, out / "model.safetensors", metadata={"format": "pt"})
            files.append("model.safetensors")
        else:
            state, config = medusa_state(heads, meta["base"]["name_or_path"])
            torch.save(state, out / "medusa_lm_head.pt")
            files.append("medusa_lm_head.pt")
        (out / "config.json").write_text(json.dumps(config, indent=2))
        files.append("config.json")
        if meta.get("adapter"):  # Medusa-2: the heads need their adapted base (the model card says how)
            shutil.copytree(Path(export_dir) / meta["adapter"], out / "adapter", dirs_exist_ok=True)
            files += [f"adapter/{f.name}" for f in (out / "adapter").iterdir()]
    (out / "README.md").write_text(model_card(meta, fmt, eval_dir, license_id, base_model))
    note = serving_note(fmt, meta["head"])
    if note:
        print(f"export: {note}", file=sys.stderr)
    readable_as_umask(Path(out))
    return {"out": str(out), "format": fmt, "files": sorted(files + ["README.md"])}
