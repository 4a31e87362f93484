"""Speculation schedules per batch size: which tree (or chain length) to verify at each batch size, and the batch
size above which plain decoding wins.

For every batch size B the candidate trees and plain decoding are timed on this machine (seconds per
verification step of the whole batch, prefill left out), and each is scored by its expected throughput

    tokens/s(tree, B) = B x accept_length(tree) / step_s(tree, B)        (plain decoding: accept length 1)

with the accept length from the calibration statistics (the replay of the decoder's walk, see decode/search.py),
which does not depend on B. The verification forward of a bigger tree costs more at a bigger batch, so the best
tree shrinks with B and, once the base is compute-bound, plain decoding wins. That estimate models a batch kept
full (continuously batched engines); --schedule-by timed chooses instead by the measured tokens/s of static
batches, whose rows end at different steps (draftlab's own decoder), among the top few by estimate and plain
decoding. Where plain decoding wins, the schedule says so (tree_for_batch gives None, drafter_for_batch NoDraft).

Three outputs (docs/decoding.md, "Schedules per batch size"):
- a draftlab tree file whose `paths` are the smallest batch size's choice (so `generate --tree FILE` runs it as it
  runs any tree file) and whose `schedule` lists every batch size's choice (`tree_for_batch` reads it);
- a vLLM `--speculative-config` JSON: vLLM drafts chains only, so the best chain length per batch-size range, in
  `num_speculative_tokens_per_batch_size` ([start, end, K], K = 0: no drafting in that range);
- SGLang flags (`--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens`) for the
  smallest batch size's tree: SGLang mainline has no per-batch-size switch. Its DFLASH algorithm verifies chains
  only (steps and top-k fixed at 1): `--speculative-num-draft-tokens` = the chain's length + 1, the block size
  (DFlash's engine chains are whole blocks: see choose_schedule's engine_chains).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from ..data import replace_text
from ..decode.tree import Tree
# Decoding by a schedule file lives in scheduled.py (generate imports it without the search); re-exported here.
from .scheduled import (ScheduledDecoder, decoder_for_batch, drafter_for_batch, is_schedule,  # noqa: F401
                        tree_for_batch)

# The engine's name for a draftlab export kind (notes: vLLM SpeculativeConfig.method, SGLang
# --speculative-algorithm). Kinds missing here have no drafter of their kind in that engine.
VLLM_METHOD = {"medusa": "medusa", "ssm": "draft_model", "dflash": "dflash", "eagle3": "eagle3"}
SGLANG_ALGORITHM = {"ssm": "STANDALONE", "eagle3": "EAGLE3", "dflash": "DFLASH"}
PLAIN = "plain"
SCHEDULE_BY = ("estimate", "timed")
TIMED_FINALISTS = 3  # --schedule-by timed: the candidates with the highest estimates that the timings decide among


def is_chain(paths) -> bool:
    """A chain: one top-1 candidate per depth ([[0], [0, 0], ...]); what vLLM and SGLang with topk 1 verify."""
    return all(tuple(p) == (0,) * (i + 1) for i, p in enumerate(sorted(map(tuple, paths), key=len)))


def full_batches(prompts: list, batch_size: int, at_least: int = 0) -> list:
    """The prompts repeated cyclically to a whole number of batches of batch_size (and at least at_least rows), so
    every timed batch has exactly batch_size rows: a short last batch steps faster and would bias the step time
    low at batch sizes that do not divide the number of timing prompts."""
    if not prompts:
        raise ValueError("no timing prompts")
    n = -(-max(len(prompts), at_least, 1) // batch_size) * batch_size
    return [prompts[i % len(prompts)] for i in range(n)]


def cutoff_of(entries: list[dict], key: str = "speculate"):
    """The largest batch size at which speculation wins (entry[key]) with plain decoding winning at every larger one
    measured; None: speculation wins at the largest; 0: it never wins."""
    pays = [e["batch_size"] for e in entries if e[key]]
    if not pays:
        return 0
    return None if entries[-1][key] else max(pays)


def choose_schedule(batch_sizes: list[int], candidates: list[dict], step_s: dict[int, dict[str, float]],
                    plain_step_s: dict[int, float], by: str = "estimate",
                    tokens_per_s: dict[int, dict[str, float]] | None = None, finalists: int = TIMED_FINALISTS,
                    engine_chains: set[int] | None = None) -> dict:
    """Per batch size, the candidate to decode with, and the cut-off batch size. Pure.

    candidates: {"name", "paths", "accept_length"} each (accept length from the statistics); step_s[B][name] and
    plain_step_s[B]: measured seconds per verification step at batch size B. Every candidate's estimate is
    B x accept length / step time (plain decoding: B / its step time), a batch kept full, as continuously batched
    engines keep it. by="estimate": the highest estimate wins. by="timed": of the `finalists` candidates with the
    highest estimates and plain decoding, the one with the highest tokens_per_s[B][name] (tokens_per_s[B]["plain"]
    for plain decoding) wins: measured tokens/s of decoding the timing prompts in static batches of B, whose rows
    end at different steps, as draftlab's own decoder runs them.

    Returns {"entries": [one per batch size, ascending], "schedule_by", "no_speculation_above": the largest batch
    size at which speculation wins and above which plain decoding wins at every batch size measured (None:
    speculation still wins at the largest; 0: it never wins), "estimate_no_speculation_above": the same by the
    estimate}. Each entry names the chosen tree (`tree`, `paths`; "plain" and [] where plain decoding wins), the
    estimate's choice (`estimate_tree`, `estimate_paths`: what SGLang gets) and the best chain by the estimate (its
    length `chain_length`, 0 when plain decoding beats every chain: what vLLM gets); the engines' choices follow
    the estimate whatever `by` is. engine_chains: the chain lengths an engine runs as draftlab measured them (None:
    any); DFlash's is the whole block only, since the engines draft a block num_speculative_tokens + 1 long and a
    shorter block, attending both ways, drafts other tokens than the first positions of the trained one."""
    if by not in SCHEDULE_BY:
        raise ValueError(f"--schedule-by {by!r}: expected one of {', '.join(SCHEDULE_BY)}")
    if by == "timed" and tokens_per_s is None:
        raise ValueError("--schedule-by timed needs the measured tokens/s of every candidate")
    if not batch_sizes:
        raise ValueError("--batch-sizes: give at least one batch size, e.g. 1,2,4,8,16")
    entries = []
    for B in sorted(set(batch_sizes)):
        if B not in plain_step_s or B not in step_s:
            raise ValueError(f"batch size {B}: no step time measured")
        plain = B / plain_step_s[B]
        scored = [(B * c["accept_length"] / step_s[B][c["name"]], c) for c in candidates if c["name"] in step_s[B]]
        scored.sort(key=lambda x: -x[0])  # stable: ties keep the candidates' order
        best_tps, best = scored[0] if scored else (0.0, None)
        chains = [(t, c) for t, c in scored if c["paths"] and is_chain(c["paths"])
                  and (engine_chains is None or len(c["paths"]) in engine_chains)]
        chain_tps, chain = chains[0] if chains else (0.0, None)
        estimate_wins = best is not None and best_tps > plain
        extra = {}
        if by == "estimate":
            fastest, fastest_tps, speculate = best, best_tps, estimate_wins
        else:
            timed = tokens_per_s.get(B, {})
            if PLAIN not in timed:
                raise ValueError(f"batch size {B}: no tokens/s measured for plain decoding")
            top = [(timed[c["name"]], t, c) for t, c in scored[:finalists] if c["name"] in timed]
            _, fastest_tps, fastest = max(top, key=lambda x: x[0], default=(0.0, 0.0, None))
            speculate = fastest is not None and timed[fastest["name"]] > timed[PLAIN]
            extra = {"finalists": [c["name"] for _, _, c in top] + [PLAIN],
                     "timed_finalists_tokens_per_s": {**{c["name"]: round(v, 2) for v, _, c in top},
                                                      PLAIN: round(timed[PLAIN], 2)}}
        entries.append({
            "batch_size": B, "schedule_by": by, "speculate": speculate,
            "tree": fastest["name"] if speculate else PLAIN,
            "paths": [list(p) for p in fastest["paths"]] if speculate else [],
            "tree_size": len(fastest["paths"]) + 1 if speculate else 1,
            "accept_length": round(fastest["accept_length"], 4) if speculate else 1.0,
            "estimated_tokens_per_s": round(fastest_tps if speculate else plain, 2),
            "estimated_plain_tokens_per_s": round(plain, 2),
            # the estimate's choice (a full batch, as engines keep it): what the SGLang flags hold
            "estimate_speculate": estimate_wins,
            "estimate_tree": best["name"] if estimate_wins else PLAIN,
            "estimate_paths": [list(p) for p in best["paths"]] if estimate_wins else [],
            "estimate_accept_length": round(best["accept_length"], 4) if estimate_wins else 1.0,
            "chain_length": len(chain["paths"]) if chain is not None and chain_tps > plain else 0,
            "estimated_chain_tokens_per_s": round(chain_tps, 2) if chain is not None else None,
            # the fastest drafting candidate (by `by`) even where plain decoding beats it (what a tree file must hold)
            "fastest_tree": fastest["name"] if fastest is not None else None,
            "fastest_tree_paths": [list(p) for p in fastest["paths"]] if fastest is not None else [],
            "estimated_fastest_tree_tokens_per_s": round(fastest_tps, 2),
            **extra,
        })
    return {"entries": entries, "schedule_by": by, "no_speculation_above": cutoff_of(entries),
            "estimate_no_speculation_above": cutoff_of(entries, "estimate_speculate")}


def vllm_config(entries: list[dict], method: str, model: str) -> dict:
    """vLLM's --speculative-config for the schedule: the best chain length per batch-size range.

    Ranges are [start, end, K], inclusive, contiguous from the smallest batch size measured to the largest; equal
    neighbours merge. num_speculative_tokens is the largest K (vLLM sizes its buffers by it and needs it > 0)."""
    entries = sorted(entries, key=lambda e: e["batch_size"])
    ranges = []
    for i, e in enumerate(entries):
        end = entries[i + 1]["batch_size"] - 1 if i + 1 < len(entries) else e["batch_size"]
        k = e["chain_length"]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([e["batch_size"], end, k])
    return {"method": method, "model": model, "num_speculative_tokens": max(1, max(r[2] for r in ranges)),
            "num_speculative_tokens_per_batch_size": ranges}


def _estimate(entry: dict) -> dict:
    """An entry's choice by the estimate: tree, paths, accept length (entries written before --schedule-by have
    only the chosen tree, which was the estimate's)."""
    if "estimate_paths" in entry:
        return {"tree": entry["estimate_tree"], "paths": entry["estimate_paths"],
                "accept_length": entry["estimate_accept_length"]}
    return {"tree": entry["tree"], "paths": entry["paths"] if entry["speculate"] else [],
            "accept_length": entry["accept_length"]}


