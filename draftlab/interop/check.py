"""`draftlab check`: what silently ruins served acceptance in an export, read the way vLLM and SGLang read it.

Seven checks, each one line that names what is wrong, where, and the fix: auxiliary-layer ids (each engine's
convention), whether each engine's model for the base captures EAGLE-3's layers at all, draft-vocabulary maps (d2t / t2d), RoPE / max positions against the base's config.json, a
quantization config an engine would apply to the draft, the tokenizer / chat template against training's, and
proposals: fixed prompts decoded with draftlab's drafter, each step's chain compared token by token with the
chain computed from the served files the engine's way (`EngineEagle3`, `vllm_medusa_logits`, `EngineDFlash`; SSMs
and an ensemble's SSM members: the files loaded as a Hugging Face causal LM). Hydra has no engine: its decode is
compared with draftlab's own uncached second reading, and the check says it is no engine check; lookup has no
weights to read.

Engine rules (the loaders' code; sources in docs/interop.md):
- vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` as Hugging Face hidden_states indices (the
  residual stream captured before decoder layer L); missing: (2, n // 2, n - 3), silently.
- SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids`, as decoder-layer outputs: it captures
  hidden_states[L + 1]; missing: (2, n // 2, n - 3) with no offset. For DeepSeek-V2/V3 and GLM4-MoE-Lite targets
  only, since sglang PR #25454 the +1 is applied only when the first id is 1 (a first id of 2 is taken as vLLM's
  convention); its Llama, Qwen2 and Qwen3 models (0.5.23) add 1 always.
- Both capture each layer once, in layer order, whatever the order of the ids; target id = draft id + d2t[id]
  (a missing d2t is all zeros: the first draft_vocab_size ids, no error); t2d is not read.
- DFlash: both read `dflash_config.target_layer_ids` as hidden_states[id + 1] (a layer's output), captured in layer
  order whatever the order given (z-lab's reference code keeps the order given). vLLM (0.33.0) reads a top-level
  `eagle_aux_hidden_state_layer_ids` first (as they are), takes the last decoder layer's output before the base's
  final norm, drafts blocks of num_speculative_tokens + 1 (no block_size) and reads only the mask id; SGLang never
  captures the last layer's output and resolves `dflash_config.mask_token` in the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..drafters.base import Drafter, ExportError, flat_rope, partial_factor, read_safetensors, table_of
from ..drafters.dflash import SGLANG_MASK_TOKEN
from .convert import VLLM_MEDUSA_NOTE
from .targets import EAGLE3_READ_FROM, EAGLE3_TARGETS
from .engine_read import EngineDFlash, EngineEagle3, dflash_layers, last_layer_problem, vllm_medusa_logits
from .export import apply_adapter, load_export, read_meta, tokenizer_fingerprint, use_chat_template

ENGINES = ("vllm", "sglang")
NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
DEFAULT_PROMPTS = ("Once upon a time", "The little cat saw a big dog.", "What is a cat?")
TIE = 1e-3  # logits this close are a tie: the two float paths may order them either way


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable / not checked for this kind (said in the message)
    message: str


def default_aux(n: int) -> list[int]:
    """The engines' fallback aux layers for an n-layer base (hidden_states indices)."""
    return [2, n // 2, n - 3]


# The target models whose SGLang code adds 1 to the ids only when the first is 1 (PR #25454, in deepseek_v2.py,
# which serves DeepSeek-V3 too, and glm4_moe_lite.py); its other models add 1 always (llama.py, qwen2.py, qwen3.py).
FIRST_ID_RULE = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")


def engine_reads(cfg: dict, engine: str, n: int, base_type: str = "") -> list[tuple[str, list[int]]]:
    """(who reads it, the hidden_states indices captured) for each reading of config.json by `engine`, for a base
    of model_type base_type."""
    if engine == "vllm":
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        return [("vLLM (no top-level ids: its silent default)" if ids is None else "vLLM", default_aux(n)
                 if ids is None else [int(i) for i in ids])]
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [("SGLang (no eagle_config ids: its default)", default_aux(n))]
    old = [int(i) + 1 for i in ids]
    new = old if ids and int(ids[0]) == 1 else [int(i) for i in ids]
    if base_type not in FIRST_ID_RULE or new == old:
        return [("SGLang", old)]
    return [("SGLang", old), (f"SGLang since PR #25454 (a {base_type} target: +1 only when the first id is 1)", new)]


def check_aux(cfg: dict, meta: dict, engines: list[str], n: int, base_type: str = "") -> Check:
    head = meta["head"]
    if head["type"] == "dflash":
        return _check_dflash_layers(cfg, head["layers"], engines, n)
    if head["type"] != "eagle3":
        return Check("aux-layer-ids", None, f"not applicable to {head['type']} (it reads no auxiliary layers)")
    layers, problems, notes = [int(i) for i in head["layers"]], [], []
    if any(not 0 <= l < n for l in layers):
        problems.append(f"draftlab.json layers {layers} leave 0..{n - 1}, the base's {n} decoder layers' inputs "
                        "(engines capture the residual stream before a decoder layer); retrain with layers in range")
    if sorted(set(layers)) != layers:
        problems.append(f"draftlab.json layers {layers} are not distinct and ascending: engines capture each layer "
                        f"once, in layer order ({sorted(set(layers))}), so fc would read other features; retrain with "
                        "distinct ascending layers")
    for engine in engines:
        for who, got in engine_reads(cfg, engine, n, base_type):
            if got == layers:
                notes.append(f"{who} captures hidden_states {got}")
                continue
            key = "eagle_aux_hidden_state_layer_ids" if engine == "vllm" else "eagle_config.eagle_aux_hidden_state_layer_ids"
            if engine == "vllm":
                fix = f"set {key} to {layers}"
            elif "25454" not in who:
                fix = f"set {key} to {[l - 1 for l in layers]} (SGLang adds 1)"
            elif layers[0] == 1:  # an id of 1 first makes it add 1 to every id: hidden_states[1] cannot come first
                fix = ("no value serves this draft there: a first id of 1 makes SGLang add 1 to every id, and any "
                       "other is read as it is, so hidden_states[1] cannot be the first layer captured; retrain with "
                       "a first layer other than 1 (2 is read alike by SGLang before and after the PR)")
            else:
                fix = (f"set {key} to {layers} for SGLang since the PR (read as they are); SGLang before it then adds "
                       "1: no value is read alike by both unless the first layer is 2")
            gone = [l for l in got if not 0 <= l < n]
            problems.append(f"{key}: {who} captures hidden_states {got}" + (
                f" ({gone} past the {n} decoder layers' inputs: never captured)" if gone else "") +
                f", draftlab trained on {layers}; {fix}")
    if problems:
        return Check("aux-layer-ids", False, "; ".join(problems + [f"({x})" for x in notes]))
    return Check("aux-layer-ids", True, f"draftlab.json layers {layers} (hidden_states indices): " + "; ".join(notes))


def check_target(meta: dict, base_cfg: dict, engines: list[str]) -> Check:
    """EAGLE-3: whether each engine's model code for the base's architecture captures the draft's auxiliary layers
    (targets.py, read from the engines' source); an engine refuses the draft for a target whose code does not."""
    kind = meta["head"]["type"]
    if kind != "eagle3":
        return Check("target", None, f"not applicable to {kind} (only EAGLE-3's target models are read from the "
                                     "engines' source)")
    arch = (base_cfg.get("architectures") or [None])[0]
    if arch is None:
        return Check("target", None, "the base's config.json names no architecture: whether an engine's model for it "
                                     "captures EAGLE-3's layers is not known")
    msgs, oks = [], []
    for engine in engines:
        who = EAGLE3_READ_FROM[engine]
        oks.append(arch in EAGLE3_TARGETS[engine])
        msgs.append(f"{who}'s {arch} captures EAGLE-3's auxiliary layers" if oks[-1] else
                    f"{who}'s {arch} does not capture EAGLE-3's auxiliary layers, so {NAMES[engine]} refuses the draft "
                    "when it loads (a later release may add it" + (
                        "; vLLM's Transformers backend, --model-impl transformers, captures them for the models it "
                        "runs: not tried here)" if engine == "vllm" else ")"))
    return Check("target", all(oks), "; ".join(msgs))


def _check_dflash_layers(cfg: dict, layers: list[int], engines: list[str], n: int) -> Check:
    """The hidden_states each engine captures for a DFlash draft (engine_read.dflash_layers: the ids as layer
    outputs, in layer order) against those draftlab trained on (draftlab.json's layers, in their order)."""
    if len(set(layers)) != len(layers):  # (exports trained before 2026-12-01 on a base too shallow for their layers)
        return Check("aux-layer-ids", False, f"draftlab.json layers {layers} are not distinct: engines capture each "
                     "layer once, so the draft's fc would read other features; retrain with distinct layers "
                     "(head.dflash.layers, or fewer head.dflash.num_layers)")
    want = [i - 1 for i in layers]
    problems, notes = [], []
    for engine in engines:
        name = NAMES[engine]
        try:
            got, key = dflash_layers(cfg, n, engine)
        except ValueError as e:
            problems.append(f"{name}: {e}")
            continue
        if got == layers:
            notes.append(f"{name} captures hidden_states {got} (the layer outputs of {key} {want})")
        elif got == sorted(layers) and key == "dflash_config.target_layer_ids":
            problems.append(f"{name} captures hidden_states {got}, in layer order, and draftlab trained on them in the "
                            f"order {layers}: fc reads other features; retrain with head.dflash.layers in ascending "
                            "order")
        else:
            top = " and no top-level eagle_aux_hidden_state_layer_ids or target_layer_ids (vLLM reads those first)"
            problems.append(f"{name} captures hidden_states {got} (from {key}, as layer outputs), draftlab trained on "
                            f"{layers}; give dflash_config.target_layer_ids {want}" + (top if engine == "vllm" else ""))
        if n in layers:
            problems.append(f"{name}: {last_layer_problem(engine, n)}; retrain with head.dflash.layers below {n}")
    if problems:
        return Check("aux-layer-ids", False, "; ".join(problems + [f"({x})" for x in notes]))
    return Check("aux-layer-ids", True, "; ".join(notes) or f"draftlab.json layers {layers}")


def check_vocab(cfg: dict, tensors: dict, meta: dict, V_base: int, tok, engines: list[str]) -> Check:
    kind, msgs = meta["head"]["type"], []
    V = cfg.get("vocab_size", V_base)
    if V != V_base:
        msgs.append(f"config.json vocab_size {V} != the base's {V_base}; set it to {V_base}")
    if tok is not None and len(tok) > V_base:
        msgs.append(f"the tokenizer has {len(tok)} tokens, the base's vocabulary {V_base}: not this base's tokenizer")
    if kind == "medusa":
        Vt = cfg.get("truncated_vocab_size", V)
        rows = {tuple(v.shape) for k, v in tensors.items() if k.startswith("lm_heads.")}
        if Vt != V or rows != {(V_base, cfg["hidden_size"])}:
            msgs.append(f"truncated_vocab_size {Vt} / lm_heads {sorted(rows)} do not cover the base's {V_base} ids "
                        "(vLLM then needs a token_map); export --to vllm-medusa again")
    elif kind == "eagle3":
        Vd = cfg.get("draft_vocab_size") or V
        d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
        rows = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None
        if rows != Vd:
            msgs.append(f"lm_head.weight has {rows} rows, draft_vocab_size is {Vd}; export again")
        if Vd < V and d2t is None:
            msgs.append(f"no d2t in model.safetensors with draft_vocab_size {Vd} < vocab_size {V}: both engines then "
                        f"map draft id i to target id i (the first {Vd} ids), silently; export again")
        elif d2t is not None:
            if tuple(d2t.shape) != (Vd,) or d2t.dtype not in (torch.int64, torch.int32):
                msgs.append(f"d2t is {d2t.dtype} {tuple(d2t.shape)}, engines need int64 [{Vd}]")
            else:
                target = torch.arange(Vd) + d2t.long()
                if target.min() < 0 or target.max() >= V_base:
                    msgs.append(f"d2t maps draft ids to target ids {int(target.min())}..{int(target.max())}, outside "
                                f"the base's 0..{V_base - 1} (target = draft + d2t[draft]); export again")
                elif len(torch.unique(target)) != Vd:  # (any order serves: the engines place logit i at target i)
                    msgs.append("d2t's target ids (draft + d2t[draft]) are not distinct: two draft ids name one "
                                "target, or d2t holds ids rather than offsets; export again")
                elif tok is not None and int(target.max()) >= len(tok):
                    msgs.append(f"d2t maps to target id {int(target.max())}, beyond the tokenizer's {len(tok)} tokens")
                if t2d is not None and tuple(t2d.shape) == (V_base,) and t2d.dtype == torch.bool and not msgs:
                    if not bool(t2d[target].all()) or int(t2d.sum()) != Vd:
                        msgs.append(f"t2d marks {int(t2d.sum())} target ids, not the {Vd} that d2t names (d2t and "
                                    "t2d disagree: one of them was rewritten); export again")
                elif t2d is not None and not msgs:
                    msgs.append(f"t2d is {t2d.dtype} {tuple(t2d.shape)}, the convention is bool [{V_base}]")
    elif kind == "dflash" and "sglang" in engines:
        msgs += _mask_token_problems(cfg.get("dflash_config") or {}, V_base, tok)
    if msgs:
        return Check("vocab-maps", False, "; ".join(msgs))
    size = f", tokenizer {len(tok)} tokens" if tok is not None else ""
    if kind == "dflash" and "sglang" in engines and tok is not None:
        dc = cfg["dflash_config"]
        name = dc.get("mask_token", SGLANG_MASK_TOKEN)
        size += f", mask token {name!r} = id {dc['mask_token_id']} as SGLang reads it"
    if kind == "eagle3" and (cfg.get("draft_vocab_size") or V) < V:
        return Check("vocab-maps", True, f"d2t maps {cfg['draft_vocab_size']} draft ids into {V_base} target ids "
                                         f"(distinct, ascending), t2d agrees{size}")
    return Check("vocab-maps", True, f"full vocabulary {V} = the base's{size}")


def _mask_token_problems(dc: dict, V_base: int, tok) -> list[str]:
    """DFlash's mask token as SGLang resolves it (dflash_config.mask_token, default "<|MASK|>", looked up in the
    served tokenizer; mask_token_id, where set, must agree with it or SGLang refuses to start; its runners that
    read only the string add "<|MASK|>" to the tokenizer where absent: an id the draft never trained with)."""
    i, name = dc.get("mask_token_id"), dc.get("mask_token")
    if i is None:
        return ["no dflash_config.mask_token_id: the engines then pick a mask id of their own; export again"]
    if not 0 <= int(i) < V_base:
        return [f"dflash_config.mask_token_id {i} is outside the base's vocabulary 0..{V_base - 1}; export again"]
    if tok is None:
        return []
    at = tok.get_vocab().get(name or SGLANG_MASK_TOKEN)
    if at == int(i):
        return []
    if name is None:
        return [f"no dflash_config.mask_token: SGLang looks up {SGLANG_MASK_TOKEN!r} in the tokenizer "
                + (f"(id {at}, not the trained mask id {i}: it refuses to start)" if at is not None else
                   "and its runners that read only that string add it as a new id the draft never trained with")
                + "; export again with a tokenizer (training does), which names the mask id's own token"]
    return [f"dflash_config.mask_token {name!r} is " + (f"id {at}" if at is not None else "not a token")
            + f" in the served tokenizer, mask_token_id is {i}: SGLang " + ("refuses to start" if at is not None
                                                                            else "adds it as a new id")
            + "; is this the tokenizer the draft was trained with?"]


def _rope(c: dict) -> tuple[float, dict]:
    """(theta, scaling without theta) from a config dict: rope_parameters if present, else rope_theta/rope_scaling.
    partial_rotary_factor is left out (a draft layer rotates its whole head: drafters.base.draft_rope; check_rope
    fails a draft config that keeps one)."""
    p = flat_rope(c.get("rope_parameters"), table_of(c.get("layer_types")))  # (a table per layer type: drafts')
    theta = p.get("rope_theta", c.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in (p or c.get("rope_scaling") or {}).items()
               if k not in ("rope_theta", "partial_rotary_factor")}
    return float(theta), {} if scaling.get("rope_type", scaling.get("type", "default")) == "default" else scaling


def check_rope(cfg: dict, base_cfg: dict, kind: str, engines: list[str]) -> Check:
    if kind in ("ssm", "ensemble"):
        return Check("rope", None, f"not applicable to {kind} (a small LM keeps its own RoPE, not the base's; "
                                   "draftlab and the engines read it alike from its config.json)")
    if kind not in ("eagle3", "dflash"):
        return Check("rope", None, f"not applicable to {kind} (no attention layer of its own in the served files)")
    msgs = []
    if "rope_theta" in cfg and cfg.get("rope_parameters") and \
            float(cfg["rope_theta"]) != float(cfg["rope_parameters"].get("rope_theta", cfg["rope_theta"])):
        msgs.append(f"config.json rope_theta {cfg['rope_theta']} != rope_parameters.rope_theta "
                    f"{cfg['rope_parameters'].get('rope_theta')} (transformers < 5 reads the first, >= 5 the second)")
    p = flat_rope(cfg.get("rope_parameters"), table_of(cfg.get("layer_types")))
    f = min(partial_factor(x) for x in (p, cfg, cfg.get("rope_scaling")))
    if f < 1:  # (vLLM and SGLang then rotate part of the head; draftlab's draft layer rotated it whole or repeated)
        msgs.append(f"config.json keeps partial_rotary_factor {f}: engines rotate that part of each head, as no "
                    "draftlab draft layer does (a draft made before 2026-12-03); retrain it with this draftlab")
    (t, s), (bt, bs) = _rope(cfg), _rope(base_cfg)
    if t != bt:
        msgs.append(f"rope_theta {t} != the base's {bt}; set rope_theta (and rope_parameters.rope_theta) to {bt}")
    if s != bs:
        msgs.append(f"rope scaling {s or None} != the base's {bs or None}; copy the base's rope_scaling / rope_parameters")
    hd = lambda c: c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if kind == "eagle3" and hd(cfg) != hd(base_cfg):
        msgs.append(f"head_dim {hd(cfg)} != the base's {hd(base_cfg)}")
    mp, bmp = cfg.get("max_position_embeddings"), base_cfg.get("max_position_embeddings")
    if mp != bmp:
        raised = kind == "eagle3" and engines == ["vllm"]
        (msgs if not raised else []).append(f"max_position_embeddings {mp} != the base's {bmp}; set it to {bmp}")
    if msgs:
        return Check("rope", False, "; ".join(msgs))
    return Check("rope", True, f"rope_theta {t}, scaling {s or None}, max_position_embeddings {mp}"
                 + (f" (vLLM raises an EAGLE-3 draft's to the target's {bmp})" if mp != bmp else "") + " = the base's")


def check_quant(cfg: dict, base_cfg: dict, engines: list[str]) -> Check:
    msgs, notes = [], []
    q = cfg.get("quantization_config")
    if q:
        msgs.append(f"config.json has quantization_config ({q.get('quant_method', '?')}): vLLM and SGLang load the "
                    "draft's layers with it; remove it unless the weights are quantized that way")
    bq = (base_cfg.get("quantization_config") or {}).get("quant_method")
    if "sglang" in engines:
        if bq:
            msgs.append(f"the base is quantized ({bq}) and SGLang quantizes the draft like the target unless "
                        "--speculative-draft-model-quantization unquant; serve with that flag")
        else:
            notes.append("SGLang applies the target's quantization to the draft by default; the base has none")
    if "vllm" in engines:
        notes.append("vLLM quantizes the draft only by its own config" + (f" (the base's {bq} is not applied)" if bq else ""))
    if msgs:
        return Check("quantization", False, "; ".join(msgs))
    where = "the draft's config.json" if cfg else "the draft's files (they hold no config.json)"
    return Check("quantization", True, f"no quantization_config in {where}; " + "; ".join(notes))


def _tok_raw(src: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src)


def check_tokenizer(export_dir: Path, meta: dict, served: str, template: str | None = None) -> Check:
    """The served tokenizer against training's. `template` is the chat-template file the engine is given (vLLM,
    SGLang: --chat-template); without it, the export's shipped template where it keeps one (as it says to serve),
    else the served tokenizer's own."""
    recipe = (meta.get("training") or {}).get("recipe") or {}
    text_only = read_plain_text(meta)
    if (export_dir / "tokenizer_config.json").is_file():
        trained, where = str(export_dir), "the export's tokenizer files"
    else:
        trained = (recipe.get("base") or {}).get("name_or_path") or meta["base"]["name_or_path"]
        where = "the recipe's base" if recipe else "draftlab.json's base"
    recorded = meta.get("tokenizer")
    shipped = export_dir / meta["chat_template"] if meta.get("chat_template") else None
    if shipped is not None and not shipped.is_file():
        return Check("tokenizer", False, f"draftlab.json names the chat template {shipped}, which is missing: training "
                                         "rendered conversations with it; export the run again")
    given = Path(template) if template else shipped
    given_note = f" (served with --chat-template {template})" if template else ""
    if recorded:  # the fingerprint save_export took of the tokenizer used in training: edits in place show too
        try:
            tok = _tok_raw(served)
        except (OSError, ValueError) as e:
            return Check("tokenizer", False, f"cannot load the served tokenizer {served} ({e})")
        if given is not None:  # served with --chat-template that file (the export's, as it says to, by default)
            tok.chat_template = given.read_text(encoding="utf-8")
        now = tokenizer_fingerprint(tok)
        diff = [k for k in recorded if recorded[k] != now.get(k)]
        if not diff:
            return Check("tokenizer", True, f"served tokenizer {served}{given_note} matches the fingerprint "
                                            "draftlab.json took in training (vocabulary, special ids, chat template" +
                         (f": the export's {shipped}, which the engine must be given, vLLM and SGLang with "
                          "--chat-template)" if shipped is not None and not template else ")"))
        if diff == ["chat_template_sha256"] and text_only:  # (a template training never applied: walk-through)
            return Check("tokenizer", True, f"served tokenizer {served}{given_note} matches the fingerprint "
                                            "draftlab.json took in training in vocabulary and special ids; its chat "
                                            f"template differs from training's, {NEVER_APPLIED}")
        names = {"vocab_sha256": "vocabulary", "chat_template_sha256": "chat_template"}
        kept = (f"; training rendered with the chat template kept in {shipped}" + (
            ", compared as served with it (vLLM, SGLang: --chat-template that file)" if not template else "")
            if shipped is not None else "")
        return Check("tokenizer", False, f"served tokenizer {served}{given_note} differs from the one used in "
                                         "training in "
                     f"{', '.join(names.get(k, k) for k in diff)} (draftlab.json's tokenizer fingerprint); serve "
                     "with the training tokenizer and template, or retrain" + kept)
    same = Path(trained).resolve() == Path(served).resolve() if Path(trained).exists() else trained == served
    if same and not template:
        return Check("tokenizer", True, f"served tokenizer {served} is {where} used in training (this export "
                                        "records no tokenizer fingerprint: a template edited in place since is not seen)")
    try:
        a, b = _tok_raw(trained), _tok_raw(served)
    except (OSError, ValueError) as e:
        return Check("tokenizer", False, f"cannot load {trained} ({where}) or {served} to compare ({e})")
    if shipped is not None:  # training rendered with the export's template; served with it unless told otherwise
        a.chat_template = shipped.read_text(encoding="utf-8")
    if given is not None:
        b.chat_template = given.read_text(encoding="utf-8")
    msgs = []
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = sum(va.get(t) != i for t, i in vb.items()) + len(set(va) - set(vb))
        msgs.append(f"vocabulary differs in {diff} entries ({len(va)} vs {len(vb)} tokens)")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(a, name) != getattr(b, name):
            msgs.append(f"{name} {getattr(a, name)} in training, {getattr(b, name)} served")
    template_differs = (a.chat_template or None) != (b.chat_template or None)
    if template_differs and not text_only:
        msgs.append(f"chat_template differs from training's; serve with {where}'s template ({trained}) or retrain")
    if msgs:
        return Check("tokenizer", False, f"served tokenizer {served}{given_note} vs {where} {trained}: " +
                     "; ".join(msgs))
    if template_differs:
        return Check("tokenizer", True, f"served tokenizer {served}{given_note} = {where} {trained} in vocabulary and "
                                        f"special ids; its chat template differs from training's, {NEVER_APPLIED}")
    return Check("tokenizer", True, f"served tokenizer {served}{given_note} = {where} {trained} (vocabulary, special "
                                    "ids, chat template)")


NEVER_APPLIED = ("which training never applied (it read plain text alone): served chat prompts are rendered with the "
                 "served one")


def read_plain_text(meta: dict) -> bool:
    """Whether training read plain text alone (no conversation went through a chat template): the formats its data
    was read as (exports since 2026-12-03), else the recipe's data.format (auto: not known, taken as chat)."""
    training = meta.get("training") or {}
    if training.get("data_formats"):
        return set(training["data_formats"]) == {"text"}
    return ((training.get("recipe") or {}).get("data") or {}).get("format") == "text"


class _Recorder(Drafter):
    """A drafter in the decoder, recording each step's chain and how many tokens were committed before it."""

    def __init__(self, inner):
        self.inner, self.hidden_layers, self.steps, self.n = inner, inner.hidden_layers, [], 0

    max_nodes = property(lambda self: self.inner.max_nodes)

    def begin(self, prompt, sampling, gen):
        self.inner.decode_path = self.decode_path
        self.inner.begin(prompt, sampling, gen)

    def propose(self, root):
        prop = self.inner.propose(root)
        self.steps.append((self.n, prop.tokens[0, 1:].tolist()))
        return prop

    def commit(self, step):
        self.n += int(step.keep_valid[0].sum())
        self.inner.commit(step)


def _first_difference(mine: list[int], logits, targets: torch.Tensor | None = None) -> tuple[int, int] | None:
    """(depth, engine's token) where the engine's choice differs from draftlab's chain `mine` (ties allowed), else
    None. logits: the engine's logits at depth 1, 2, ... given mine's tokens above; targets: the token id of each
    logit (a draft vocabulary), None for the whole vocabulary."""
    for d, (x, lg) in enumerate(zip(mine, logits)):
        best = int(lg.argmax())
        got = best if targets is None else int(targets[best])
        where = [x] if targets is None else (targets == x).nonzero()
        if got != x and (len(where) == 0 or float(lg[best] - lg[int(where[0])]) > TIE):
            return d + 1, got
    return None


def _eagle_chain_logits(eng: EngineEagle3, g: torch.Tensor, toks: torch.Tensor, chain: list[int]):
    """The engine's logits at each depth of a chain drafted from entries (g [c, H], toks [c]), fed draftlab's tokens."""
    for x in chain:
        state = eng.step(g, toks)[-1]
        yield eng.logits(state)
        g, toks = torch.cat([g, state[None]]), torch.cat([toks, torch.tensor([x])])


def _decode(base, make, tok, prompts: list[str], max_new_tokens: int) -> list:
    """Each prompt decoded greedily by draftlab with a fresh drafter make(): (prompt ids, the whole text, the base's
    hidden_states over it, the recorded (committed, chain) steps)."""
    from ..decode.decoder import SpeculativeDecoder

    runs = []
    for text in prompts:
        p = tok.encode(text)
        rec = _Recorder(make())
        out = SpeculativeDecoder(base, rec).generate([p], max_new_tokens=max_new_tokens)
        seq = torch.tensor(p + out.tokens[0])
        runs.append((p, seq, base(input_ids=seq[None], output_hidden_states=True).hidden_states, rec.steps))
    return runs


def _compare(name: str, runs: list, prompts: list[str], tok, logits_of, targets=None, at: str = "depth") -> tuple[bool, str]:
    """Every recorded chain against `name`'s reading: logits_of(run index, c, chain) gives its logits at each depth
    given draftlab's tokens above (c tokens committed before the root seq[c]). The first difference is named."""
    n, width = 0, 0
    for i, (p, seq, hs, steps) in enumerate(runs):
        for s, (done, chain) in enumerate(steps):
            n, width = n + 1, max(width, len(chain))
            found = _first_difference(chain, logits_of(i, len(p) + done, chain), targets)
            if found:
                d, e = found
                return False, (f"{name}: first difference at prompt {i} ({prompts[i]!r}), step {s}, {at} {d}: "
                               f"draftlab proposes {chain[d - 1]} {tok.decode([chain[d - 1]])!r}, {name} read from the "
                               f"files {e} {tok.decode([e])!r}")
    return True, f"{name}: the same {width}-token chains at all {n} steps of {len(runs)} prompts"


def _check_hf(module, src: Path, decode, prompts: list[str], tok) -> tuple[bool, str]:
    """An SSM's chains against the Hugging Face causal LM loaded from its files with transformers (a draft model is
    what vLLM and SGLang load as a plain causal LM), greedy-drafting the same chain: one forward over the text up
    to the root followed by draftlab's chain."""
    from ..base import pretrained_lm
    from ..decode.tree import Tree
    from ..drafters import SSM_DEFAULT_CHAIN, make_drafter

    try:
        lm = pretrained_lm(src, dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        return False, f"transformers does not load {src} as a causal LM ({e}): neither would an engine"
    runs = decode(lambda: make_drafter(module, Tree.chain(SSM_DEFAULT_CHAIN)))

    def logits_of(i, c, chain):
        ids = torch.cat([runs[i][1][: c + 1], torch.tensor(chain[:-1], dtype=torch.long)])
        return lm(input_ids=ids[None]).logits[0, c:].float()

    ok, msg = _compare("transformers", runs, prompts, tok, logits_of)
    return ok, f"{src} as a Hugging Face causal LM (AutoModelForCausalLM; engines run their own code for it): {msg}"


@torch.no_grad()
def check_proposals(export_dir: Path, meta: dict, cfg: dict, tensors: dict, engines: list[str], base, tok,
                    prompts, max_new_tokens: int, served: str | None = None) -> Check:
    kind = meta["head"]["type"]
    if kind == "lookup":
        return Check("proposals", None, "no engine loads lookup drafts: they have no weights (an engine's n-gram "
                                        "proposer is configured, not read from an export); nothing to compare")
    from ..decode.tree import Tree
    from ..drafters import make_drafter
    from ..drafters.eagle import Eagle3Drafter

    try:
        module, _ = load_export(export_dir, base=base)
    except ExportError as e:
        return Check("proposals", False, f"draftlab does not load the export, so there is nothing to compare: {e}")
    base = apply_adapter(base, export_dir, meta)  # Medusa-2: the heads run on the adapted base
    prompts = list(prompts)
    decode = lambda make: _decode(base, make, tok, prompts, max_new_tokens)
    if kind == "ssm":
        ok, msg = _check_hf(module, Path(served or export_dir), decode, prompts, tok)
        return Check("proposals", ok, msg)
    if kind == "ensemble":  # an engine serves one draft model: each SSM member alone
        parts, oks = [], []
        for m, member in zip(meta["head"]["members"], module.members):
            if member.kind != "ssm":
                parts.append(f"member {m['name']} ({member.kind}): not a Hugging Face model, not compared")
                continue
            ok, msg = _check_hf(member, Path(served or export_dir) / m["dir"], decode, prompts, tok)
            parts.append(f"member {m['name']} (ssm, decoded alone): {msg}")
            oks.append(ok)
        return Check("proposals", all(oks) if oks else None, "; ".join(parts))
    if kind == "hydra":
        # No engine to read it the other way: a second reading of the files by draftlab itself, in float32, the
        # prefix layer run over the whole text at once (no cache), each head given draftlab's chain above it.
        again = load_export(export_dir, base=base, dtype=torch.float32)[0]
        runs = decode(lambda: make_drafter(module, Tree.chain(module.num_heads)))

        def logits_of(i, c, chain):
            seq, hs = runs[i][1], runs[i][2]
            h = again.context(hs[-1][:, :c].float())[0, c - 1]
            return (again.head_logits(k, h, torch.tensor([int(seq[c])] + chain[:k])).float() for k in range(len(chain)))

        ok, msg = _compare("the reload", runs, prompts, tok, logits_of)
        return Check("proposals", ok, "no engine loads hydra drafts (vLLM and SGLang implement no Hydra heads): not an "
                     "engine check; draftlab's decode compared with draftlab's own second reading of the export's files "
                     f"(float32, uncached): {msg}")
    skip = {("medusa", "sglang"): "SGLang serves no Medusa heads: not compared"}
    compared = [e for e in engines if (kind, e) not in skip]
    make = {"eagle3": lambda: Eagle3Drafter(module, 4, 1, 5),
            "medusa": lambda: make_drafter(module, Tree.chain(module.num_heads)),
            "dflash": lambda: make_drafter(module, Tree.chain(module.block_size - 1))}.get(kind)
    if make is None:
        return Check("proposals", None, f"not checked for {kind}: draftlab models no engine's reading of it")
    runs = decode(make) if compared else []
    msgs, oks = [], []
    for engine in engines:
        name = NAMES[engine]
        if (kind, engine) in skip:
            msgs.append(skip[kind, engine])
            continue
        try:
            if kind == "eagle3":
                reads = engine_reads(cfg, engine, base.config.num_hidden_layers, base.config.model_type)
                eng = EngineEagle3(tensors, cfg, base, reads[0][1])  # (vLLM 0.33 and SGLang read EAGLE-3.1's switches)
            elif kind == "dflash":
                eng = EngineDFlash(tensors, cfg, base, engine)
        except (ValueError, KeyError) as e:
            msgs.append(f"{name}: {e}")
            oks.append(False)
            continue
        if kind == "eagle3":
            g = [eng.fuse(r[2]) for r in runs]
            ok, msg = _compare(name, runs, prompts, tok, lambda i, c, chain: _eagle_chain_logits(
                eng, g[i][:c], runs[i][1][1: c + 1], chain), eng.targets)
        elif kind == "dflash":
            ctx = [eng.context(r[2]) for r in runs]
            ok, msg = _compare(name, runs, prompts, tok, lambda i, c, chain: eng.block_logits(
                ctx[i][:c], int(runs[i][1][c])), at="block position")
            if engine == "vllm":  # vLLM reads no block_size: its block is num_speculative_tokens + 1 long
                msg += (f" (given num_speculative_tokens {eng.block - 1}, block_size - 1, as docs/interop.md's command "
                        "does: vLLM reads no block_size, and another number drafts other blocks)")
        else:
            ok, msg = _compare(name, runs, prompts, tok, lambda i, c, chain: vllm_medusa_logits(
                tensors, cfg, runs[i][2][-1][0, c - 1].float()))
            dropped = [k for k, v in tensors.items() if k.endswith(".bias") and bool(v.any())]
            if dropped and not cfg.get("medusa_fc_bias"):  # the cause, where it is this field (walk-through)
                msg += (f"; config.json has no `medusa_fc_bias: true`, so vLLM builds the blocks without biases and "
                        f"drops the {len(dropped)} nonzero bias tensors the file holds: set it (export --to "
                        "vllm-medusa writes it)")
            msg += f" ({VLLM_MEDUSA_NOTE.rstrip('.')})"  # (a PASS naming vLLM read as if the newest served it; walk-through)
        oks.append(ok)
        msgs.append(msg)
    return Check("proposals", all(oks) if oks else None, "; ".join(msgs))


# --- the whole check -------------------------------------------------------------------------------------------

def _served_files(d: Path, meta: dict, served: str | None) -> tuple[dict, dict, str]:
    """(config.json, tensors, where) of what the engine is given."""
    kind = meta["head"]["type"]
    if kind == "medusa" and not served:
        from .convert import vllm_medusa_state

        state, cfg = vllm_medusa_state(load_export(d)[0])
        return cfg, state, "the vllm-medusa layout `draftlab export --to vllm-medusa` writes (--served DIR: your files)"
    src = Path(served) if served else d
    if served and not src.is_dir():
        raise FileNotFoundError(f"--served {src}: no such directory (the files the engine is given)")
    cfg = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    if kind == "medusa" and served and ("hidden_size" not in cfg or "num_heads" not in cfg):
        what = ("it holds an SSM or another causal LM (model_type " + repr(cfg.get("model_type")) + ")"
                if "hidden_size" in cfg else "FasterDecoding's `export --to medusa`, say, which no engine checked "
                "here reads")  # (an HF directory was a KeyError deep in the comparison: walk-through)
        raise ValueError(f"--served {src}: its config.json has no {'num_heads' if 'hidden_size' in cfg else 'hidden_size'}"
                         f", so it is not the layout vLLM's Medusa model loads ({what}); give the `export --to "
                         "vllm-medusa` directory")
    st = src / "model.safetensors"
    return cfg, (read_safetensors(st) if st.is_file() and kind in ("eagle3", "dflash", "medusa") else {}), str(src)


def check_export(export_dir: str | Path, engine: str | None = None, base: str | None = None,
                 tokenizer: str | None = None, prompts: list[str] | None = None, served: str | None = None,
                 max_new_tokens: int = 16, chat_template: str | None = None) -> dict:
    """Run every check on an export; {"export", "kind", "base", "engines", "served", "ok", "checks": [...]}.
    `chat_template`: the template file the engine is given (--chat-template), compared with training's."""
    from transformers import AutoConfig

    from ..base import check_model_path, load_base, load_tokenizer

    if engine is not None and engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if chat_template is not None and not Path(chat_template).is_file():
        raise FileNotFoundError(f"--chat-template {chat_template}: no such file (the Jinja template the engine is "
                                "given)")
    d = Path(export_dir)
    try:
        meta = read_meta(d)
    except ExportError:
        if (d / "config.json").is_file():  # an engine's files (`draftlab export --to ...`), not draftlab's export
            raise ExportError(f"{d}: not a draftlab export (no draftlab.json) but a model directory, as `draftlab "
                              f"export --to` writes; check it against the export it came from: `draftlab check "
                              f"EXPORT --served {d}`") from None
        raise
    kind = meta["head"]["type"]
    engines = [engine] if engine else list(ENGINES)
    base_name = base or meta["base"]["name_or_path"]
    check_model_path(base_name, "--base" if base else "base.name_or_path")  # (was a traceback: walk-through)
    base_cfg = AutoConfig.from_pretrained(base_name).to_dict()  # config.json only: no weights
    tok_src = tokenizer or base_name
    tok = load_tokenizer(tok_src, field="--tokenizer") if tokenizer else use_chat_template(load_tokenizer(tok_src), d,
                                                                                             meta)
    cfg, tensors, where = _served_files(d, meta, served)
    checks = [check_aux(cfg, meta, engines, base_cfg["num_hidden_layers"], base_cfg.get("model_type", "")),
              check_target(meta, base_cfg, engines),
              check_vocab(cfg, tensors, meta, base_cfg["vocab_size"], tok, engines),
              check_rope(cfg, base_cfg, kind, engines), check_quant(cfg, base_cfg, engines),
              check_tokenizer(d, meta, tok_src, chat_template)]
    model = load_base(base_name, "float32")[0] if kind != "lookup" else None
    checks.append(check_proposals(d, meta, cfg, tensors, engines, model, tok, list(prompts or DEFAULT_PROMPTS),
                                  max_new_tokens, served))
    return {"export": str(d), "kind": kind, "base": base_name, "engines": engines, "served": where,
            "ok": all(c.ok is not False for c in checks), "checks": [asdict(c) for c in checks],
            "unserved": UNSERVED.get(kind)}


# Kinds no engine serves whole: `check` says so beside its verdict (an ensemble's "all checks passed" beside
# "engines: vllm, sglang" read as servable: walk-through).
UNSERVED = {"hydra": "vLLM and SGLang implement no Hydra heads; draftlab decodes it",
            "ensemble": "vLLM and SGLang take one draft model; draftlab decodes the ensemble, and each SSM member can "
                        "be served alone as a draft model (the members' checks above)"}
