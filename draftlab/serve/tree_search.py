"""Tree search for an export: acceptance statistics on calibration text -> greedy trees -> the fastest here."""

from __future__ import annotations

import datetime
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from ..base import stop_token_ids
from ..progress import progress

from ..decode.compiled import timed_without_compiling
from ..decode.decoder import SpeculativeDecoder, hardware, sync_device
from ..decode.tensor_parallel import agree
from ..decode.search import RankStats, expected_accept_length, geometric_sizes, proposal_trees, replay_accept_length
from ..decode.tree import DynamicTree, Tree


def greedy_continuations(base, prompts: list[list[int]], max_new_tokens: int, eos) -> list[list[int]]:
    """prompt + the base's greedy continuation, the text decoding will actually walk."""
    from ..decode.acceptance import Sampling
    from .generate import plain_generate

    return [p + plain_generate(base, [p], max_new_tokens, Sampling(), eos)[0][0]
            for p in progress(prompts, desc="greedy continuations", unit="prompt", leave=False)]


@torch.no_grad()
def collect_ranks(base, draft, sequences: list[list[int]], prompt_lens: list[int], depth: int | None = None
                  ) -> list[torch.Tensor]:
    """Per sequence, rank vectors [T, D] of the states greedy decoding can verify from; a rank of V means
    'beyond the text'.

    At state t (x_0..x_t committed, root x_{t+1}), depth d's target is x_{t+d+1}; the draft is conditioned
    on the true path x_{t+1..t+d} (Hydra heads, SSMs), as an accepting tree would have it. States run from
    the prompt's last token to the one before the text's last: once the root is the final token
    (max_new_tokens or EOS), decoding stops without another verification step. depth defaults to the
    number of heads.
    """
    from ..drafters import text_ranks

    depth = depth or draft.num_heads
    return [text_ranks(draft, base, seq, plen, depth) for seq, plen in zip(sequences, prompt_lens)]


def measure(decoder: SpeculativeDecoder, prompts: list[list[int]], batch_size: int, max_new_tokens: int, eos,
            warm: bool = True) -> dict:
    """Greedy tokens/s and accept length of the decoder on prompts, in batches of batch_size. The warm-up (warm)
    is outside the timing; a compiled decoder compiles there for the first batch's shapes, and a later batch that
    meets a new shape (a prompt width, a cache size) is decoded again until a run compiles nothing, that run timed
    (decode.compiled.timed_without_compiling), so no compiling is in the figures."""
    if warm:
        decoder.warm_up(prompts[:batch_size], max_new_tokens, eos_token_id=eos)
    tokens = committed = rows = steps = 0
    prefill = dt = 0.0

    def run(batch):
        res = decoder.generate(batch, max_new_tokens=max_new_tokens, eos_token_id=eos)
        sync_device(decoder.device)
        return res

    for s in range(0, len(prompts), batch_size):
        res, wall, _ = timed_without_compiling(lambda: run(prompts[s:s + batch_size]), agree)
        dt += wall
        tokens += res.new_tokens
        committed += sum(res.committed)
        rows += sum(res.rows_per_step)
        steps += res.steps
        prefill += res.time_s.get("prefill", 0.0)
    # step_s: wall time per verification step (a forward over the whole batch), prefill left out: the cost that
    # batch-size schedules weigh against the accept length.
    return {"tokens_per_s": tokens / dt, "accept_length": committed / max(rows, 1),
            "step_s": max(dt - prefill, 0.0) / max(steps, 1), "steps": steps}


