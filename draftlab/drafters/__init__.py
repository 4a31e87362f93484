"""Everything that proposes tokens, behind the one interface the decoder consumes (`base.Drafter`).

Each draft kind is one entry of `KINDS`: how a recipe builds its trainable module, how an export stores
and reloads it, which drafter decodes with it and its default tree. Adding a kind touches this package
and the recipe schema, never the decoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..decode.tree import Tree
from .base import Drafter, PromptState, Proposal, StepResult, rank_of

WEIGHTS = "draft.safetensors"


@dataclass(frozen=True)
class DraftKind:
    """How one kind of draft model is built, stored, reloaded and decoded with."""

    build: Callable  # (head section dict, base) -> trainable nn.Module, initialised from the base
    save: Callable  # (module, out_dir) -> list of files written
    load: Callable  # (export's head dict, export_dir, base or None) -> module
    drafter: Callable  # (module, Tree) -> Drafter
    default_tree: Callable  # (module) -> Tree
    files: tuple  # files an export of this kind must hold besides draftlab.json
    # (module, base, ids [1, S], depth) -> [S, depth] long: at state t (x_0..x_t committed, root x_{t+1}),
    # the rank of the true x_{t+d+2} among the draft's candidates at depth d+1 when the path above it is
    # the true one; V where the text has no such token. The tree search's statistics.
    ranks: Callable
    # (module, out_dir, tokenizer) -> None: what the export needs of the training tokenizer beyond draftlab.json's
    # fingerprint (an SSM directory loads on its own with it; DFlash names its mask token for SGLang)
    with_tokenizer: Callable = lambda module, out, tokenizer: None


# --- heads: draft.safetensors holds the heads module ------------------------------------------------

def _build_heads(head: dict, base):
    from .heads import build_heads

    return build_heads(head, base.config.hidden_size, base.get_output_embeddings().weight.shape[0], base=base)


def _save_heads(module, out: Path) -> list[str]:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, out / (WEIGHTS + ".tmp"), metadata={"format": "draftlab"})
    (out / (WEIGHTS + ".tmp")).replace(out / WEIGHTS)
    return [WEIGHTS]


def _load_heads(head: dict, export_dir: Path, base):
    from .heads import build_heads
    from .base import ExportError, read_safetensors

    module = build_heads(head, head["hidden_size"], head["vocab_size"], base=None)
    if hasattr(module, "attach_base") and base is not None:
        module.attach_base(base)
    state = read_safetensors(export_dir / WEIGHTS)
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{export_dir / WEIGHTS}: weights do not match the head config in draftlab.json "
                          f"(missing {missing[:5]}, unexpected {unexpected[:5]}); re-export the run")
    return module


def _heads_tree(module) -> Tree:
    from ..decode.search import default_tree

    return default_tree(module.num_heads)


def _heads_drafter(module, tree: Tree) -> Drafter:
    from .heads import HeadsDrafter

    return HeadsDrafter(module, tree)


@torch.no_grad()
def _heads_ranks(module, base, ids: torch.Tensor, depth: int) -> torch.Tensor:
    from ..base import base_hidden

    S, V = ids.shape[1], base.get_output_embeddings().weight.shape[0]
    h = base_hidden(base, ids, torch.ones_like(ids))
    feats = module.train_hidden(h.to(next(module.parameters()).dtype), ids, torch.ones_like(ids))
    ranks = torch.full((S, depth), V, dtype=torch.long, device=ids.device)
    for k in range(min(depth, module.num_heads)):
        n = S - (k + 2)  # head k at position t predicts x_{t+k+2}
        if n > 0:
            ranks[:n, k] = rank_of(module.lm_heads[k](feats[k][0, :n]), ids[0, k + 2:])
    return ranks


HEADS = DraftKind(_build_heads, _save_heads, _load_heads, _heads_drafter, _heads_tree, (WEIGHTS,), _heads_ranks)


# --- SSM: the export directory is itself a Hugging Face model directory -------------------------------

def _build_ssm(head: dict, base):
    from .ssm import build_ssm

    return build_ssm(head, base)


def _save_ssm(module, out: Path) -> list[str]:
    module.lm.save_pretrained(out, safe_serialization=True)
    return ["config.json", "model.safetensors"]


def _load_ssm(head: dict, export_dir: Path, base):
    from safetensors import SafetensorError
    from ..base import pretrained_lm
    from .base import ExportError
    from .ssm import SSMDraft, check_vocab

    try:
        lm = pretrained_lm(export_dir, dtype=torch.float32)
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"{export_dir}: the SSM's Hugging Face files do not load ({e}); re-export the run") from None
    if base is not None:
        check_vocab(lm, base, str(export_dir))
    return SSMDraft(lm, {k: head[k] for k in ("source", "init") if k in head})


def _ssm_drafter(module, tree: Tree) -> Drafter:
    from .ssm import SSMDrafter

    return SSMDrafter(module.lm, tree)


@torch.no_grad()
def _ssm_ranks(module, base, ids: torch.Tensor, depth: int) -> torch.Tensor:
    S, V = ids.shape[1], base.get_output_embeddings().weight.shape[0]
    at = torch.full((S + depth + 1,), V, dtype=torch.long, device=ids.device)
    at[: S - 1] = rank_of(module.lm(input_ids=ids).logits[0, :-1], ids[0, 1:])  # at[j]: rank of x_{j+1}
    # Depth d+1 below root x_{t+1} is the SSM's prediction at position t+1+d, on the true path.
    return torch.stack([at[1 + d: 1 + d + S] for d in range(depth)], dim=1)


SSM_DEFAULT_CHAIN = 4
SSM = DraftKind(_build_ssm, _save_ssm, _load_ssm, _ssm_drafter, lambda m: Tree.chain(SSM_DEFAULT_CHAIN),
                ("config.json", "model.safetensors"), _ssm_ranks,
                lambda module, out, tokenizer: tokenizer.save_pretrained(out))

# --- eagle3: the EAGLE-3 checkpoint layout (model.safetensors + config.json that vLLM / SGLang read) --------

def _build_eagle(head: dict, base):
    from .eagle import Eagle3Draft

    module = Eagle3Draft(Eagle3Draft.settings(head, base), base)
    module.fit_vocab([])  # the whole vocabulary, or a placeholder until the trainer counts its data
    return module


def _save_engine_layout(module, out: Path) -> list[str]:
    from safetensors.torch import save_file

    state = module.engine_state() if hasattr(module, "engine_state") else module.state_dict()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, out / "model.safetensors.tmp", metadata={"format": "pt"})
    (out / "model.safetensors.tmp").replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(module.engine_config(), indent=2) + "\n")
    return ["config.json", "model.safetensors"]


def _load_engine_layout(module, export_dir: Path):
    """A module of the engines' checkpoint layout (eagle3, dflash) with the weights of its model.safetensors."""
    from .base import ExportError, read_safetensors

    state = read_safetensors(export_dir / "model.safetensors")
    missing, unexpected = module.load_state_dict(state, strict=False)
    if getattr(module, "full_vocab", False) and set(missing) == {"d2t", "t2d"}:  # (see Eagle3Draft.engine_state)
        module.loaded_without_maps()
        missing = []
    if missing or unexpected:
        raise ExportError(f"{export_dir / 'model.safetensors'}: weights do not match the {module.kind} config in "
                          f"draftlab.json (missing {missing[:5]}, unexpected {unexpected[:5]}); re-export the run")
    return module


