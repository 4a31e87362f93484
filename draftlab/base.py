"""Load the frozen base LM + tokenizer (hub id or path) and read its hidden states."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}

# A plain-text chat template for bases that ship none (llama2.c imports, quickstart base).
# Assistant turns end with EOS so heads learn where answers stop.
SIMPLE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


# FastChat's vicuna_v1.1 conversation format (the system line, "USER: ... ASSISTANT: ...</s>"), which the Vicuna
# v1.1-v1.5 bases were tuned on and which Medusa, Hydra and EAGLE trained and evaluated their Vicuna drafters with;
# those bases ship no chat template. `base.chat_template: vicuna`.
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")
VICUNA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}" + VICUNA_SYSTEM + "{% endif %} "
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% elif m['role'] == 'assistant' %}ASSISTANT: {{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
CHAT_TEMPLATES = {"vicuna": VICUNA_CHAT_TEMPLATE, "simple": SIMPLE_CHAT_TEMPLATE}


class BaseModelError(ValueError):
    """The base model or tokenizer cannot be loaded or used as asked."""


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id (`org/name`): starts with / . ~, has more than one separator, or its first
    part is a directory here (runs/my-base, with a runs/ folder)."""
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
            or "/" in name and Path(name.split("/")[0]).is_dir())


def check_model_path(name_or_path: str, field: str = "base.name_or_path", revision: str | None = None) -> None:
    """A name that can only be a local directory must exist (else hub clients report a malformed repo id, after
    retrying for a minute); offline, a hub id must be in the hub cache (else they report a failed connection)."""
    p = Path(name_or_path).expanduser()
    if not looks_like_path(name_or_path) and not p.exists() and hub_offline():
        from huggingface_hub import constants, try_to_load_from_cache

        try:  # (a model's config, or a tokenizer's alone)
            cached = [try_to_load_from_cache(name_or_path, f, revision=revision)
                      for f in ("config.json", "tokenizer_config.json")]
        except ValueError:  # (not a valid hub id either)
            cached = []
        if not any(isinstance(c, str) for c in cached):
            raise BaseModelError(f"{field}={name_or_path!r}: no such directory here (from {os.getcwd()}), and as a hub "
                                 f"id it is not in the hub cache ({constants.HF_HUB_CACHE}); HF_HUB_OFFLINE is set, "
                                 "so it is not downloaded. Give a local directory, or download it where the hub "
                                 "can be reached (`hf download ID`) into the cache this machine reads (HF_HOME)")
    if looks_like_path(name_or_path) and not p.is_dir():
        what = ("a file: give the directory that holds the model's (or tokenizer's) files" if p.is_file() else
                f"no such directory (from {os.getcwd()}; a hub id looks like org/name)")
        hint = (" (A recipe names its base here; an export names it in its draftlab.json, and the commands that read "
                "an export, e.g. generate, eval and check, take another with --base.) For a llama2.c checkpoint "
                "run `draftlab import-llama2c MODEL.bin --tokenizer TOK.model --out DIR`"
                if field == "base.name_or_path" else "")
        raise BaseModelError(f"{field}={name_or_path!r}: {what}.{hint}")


def hub_offline() -> bool:
    """Whether the hub is off for this process (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE), read now: huggingface_hub
    reads its variable once, at import."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_device(device) -> None:
    """A device this machine has (--device): named with the reason otherwise, rather than torch's assertion from
    deep inside the first copy to it."""
    if device is None:
        return
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise BaseModelError(f"--device {device!r}: not a device name; use cpu, cuda, cuda:N or mps") from None
    if d.type == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            built = "" if torch.backends.cuda.is_built() else ", a torch built without CUDA"
            raise BaseModelError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}"
                                 f"{built}); use --device cpu, or install a CUDA build of torch (README)")
        if d.index is not None and d.index >= n:
            raise BaseModelError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    elif d.type == "mps" and not torch.backends.mps.is_available():
        raise BaseModelError(f"--device {device}: MPS is not available here; use --device cpu")


def chat_template_text(value: str) -> str:
    """base.chat_template's Jinja text: a built-in name (CHAT_TEMPLATES), a file holding the template, or the
    template itself."""
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value]
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise BaseModelError(f"base.chat_template={value!r}: not a built-in template ({', '.join(CHAT_TEMPLATES)}), "
                         "a file, or Jinja text")


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False,
                   chat_template: str | None = None, field: str = "base.name_or_path"):
    """AutoTokenizer with a pad token and a chat template guaranteed: `chat_template` (see chat_template_text) in
    place of its own when given, else its own, else SIMPLE_CHAT_TEMPLATE."""
    from transformers import AutoTokenizer

    check_model_path(name_or_path, field, revision)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise BaseModelError(
            f"{field}={name_or_path!r}: no tokenizer found ({e}). Use a local directory "
            "holding tokenizer files or a hub id reachable from this machine (set HF_HOME for a cache)."
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if chat_template:
        tok.chat_template = chat_template_text(chat_template)
    elif not getattr(tok, "chat_template", None):
        tok.chat_template = SIMPLE_CHAT_TEMPLATE
        tok.draftlab_fallback_template = True  # see template_to_ship
    return tok


def template_to_ship(tok, chosen) -> str | None:
    """The chat template an export keeps beside it (chat_template.jinja, which draftlab serves with and an engine is
    given with --chat-template): the recipe's base.chat_template where it set one (`chosen`), or draftlab's simple
    one where the tokenizer had none (training rendered conversations with it, and the base's own files hold no
    template a server could read); else None, the tokenizer's own template serving as it is."""
    return tok.chat_template if chosen or getattr(tok, "draftlab_fallback_template", False) else None


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokens a turn of the base ends on: the tokenizer's EOS and every `eos_token_id` of the base's
    generation_config.json (a list on chat bases: Llama-3's <|eot_id|>, Gemma's <end_of_turn>, Qwen's <|im_end|>
    beside the end of text), as Hugging Face's `generate` stops on them. In order, without repeats."""
    found = [getattr(tokenizer, "eos_token_id", None)]
    cfg = getattr(model, "generation_config", None)
    more = getattr(cfg, "eos_token_id", None)
    found += more if isinstance(more, (list, tuple)) else [more]
    return list(dict.fromkeys(int(t) for t in found if t is not None))


