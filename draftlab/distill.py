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


def prompts_of(path: str, max_records: int | None = None) -> list[tuple[int, list[dict]]]:
    """(record index, messages up to the first assistant turn) for each usable record."""
    out = []
    for _, i, rec in read_records(path, max_records=max_records):
        fmt = detect_format(rec)
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
                 dtype: str | None = None, device: str | None = None, seed: int = 0) -> dict:
    """Generate answers with the base and append ShareGPT records to out_file; records already there are skipped."""
    name, dtype = _base_args(base_or_recipe, dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_base(name, dtype, device)
    tok.padding_side = "left"
    todo = prompts_of(prompts_file, max_records)
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
            texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for _, m in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
            kw.update(dict(temperature=temperature, top_p=top_p) if temperature > 0 else
                      dict(temperature=None, top_p=None, top_k=None))
            with torch.no_grad():
                gen = model.generate(**enc, **kw)[:, enc["input_ids"].shape[1]:]
            for (i, msgs), ids in zip(chunk, gen):
                answer = tok.decode(ids, skip_special_tokens=True).strip()
                conv = [{"from": "human" if m["role"] == "user" else m["role"], "value": m["content"]} for m in msgs]
                conv.append({"from": "gpt", "value": answer})
                f.write(json.dumps({"source_index": i, "conversations": conv}) + "\n")
                written += 1
            f.flush()
            bar.update(len(chunk))
    return {"out": str(out), "written": written, "skipped_existing": len(done), "base": name}
