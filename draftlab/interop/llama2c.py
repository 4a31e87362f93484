"""Import a llama2.c checkpoint (legacy version 0 files, e.g. stories260K) as a Hugging Face Llama directory."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import torch

from ..base import SIMPLE_CHAT_TEMPLATE, BaseModelError
from .export import readable_as_umask


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
    # llama2.c's models are trained on stories each opened by BOS, and its run.c stops at BOS: generation stops
    # there too (with EOS alone a story ran on into the next, and distill-data glued them into one record)
    model.generation_config.eos_token_id = [2, 1]
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
    readable_as_umask(out_dir)
    return out_dir