def logit_transforms(config, head=None) -> list[str]:
    """What a base does to its logits after its lm_head's product (soft-capping, scaling; with its lm_head, a bias):
    a teacher taken as softmax(h @ W) from its hidden states, as distillation computes it, is not its distribution."""
    c, found = config, []  # (a multimodal base's text config: teacher_transform hands it over)
    for name in _SOFT_CAPS + ("output_logit_soft_cap",):  # (xLSTM's: not read, so refused)
        if getattr(c, name, None):
            found.append(f"{name} {getattr(c, name)}")
    for name in ("logit_scale", "logits_scaling", "lm_head_multiplier", "logits_mup_width_multiplier"):
        v = getattr(c, name, None)
        if v is not None and v != 1:
            found.append(f"{name} {v}")
    if getattr(head, "bias", None) is not None:
        found.append("an lm_head bias")
    if head is not None and getattr(type(head), "forward", None) is not torch.nn.Linear.forward:  # (FSDP's wrapping
        found.append(f"an output head of its own ({type(head).__name__})")  # keeps Linear's forward; Dory's does not)
    return found


_SOFT_CAPS = ("final_logit_softcapping", "logits_soft_cap")  # (Gemma-2 and most; RecurrentGemma): cap * tanh(z / cap)


# Bases whose logits are their lm_head's product scaled, by model type: (config key, True: multiplied by it, False:
# divided; MiniCPM3 divides its final state before the product, which is the same). The same key means either
# (Granite divides by logits_scaling, HyperCLOVA X multiplies), so an unknown model type with one is not guessed.
_LOGIT_SCALES = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass", "cohere_compass_text"),
                    ("logit_scale", True)),
    "falcon_h1": ("lm_head_multiplier", True),
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
                     "minicpm3"), ("logits_scaling", False)),
    "hyperclovax": ("logits_scaling", True),
}


def teacher_transform(config, head=None) -> tuple[float, float | None] | None:
    """(scale, softcap) such that the base's logits are losses.lm_logits(h, W, (scale, softcap)) of its final hidden
    states h: Cohere's and Granite's scales, Gemma-2's final_logit_softcapping; None: the product itself. Raises
    ValueError for what it cannot reproduce from h (an lm_head bias, a scale of a model type it does not know)."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    found = logit_transforms(c, head)
    if not found:
        return None
    key, times = _LOGIT_SCALES.get(getattr(c, "model_type", None), (None, True))
    unknown = [t for t in found if not (t.split(" ")[0] in _SOFT_CAPS or (key and t.startswith(key + " ")))]
    if unknown:
        raise ValueError(", ".join(unknown))
    scale = float(getattr(c, key, None) or 1.0) if key else 1.0
    cap = next((getattr(c, k) for k in _SOFT_CAPS if getattr(c, k, None)), None)
    return (scale if times else 1.0 / scale), (float(cap) if cap else None)


def pretrained_lm(name_or_path, **kwargs):
    """AutoModelForCausalLM.from_pretrained with transformers' torch layers. From 5.25 transformers swaps layers for
    Hub kernels by default (`use_kernels`): fetched from the Hub as the model loads, so an offline node fails, and
    rounding otherwise than the layers draftlab trains, checks and compiles. draftlab asks for none."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name_or_path, use_kernels=False, **kwargs)