def sglang_settings(entry: dict) -> dict | None:
    """SGLang's three tree settings for one schedule entry's estimate choice (a continuously batched engine keeps
    its batch full, as the estimate assumes), or None when plain decoding wins there by the estimate.

    num_steps: the tree's depth; eagle_topk: the widest rank used at any depth (SGLang expands the top-k at every
    step); num_draft_tokens: the tree's nodes, root included (SGLang reranks its tree down to this many). With
    topk 1 the tree is a chain and num_draft_tokens = num_steps + 1, as SGLang forces it."""
    paths = _estimate(entry)["paths"]
    if not paths:
        return None
    tree = Tree.from_paths(paths)
    topk = max(tree.topk_per_depth())
    return {"num_steps": tree.depth, "eagle_topk": topk,
            "num_draft_tokens": tree.depth + 1 if topk == 1 else tree.size}


def sglang_text(entry: dict, algorithm: str, model: str, cutoff) -> str:
    """The SGLang flags file: comments saying what it is for, then one line of flags (none if plain wins)."""
    if algorithm == "DFLASH":
        return _sglang_dflash_text(entry, model, cutoff)
    s, est = sglang_settings(entry), _estimate(entry)
    lines = [f"# SGLang flags from draftlab search-tree, for batch size {entry['batch_size']} (its tree by the "
             f"estimate: {est['tree']}, {len(est['paths']) + 1} nodes, expected accept length {est['accept_length']})",
             *_sglang_batch_notes(cutoff)]
    if s is None:
        lines.append("# Plain decoding was faster at this batch size: no flags.")
        return "\n".join(lines) + "\n"
    lines.append(f"--speculative-algorithm {algorithm} --speculative-draft-model-path {model} "
                 f"--speculative-num-steps {s['num_steps']} --speculative-eagle-topk {s['eagle_topk']} "
                 f"--speculative-num-draft-tokens {s['num_draft_tokens']}")
    return "\n".join(lines) + "\n"


