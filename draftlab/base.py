"""Load the frozen base LM + tokenizer (hub id or path), and import llama2.c checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import struct
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


class BaseModelError(ValueError):
    """The base model or tokenizer cannot be loaded or used as asked."""


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id (`org/name`): starts with / . ~, or has more than one separator."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def check_model_path(name_or_path: str, field: str = "base.name_or_path") -> None:
    """A name that can only be a local directory must exist (else hub clients report a malformed repo id)."""
    if looks_like_path(name_or_path) and not Path(name_or_path).expanduser().is_dir():
        raise BaseModelError(f"{field}={name_or_path!r}: no such directory (a hub id looks like org/name). For a "
                             "llama2.c checkpoint run `draftlab import-llama2c MODEL.bin --tokenizer TOK.model --out DIR`")


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False):
    """AutoTokenizer with a pad token and a chat template guaranteed."""
    from transformers import AutoTokenizer

    check_model_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise BaseModelError(
            f"base.name_or_path={name_or_path!r}: no tokenizer found ({e}). Use a local directory "
            "holding tokenizer files or a hub id reachable from this machine (set HF_HOME for a cache)."
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if not getattr(tok, "chat_template", None):
        tok.chat_template = SIMPLE_CHAT_TEMPLATE
    return tok


def load_base(name_or_path: str, dtype: str = "bfloat16", device: str | torch.device | None = None,
              revision: str | None = None, trust_remote_code: bool = False,
              attn_implementation: str | None = None, **placement):
    """Frozen base causal LM in eval mode, and its tokenizer. placement: `distributed_config` (tensor parallel over a
    torchrun launch) or `device_map` (layer-wise placement), passed to from_pretrained; `device` is then unused."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise BaseModelError(f"base.dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    check_model_path(name_or_path)
    kwargs = dict(dtype=DTYPES[dtype], revision=revision, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    placement = {k: v for k, v in placement.items() if v is not None}
    kwargs.update(placement)
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as e:
        raise BaseModelError(
            f"base.name_or_path={name_or_path!r}: cannot load a causal LM ({e}). For a llama2.c "
            "checkpoint run `draftlab import-llama2c MODEL.bin --tokenizer TOK.model --out DIR` first."
        ) from None
    model.requires_grad_(False).eval()
    if device is not None and not placement:
        model.to(device)
    return model, load_tokenizer(name_or_path, revision, trust_remote_code)


def base_identity(model, name_or_path: str | None = None) -> dict:
    """What an export records about its base, to refuse a different one at load time."""
    cfg = model.config
    return {
        "name_or_path": name_or_path or getattr(cfg, "_name_or_path", ""),
        "model_type": cfg.model_type,
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "num_hidden_layers": int(getattr(cfg, "num_hidden_layers", 0)),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


def base_hidden(model, input_ids, attention_mask=None, **kwargs):
    """Final (normalised) hidden states of the base, [B, S, H]; the one definition training and decoding share."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                use_cache=False, logits_to_keep=1, **kwargs)
    return out.hidden_states[-1]


def base_states(model, input_ids, attention_mask=None, layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The base's residual stream entering each decoder layer in `layers`, and its final (normalised) state,
    stacked as [B, S, len(layers) + 1, H].

    Indexing follows Hugging Face's `output_hidden_states`: layer id i is hidden_states[i], the input of decoder
    layer i (0 = the token embeddings), which is what vLLM and SGLang hand an EAGLE-3 drafter for its layer ids.
    Captured with forward pre-hooks, so only these layers are kept, not all of them."""
    blocks = model.base_model.layers
    caught: dict[int, torch.Tensor] = {}
    hooks = []
    for i in layers:
        if not 0 <= i < len(blocks):
            raise BaseModelError(f"base layer id {i}: the base has decoder layers 0..{len(blocks) - 1}")
        hooks.append(blocks[i].register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: caught.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True))
    try:
        final = base_hidden(model, input_ids, attention_mask)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([caught[i] for i in layers] + [final], dim=2)


# ---------------------------------------------------------------------------------------------
# llama2.c import

def _read_llama2c(path: Path) -> tuple[dict, dict]:
    raw = path.read_bytes()
    if len(raw) < 28:
        raise BaseModelError(f"{path}: too small to be a llama2.c checkpoint (needs a 28-byte header)")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", raw[:28])
    if min(dim, hidden, n_layers, n_heads, n_kv, seq_len) <= 0 or dim % n_heads:
        raise BaseModelError(f"{path}: header {dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len} is not a "
                             "legacy (version 0) llama2.c checkpoint; export it with llama2.c's export.py --version 0")
    shared = vocab > 0
    vocab = abs(vocab)
    head = dim // n_heads
    kv_dim = head * n_kv
    w = np.frombuffer(raw, dtype="<f4", offset=28)
    sizes = [("tok", (vocab, dim)), ("attn_norm", (n_layers, dim)), ("wq", (n_layers, dim, dim)),
             ("wk", (n_layers, kv_dim, dim)), ("wv", (n_layers, kv_dim, dim)), ("wo", (n_layers, dim, dim)),
             ("ffn_norm", (n_layers, dim)), ("w1", (n_layers, hidden, dim)), ("w2", (n_layers, dim, hidden)),
             ("w3", (n_layers, hidden, dim)), ("norm", (dim,)), ("freq", (seq_len, head))]
    if not shared:
        sizes.append(("out", (vocab, dim)))
    need = sum(int(np.prod(s)) for _, s in sizes)
    if w.size != need:
        raise BaseModelError(f"{path}: holds {w.size} floats after the header, the header implies {need}")
    arrays, off = {}, 0
    for name, shape in sizes:
        n = int(np.prod(shape))
        arrays[name] = torch.from_numpy(w[off:off + n].copy()).reshape(shape)
        off += n
    cfg = dict(dim=dim, hidden=hidden, n_layers=n_layers, n_heads=n_heads, n_kv=n_kv, vocab=vocab,
               seq_len=seq_len, shared=shared)
    return cfg, arrays


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair RoPE rows (llama2.c / Meta) -> HF rotate_half order."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def import_llama2c(model_path: str | Path, tokenizer_path: str | Path, out_dir: str | Path,
                   chat_template: str = SIMPLE_CHAT_TEMPLATE) -> Path:
    """Write a standard HF Llama directory (weights, tokenizer, chat template) from llama2.c files."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    model_path, tokenizer_path, out_dir = Path(model_path), Path(tokenizer_path), Path(out_dir)
    if not model_path.is_file():
        raise BaseModelError(f"{model_path}: no such llama2.c checkpoint")
    if not tokenizer_path.is_file() or tokenizer_path.suffix != ".model":
        raise BaseModelError(f"{tokenizer_path}: expected a SentencePiece .model file (e.g. tok512.model)")
    c, a = _read_llama2c(model_path)
    config = LlamaConfig(
        hidden_size=c["dim"], intermediate_size=c["hidden"], num_hidden_layers=c["n_layers"],
        num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv"], vocab_size=c["vocab"],
        max_position_embeddings=c["seq_len"], rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=c["shared"], bos_token_id=1, eos_token_id=2, pad_token_id=None,
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    )
    sd = {"model.embed_tokens.weight": a["tok"], "model.norm.weight": a["norm"]}
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = a["attn_norm"][i]
        sd[p + "post_attention_layernorm.weight"] = a["ffn_norm"][i]
        sd[p + "self_attn.q_proj.weight"] = _permute_rope(a["wq"][i], c["n_heads"])
        sd[p + "self_attn.k_proj.weight"] = _permute_rope(a["wk"][i], c["n_kv"])
        sd[p + "self_attn.v_proj.weight"] = a["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = a["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = a["w1"][i]
        sd[p + "mlp.down_proj.weight"] = a["w2"][i]
        sd[p + "mlp.up_proj.weight"] = a["w3"][i]
    sd["lm_head.weight"] = a["tok"] if c["shared"] else a["out"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise BaseModelError(f"{model_path}: weight names did not map (missing {missing}, unexpected {unexpected})")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)

    # The tokenizer: let transformers convert the SentencePiece model, then pin BOS handling.
    staging = out_dir / "_spm"
    staging.mkdir(exist_ok=True)
    shutil.copy(tokenizer_path, staging / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(staging, add_bos_token=True, add_eos_token=False, legacy=False)
    shutil.rmtree(staging)
    if len(tok) != c["vocab"]:
        raise BaseModelError(f"{tokenizer_path}: {len(tok)} tokens, but {model_path} has vocab_size={c['vocab']}")
    tok.pad_token = tok.unk_token
    tok.chat_template = chat_template
    tok.model_max_length = c["seq_len"]
    tok.save_pretrained(out_dir)
    shutil.copy(tokenizer_path, out_dir / "tokenizer.model")
    (out_dir / "draftlab_import.json").write_text(json.dumps(
        {"source": str(model_path), "tokenizer": str(tokenizer_path), "format": "llama2.c v0"}, indent=2))
    return out_dir


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch RNGs."""
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
