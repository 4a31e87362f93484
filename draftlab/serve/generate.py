"""Decoding with an export: load it with its base, encode prompts, decode, compare with plain decoding."""

from __future__ import annotations

import time
import warnings

import torch

from ..decode.acceptance import Sampling
from ..decode.compiled import compile_cache_report
from ..base import stop_token_ids
from ..decode.decoder import NoDraft, SpeculativeDecoder, hardware, sync_device
from ..decode.tree import DynamicTree, Tree, TreeError
from ..drafters.base import base_context


def resolve_tree(spec: str | None, meta: dict) -> Tree | DynamicTree:
    """A --tree value for an export: 'default' (or None: the export's default tree, else its kind's), 'kind' (its
    kind's default tree, also where the export has its own), 'chain' (heads: one per head; a block drafter: its
    whole block; SSM: the default chain length), 'chain:N', 'expansion:K1,K2,...' (SpecInfer's expansion
    configuration), 'dynamic:DEPTH,TOP_K,TOTAL' (EAGLE-2 dynamic trees, eagle3
    exports), or a tree file / inline list (see Tree.parse). A tree given deeper than an EAGLE-3 draft's ttt_steps
    is decoded, with a warning."""
    tree = _resolve_tree(spec, meta)
    steps = meta["head"].get("ttt_steps") if meta["head"]["type"] == "eagle3" else None
    if steps and tree.depth > steps and spec not in (None, "", "default", "kind"):  # (a tree the user chose)
        warnings.warn(f"tree {spec or 'default'} drafts {tree.depth} levels, but this EAGLE-3 draft trained on "
                      f"{steps} (ttt_steps): levels past {steps} read features of its own it never trained on, and may "
                      f"accept less; a depth of at most {steps} costs less per step", stacklevel=2)
    return tree


def _resolve_tree(spec: str | None, meta: dict) -> Tree | DynamicTree:
    from ..drafters import SSM_DEFAULT_CHAIN, kind_of

    head = meta["head"]
    if spec == "kind":  # the kind's own default, where the export's was grown from its heads' statistics
        return kind_of(head["type"]).default_tree(_Shape(head))
    if spec in (None, "", "default"):
        if meta.get("default_tree"):
            d = meta["default_tree"]
            if isinstance(d, str):  # a dynamic tree's settings, as search-tree writes them
                return DynamicTree.parse(d.partition(":")[2])
            return Tree.from_paths(d, {"name": "export default"})
        return kind_of(head["type"]).default_tree(_Shape(head))
    if spec == "chain":  # heads: one per head; a block drafter: the whole block; an SSM: its default length
        if head["type"] == "dflash":
            return Tree.chain(head["block_size"] - 1)
        return Tree.chain(head["num_heads"] if head["type"] in ("medusa", "hydra") else SSM_DEFAULT_CHAIN)
    name, _, arg = spec.partition(":")
    if name == "dynamic":
        return DynamicTree.parse(arg) if arg else DynamicTree()
    if name == "chain" and arg.isdigit():
        return Tree.chain(int(arg))
    if name == "expansion" and arg:
        try:
            return Tree.expansion(arg.split(","))
        except TreeError as e:  # (widths below 1 were said not to be integers: walk-through)
            raise TreeError(f"--tree {spec}: {e}") from None
        except ValueError:
            raise TreeError(f"--tree {spec}: expansion widths must be integers, e.g. expansion:1,2,1") from None
    return Tree.parse(spec)


class _Shape:
    """The fields of an export's head config that a kind's default tree reads, without loading weights."""

    def __init__(self, head: dict):
        self.num_heads = head.get("num_heads", 1)
        self.block_size = head.get("block_size", 2)
        self.kind = head["type"]