def _load_eagle(head: dict, export_dir: Path, base):
    from .eagle import Eagle3Draft

    return _load_engine_layout(Eagle3Draft({k: v for k, v in head.items() if k != "type"}, base), export_dir)


def _eagle_drafter(module, tree) -> Drafter:
    from ..decode.tree import DynamicTree, TreeError
    from .eagle import Eagle3Drafter

    if not isinstance(tree, DynamicTree):
        raise TreeError("an eagle3 drafter builds its tree every step: give --tree dynamic:DEPTH,TOP_K,TOTAL_TOKENS "
                        "(default dynamic:7,10,60), not a static tree")
    return Eagle3Drafter(module, tree.depth, tree.top_k, tree.total_tokens)


@torch.no_grad()
def _eagle_ranks(module, base, ids: torch.Tensor, depth: int) -> torch.Tensor:
    """Along the true path, as the training-time test unrolls it: step k at slot t reads the drafter's own state
    of step k - 1 and predicts x_{t+k+2}, which is what the drafter computes for the depth-(k+1) node on the true
    path (tests/test_eagle.py). Ranks are over the draft vocabulary; a token outside it is never proposed (rank V).
    What a chain (a dynamic tree with top_k 1) accepts; the default dynamic trees are rebuilt every step from
    off-path nodes too, so they have no replay (the training estimate measures them)."""
    from ..base import base_states

    S, V = ids.shape[1], base.get_output_embeddings().weight.shape[0]
    states = base_states(base, ids, torch.ones_like(ids), module.base_layers)
    g = module.fuse(states[:, :, : len(module.base_layers)])
    as_draft = torch.full((V,), -1, dtype=torch.long, device=ids.device)
    as_draft[module.draft_ids()] = torch.arange(module.d2t.numel(), device=ids.device)
    ranks = torch.full((S, depth), V, dtype=torch.long, device=ids.device)
    for k, o in enumerate(module.unroll(g, ids, torch.ones_like(ids, dtype=torch.bool), depth)):
        n = S - (k + 2)  # slot t at step k predicts x_{t+k+2}
        if n > 0:
            target = as_draft[ids[0, k + 2:]]
            logits = module.lm_head(module.head_input(o[0, :n]))
            r = rank_of(logits, target.clamp(min=0))
            ranks[:n, k] = torch.where(target >= 0, r, torch.full_like(r, V))
    return ranks