def load_base(name_or_path: str, dtype: str = "bfloat16", device: str | torch.device | None = None,
              revision: str | None = None, trust_remote_code: bool = False,
              attn_implementation: str | None = None, chat_template: str | None = None, **placement):
    """Frozen base causal LM in eval mode, and its tokenizer (with `chat_template`: see load_tokenizer).
    placement: `distributed_config` (tensor parallel over a torchrun launch) or `device_map` (layer-wise placement),
    passed to from_pretrained; `device` is then unused."""
    if dtype not in DTYPES:
        raise BaseModelError(f"base.dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    check_model_path(name_or_path, revision=revision)
    check_device(device)
    if chat_template:  # (refused before the weights load)
        chat_template_text(chat_template)
    kwargs = dict(dtype=DTYPES[dtype], revision=revision, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    placement = {k: v for k, v in placement.items() if v is not None}
    kwargs.update(placement)
    try:
        model = pretrained_lm(name_or_path, **kwargs)
    except OSError as e:
        raise BaseModelError(
            f"base.name_or_path={name_or_path!r}: cannot load a causal LM ({e}). For a llama2.c "
            "checkpoint run `draftlab import-llama2c MODEL.bin --tokenizer TOK.model --out DIR` first."
        ) from None
    model.requires_grad_(False).eval()
    if device is not None and not placement:
        model.to(device)
    return model, load_tokenizer(name_or_path, revision, trust_remote_code, chat_template)


def load_recipe_base(b, device=None, **placement):
    """load_base with every field of a recipe's base section `b` (name, dtype, revision, remote code, attention,
    chat template)."""
    return load_base(b.name_or_path, b.dtype, device, b.revision, b.trust_remote_code, b.attn_implementation,
                     b.chat_template, **placement)


def base_identity(model, name_or_path: str | None = None) -> dict:
    """What an export records about its base, to refuse a different one at load time. A local directory is
    recorded whole (absolute), so the export finds its base from any working directory."""
    cfg = model.config
    name = name_or_path or getattr(cfg, "_name_or_path", "")
    if name and Path(name).expanduser().is_dir():
        name = str(Path(name).expanduser().resolve())
    return {
        "name_or_path": name,
        "model_type": cfg.model_type,
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "num_hidden_layers": int(getattr(cfg, "num_hidden_layers", 0)),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "embedding_sample": embedding_sample(model),
    }


def embedding_sample(model, rows: int = 8, cols: int = 4) -> list[float] | None:
    """A few values of the base's input embedding (the first `cols` of `rows` rows spread over the vocabulary), to
    tell two bases of the same shape apart (same_embedding). None where the weights are not at hand (a meta-device
    or sharded embedding)."""
    w = model.get_input_embeddings().weight
    if type(w).__name__ == "DTensor" or w.device.type == "meta":
        return None
    at = torch.linspace(0, w.shape[0] - 1, rows).long().to(w.device)
    return [float(f"{v:.5g}") for v in w[at, :cols].detach().float().flatten().tolist()]


def same_embedding(a: list[float], b: list[float]) -> bool:
    """Two embedding samples of one checkpoint, however it was loaded (float32, bfloat16, float16: each rounds a
    value by at most 2^-8 of it), agree within 1% of each value (or of the sample's scale for values near zero);
    another model's differ far beyond."""
    scale = max(max(map(abs, a), default=0.0), 1e-12)
    return len(a) == len(b) and all(abs(x - y) <= 0.01 * max(abs(x), abs(y)) + 1e-3 * scale for x, y in zip(a, b))


def base_hidden(model, input_ids, attention_mask=None, **kwargs):
    """Final (normalised) hidden states of the base, [B, S, H]; the one definition training and decoding share.
    Read from its decoder's output through a hook, the forward called as it is (a PEFT adapter or FSDP's wrapping
    see the same call): output_hidden_states kept every layer's states until the forward returned, about 5 GB a
    rank more at its peak for a 70B base at batch 2 x 2,048."""
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1, **kwargs)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        return model(**kw, output_hidden_states=True).hidden_states[-1]
    got = []
    handle = decoder.register_forward_hook(lambda m, args, out: got.append(
        out[0] if isinstance(out, tuple) else out.last_hidden_state))
    try:
        model(**kw)
    finally:
        handle.remove()
    return got[-1]


def base_states(model, input_ids, attention_mask=None, layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The base's residual stream entering each decoder layer in `layers`, and its final (normalised) state,
    stacked as [B, S, len(layers) + 1, H].

    Indexing follows Hugging Face's `output_hidden_states`: layer id i is hidden_states[i], the input of decoder
    layer i (0 = the token embeddings), which is what vLLM and SGLang hand an EAGLE-3 drafter for its layer ids.
    Id L (the number of decoder layers) is hidden_states[L], the last layer's output after the final norm, as
    decoding reads it from the base's forward. Captured with forward pre-hooks, so only these layers are kept, not
    all of them."""
    blocks = model.base_model.layers
    L = len(blocks)
    caught: dict[int, torch.Tensor] = {}
    hooks = []
    for i in layers:
        if not 0 <= i <= L:
            raise BaseModelError(f"base layer id {i}: this base's ids (Hugging Face's hidden_states indexing, id i the "
                                 f"input of decoder layer i) are 0..{L}, {L} being the last layer's output after the "
                                 "final norm")
        if i == L:
            continue
        hooks.append(blocks[i].register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: caught.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True))
    try:
        final = base_hidden(model, input_ids, attention_mask)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([final if i == L else caught[i] for i in layers] + [final], dim=2)


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch RNGs."""
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