def load_decoder(export_dir: str, base: str | None = None, tree: str | None = None, dtype: str | None = None,
                 device: str | None = None, tp: bool = False, device_map: str | None = None, compile: bool = False,
                 **drafter_options):
    """(decoder, tokenizer, meta) for an export; the base defaults to the one the export names. `lookup` (or
    `lookup:N`, N tokens per continuation) instead of an export decodes with prompt lookup and needs `base`.
    tp: split the base over the processes of this torchrun / accelerate launch (tensor parallel); device_map:
    place its layers over the visible devices (e.g. 'auto'); see draftlab.decode.tensor_parallel.
    compile: the static-shape, compiled decode path (SpeculativeDecoder's compile).
    drafter_options go to drafters that take them (ensembles: mode, node_budget, length, adaptive)."""
    from ..base import base_identity
    from ..drafters import LookupDraft, check_drafter_options, make_drafter
    from ..interop.export import apply_adapter, check_tokens, load_export, read_meta, use_chat_template
    from ..decode.tensor_parallel import RankSync, check_launch
    from .scheduled import ScheduledDecoder, is_schedule

    check_launch(tp)
    sync = RankSync() if tp else None
    if export_dir.split(":")[0] == "lookup":
        if not base:
            raise ValueError("the lookup drafter needs --base (the model to decode)")
        _, _, arg = export_dir.partition(":")
        if arg and not (arg.isdigit() and int(arg) > 0):
            raise ValueError(f"{export_dir}: lookup:N takes the tokens per continuation, a positive integer (lookup:5)")
        if tree:
            raise ValueError(f"--tree {tree}: prompt lookup drafts one continuation found in the text; its length is "
                             "lookup:N's N, and it takes no tree")
        check_drafter_options("lookup", drafter_options)
        model, tok = load_placed(base, dtype or "float32", device, tp, device_map)
        n = int(arg) if arg else 5
        meta = {"head": {"type": "lookup", "num_tokens": n}, "base": base_identity(model, base)}
        return SpeculativeDecoder(model, make_drafter(LookupDraft(num_tokens=n)), sync=sync, compile=compile), tok, meta
    meta = read_meta(export_dir)
    name = base or meta["base"]["name_or_path"]
    model, tok = load_placed(name, dtype or meta["base"]["dtype"], device, tp, device_map)
    tok = use_chat_template(tok, export_dir, meta)  # the template training rendered with, where the recipe set one
    model = apply_adapter(model, export_dir, meta)  # Medusa-2: decode (and compare with) the adapted base
    device = decoder_device(model)
    check_tokens(meta, tok, str(export_dir))
    draft, meta = load_export(export_dir, base=model, device=device, dtype=model.get_input_embeddings().weight.dtype)
    options = {k: v for k, v in drafter_options.items() if v is not None}
    check_drafter_options(meta["head"]["type"], options)
    note = searched_elsewhere(tree, export_dir, compile)
    if note:
        warnings.warn(note, stacklevel=2)
    if tree and is_schedule(tree):  # search-tree --batch-sizes: the tree follows each call's batch size
        return ScheduledDecoder(model, draft, tree, options, sync=sync, compile=compile), tok, meta
    resolved = resolve_tree(tree, meta)
    check_ranks(resolved, meta["head"].get("draft_vocab_size") or model.get_output_embeddings().weight.shape[0], tree)
    drafter = make_drafter(draft, resolved, **options)
    return SpeculativeDecoder(model, drafter, sync=sync, compile=compile), tok, meta


def check_ranks(tree, vocab: int, spec: str | None) -> None:
    """A static tree's ranks index the draft's top tokens: one at or past its vocabulary has no token (it was
    torch's 'selected index k out of range' from inside the first step: walk-through)."""
    top = max((r for p in getattr(tree, "paths", ()) for r in p), default=-1)
    if top >= vocab:
        raise TreeError(f"--tree {spec}: rank {top} asks for the draft's token of that rank, but it ranks {vocab} "
                        f"tokens (ranks 0..{vocab - 1}); search-tree chooses ranks from the draft's statistics")