def time_trees(decoders: list, prompts: list[list[int]], batch_size: int, max_new_tokens: int, eos,
               rounds: int, budget_s: float | None = None, always: int = 1) -> list[dict | None]:
    """measure() of every decoder, `rounds` times interleaved (round 1 of every tree, then round 2, ...); each
    tree keeps its fastest round. A shared or busy machine slows some rounds down: the fastest round of each is
    the one least disturbed, and interleaving spreads a slow spell over all trees instead of one.
    budget_s: once this many seconds have gone (warm-ups and compiles included), the tree being timed is the last;
    the trees not timed at all by then get None. The first `always` trees are always timed. Rank 0's clock decides,
    so the ranks of a tensor-parallel search stop together. Each round records `eager_fallback` (why the decoder's
    compiled calls fell back to eager decoding, or None), and a round timed on the compiled path beats one that fell
    back."""
    best: list[dict | None] = [None] * len(decoders)
    bar = progress(total=rounds * len(decoders), desc="timing trees", unit="tree")
    start = time.perf_counter()
    for r in range(rounds):
        for i, dec in enumerate(decoders):
            if budget_s is not None and (r or i >= always) and agree(time.perf_counter() - start >= budget_s):
                bar.close()
                return best
            m = measure(dec, prompts, batch_size, max_new_tokens, eos, warm=r == 0)  # warmed up once
            m["eager_fallback"] = getattr(dec, "compile_failed", None)  # see timed_trees
            prev = best[i]
            if prev is None or (not m["eager_fallback"], m["tokens_per_s"]) > (not prev["eager_fallback"],
                                                                               prev["tokens_per_s"]):
                best[i] = m
            # The rounds on the path of the kept figure: an eager round after a fallback measures no compiled noise.
            path = bool(best[i]["eager_fallback"])
            seen = prev["rounds_tokens_per_s"] if prev is not None and bool(prev["eager_fallback"]) == path else []
            best[i]["rounds_tokens_per_s"] = seen + [m["tokens_per_s"]] * (bool(m["eager_fallback"]) == path)
            bar.update(1)
    bar.close()
    return best


def timed_trees(trees: list, decoders: list, prompts, batch_size: int, max_new_tokens: int, eos, rounds: int,
                budget_s: float | None, name, plain=None) -> tuple[list[tuple], list[str], dict | None]:
    """time_trees within budget_s: ([(tree, its measure()), ...] for the trees timed, [name(tree), ...] for the
    others, plain's measure()), saying on stderr how many the budget left out. plain: a decoder of the same base
    without a drafter on the same path, timed first in every round beside the trees (the bar a tree must clear).
    A tree timed only after a compiled call fell back to eager decoding (a graph that failed to build; the fallback
    holds for every later call of that function) has no figure of the path the search is for, unlike trees timed
    before: it joins the others, with a line saying why."""
    timed = time_trees(([plain] if plain is not None else []) + decoders, prompts, batch_size, max_new_tokens, eos,
                       rounds, budget_s, always=2 if plain is not None else 1)
    plain_m, timed = (timed[0], timed[1:]) if plain is not None else (None, timed)
    untimed = [name(t) for t, m in zip(trees, timed) if m is None]
    if untimed:
        print(f"search-tree: the time budget ({budget_s:g} s) was spent after {len(trees) - len(untimed)} of "
              f"{len(trees)} trees; choosing among those (not timed: {', '.join(untimed)})", file=sys.stderr)
    eager = [i for i, m in enumerate(timed) if m is not None and m["eager_fallback"]]
    if eager and len(eager) < sum(m is not None for m in timed):
        print(f"search-tree: {len(eager)} trees ran eagerly ({timed[eager[0]]['eager_fallback']}); choosing among "
              f"those timed compiled (eager: {', '.join(name(trees[i]) for i in eager)})", file=sys.stderr)
        for i in eager:
            timed[i] = None
            untimed.append(name(trees[i]))
    if plain_m is not None and plain_m["eager_fallback"] and any(m is not None and not m["eager_fallback"]
                                                                 for m in timed):
        print(f"search-tree: plain decoding ran eagerly ({plain_m['eager_fallback']}), the trees compiled: the "
              "comparison with plain decoding is not on one path", file=sys.stderr)
    return [(t, m) for t, m in zip(trees, timed) if m is not None], untimed, plain_m