def _sglang_batch_notes(cutoff) -> list[str]:
    lines = ["# SGLang mainline has no per-batch-size switch (--speculative-adaptive follows the accept length, "
             "not the batch size): these settings hold at every batch size."]
    if cutoff == 0:
        lines.append("# Speculation did not pay at any batch size measured: serve without --speculative-* flags.")
    elif cutoff is not None:
        lines.append(f"# Speculation stopped paying above batch size {cutoff} on the machine measured.")
    return lines


def _sglang_dflash_text(entry: dict, model: str, cutoff) -> str:
    """SGLang's DFLASH verifies one chain per step (it sets steps and top-k to 1): the flags give the chain the
    estimate chose at the smallest batch size (a whole block), as --speculative-num-draft-tokens = its length + 1."""
    k = entry.get("chain_length", 0)
    lines = [f"# SGLang flags from draftlab search-tree, for batch size {entry['batch_size']}: DFLASH drafts whole "
             "blocks and verifies them as one chain", *_sglang_batch_notes(cutoff)]
    if not k:
        lines.append("# Plain decoding was faster than drafting whole blocks at this batch size: no flags.")
        return "\n".join(lines) + "\n"
    lines.append(f"--speculative-algorithm DFLASH --speculative-draft-model-path {model} "
                 f"--speculative-num-draft-tokens {k + 1}")
    return "\n".join(lines) + "\n"


