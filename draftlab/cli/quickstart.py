"""`draftlab quickstart`: the whole pipeline on CPU, offline, with a base it builds itself.

1. Corpus: Python standard-library sources (present on every machine with Python).
2. Base: a byte-level BPE tokenizer and a small Llama pretrained for a few minutes.
3. Draft: the base's own greedy continuations of training-file windows (`draftlab distill-data --mode text`), on
   which Medusa, Hydra and Hydra++ heads and a 1-layer SSM distilled from the base are trained by the regular
   recipe trainer, and exported.
4. Tree search (with --compile, or --search): each draft's fastest tree on this machine (`draftlab search-tree`),
   on training text.
5. Decode: held-out prompts through the speculative decoder with each, with its export's default tree (and with the
   searched one), vs plain decoding of the same base.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
from ..progress import progress, quiet_libraries

from ..base import SIMPLE_CHAT_TEMPLATE, set_seed

CORPUS_BYTES = 3_000_000
VOCAB = 512
SEQ = 256
PROMPT_CHARS = 200  # a prompt: the opening of a file (held out for decoding; from training for the tree search)
DISTILL_PROMPTS, DISTILL_STRIDE, DISTILL_NEW_TOKENS = 768, 2000, 160  # the drafts' self-distilled training text
# The three head types of the paper (4 heads each) and a small draft model, as recipe `head` and `loss` sections.
HEADS = {
    "medusa": ({"type": "medusa", "num_heads": 4, "num_layers": 1}, {}),
    "hydra": ({"type": "hydra", "num_heads": 4, "num_layers": 1}, {}),
    "hydra++": ({"type": "hydra", "num_heads": 4, "num_layers": 4, "prefix_attention": True}, {"distill_weight": 1.0}),
    "ssm": ({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, {"distill_weight": 1.0}),
}


def stdlib_corpus(max_bytes: int = CORPUS_BYTES) -> list[str]:
    """Source files of the running Python's standard library, in a fixed order, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for f in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in f.parts[-2:][0] or "site-packages" in f.parts:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not docs:
        raise RuntimeError(f"no Python sources found under {root}")
    return docs


def split_corpus(docs: list[str]) -> tuple[list[str], list[str]]:
    """(training files, held-out files): the last 10% are held out."""
    k = int(len(docs) * 0.9)
    return docs[:k], docs[k:]


def distill_corpus(base_dir: Path, train_docs: list[str], data_dir: Path, seed: int) -> Path:
    """The drafts' training text: the base's greedy continuations (DISTILL_NEW_TOKENS) of PROMPT_CHARS-character
    windows of the training files, one every DISTILL_STRIDE characters, DISTILL_PROMPTS of them in a seeded order,
    through `draftlab distill-data --mode text` in float32, as the drafts train and decode (self-distillation: each
    record is a corpus window and, most of it, the base's own text, which decoding verifies). Records already written
    for the same base weights and prompts are kept (a killed run resumes); any others are made again."""
    import hashlib
    import random

    from ..train.distill import distill_data

    windows = [d[i:i + PROMPT_CHARS] for d in train_docs for i in range(0, len(d) - PROMPT_CHARS, DISTILL_STRIDE)]
    random.Random(seed).shuffle(windows)
    text = "".join(json.dumps({"text": w}) + "\n" for w in windows[:DISTILL_PROMPTS])
    key = hashlib.sha256(text.encode())
    for f in sorted(base_dir.glob("*.safetensors")) + sorted(base_dir.glob("*.bin")):
        key.update(f.read_bytes())
    key = f"{key.hexdigest()} {DISTILL_NEW_TOKENS}"
    prompts, out, stamp = (data_dir / n for n in ("distill_prompts.jsonl", "distilled.jsonl", "distilled.key"))
    if not stamp.is_file() or stamp.read_text() != key:  # (another base's, or other prompts': made again)
        out.unlink(missing_ok=True)
        stamp.write_text(key)
    prompts.write_text(text)
    distill_data(str(base_dir), str(prompts), str(out), max_new_tokens=DISTILL_NEW_TOKENS, batch_size=64,
                 mode="text", prompt_chars=PROMPT_CHARS, seed=seed, dtype="float32")
    return out