def rounds_gap(m: dict) -> float | None:
    """How far apart a tree's two fastest timing rounds are, (fastest - second) / fastest: how well its figure, the
    fastest round, repeats (a round slowed by the machine's other work leaves it alone, and more rounds narrow it).
    None with one round."""
    r = sorted(m.get("rounds_tokens_per_s") or [m["tokens_per_s"]], reverse=True)
    return round((r[0] - r[1]) / r[0], 4) if len(r) > 1 and r[0] else None


def plain_decoder(base, sync, compile):
    from ..decode.decoder import NoDraft

    return SpeculativeDecoder(base, NoDraft(), check_base=False, sync=sync, compile=compile)


@dataclass
class SearchInputs:
    """What every search reads: the base and draft of an export, and the calibration / timing prompts."""

    base: object
    draft: object
    tok: object
    sync: object
    eos: list[int]  # the base's stop tokens (base.stop_token_ids)
    calib: list[list[int]]
    timing: list[list[int]]


def load_search(export: str, data: str, calibration_prompts: int, timing_prompts: int, chat: bool = False,
                prompt_chars: int = 64, tp: bool = False, device_map: str | None = None,
                base_name: str | None = None) -> SearchInputs:
    """Load an export with its base (base_name, else the one the export names) and read the prompts: the first
    calibration_prompts calibrate, the next timing_prompts (or, with too few records, the first ones) are timed."""
    from ..data import detect_format, prompt_turns, read_records, to_messages
    from ..interop.export import apply_adapter, check_tokens, load_export, read_meta, use_chat_template
    from .generate import decoder_device, encode_prompt, load_placed
    from ..decode.tensor_parallel import RankSync, check_launch

    check_launch(tp)
    meta = read_meta(export)
    base, tok = load_placed(base_name or meta["base"]["name_or_path"], meta["base"]["dtype"], None, tp, device_map)
    tok = use_chat_template(tok, export, meta)
    check_tokens(meta, tok, str(export))
    base = apply_adapter(base, export, meta)
    device = decoder_device(base)
    draft, meta = load_export(export, base=base, device=device, dtype=base.get_input_embeddings().weight.dtype)
    prompts = []
    for _, _, rec in read_records(data, max_records=calibration_prompts + timing_prompts, field="--data"):
        fmt = detect_format(rec)
        if fmt == "text":
            text = rec["text"][:prompt_chars]
            prompts.append(encode_prompt(tok, text.rsplit(" ", 1)[0] if " " in text else text, chat))
        else:
            prompts.append(encode_prompt(tok, prompt_turns(to_messages(rec, fmt)), True))
    if len(prompts) < 2:
        raise ValueError(f"--data {data}: need at least 2 prompts, found {len(prompts)}")
    calib, timing = prompts[:calibration_prompts], prompts[calibration_prompts:]
    if not timing:
        timing = prompts[:timing_prompts]
        print(f"search-tree: --data {data} has no records past the {len(calib)} calibration prompts; the trees are "
              f"timed on the first {len(timing)} of them (the texts their statistics came from)", file=sys.stderr)
    return SearchInputs(base, draft, tok, RankSync() if tp else None, stop_token_ids(base, tok), calib, timing)


def rank_statistics(base, draft, calib: list[list[int]], max_new_tokens: int, eos, depth: int, max_rank: int,
                    max_nodes: int, collect_depth: int = 0) -> tuple[RankStats, list[torch.Tensor], list[Tree]]:
    """(statistics, per-text rank vectors, the greedy tree of every size up to max_nodes) on the calibration
    prompts' greedy continuations. The trees grow within depth and max_rank; the rank vectors reach
    max(depth, collect_depth), so that a deeper tree (an export's default) is scored too (scoring_stats)."""
    seqs = greedy_continuations(base, calib, max_new_tokens, eos)
    per_text = collect_ranks(base, draft, seqs, [len(p) for p in calib], max(depth, collect_depth))
    # Rank V (the vocabulary's size) marks a token with no rank: a --max-rank above V would count it as a candidate
    # (and draft a node no top-k has)
    stats = RankStats(torch.cat([r[:, :depth] for r in per_text]),
                      min(max_rank, base.get_output_embeddings().weight.shape[0]))
    trees = proposal_trees(stats, max_nodes)
    if not trees:
        raise ValueError("the draft's candidates never matched the base on the calibration text; train it longer")
    return stats, per_text, trees