def parse_sglang_flags(text: str) -> dict:
    """The flags of an SGLang flags file as {flag: value} (comment lines skipped)."""
    words = " ".join(line for line in text.splitlines() if line.strip() and not line.startswith("#")).split()
    return dict(zip(words[::2], words[1::2]))


def engine_paths(out: str | Path) -> tuple[Path, Path]:
    """Where the engines' files go beside the tree file OUT.json: OUT.vllm.json and OUT.sglang.txt."""
    out = Path(out)
    return out.with_suffix(".vllm.json"), out.with_suffix(".sglang.txt")


def write_schedule(out: str | Path, schedule: dict, metadata: dict, kind: str, engine_model: str) -> dict:
    """Write the tree file (with its schedule) and the engines' files a kind has; return {output: path or why not}."""
    out = Path(out)
    entries = schedule["entries"]
    first = entries[0]
    meta = {**metadata, "batch_size": first["batch_size"], "tree_size": first["tree_size"],
            "expected_accept_length": first["accept_length"], "no_speculation_above": schedule["no_speculation_above"],
            "schedule_by": schedule.get("schedule_by", "estimate")}
    paths = first["paths"]
    if not first["speculate"]:  # drafters such as the SSM refuse an empty tree: keep the fastest one, and say so
        paths = first["fastest_tree_paths"]
        meta.update(tree_size=len(paths) + 1, plain_is_faster=True,
                    note=f"plain decoding was faster at batch size {first['batch_size']}; `paths` hold the fastest "
                         f"tree there ({first['fastest_tree']}) for readers of the file as one tree (generate and eval "
                         "follow the schedule: plain steps there)")
    record = {"paths": paths, "metadata": meta, "schedule": entries}
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_text(out, json.dumps(record, indent=1))
    written = {"tree": str(out)}
    vllm_path, sglang_path = engine_paths(out)
    if kind in VLLM_METHOD:
        # one line: `vllm serve BASE --speculative-config "$(cat OUT.vllm.json)"`
        replace_text(vllm_path, json.dumps(vllm_config(entries, VLLM_METHOD[kind], engine_model)) + "\n")
        written["vllm"] = str(vllm_path)
    else:
        written["vllm"] = f"not written: vLLM has no {kind} drafter"
    if kind in SGLANG_ALGORITHM:
        cutoff = (cutoff_of(entries, "chain_length") if kind == "dflash"  # (its flags hold a chain, not a tree)
                  else schedule.get("estimate_no_speculation_above", schedule["no_speculation_above"]))
        replace_text(sglang_path, sglang_text(first, SGLANG_ALGORITHM[kind], engine_model, cutoff))
        written["sglang"] = str(sglang_path)
    else:
        written["sglang"] = f"not written: SGLang's steps / top-k / draft-token settings have no {kind} drafter"
    return written