def build_tokenizer(docs: list[str], out: Path):
    """Byte-level BPE with BOS/EOS/PAD, saved as a transformers tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(docs, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.chat_template = SIMPLE_CHAT_TEMPLATE
    tok.model_max_length = 1024
    tok.save_pretrained(out)
    return tok


def pretrain_base(tok, train_docs: list[str], out: Path, minutes: float, seed: int) -> dict:
    """Pretrain a small Llama on the corpus for a wall-clock budget; save it to out."""
    from transformers import LlamaConfig, LlamaForCausalLM

    set_seed(seed)
    stream = []
    # Whole files on purpose (they are cut into SEQ-token windows below): no "longer than the maximum" warning.
    for ids in tok(train_docs, add_special_tokens=False, verbose=False).input_ids:
        stream += [tok.bos_token_id] + ids + [tok.eos_token_id]
    data = torch.tensor(stream)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    budget = minutes * 60
    t0, step, loss_ema = time.perf_counter(), 0, None
    bar = progress(total=int(budget), desc="pretrain base", unit="s")
    while (elapsed := time.perf_counter() - t0) < budget:
        starts = torch.randint(0, len(data) - SEQ - 1, (16,), generator=g)
        x = torch.stack([data[s:s + SEQ] for s in starts])
        frac = elapsed / budget
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        step += 1
        bar.n = int(elapsed)
        bar.set_postfix(loss=f"{loss_ema:.3f}", steps=step)
        bar.refresh()
    bar.n = bar.total  # the budget is spent (the last update was made before the last step)
    bar.close()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"pretrain_steps": step, "pretrain_loss": round(loss_ema, 4), "params": sum(p.numel() for p in model.parameters()),
            "tokens": int(len(data))}


def search_trees(exports: dict[str, str], train_docs: list[str], out_dir: Path, max_new_tokens: int,
                 compile: bool = False, step: str = "[3/5]") -> dict[str, dict]:
    """`search-tree` for each export on this machine, on the path the decoding below takes, calibrated on the
    openings of 32 training files and timed on those of the next ones (never the held-out files), as long as the
    held-out openings decoded afterwards (a longer context is easier to draft). Eager: trees of
    1-32 nodes (and an SSM's chains), timed on 8 prompts, 2 rounds. Compiled: trees of 2, 4 and 8 nodes and chains
    up to 4, as each size compiles graphs of its own, timed on 16 prompts, 3 rounds (next to the compiling, a
    round costs little). Returns each kind's report with the search's seconds."""
    from ..serve.tree_search import search_tree
    from .search_tree import toss_up

    timing_prompts, rounds = (16, 3) if compile else (8, 2)
    calib = out_dir / "data" / "calibration.jsonl"
    calib.write_text("".join(json.dumps({"text": d}) + "\n" for d in train_docs[:32 + timing_prompts]))
    print(f"\n{step} searching each draft's fastest tree on this machine ({'compiled' if compile else 'eager'} "
          f"decoding; draftlab search-tree on the openings of training files)")
    reports = {}
    for kind, export in exports.items():
        t0 = time.perf_counter()
        try:
            rep = search_tree(export, str(calib), str(out_dir / f"{kind}.tree.json"), max_nodes=32,
                              calibration_prompts=32, timing_prompts=timing_prompts, max_new_tokens=max_new_tokens,
                              timing_rounds=rounds, prompt_chars=PROMPT_CHARS, sizes=[2, 4, 8] if compile else None,
                              max_depth=4 if compile else 8, compile=compile)
        except ValueError as e:  # (a draft that never matched the base: it decodes with its default tree only)
            print(f"  {kind}: no tree searched ({e})")
            continue
        close = toss_up(rep)
        reports[kind] = {**rep, "search_s": time.perf_counter() - t0, "toss_up": close}
        lost = (f"; plain decoding timed faster than every tree, {rep['plain_tokens_per_s']:.0f} against "
                f"{rep['tokens_per_s']:.0f} tokens/s" if rep["plain_tokens_per_s"] >= rep["tokens_per_s"] else "")
        near = (f"; {close['runner_up']} ran within {100 * close['gap']:.1f}% of it, less than their two fastest "
                f"timing rounds differ ({100 * close['rounds_gap']:.0f}%): a toss-up" if close else "")
        print(f"  {kind}: {rep['tree_size']} nodes, the root included ({rep['tree']}, "
              f"{reports[kind]['search_s']:.0f} s{lost}{near})")
    return reports


def decode_held_out(exports: dict[str, str], held_out_docs: list[str], num_prompts: int, max_new_tokens: int,
                    compile: bool = False, trees: dict[str, str] | None = None, step: str = "[4/5]"):
    """The opening of each held-out file (at most num_prompts) through each export's decoder (trees: a tree
    file for some of them, by name; the others take their export's default tree) and plain decoding of the base, in
    turn. compile: the compiled, static-shape decoders, each warmed up on every prompt first (so no timed decoding
    compiles), and draftlab's plain decoding on that path too. Returns per-export totals, plain tokens/s, compiled
    plain decoding's totals (None without compile), the decoders and the prompt count."""
    from ..decode.acceptance import Sampling
    from ..decode.decoder import NoDraft, SpeculativeDecoder
    from ..serve.generate import encode_prompt, load_decoder, plain_generate

    decoders = {}
    for kind, export in exports.items():
        decoders[kind], tok, _ = load_decoder(export, tree=(trees or {}).get(kind), compile=compile)
    base = next(iter(decoders.values())).base
    if not compile:  # one base object, so every method runs the same weights (compiled decoders keep their own
        for d in decoders.values():  # copy of the same file's weights: a compiled call is bound to its model)
            d.base = base
    eos = tok.eos_token_id
    prompts = [encode_prompt(tok, d[:PROMPT_CHARS], chat=False) for d in held_out_docs[:num_prompts]]
    which = ("each held-out file" if len(prompts) == len(held_out_docs)
             else f"{len(prompts)} of the {len(held_out_docs)} held-out files")
    print(f"\n{step} decoding {len(prompts)} held-out prompts (the opening of {which}; {max_new_tokens} new tokens, "
          f"greedy), each draft and plain decoding in turn{', compiled' if compile else ''}")
    methods = dict(decoders)
    if compile:
        methods["plain (compiled)"] = SpeculativeDecoder(base, NoDraft(), check_base=False, compile=True)
    warm = {}
    for kind, d in progress(list(methods.items()), desc="compile", unit="method", disable=not compile):
        t0 = time.perf_counter()  # (outside the timed region; compiled: every prompt, so every shape compiles here)
        for p in prompts if compile else prompts[:1]:
            d.generate([p], max_new_tokens=max_new_tokens if compile else 8, eos_token_id=eos)
        warm[kind] = time.perf_counter() - t0
    plain_generate(base, prompts[:1], 8, Sampling(), eos)
    tot = {k: {"new": 0, "committed": 0, "steps": 0, "t": 0.0, "identical": True, "warmup_s": warm[k]}
           for k in methods}
    plain_t = plain_new = 0
    for p in progress(prompts, desc="decode", unit="prompt"):
        ref, t = plain_generate(base, [p], max_new_tokens, Sampling(), eos)
        plain_t, plain_new = plain_t + t, plain_new + len(ref[0])
        for kind, dec in methods.items():
            t0 = time.perf_counter()
            res = dec.generate([p], max_new_tokens=max_new_tokens, eos_token_id=eos)
            row = tot[kind]
            row["t"] += time.perf_counter() - t0
            row["new"] += res.new_tokens
            row["committed"] += sum(res.committed)
            row["steps"] += res.steps
            row["identical"] &= res.tokens[0] == ref[0]
    return tot, plain_new / plain_t, tot.pop("plain (compiled)", None), decoders, len(prompts)


def print_results(results: dict, searched: dict, tot: dict, btps: float, plain_c: dict | None, decoders: dict,
                  step: str = "[4/4]") -> dict:
    """The table of decode_held_out's figures (compiled when plain_c, compiled plain decoding's totals, is given),
    each draft's default tree and searched one (searched: search_trees' reports); returns the summary's figures.
    results: each kind's train() result."""
    compile = plain_c is not None
    cps = plain_c["new"] / plain_c["t"] if compile else None
    print(f"\n{step} speculative decoding vs plain decoding of the same base")
    print(f"plain decoding (Hugging Face generate, eager): {btps:.1f} tokens/s"
          + (f"; draftlab's plain decoding compiled: {cps:.1f} tokens/s" if compile else "")
          + "; each draft with its export's default tree (heads: grown from their held-out ranks where that decoded "
          "held-out text better, else their kind's)" + (", then with the tree searched on this machine" if searched
                                                         else "") + "\n")
    if compile:
        print("| draft | tree | tree size | accept length | tokens/s | speedup over compiled plain | over HF eager "
              "| compile s | identical to plain greedy |\n|---|---|---|---|---|---|---|---|---|")
    else:
        print("| draft | tree | tree size | accept length | tokens/s | speedup | identical to plain greedy |\n"
              "|---|---|---|---|---|---|---|")
    summary: dict = {"baseline_tokens_per_s": round(btps, 1), "heads": {}}
    if compile:  # (its tokens are checked against HF's as the drafts' are)
        summary.update(compiled_plain_tokens_per_s=round(cps, 1), compiled_plain_identical=plain_c["identical"],
                       compiled_plain_warmup_s=round(plain_c["warmup_s"], 1))
    for name, row in tot.items():
        kind = name.split()[0]
        accept, tps = row["committed"] / max(1, row["steps"]), row["new"] / row["t"]
        size = decoders[name].drafter.max_nodes
        source = "searched" if name != kind else (results[kind].get("default_tree") or {}).get("source", "kind")
        h = {"tree": source, "tree_size": size, "accept_length": round(accept, 3), "tokens_per_s": round(tps, 1),
             "speedup": round(tps / btps, 3), "identical_to_baseline": row["identical"]}
        if compile:
            h.update(speedup_vs_compiled_plain=round(tps / cps, 3), warmup_s=round(row["warmup_s"], 1))
            print(f"| {kind} | {source} | {size} | {accept:.2f} | {tps:.1f} | {tps / cps:.2f}x | {tps / btps:.2f}x | "
                  f"{row['warmup_s']:.0f} | {row['identical']} |")
        else:
            print(f"| {kind} | {source} | {size} | {accept:.2f} | {tps:.1f} | {tps / btps:.2f}x | {row['identical']} |")
        if name != kind:
            summary["heads"][kind]["searched"] = {**h, "tree_file": searched[kind]["tree"],
                                                  **{k: searched[kind][k] for k in ("toss_up", "plain_tokens_per_s")},
                                                  "search_s": round(searched[kind]["search_s"], 1)}
        else:
            summary["heads"][kind] = {**h, "head_top1": [round(x, 4) for x in results[kind]["eval"]["top1"]],
                                      "agree_top1": [round(x, 4) for x in results[kind]["eval"]["agree1"]],
                                      "export": results[kind]["export"]}
    if compile:
        print("\n(compile s: each method's compiling and warm-up on every prompt, before and outside its timing; a "
              "searched tree's graphs were compiled by the search, and graphs an earlier run left in inductor's "
              "on-disk cache load instead of compiling, so a second run on this machine shows less)")
    return summary


def quickstart(out: str = "runs/quickstart", minutes: float = 3.0, seed: int = 0, head_steps: int = 300,
               num_prompts: int = 16, max_new_tokens: int = 96, compile: bool = False, search: bool = False) -> dict:
    """Build a base, train + export Medusa / Hydra / Hydra++ heads and an SSM, search each one's tree on this
    machine (search), decode with the export's default tree and the searched one (compile: on the compiled path,
    beside compiled plain decoding); print tables and return the figures."""
    from ..config import build_recipe
    from ..train import train

    # The bars transformers draws while loading and saving these small models (in milliseconds) and the
    # libraries' save warnings would be all the log shows between draftlab's own lines.
    quiet_libraries(bars=False)
    out_dir = Path(out)
    base_dir, data_dir = out_dir / "base", out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    of = 5 if search else 4  # (steps)
    docs = stdlib_corpus()
    train_docs, held_docs = split_corpus(docs)
    summary: dict = {"corpus_files": len(docs)}
    if not (base_dir / "config.json").is_file():
        print(f"[1/{of}] building a small base on {len(train_docs)} standard-library files ({len(held_docs)} more "
              f"held out; {minutes:g} min of pretraining)")
        building = out_dir / "base.tmp"  # renamed when whole: a run killed while saving leaves no base to reuse
        shutil.rmtree(building, ignore_errors=True)
        tok = build_tokenizer(train_docs, building)
        summary.update(pretrain_base(tok, train_docs, building, minutes, seed))
        shutil.rmtree(base_dir, ignore_errors=True)
        os.replace(building, base_dir)
    else:
        print(f"[1/{of}] reusing the base in {base_dir}")

    from ..config import dump_recipe

    print(f"[2/{of}] the base continues {DISTILL_PROMPTS} windows of the training files (greedy, "
          f"{DISTILL_NEW_TOKENS} tokens: self-distilled training text, `draftlab distill-data --mode text`), then "
          f"{', '.join(HEADS)} drafts train on it with the recipe trainer ({head_steps} steps each)")
    t0 = time.perf_counter()
    distilled = distill_corpus(base_dir, train_docs, data_dir, seed)
    summary["distill_s"] = round(time.perf_counter() - t0, 1)
    results = {}
    for kind, (head, loss) in HEADS.items():
        recipe = build_recipe({
            "base": {"name_or_path": str(base_dir), "dtype": "float32"},
            "head": head, "loss": loss,
            "data": {"path": str(distilled), "format": "text", "max_len": SEQ, "eval_size": 0.1,
                     "eval_pick": "tail"},
            "train": {"lr": 1e-2, "warmup_steps": 20, "max_steps": head_steps, "batch_size": 8,
                      "eval_every_steps": head_steps, "save_every_steps": head_steps, "log_every_steps": 25,
                      "seed": seed},
            "output_dir": str(out_dir / kind),
        }, source="quickstart")
        path = out_dir / f"{kind}.yaml"
        path.write_text(f"# draftlab train {path}\n" + dump_recipe(recipe))
        print(f"  {kind}: {path}")
        results[kind] = train(recipe, overwrite=True)
        if results[kind]["stopped"]:  # (a signal or a STOP file: the rest would read a draft half trained)
            print(f"quickstart stopped while training {kind}; a new quickstart starts over, and "
                  f"`draftlab train {path}` resumes this draft", file=sys.stderr)
            return {"stopped": kind, "recipe": str(path)}
    print("\ntop-1 agreement with the base on the self-distilled records held out from training, the last 10% (heads: "
          "head k predicts the token k+1 past the base's; the SSM: the next token):")
    print("| draft | " + " | ".join(f"head {k + 1}" for k in range(4)) + " |")
    print("|---" * 5 + "|")
    for h in HEADS:
        agree = results[h]["eval"]["agree1"]
        print(f"| {h} | " + " | ".join(f"{x:.3f}" for x in agree) + " |" + " - |" * (4 - len(agree)))

    exports = {kind: results[kind]["export"] for kind in HEADS}
    searched = search_trees(exports, train_docs, out_dir, max_new_tokens, compile, f"[3/{of}]") if search else {}
    methods = {name: export for kind, export in exports.items()
               for name in ((kind, f"{kind} searched") if kind in searched else (kind,))}
    tot, btps, plain_c, decoders, n_prompts = decode_held_out(
        methods, held_docs, num_prompts, max_new_tokens, compile,
        trees={f"{kind} searched": rep["tree"] for kind, rep in searched.items()}, step=f"[{of - 1}/{of}]")
    summary.update({"prompts": n_prompts, "compiled": compile, "tree_search": search})
    summary.update(print_results(results, searched, tot, btps, plain_c, decoders, f"[{of}/{of}]"))
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    fastest = max(((k, h) for k, head in summary["heads"].items() for h in (head, head.get("searched")) if h),
                  key=lambda kh: kh[1]["speedup"])
    tree = f" --tree {fastest[1]['tree_file']}" if "tree_file" in fastest[1] else ""
    print(f"\nexports: {', '.join(r['export'] for r in results.values())} ({summary['wall_s'] / 60:.1f} min in all)\n"
          f"(try the fastest here: draftlab generate {results[fastest[0]]['export']}{tree} --prompt 'def ' --compare"
          f"{' --compile' if compile else ''})")
    if not compile:
        print("(eager decoding of a base this small is mostly per-call overhead, which verifying a tree adds to; "
              "`draftlab quickstart --compile` decodes on the compiled path, beside compiled plain decoding, with each "
              "draft's tree also searched on that path, after several minutes of compiling)")
    if minutes < 3:
        print(f"(a base pretrained for {minutes:g} min writes poor text; the figures compare decoders of that base, "
              "whose outputs are its own)")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
