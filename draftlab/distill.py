"""Self-distilled data: the base answers a dataset's prompts; heads then train on the base's own text."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .base import load_base
from .data import DataError, detect_format, prompt_turns, read_records, to_messages


def _base_args(base_or_recipe: str, dtype: str | None) -> tuple[str, str]:
    if base_or_recipe.endswith((".yaml", ".yml")):
        from .config import load_recipe

        r = load_recipe(base_or_recipe)
        return r.base.name_or_path, dtype or r.base.dtype
    return base_or_recipe, dtype or ("bfloat16" if torch.cuda.is_available() else "float32")


def text_prefix(text: str, chars: int) -> str:
    """The first `chars` characters of a text, cut back to a word boundary."""
    head = text[:chars]
    return head.rsplit(" ", 1)[0] if " " in head and len(text) > chars else head


def prompts_of(path: str, max_records: int | None = None, mode: str = "chat",
               prompt_chars: int = 64) -> list[tuple[int, object]]:
    """(record index, prompt) for each usable record: messages up to the first assistant turn (chat), or the
    opening of the text / of the first user turn (text)."""
    out = []
    for _, i, rec in read_records(path, max_records=max_records):
        fmt = detect_format(rec)
        if mode == "text":
            if fmt == "text":
                out.append((i, text_prefix(rec["text"], prompt_chars)))
            else:
                try:
                    out.append((i, prompt_turns(to_messages(rec, fmt))[-1]["content"]))
                except DataError:
                    continue
            continue
        if fmt == "text":
            out.append((i, [{"role": "user", "content": rec["text"]}]))
            continue
        try:
            msgs = to_messages(rec, fmt)
        except DataError:
            continue
        out.append((i, prompt_turns(msgs)))
    return out


def distill_data(base_or_recipe: str, prompts_file: str, out_file: str, max_new_tokens: int = 512,
                 temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 8, max_records: int | None = None,
                 dtype: str | None = None, device: str | None = None, seed: int = 0, mode: str = "chat",
                 prompt_chars: int = 64) -> dict:
    """Generate with the base and append records to out_file; records already there are skipped.

    mode chat: the base answers each record's first user turn through its chat template, written as ShareGPT
    conversations. mode text (bases without a chat format, e.g. TinyStories models): the base continues the
    first prompt_chars characters of each text, written as {"text": prefix + continuation}."""
    if mode not in ("chat", "text"):
        raise DataError(f"--mode {mode!r}: use chat or text")
    name, dtype = _base_args(base_or_recipe, dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_base(name, dtype, device)
    tok.padding_side = "left"
    todo = prompts_of(prompts_file, max_records, mode, prompt_chars)
    if not todo:
        raise DataError(f"{prompts_file}: no prompts found (expected ShareGPT, Alpaca or text records)")
    out = Path(out_file)
    done = set()
    if out.is_file():
        for line in out.read_text().splitlines():
            if line.strip():
                done.add(json.loads(line)["source_index"])
    todo = [(i, m) for i, m in todo if i not in done]
    torch.manual_seed(seed)
    written = 0
    with open(out, "a") as f, tqdm(total=len(todo) + len(done), initial=len(done), desc="distill", unit="prompt") as bar:
        for s in range(0, len(todo), batch_size):
            chunk = todo[s:s + batch_size]
            if mode == "chat":
                texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for _, m in chunk]
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            else:
                enc = tok([m for _, m in chunk], return_tensors="pt", padding=True, add_special_tokens=True).to(device)
            kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
            kw.update(dict(temperature=temperature, top_p=top_p) if temperature > 0 else
                      dict(temperature=None, top_p=None, top_k=None))
            with torch.no_grad():
                gen = model.generate(**enc, **kw)[:, enc["input_ids"].shape[1]:]
            for j, ((i, prompt), ids) in enumerate(zip(chunk, gen)):
                answer = tok.decode(ids, skip_special_tokens=True)
                if mode == "text":  # decoded with the prompt's ids, so word boundaries come out as the base made them
                    own = enc["input_ids"][j][enc["attention_mask"][j].bool()].tolist()
                    f.write(json.dumps({"source_index": i, "text": tok.decode(own + ids.tolist(),
                                                                             skip_special_tokens=True)}) + "\n")
                else:
                    conv = [{"from": "human" if m["role"] == "user" else m["role"], "value": m["content"]}
                            for m in prompt]
                    conv.append({"from": "gpt", "value": answer.strip()})
                    f.write(json.dumps({"source_index": i, "conversations": conv}) + "\n")
                written += 1
            f.flush()
            bar.update(len(chunk))
    return {"out": str(out), "written": written, "skipped_existing": len(done), "base": name}

