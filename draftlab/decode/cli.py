"""`draftlab generate`: load an export with its base, decode, optionally compare with plain decoding."""

from __future__ import annotations

import json
import sys
import time

import torch

from .acceptance import Sampling
from .decoder import SpeculativeDecoder, sync_device
from .tree import Tree, default_tree


def resolve_tree(tree: str | None, meta: dict) -> Tree:
    """--tree value (a file, 'chain' or 'default'), else the export's default tree, else a shipped default."""
    k = meta["head"]["num_heads"]
    if tree == "chain":
        return Tree.chain(k)
    if tree and tree != "default":
        return Tree.load(tree)
    if meta.get("default_tree"):
        return Tree.from_paths(meta["default_tree"], {"name": "export default"})
    return default_tree(k)


def load_decoder(export_dir: str, base: str | None = None, tree: str | None = None, dtype: str | None = None,
                 device: str | None = None):
    """(decoder, tokenizer, meta) for an export; the base defaults to the one the export names."""
    from ..base import load_base
    from ..export import load_export, read_meta

    meta = read_meta(export_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = base or meta["base"]["name_or_path"]
    model, tok = load_base(name, dtype or meta["base"]["dtype"], device)
    draft, meta = load_export(export_dir, base=model, device=device, dtype=next(model.parameters()).dtype)
    return SpeculativeDecoder(model, draft, resolve_tree(tree, meta)), tok, meta


def encode_prompt(tok, prompt, chat: bool) -> list[int]:
    """Token ids of a prompt: raw text (with BOS) or a user turn through the chat template."""
    if chat or isinstance(prompt, list):
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids
    ids = tok(prompt, add_special_tokens=False).input_ids
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids


def stop_fn(tok, stops: list[str]):
    """stop(row, tokens) -> cut index just past the first stop string, or None."""
    if not stops:
        return None

    def stop(_, tokens):
        text = tok.decode(tokens, skip_special_tokens=True)
        if not any(s in text for s in stops):
            return None
        for i in range(1, len(tokens) + 1):
            if any(s in tok.decode(tokens[:i], skip_special_tokens=True) for s in stops):
                return i
        return None
    return stop


def plain_generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, eos, seed: int = 0):
    """Plain HF `generate` of the same base (one prompt at a time), the speedup baseline."""
    out, t = [], 0.0
    for p in prompts:
        ids = torch.tensor([p], device=next(model.parameters()).device)
        kw = dict(do_sample=sampling.temperature > 0, max_new_tokens=max_new_tokens, eos_token_id=eos,
                  pad_token_id=eos if eos is not None else 0)
        if sampling.temperature > 0:
            kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        # An explicit mask: generate() would otherwise mask prompt tokens equal to pad_token_id.
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, len(p):].tolist()
        sync_device(ids.device)
        t += time.perf_counter() - t0
        if eos is not None and eos in gen:
            gen = gen[: gen.index(eos) + 1]
        out.append(gen)
    return out, t


def run_generate(decoder, tok, prompts, max_new_tokens=128, sampling=Sampling(), compare=False, chat=False,
                 stops=(), seed=0, on_text=None) -> dict:
    """Decode prompts (batched) and report; with compare, also plain decoding of the same base."""
    ids = [encode_prompt(tok, p, chat) for p in prompts]
    eos = tok.eos_token_id
    gen = torch.Generator(device=decoder.device).manual_seed(seed)
    # Warm-up (allocator, kernels) outside the timed region.
    decoder.generate(ids[:1], max_new_tokens=4, sampling=sampling, eos_token_id=eos, generator=gen)
    res_tokens = [[] for _ in ids]
    seen = [""] * len(ids)

    def on_tokens(b, new):
        res_tokens[b].extend(new)
        if on_text is not None:
            text = tok.decode(res_tokens[b], skip_special_tokens=True)
            on_text(b, text[len(seen[b]):])
            seen[b] = text
    t0 = time.perf_counter()
    res = decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos,
                           stop=stop_fn(tok, list(stops)), generator=gen, on_tokens=on_tokens)
    sync_device(decoder.device)
    wall = time.perf_counter() - t0
    texts = [tok.decode(t, skip_special_tokens=True) for t in res.tokens]
    report = {
        "text": texts[0] if len(texts) == 1 else texts,
        "new_tokens": res.new_tokens,
        "steps": res.steps,
        "accept_length": round(res.accept_length, 4),
        "tokens_per_s": round(res.new_tokens / wall, 2),
        "wall_s": round(wall, 4),
        "time_split_s": {k: round(v, 4) for k, v in res.time_s.items()},
        "tree_size": decoder.tree.size,
        "batch_size": len(ids),
    }
    if compare:
        plain_generate(decoder.base, ids[:1], 4, sampling, eos, seed)  # warm-up
        base_tokens, base_t = plain_generate(decoder.base, ids, max_new_tokens, sampling, eos, seed)
        n_base = sum(len(t) for t in base_tokens)
        report["baseline_tokens_per_s"] = round(n_base / base_t, 2)
        report["speedup"] = round(report["tokens_per_s"] / report["baseline_tokens_per_s"], 4)
        if sampling.temperature <= 0 and not sampling.typical:
            same = [a == b[: len(a)] if stops else a == b for a, b in zip(res.tokens, base_tokens)]
            report["identical_to_baseline"] = all(same)
    report["tokens"] = res.tokens
    return report


def add_generate_args(p) -> None:
    p.add_argument("export", help="export directory (OUTPUT_DIR/export of a training run)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--tree", default=None, help="tree file (JSON/YAML), 'chain', or 'default'")
    p.add_argument("--base", default=None, help="base model path or hub id (default: the one the export names)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--typical", action="store_true", help="Medusa typical acceptance (lossy)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--compare", action="store_true", help="also run plain decoding of the base and report speedup")
    p.add_argument("--stream", action="store_true", help="print text as it is committed (batch of one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def generate_command(a) -> int:
    decoder, tok, _ = load_decoder(a.export, a.base, a.tree, a.dtype, a.device)
    sampling = Sampling(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, typical=a.typical)
    on_text = None
    if a.stream and not a.json:
        on_text = lambda b, delta: (sys.stdout.write(delta), sys.stdout.flush())
    rep = run_generate(decoder, tok, a.prompt, a.max_new_tokens, sampling, a.compare, a.chat, a.stop, a.seed, on_text)
    rep.pop("tokens")
    if a.json:
        print(json.dumps(rep))
        return 0
    if a.stream:
        print()
    else:
        for t in (rep["text"] if isinstance(rep["text"], list) else [rep["text"]]):
            print(t)
    line = f"\n{rep['new_tokens']} tokens in {rep['steps']} steps, accept length {rep['accept_length']:.2f}, " \
           f"{rep['tokens_per_s']:.1f} tokens/s"
    if a.compare:
        line += f"; plain decoding {rep['baseline_tokens_per_s']:.1f} tokens/s, speedup {rep['speedup']:.2f}x"
        if "identical_to_baseline" in rep:
            line += f", identical to plain greedy: {rep['identical_to_baseline']}"
    print(line, file=sys.stderr)
    return 0