def scoring_stats(base, per_text: list[torch.Tensor]) -> RankStats:
    """Statistics over every rank and depth the rank vectors hold: the expected accept length of any tree they reach
    (a tree past the search's --max-rank or --max-depth counted its deeper nodes as never accepted). For a tree
    within those bounds it equals the search statistics' figure."""
    return RankStats(torch.cat(per_text), base.get_output_embeddings().weight.shape[0])


def candidate_trees(trees: list[Tree], sizes: list[int] | None, chains, max_nodes: int) -> list[Tree]:
    """The trees to time: the grown trees of `sizes` (default 1, 2, 4, ...), then chains of the lengths `chains`
    up to max_nodes non-root nodes, each distinct tree once (a chain the same as a grown tree keeps the grown
    tree's name)."""
    if sizes and min(sizes) < 1:
        raise ValueError(f"--sizes {sizes}: tree sizes (non-root nodes) are at least 1")
    if sizes and max(sizes) > len(trees):
        print(f"search-tree: --sizes {', '.join(str(s) for s in sizes if s > len(trees))} timed as {len(trees)} "
              f"nodes, the largest tree grown here (--max-nodes {max_nodes}, the draft's depth and --max-rank bound "
              "it)", file=sys.stderr)
    sizes = sorted({min(s, len(trees)) for s in (sizes or geometric_sizes(len(trees)))})
    out, seen = [], set()
    for tree in [trees[n - 1] for n in sizes] + [Tree.chain(d) for d in chains if d <= max_nodes]:
        if tree.paths not in seen:
            seen.add(tree.paths)
            out.append(tree)
    return out


DEFAULT_NAME = "export default"


def export_default_tree(export: str) -> Tree:
    """The static tree an export decodes with when no --tree is given (generate, eval, dsi): the one it holds, else
    its kind's."""
    from ..interop.export import read_meta
    from .generate import _resolve_tree

    return Tree.from_paths(_resolve_tree(None, read_meta(export)).paths, {"name": DEFAULT_NAME})