def searched_elsewhere(tree: str | None, export_dir: str, compile: bool) -> str | None:
    """A line saying how the run a `search-tree` file was chosen for differs from this one (the export searched, the
    path it was timed on, the machine and thread count), or None: its tree was the fastest there, which it need not
    be here. None for other trees, and for files older than these records."""
    import json
    from pathlib import Path

    try:
        if not tree or not Path(tree).is_file():
            return None
    except OSError:  # (inline paths longer than a file name may be: ENAMETOOLONG, a traceback before: review)
        return None
    try:
        m = json.loads(Path(tree).read_text()).get("metadata") or {}
    except (OSError, ValueError, AttributeError):
        return None  # (Tree.parse says what is wrong with it)
    differ = []
    if m.get("export") and Path(m["export"]).resolve() != Path(export_dir).resolve():
        differ.append(f"for the export {m['export']}")
    if "compiled" in m and bool(m["compiled"]) != bool(compile):
        differ.append("timed " + ("compiled (this run is eager: add --compile)" if m["compiled"] else
                                  "eagerly (this run is compiled)"))
    if m.get("hardware") and m["hardware"] != hardware():
        differ.append(f"on {m['hardware']} (here: {hardware()})")
    if not differ:
        return None
    return (f"--tree {tree} was chosen by search-tree {', '.join(differ)}; it was the fastest there, not necessarily "
            "here (run search-tree for this run to choose again)")


def load_placed(name: str, dtype: str, device, tp: bool, device_map):
    """The base and its tokenizer: whole on `device`, tensor-parallel over this launch (tp), or by a device map."""
    from ..base import load_base
    from ..decode.tensor_parallel import load_tp_base

    if tp:
        if device_map:
            raise ValueError("--tp and --device-map are two ways to split the base; pick one")
        return load_tp_base(name, dtype)
    if device_map:
        return load_base(name, dtype, device_map=device_map)
    return load_base(name, dtype, device or ("cuda" if torch.cuda.is_available() else "cpu"))


def decoder_device(model) -> torch.device:
    """Where the decoder keeps its tensors (and the drafter its weights): the device of the base's output layer
    (under a device map, the last one; its outputs come back there)."""
    return model.get_output_embeddings().weight.device


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


def plain_generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, eos, seed: int = 0,
                   batched: bool = False):
    """Plain HF `generate` of the same base, the speedup baseline: one prompt at a time, or with `batched` all of
    them in one left-padded call (as a user batches HF generate: the baseline of a batch draftlab decodes at once).
    With the sampling draftlab decodes with and nothing else (the base's generation_config.json, whose repetition
    penalty, n-gram ban or minimum length transformers would apply, is set aside for the call). Returns (each
    prompt's tokens, cut after the first EOS, and the seconds the calls took)."""
    from transformers import GenerationConfig

    saved, model.generation_config = model.generation_config, GenerationConfig()
    try:
        return _plain_generate(model, [prompts] if batched else [[p] for p in prompts], max_new_tokens, sampling,
                               eos, seed)
    finally:
        model.generation_config = saved


def _plain_generate(model, batches, max_new_tokens: int, sampling: Sampling, eos, seed: int):
    out, t = [], 0.0
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    pad = stops[0] if stops else 0
    kw = dict(do_sample=sampling.temperature > 0, max_new_tokens=max_new_tokens, eos_token_id=stops or None,
              pad_token_id=pad)
    if sampling.temperature > 0:
        kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    device = next(model.parameters()).device
    for batch in batches:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        # An explicit mask (the left padding's zeros): generate() would otherwise mask prompt tokens equal to pad.
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        gen = model.generate(ids, attention_mask=mask, **kw)[:, width:].tolist()
        sync_device(ids.device)
        t += time.perf_counter() - t0
        out += [g[:next((i + 1 for i, x in enumerate(g) if x in stops), len(g))] for g in gen]
    return out, t