def search_schedule(export: str, data: str, out: str, batch_sizes: list[int], max_nodes: int = 64,
                    max_rank: int = 10, calibration_prompts: int = 64, timing_prompts: int = 8,
                    max_new_tokens: int = 128, chat: bool = False, prompt_chars: int = 64,
                    sizes: list[int] | None = None, max_depth: int = 8, tp: bool = False,
                    device_map: str | None = None, compile: bool = False, timing_rounds: int = 3,
                    engine_model: str | None = None, schedule_by: str = "estimate",
                    base_name: str | None = None) -> dict:
    """search-tree --batch-sizes: statistics once, then at every batch size the candidate trees, chains of every
    length and plain decoding timed (interleaved rounds, fastest kept); writes the schedule and returns a report.
    schedule_by: "estimate" (B x accept length / step time: a full batch) or "timed" (the tokens/s the timing runs
    measured, static batches, among the top TIMED_FINALISTS by estimate and plain decoding); see choose_schedule.
    At every batch size B the timing prompts are repeated cyclically to whole batches of B rows (at least as many
    rows as the largest batch size), so every timed batch is full and every batch size decodes about the same work."""
    from ..decode.decoder import NoDraft, SpeculativeDecoder
    from ..decode.search import replay_accept_length
    from ..decode.tensor_parallel import is_main
    from ..drafters import make_drafter
    from .tree_search import candidate_trees, hardware, load_search, rank_statistics, time_trees

    batch_sizes = sorted(set(batch_sizes))
    if schedule_by not in SCHEDULE_BY:  # before loading anything
        raise ValueError(f"--schedule-by {schedule_by!r}: expected one of {', '.join(SCHEDULE_BY)}")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch-sizes {batch_sizes}: batch sizes must be positive integers, e.g. 1,2,4,8,16")
    ctx = load_search(export, data, calibration_prompts, timing_prompts, chat, prompt_chars, tp, device_map, base_name)
    draft = ctx.draft
    if draft.kind == "eagle3":
        raise ValueError(f"{export}: --batch-sizes schedules static trees and chains; an eagle3 export's dynamic trees "
                         "are searched per batch size with `search-tree --batch-size B`")
    if not is_main():  # tensor-parallel ranks time with rank 0; rank 0 writes the files
        import tempfile
        out = str(Path(tempfile.mkdtemp(prefix="draftlab-schedule-rank")) / Path(out).name)
    depth = max_depth if draft.kind == "ssm" else draft.num_heads
    stats, per_text, trees = rank_statistics(ctx.base, draft, ctx.calib, max_new_tokens, ctx.eos, depth, max_rank,
                                             max_nodes)
    candidates = candidate_trees(trees, sizes, range(1, min(depth, 16) + 1), max_nodes)
    engine_chains = {depth} if draft.kind == "dflash" else None  # DFlash: the whole block (depth = block_size - 1)
    if engine_chains and Tree.chain(depth).paths not in {t.paths for t in candidates}:
        candidates.append(Tree.chain(depth))  # timed whatever --max-nodes says
    timing = ctx.timing
    if not timing:
        raise ValueError("--batch-sizes needs timing prompts: the data has none beyond the calibration prompts "
                         "(raise --timing-prompts or give more records)")
    plain = SpeculativeDecoder(ctx.base, NoDraft(), check_base=False, sync=ctx.sync, compile=compile)
    decoders = [plain] + [SpeculativeDecoder(ctx.base, make_drafter(draft, t), sync=ctx.sync, compile=compile)
                          for t in candidates]
    names = [t.metadata.get("name", "") for t in candidates]
    rows = [{"name": n, "paths": [list(p) for p in t.paths], "tree_size": t.size, "tree_depth": t.depth,
             "accept_length": round(replay_accept_length(t, per_text), 4)} for n, t in zip(names, candidates)]
    measured, step_s, plain_step_s = {}, {}, {}
    rows_timed = {}
    for B in batch_sizes:
        # every batch full (B rows), about the same work at every batch size (at least the largest batch)
        prompts = full_batches(timing, B, max(batch_sizes))
        rows_timed[B] = len(prompts)
        ms = time_trees(decoders, prompts, B, max_new_tokens, ctx.eos, timing_rounds)
        plain_step_s[B] = ms[0]["step_s"]
        step_s[B] = {n: m["step_s"] for n, m in zip(names, ms[1:])}
        measured[B] = {PLAIN: ms[0], **dict(zip(names, ms[1:]))}
    eager = sorted({n for B in batch_sizes for n, m in measured[B].items() if m["eager_fallback"]})
    if compile and eager:  # a compiled call fell back to eager decoding: those figures are not the compiled path's
        print(f"search-tree: {len(eager)} of {len(names) + 1} candidates ran eagerly after a compile failure "
              f"({', '.join(eager)}); the schedule compares them as timed and says compiled: false", file=sys.stderr)
    compiled = bool(compile) and not eager
    timed_tps = {B: {n: m["tokens_per_s"] for n, m in measured[B].items()} for B in batch_sizes}
    schedule = choose_schedule(batch_sizes, rows, step_s, plain_step_s, by=schedule_by, tokens_per_s=timed_tps,
                               engine_chains=engine_chains)
    for e in schedule["entries"]:  # what the decoder did in the timing runs, beside the estimate
        m = measured[e["batch_size"]]
        e["tokens_per_s"] = round(m[e["tree"]]["tokens_per_s"], 2)
        e["plain_tokens_per_s"] = round(m[PLAIN]["tokens_per_s"], 2)
        e["measured_accept_length"] = round(m[e["tree"]]["accept_length"], 4)
    table = [{"batch_size": B, "name": n, "tree_size": 1 if n == PLAIN else next(r["tree_size"] for r in rows
                                                                                   if r["name"] == n),
              "step_ms": round(1000 * m["step_s"], 3), "tokens_per_s": round(m["tokens_per_s"], 2),
              "measured_accept_length": round(m["accept_length"], 4)}
             for B in batch_sizes for n, m in measured[B].items()]
    how = ("batch size x accept length (statistics) / step time" if schedule_by == "estimate" else
           f"the tokens/s of decoding the timing prompts in static batches, among the {TIMED_FINALISTS} highest by "
           "batch size x accept length (statistics) / step time and plain decoding")
    meta = {"name": Path(out).stem, "method": f"per batch size: greedy trees and chains timed here, chosen by {how}",
            "export": str(export), "calibration": {"data": str(data), "prompts": len(ctx.calib), "states": stats.n},
            "timing_prompts": len(timing), "timed_rows": {str(B): n for B, n in rows_timed.items()},
            "max_new_tokens": max_new_tokens, "batch_sizes": batch_sizes,
            "hardware": hardware(), "compiled": compiled, "timing_rounds": timing_rounds,
            "date": datetime.date.today().isoformat(), "measured": table}
    # The engine resolves a relative path against its own working directory (and, not found, as a hub id): a local
    # directory is written absolute; an --engine-draft that is no local path (a hub id) as given.
    model = engine_model or str(export)
    model = str(Path(model).resolve()) if Path(model).exists() else model
    files = write_schedule(out, schedule, meta, draft.kind, model)
    return {"files": files, "schedule": schedule["entries"], "no_speculation_above": schedule["no_speculation_above"],
            "estimate_no_speculation_above": schedule["estimate_no_speculation_above"], "schedule_by": schedule_by,
            "candidates": [{k: v for k, v in r.items() if k != "paths"} for r in rows], "measured": table,
            "hardware": hardware(), "compiled": compiled}