def search_tree(export: str, data: str, out: str, max_nodes: int = 64, batch_size: int = 1, max_rank: int = 10,
                calibration_prompts: int = 64, timing_prompts: int = 8, max_new_tokens: int = 128, chat: bool = False,
                prompt_chars: int = 64, sizes: list[int] | None = None, plot: bool = False,
                max_depth: int = 8, tp: bool = False, device_map: str | None = None, compile: bool = False,
                timing_rounds: int = 3, time_budget_s: float | None = None, base_name: str | None = None) -> dict:
    """The whole search; writes the tree file (and PNGs with plot) and returns a report. base_name: the base to
    search with (default: the one the export names).

    Heads: trees up to one level per head. An SSM drafts to any depth (up to max_depth), and its cost
    grows with depth (one forward per level) rather than with width, so chains of several lengths are
    timed beside the greedy trees. compile: time every tree on the static-shape compiled path (each tree size
    compiles once, in its warm-up), so the tree is chosen by the costs of the path that will run it.
    The export's default tree (export_default_tree) is timed beside them; the report gives its tokens/s.
    timing_rounds: each tree is timed this many times, interleaved with the others; its fastest round counts.
    time_budget_s: stop timing trees after this many seconds (see time_trees) and choose among those timed; on a CPU
    every tree size of the compiled path compiles graphs of its own, which for an SSM's or EAGLE-3's many settings
    can take half an hour."""
    from ..decode.tensor_parallel import is_main
    from ..drafters import make_drafter

    ctx = load_search(export, data, calibration_prompts, timing_prompts, chat, prompt_chars, tp, device_map, base_name)
    base, draft, sync, eos, calib, timing = ctx.base, ctx.draft, ctx.sync, ctx.eos, ctx.calib, ctx.timing
    if not is_main():  # tensor-parallel ranks time the same trees; rank 0 writes the tree file
        out, plot = str(Path(tempfile.mkdtemp(prefix="draftlab-search-rank")) / Path(out).name), False
    depth = max_depth if draft.kind == "ssm" else draft.num_heads
    if draft.kind == "eagle3":
        if plot:
            print("search-tree: --plot draws static trees; an EAGLE-3 export's dynamic trees are not drawn",
                  file=sys.stderr)
        return search_dynamic(base, draft, export, timing, out, max_nodes, batch_size, max_new_tokens, eos,
                              calib_source=str(data), sync=sync, compile=compile, rounds=timing_rounds,
                              budget_s=time_budget_s)
    default = export_default_tree(export)  # (an SSM's may be deeper than --max-depth: its ranks are collected too)
    stats, per_text, trees = rank_statistics(base, draft, calib, max_new_tokens, eos, depth, max_rank, max_nodes,
                                             collect_depth=default.depth if draft.kind == "ssm" else 0)
    scores = scoring_stats(base, per_text)
    # An SSM's or a block drafter's chains: how far it drafts, or how many of its block positions are verified.
    chains = [d for d in (2, 3, 4, 6, 8, 12, 15) if d <= depth] if draft.kind in ("ssm", "dflash") else []
    candidates = candidate_trees(trees, sizes, chains, max_nodes)
    # The tree the export decodes with when no --tree is given: the bar the search's choice is judged against (it
    # was never timed, so a search could not show it beat the default). Timed first, so a time budget keeps it,
    # unless it is larger than max_nodes: then it is timed last, as the bar only, and never chosen.
    default = next((t for t in candidates if t.paths == default.paths), default)
    others = [t for t in candidates if t is not default]  # (a searched tree that is the default moves first too)
    candidates = [default] + others if default.size - 1 <= max_nodes else others + [default]
    rows = []
    decoders = [SpeculativeDecoder(base, make_drafter(draft, tree), sync=sync, compile=compile) for tree in candidates]
    timed, untimed, plain = timed_trees(candidates, decoders, timing, batch_size, max_new_tokens, eos,
                                        timing_rounds, time_budget_s, lambda t: t.metadata.get("name", ""),
                                        plain_decoder(base, sync, compile))
    for tree, m in timed:
        rows.append({"name": tree.metadata.get("name", ""), "tree_size": tree.size, "tree_depth": tree.depth,
                     "export_default": tree is default, "eager_fallback": m["eager_fallback"],
                     "rounds_gap": rounds_gap(m),
                     "expected_accept_length": round(expected_accept_length(tree.paths, scores), 4),
                     "replayed_accept_length": round(replay_accept_length(tree, per_text), 4),
                     "measured_accept_length": round(m["accept_length"], 4), "tokens_per_s": round(m["tokens_per_s"], 2),
                     "paths": [list(p) for p in tree.paths]})
    # (a default larger than --max-nodes is timed, as the bar, but not chosen: the bound may be an engine's)
    best = max([r for r in rows if r["tree_size"] - 1 <= max_nodes or not r["export_default"]] or rows,
               key=lambda r: r["tokens_per_s"])  # (or rows: only the default was timed, every other fell back)
    rows = [{k: v for k, v in r.items() if k not in ("paths", "eager_fallback")} for r in rows]
    method = ("a chain, timed beside the grown trees" if best["name"].startswith("chain") else
              "the export's default tree, timed beside the grown trees" if best["name"] == DEFAULT_NAME else
              "greedy growth on empirical acceptance statistics (Hydra sec. 4)")
    timed_default = next((r for r in rows if r["export_default"]), None)
    chosen = Tree.from_paths(best["paths"], {
        "name": Path(out).stem, "chosen": best["name"], "method": method,
        "export": str(export), "calibration": {"data": str(data), "prompts": len(calib), "states": stats.n},
        "expected_accept_length": best["expected_accept_length"],
        "replayed_accept_length": best["replayed_accept_length"],
        "measured_accept_length": best["measured_accept_length"], "tokens_per_s": best["tokens_per_s"],
        "tree_size": best["tree_size"], "batch_size": batch_size, "hardware": hardware(),
        "compiled": bool(compile) and not best["eager_fallback"],  # (every tree fell back to eager: compared eagerly)
        "timing_rounds": timing_rounds, "time_budget_s": time_budget_s, "untimed": untimed,
        "plain_tokens_per_s": round(plain["tokens_per_s"], 2), "rounds_gap": best["rounds_gap"],
        "default_tokens_per_s": timed_default and timed_default["tokens_per_s"],
        "date": datetime.date.today().isoformat(), "sizes_measured": rows})
    chosen.save(out)
    report = {"tree": str(out), **{k: chosen.metadata[k] for k in ("expected_accept_length", "replayed_accept_length",
                                                                    "measured_accept_length",
                                                                    "tokens_per_s", "tree_size", "batch_size", "hardware",
                                                                    "compiled", "plain_tokens_per_s",
                                                                    "default_tokens_per_s")},
              "sizes": rows, "untimed": untimed}
    if plot:
        report["plots"] = plot_search(rows, chosen, Path(out))
    return report