def run_generate(decoder, tok, prompts, max_new_tokens=128, sampling=Sampling(), compare=False, chat=False,
                 stops=(), seed=0, on_text=None) -> dict:
    """Decode prompts (batched) and report; with compare, also plain decoding of the same base."""
    from .scheduled import ScheduledDecoder

    ids = [encode_prompt(tok, p, chat) for p in prompts]
    if isinstance(decoder, ScheduledDecoder):  # the decoder of this batch size: its tree is the report's, its graphs
        decoder = decoder.for_batch(len(ids))  # compile in the warm-up
    eos = stop_token_ids(decoder.base, tok)
    ctx = base_context(decoder.base)
    if ctx is not None and max(map(len, ids)) + max_new_tokens > ctx:  # (it wrote past them without a word)
        warnings.warn(f"the longest prompt ({max(map(len, ids))} tokens) and --max-new-tokens {max_new_tokens} pass the "
                      f"base's {ctx} positions (max_position_embeddings): past them it writes what it was not trained "
                      "to", stacklevel=2)
    gen = torch.Generator(device=decoder.device).manual_seed(seed)
    # Warm-up (allocator, kernels) outside the timed region; a compiled decoder compiles for these shapes here.
    t0 = time.perf_counter()
    decoder.warm_up(ids, max_new_tokens, sampling=sampling, eos_token_id=eos, generator=gen)
    warmup = time.perf_counter() - t0
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
        "chained_steps": res.chained_steps,  # their drafting time is in time_split_s's verify
        "tree_size": decoder.drafter.max_nodes,
        "drafter": decoder.drafter.describe(),
        "batch_size": len(ids),
        "compiled": decoder.forward is not None,
        "warmup_s": round(warmup, 3),
    }
    if decoder.forward is not None:
        from ..decode.fuse import fused

        report["compile_s"] = round(decoder.compile_s, 3)
        report["compile_failed"] = decoder.compile_failed
        report["fused_projections"] = sum(fused(m) for m in decoder.fused_models)  # decode.fuse
    if compare:
        plain_generate(decoder.base, ids, 4, sampling, eos, seed, batched=True)  # warm-up
        # HF generate on the same batch in one call: speculation's gain, not batching's (walk-through: with one
        # prompt a call, a tree that drafts nothing read 2.89x on four prompts).
        base_tokens, base_t = plain_generate(decoder.base, ids, max_new_tokens, sampling, eos, seed, batched=True)
        n_base = sum(len(t) for t in base_tokens)
        report["baseline_tokens_per_s"] = round(n_base / base_t, 2)
        report["speedup"] = round(report["tokens_per_s"] / report["baseline_tokens_per_s"], 4)
        if sampling.temperature <= 0:  # (typical acceptance too: at temperature 0 it is greedy's rule, exact)
            same = [a == b[: len(a)] if stops else a == b for a, b in zip(res.tokens, base_tokens)]
            report["identical_to_baseline"] = all(same)
        if decoder.forward is not None:  # the fair baseline: plain decoding on the same compiled path
            plain = SpeculativeDecoder(decoder.base, NoDraft(), check_base=False, sync=decoder.sync,
                                       compile=decoder.forward.backend)
            plain.warm_up(ids, max_new_tokens, sampling=sampling, eos_token_id=eos, generator=gen)
            t0 = time.perf_counter()
            r = plain.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos,
                               stop=stop_fn(tok, list(stops)), generator=gen)
            sync_device(decoder.device)
            report["compiled_plain_tokens_per_s"] = round(r.new_tokens / (time.perf_counter() - t0), 2)
            report["speedup_vs_compiled_plain"] = round(report["tokens_per_s"] / report["compiled_plain_tokens_per_s"], 4)
    if decoder.forward is not None:  # every compile of this process, --compare's included
        report["compile_cache"] = compile_cache_report()  # graphs loaded from inductor's on-disk cache, and built
    report["tokens"] = res.tokens
    return report