def _eagle_default(module):
    from ..decode.tree import DynamicTree

    return DynamicTree()


EAGLE3 = DraftKind(_build_eagle, _save_engine_layout, _load_eagle, _eagle_drafter, _eagle_default,
                   ("config.json", "model.safetensors"), _eagle_ranks)

# --- dflash: the DFlash checkpoint layout (model.safetensors without embeddings / lm_head + config.json) --------

def _build_dflash(head: dict, base):
    from .dflash import DFlashDraft

    return DFlashDraft(DFlashDraft.settings(head, base), base)


def _load_dflash(head: dict, export_dir: Path, base):
    from .dflash import DFlashDraft

    return _load_engine_layout(DFlashDraft({k: v for k, v in head.items() if k != "type"}, base), export_dir)


def _dflash_drafter(module, tree: Tree) -> Drafter:
    from .dflash import DFlashDrafter

    return DFlashDrafter(module, tree)


@torch.no_grad()
def _dflash_ranks(module, base, ids: torch.Tensor, depth: int) -> torch.Tensor:
    from ..base import base_states

    S, V = ids.shape[1], base.get_output_embeddings().weight.shape[0]
    states = base_states(base, ids, torch.ones_like(ids), module.base_layers)[:, :, :-1]
    ranks = torch.full((S, depth), V, dtype=torch.long, device=ids.device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    for s in range(0, S - 1, 64):  # state t has root x_{t+1}: the block anchored there, 64 anchors per forward
        anchor = torch.arange(s + 1, min(s + 65, S), device=ids.device)[None]
        out = module.block_outputs(states.to(module.fc.weight.dtype), ids, valid, anchor)
        for d in range(min(depth, module.block_size - 1)):
            at = anchor[0] + d + 1  # block position d + 1 predicts x_{t+d+2}
            inside = at < S
            if inside.any():
                logits = module.logits(out[0, inside, d + 1])
                ranks[s: s + int(inside.sum()), d] = rank_of(logits, ids[0, at[inside]])
    return ranks


def _dflash_tokenizer(module, out: Path, tokenizer) -> None:
    from .dflash import name_mask_token

    name_mask_token(out, tokenizer)


DFLASH = DraftKind(_build_dflash, _save_engine_layout, _load_dflash, _dflash_drafter, lambda m: Tree.chain(m.block_size - 1),
                   ("config.json", "model.safetensors"), _dflash_ranks,
                   _dflash_tokenizer)

# --- lookup: prompt lookup / datastore retrieval, no weights ------------------------------------------

class LookupDraft(torch.nn.Module):
    """The retrieval drafter's settings and optional datastore, as a (weightless) draft module. The datastore is
    kept as its sequences' tokens end to end (int32) and their lengths (int64): `datastore` takes those two numpy
    arrays as a tuple, or the sequences (lists of token ids)."""

    kind = "lookup"
    num_heads = 1

    def __init__(self, num_tokens: int = 5, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 4,
                 datastore=None):
        import numpy as np

        from .retrieval import flatten

        super().__init__()
        self.settings = {"num_tokens": num_tokens, "max_ngram": max_ngram, "min_ngram": min_ngram,
                         "max_matches": max_matches}
        if isinstance(datastore, tuple) and len(datastore) == 2 and isinstance(datastore[0], np.ndarray):
            datastore = (datastore[0].astype(np.int32, copy=False), np.asarray(datastore[1], dtype=np.int64))
        elif datastore is not None:
            datastore = flatten(datastore)
        self.datastore = datastore

    def config(self) -> dict:
        return {"type": "lookup", **self.settings, "datastore": self.datastore is not None}


LOOKUP_STORE = "datastore.safetensors"


def _save_lookup(module, out: Path) -> list[str]:
    from safetensors.torch import save_file

    if module.datastore is None:
        return []
    tokens, lengths = module.datastore
    save_file({"tokens": torch.from_numpy(tokens), "lengths": torch.from_numpy(lengths)}, out / LOOKUP_STORE,
              metadata={"format": "pt"})
    return [LOOKUP_STORE]


def _load_lookup(head: dict, export_dir: Path, base):
    from .base import ExportError, read_safetensors

    store = None
    if head.get("datastore"):
        if (export_dir / LOOKUP_STORE).is_file():
            t = read_safetensors(export_dir / LOOKUP_STORE)
            store = (t["tokens"].numpy(), t["lengths"].numpy())
        elif (export_dir / "datastore.json").is_file():  # exports written before 2026-12-02
            store = json.loads((export_dir / "datastore.json").read_text())
        else:
            raise ExportError(f"{export_dir}: draftlab.json says the lookup drafter has a datastore, but "
                              f"{LOOKUP_STORE} is missing. Export again from the run")
    return LookupDraft(**{k: head[k] for k in ("num_tokens", "max_ngram", "min_ngram", "max_matches")},
                       datastore=store)


def _lookup_drafter(module, tree: Tree | None) -> Drafter:
    from .retrieval import Datastore, LookupDrafter

    st = module.settings
    store = (Datastore.from_flat(*module.datastore, max(2, st["min_ngram"]), st["max_ngram"])
             if module.datastore is not None else None)
    return LookupDrafter(st["num_tokens"], st["max_ngram"], st["min_ngram"], st["max_matches"], store)


def _no_ranks(module, base, ids, depth):
    raise ValueError(f"search-tree has no rank statistics for a {module.kind} drafter (its trees come from the text); "
                     "search the trees of an ensemble's SSM members instead")


LOOKUP = DraftKind(lambda head, base: LookupDraft(), _save_lookup, _load_lookup, _lookup_drafter,
                   lambda m: Tree.chain(1), (), _no_ranks)


# --- ensemble: member exports in subdirectories ----------------------------------------------------------

class EnsembleDraft(torch.nn.Module):
    """Member draft modules and how to decode with them (mode, node budget), as one draft module."""

    kind = "ensemble"
    num_heads = 1

    def __init__(self, members: list, names: list[str], decode: dict | None = None, stages: list | None = None):
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        self.names = names
        self.decode = {"mode": "merge", "node_budget": 32, **(decode or {})}
        self.stages = stages or []

    def config(self) -> dict:
        return {"type": "ensemble", "members": [{"name": n, "dir": n, "head": m.config()}
                                                for n, m in zip(self.names, self.members)],
                "decode": self.decode}


def _save_ensemble(module, out: Path) -> list[str]:
    files = []
    for name, member in zip(module.names, module.members):
        (out / name).mkdir(parents=True, exist_ok=True)
        files += [f"{name}/{f}" for f in kind_of(member.kind).save(member, out / name)]
    return files


def _ensemble_tokenizer(module, out: Path, tokenizer) -> None:
    for name, member in zip(module.names, module.members):
        kind_of(member.kind).with_tokenizer(member, out / name, tokenizer)


def _load_ensemble(head: dict, export_dir: Path, base):
    from .base import ExportError

    members = []
    for m in head["members"]:
        kind = kind_of(m["head"]["type"])
        missing = [f for f in kind.files if not (export_dir / m["dir"] / f).is_file()]
        if missing:
            raise ExportError(f"{export_dir}: ensemble member {m['name']} is missing {', '.join(missing)}")
        members.append(kind.load(m["head"], export_dir / m["dir"], base))
    return EnsembleDraft(members, [m["name"] for m in head["members"]], head.get("decode"))


def _ensemble_drafter(module, tree: Tree | None, **decode) -> Drafter:
    """Members with their own default trees (or `tree` for every SSM member); mode and budget from the export,
    overridable by keyword (mode, node_budget, length, adaptive, scheduler, batch_members, and `options`: a dict of
    Scheduler / VoteWeights / AdaptiveLength parameters, see ensemble_parts)."""
    from .ensemble import EnsembleDrafter, ensemble_parts

    d = {**module.decode, **{k: v for k, v in decode.items() if v is not None}}
    d["options"] = {**(module.decode.get("options") or {}), **(decode.get("options") or {})}  # the export's, overridden
    drafters = [kind_of(m.kind).drafter(m, tree if tree is not None and m.kind == "ssm" else
                                        kind_of(m.kind).default_tree(m)) for m in module.members]
    scheduler, vote, adaptive = ensemble_parts(d.get("options") or {}, length=d.get("length", 4))
    return EnsembleDrafter(drafters, module.names, mode=d["mode"], node_budget=d["node_budget"],
                           scheduler=scheduler if d.get("scheduler", True) else None, vote=vote,
                           adaptive=adaptive if d.get("adaptive") else None, length=d.get("length", 4),
                           batch_members=d.get("batch_members", True))


ENSEMBLE = DraftKind(lambda head, base: None, _save_ensemble, _load_ensemble, _ensemble_drafter,
                     lambda m: None, (), _no_ranks, _ensemble_tokenizer)

KINDS: dict[str, DraftKind] = {"medusa": HEADS, "hydra": HEADS, "ssm": SSM, "eagle3": EAGLE3, "dflash": DFLASH,
                               "lookup": LOOKUP, "ensemble": ENSEMBLE}


def kind_of(name: str) -> DraftKind:
    if name not in KINDS:
        raise ValueError(f"draft kind {name!r}: this draftlab knows {', '.join(KINDS)}")
    return KINDS[name]


def build_draft(head: dict, base):
    """The trainable draft module of a recipe's `head` section, initialised from the frozen base."""
    return kind_of(head["type"]).build(head, base)


OPTION_FLAGS = {"mode": "--ensemble-mode", "node_budget": "--node-budget", "length": "--length",
                "adaptive": "--adaptive", "options": "--ensemble-option"}  # the drafter options generate / eval take


def check_drafter_options(kind: str, options: dict) -> None:
    """Refuse drafter options given to a kind that takes none (only ensembles take them), naming them as the
    command line does; they were a TypeError from deep inside (walk-through)."""
    given = [k for k, v in options.items() if v is not None]
    if given and kind != "ensemble":
        raise ValueError(f"{', '.join(OPTION_FLAGS.get(k, k) for k in given)}: options of ensemble exports; a {kind} "
                         "export takes none (its drafting is set by --tree)")


def make_drafter(module, tree: Tree | None = None, **options) -> Drafter:
    """The drafter that decodes with a draft module (its kind's default tree unless one is given); options go to
    kinds that take them (ensembles: mode, node_budget, length, adaptive, scheduler)."""
    from ..decode.tree import DynamicTree, TreeError

    check_drafter_options(module.kind, options)
    kind = kind_of(module.kind)
    tree = tree if tree is not None else kind.default_tree(module)
    if isinstance(tree, DynamicTree) and module.kind != "eagle3":
        raise TreeError(f"--tree {tree.spec()}: dynamic trees are built by eagle3 drafters from their own "
                        f"confidence; a {module.kind} export drafts a static tree (default, chain, chain:N, a tree "
                        "file or paths)")
    return kind.drafter(module, tree, **options) if options else kind.drafter(module, tree)


__all__ = ["Drafter", "DraftKind", "EnsembleDraft", "KINDS", "LookupDraft", "PromptState", "Proposal", "StepResult",
           "build_draft", "kind_of", "make_drafter"]


@torch.no_grad()
def text_ranks(draft, base, seq: list[int], prompt_len: int, depth: int) -> torch.Tensor:
    """Rank vectors [T, depth] of the states greedy decoding verifies from along one text (prompt + continuation):
    from the prompt's last token to the one before the text's last (once the root is the final token, decoding
    stops without another verification); a rank of V means 'beyond the text'. The kind's `ranks` computes them,
    the draft conditioned on the true path."""
    ids = torch.tensor([seq], device=base.get_input_embeddings().weight.device)
    ranks = kind_of(draft.kind).ranks(draft, base, ids, depth)
    start = max(prompt_len - 1, 0)
    return ranks[start: max(ids.shape[1] - 2, start)].cpu()