# EAGLE-2 settings search-tree times for an eagle3 export. The small ones (top_k 2, 8 tokens) are for the compiled path
# on hardware where every verified token costs time (a CPU; docs/drafters.md has the figures).
DYNAMIC_GRID = {"depth": (3, 5, 7), "top_k": (2, 4, 10), "total_tokens": (8, 16, 32, 60)}


def dynamic_grid(max_nodes: int) -> list[DynamicTree]:
    """The settings of DYNAMIC_GRID that verify at most max_nodes + 1 tokens, less those whose drafted candidates
    (top_k below the root, then top_k * top_k per further level) are fewer than total_tokens - 1: their trees are
    the same as a smaller total's, padded."""
    return [DynamicTree(d, k, n) for d in DYNAMIC_GRID["depth"] for k in DYNAMIC_GRID["top_k"]
            for n in DYNAMIC_GRID["total_tokens"] if n <= max_nodes + 1 and k + (d - 1) * k * k >= n - 1]


def search_dynamic(base, draft, export, prompts, out, max_nodes, batch_size, max_new_tokens, eos, calib_source,
                   sync=None, compile: bool = False, rounds: int = 3, budget_s: float | None = None) -> dict:
    """EAGLE-2 dynamic trees have no static shape to grow: time every setting of dynamic_grid(max_nodes) on the prompts
    (within budget_s: see time_trees) and keep the fastest."""
    from ..drafters import make_drafter

    grid = dynamic_grid(max_nodes)
    if not grid:
        raise ValueError(f"--max-nodes {max_nodes}: dynamic trees need at least {min(DYNAMIC_GRID['total_tokens']) - 1}")
    rows = []
    decoders = [SpeculativeDecoder(base, make_drafter(draft, tree), sync=sync, compile=compile) for tree in grid]
    timed, untimed, plain = timed_trees(grid, decoders, prompts, batch_size, max_new_tokens, eos, rounds, budget_s,
                                        DynamicTree.spec, plain_decoder(base, sync, compile))
    for tree, m in timed:
        rows.append({"name": tree.spec(), "tree_size": tree.size, "tree_depth": tree.depth, "top_k": tree.top_k,
                     "measured_accept_length": round(m["accept_length"], 4),
                     "tokens_per_s": round(m["tokens_per_s"], 2), "rounds_gap": rounds_gap(m)})
    i = max(range(len(rows)), key=lambda j: rows[j]["tokens_per_s"])
    best = rows[i]
    compiled = bool(compile) and not timed[i][1]["eager_fallback"]  # (every setting fell back: compared eagerly)
    meta = {"method": "measured grid over EAGLE-2 depth / top_k / total_tokens", "export": str(export),
            "timing": {"data": calib_source, "prompts": len(prompts)}, "batch_size": batch_size,
            "hardware": hardware(), "compiled": compiled, "date": datetime.date.today().isoformat(),
            "time_budget_s": budget_s, "untimed": untimed, "sizes_measured": rows,
            "plain_tokens_per_s": round(plain["tokens_per_s"], 2),
            **{k: best[k] for k in ("measured_accept_length", "tokens_per_s", "tree_size")}}
    DynamicTree.parse(best["name"].partition(":")[2]).save(out, meta)
    return {"tree": str(out), "dynamic": best["name"], "expected_accept_length": None,
            "replayed_accept_length": None, "measured_accept_length": best["measured_accept_length"],
            "tokens_per_s": best["tokens_per_s"], "tree_size": best["tree_size"], "batch_size": batch_size,
            "hardware": hardware(), "compiled": compiled, "sizes": [{**r, "expected_accept_length": None} for r in rows],
            "untimed": untimed, "plain_tokens_per_s": round(plain["tokens_per_s"], 2)}


def plot_search(rows: list[dict], tree: Tree, out: Path) -> list[str]:
    """PNG of expected accept length and tokens/s against tree size, and a drawing of the chosen tree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p1 = out.with_suffix(".sizes.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    grown = sorted((r for r in rows if not r["name"].startswith("chain")), key=lambda r: r["tree_size"])
    chains = sorted((r for r in rows if r["name"].startswith("chain")), key=lambda r: r["tree_size"])
    xs = [r["tree_size"] for r in grown]
    ax.plot(xs, [r["expected_accept_length"] for r in grown], "o-", label="expected accept length")
    ax.plot(xs, [r["measured_accept_length"] for r in grown], "s--", label="measured accept length")
    if chains:
        ax.plot([r["tree_size"] for r in chains], [r["measured_accept_length"] for r in chains], "d:",
                label="chains: measured accept length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree size (tokens per verification)")
    ax.set_ylabel("accept length")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["tokens_per_s"] for r in grown], "^-", color="tab:red", label="tokens/s")
    if chains:
        ax2.plot([r["tree_size"] for r in chains], [r["tokens_per_s"] for r in chains], "v:", color="tab:red")
    ax2.set_ylabel("tokens/s", color="tab:red")
    ax.legend(loc="upper left")
    ax.set_title(f"tree search ({tree.metadata.get('hardware', '')})")
    fig.tight_layout()
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    p2 = out.with_suffix(".tree.png")
    buf = tree.buffers()
    depth = buf.depth.tolist()
    x = {}
    leaves = iter(range(tree.size))
    order = [0] + [i + 1 for i in range(len(tree.paths))]

    def place(n):
        kids = buf.children[n]
        if not kids:
            x[n] = next(leaves)
        else:
            for c in kids:
                place(c)
            x[n] = sum(x[c] for c in kids) / len(kids)
    place(0)
    fig, ax = plt.subplots(figsize=(max(4, 0.35 * tree.size), 1.2 + 0.9 * tree.depth))
    for n in order[1:]:
        par = buf.parent[n].item()
        ax.plot([x[par], x[n]], [-depth[par], -depth[n]], color="0.6", lw=1)
    for n in order:
        label = "root" if n == 0 else str(tree.paths[n - 1][-1])
        ax.text(x[n], -depth[n], label, ha="center", va="center", fontsize=7,
                bbox=dict(boxstyle="round", fc="white", ec="tab:blue"))
    ax.set_axis_off()
    ax.set_title(f"{tree.size} nodes, depth {tree.depth} (labels: top-k rank)")
    fig.tight_layout()
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [str(p1), str(p2)]
