"""Collective boost-tuning of an SSM ensemble (SpecInfer): members are trained one after another, each stage a run
of the one training loop, stage i on the training examples that members 1..i-1 do not yet cover.

Whether the members so far cover an example is ensemble.score:
- generation (default, SpecInfer's test: a sample is filtered out once an SSM generates the LLM's output): each
  member generates greedily from the example's prompt part and the score is the longest share of the base's
  greedy output (its first ensemble.match_tokens tokens, up to EOS) that some member reproduces from its start;
  1.0 means a member's output is the base's. Batched greedy decoding with a KV cache, match_tokens steps per model.
- coverage (draftlab's teacher-forced test): the share of the example's supervised positions where some member's
  top-1 token is the base's top-1 token, one forward per model.
Examples scoring at least ensemble.threshold (1.0 for generation, 0.8 for coverage unless set) are covered and
dropped (or kept at the ensemble.downweight rate) for later stages. Each stage lives in OUTPUT_DIR/stages/memberN
(its own checkpoints, metrics.jsonl and export, plus examples.json: the examples it trains on, those it dropped
and the test that dropped them), so a run killed in stage 3 resumes in stage 3 with stages 1-2 untouched. After
each stage, OUTPUT_DIR/metrics.jsonl gets how many examples the stage dropped, the ensemble's coverage, the
examples left for the next stage and tau (the merged ensemble's accept length on held-out prompts). The ensemble
export (OUTPUT_DIR/export) holds the members as Hugging Face directories and a draftlab.json that lists them.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from ..base import stop_token_ids, template_to_ship
from ..config import Recipe, build_recipe
from ..data import prompt_length  # noqa: F401 (also read from here)
from .run_dir import resume_records, write_run_config


def stage_recipe(recipe: Recipe, i: int) -> Recipe:
    """Member i's recipe: head.ssm with its architecture override, its own run directory and seed (its weights' and
    data order's; the train / held-out split stays the ensemble's, see train_ensemble), no ensemble."""
    e = recipe.ensemble
    raw = recipe.model_dump(mode="json")
    raw["head"]["ssm"] = {**raw["head"]["ssm"], **(e.architectures[i] if i < len(e.architectures) else {})}
    raw["train"]["seed"] = recipe.train.seed + i
    raw["output_dir"] = str(Path(recipe.output_dir) / "stages" / f"member{i + 1}")
    raw.pop("ensemble")
    return build_recipe(raw, source=f"{recipe.output_dir} stage {i + 1}")


def _argmax(hidden: torch.Tensor, weight: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """argmax over the vocabulary of hidden [B, S, H] @ weight[V, H]^T, a chunk of positions at a time."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.cat([(flat[s:s + chunk] @ weight.t().to(flat.dtype)).argmax(-1) for s in range(0, len(flat), chunk)])
    return out.reshape(hidden.shape[:-1])


def _memo_for(memo: dict | None, members: list) -> dict:
    """The scores' memo for these members: kept while the members only grow from call to call (boost's stages),
    cleared otherwise; per example it holds `upto`, how many of the members have been run on it."""
    memo = {} if memo is None else memo
    seen, now = memo.get("members", []), [id(m) for m in members]
    if len(now) < len(seen) or now[: len(seen)] != seen:
        memo.clear()
    memo["members"] = now
    memo.setdefault("upto", {})
    return memo


@torch.no_grad()
def coverage_scores(base, members: list, examples: list[dict], pad_id: int, batch_size: int = 8,
                    indices: list[int] | None = None, memo: dict | None = None) -> dict[int, float]:
    """Per example index: the share of its supervised positions (predicting token t+1 at position t) where some
    member's top-1 equals the base's top-1.

    memo: as generation_scores' (kept while the members only grow): the base's top-1 at every position (int32) and
    the positions some member already hits (bool), about 5 bytes a token. A call with one member more runs the base
    on nothing and only the new member, on the examples not covered at every supervised position."""
    from ..base import base_hidden
    from ..data import collate

    dev = next(base.parameters()).device
    w_base = base.get_output_embeddings().weight
    idx = list(range(len(examples))) if indices is None else indices
    memo = _memo_for(memo, members)
    target, hit, upto = memo.setdefault("target", {}), memo.setdefault("hit", {}), memo["upto"]
    sup = {i: torch.tensor(examples[i]["loss_mask"][1:], dtype=torch.bool) for i in idx}  # t: when t+1 is
    todo = [i for i in idx if i not in target or (upto[i] < len(members) and not bool(hit[i][:-1][sup[i]].all()))]
    for s in range(0, len(todo), batch_size):
        part = todo[s:s + batch_size]
        b = {k: v.to(dev) for k, v in collate([examples[i] for i in part], pad_id).items()}
        ids, att, lengths = b["input_ids"], b["attention_mask"], [len(examples[i]["input_ids"]) for i in part]
        fresh = [r for r, i in enumerate(part) if i not in target]
        if fresh:
            top = _argmax(base_hidden(base, ids[fresh], att[fresh]), w_base)  # [len(fresh), S]
            for r, row in zip(fresh, top):
                i, n = part[r], lengths[r]
                target[i], hit[i], upto[i] = row[:n].to("cpu", torch.int32), torch.zeros(n, dtype=torch.bool), 0
        for k, m in enumerate(members):
            rows = [r for r, i in enumerate(part) if upto[i] <= k]
            if rows:
                h = m.lm.base_model(input_ids=ids[rows], attention_mask=att[rows]).last_hidden_state
                mine = _argmax(h.to(w_base.dtype), m.lm.get_output_embeddings().weight).cpu()
                for r, row in zip(rows, mine):
                    i = part[r]
                    hit[i] |= row[:lengths[r]] == target[i]
        upto.update((i, len(members)) for i in part)
    return {i: float((hit[i][:-1] & sup[i]).sum()) / max(int(sup[i].sum()), 1) for i in idx}


def _greedy(lm, ids: torch.Tensor, att: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens [B, n] after left-padded prompts ids / att [B, P], batched, with the model's KV cache."""
    head = lm.get_output_embeddings()
    from transformers import DynamicCache

    from ..decode.cache import cache_arg

    pos = (att.long().cumsum(-1) - 1).clamp(min=0)  # each row counts its own tokens only
    kv = cache_arg(lm.base_model, DynamicCache(config=lm.config))
    out = lm.base_model(input_ids=ids, attention_mask=att, position_ids=pos, **kv, use_cache=True)
    tok = head(out.last_hidden_state[:, -1]).argmax(-1)  # [B]: logits at the last position only
    toks, last = [tok], pos[:, -1:]
    for _ in range(n - 1):
        att, last = torch.cat([att, att.new_ones(att.shape[0], 1)], 1), last + 1
        out = lm.base_model(input_ids=tok[:, None], attention_mask=att, position_ids=last, **kv, use_cache=True)
        tok = head(out.last_hidden_state[:, -1]).argmax(-1)
        toks.append(tok)
    return torch.stack(toks, 1)


@torch.no_grad()
def generation_scores(base, members: list, examples: list[dict], pad_id: int | None, eos_ids: list[int],
                      match_tokens: int = 32, batch_size: int = 8, indices: list[int] | None = None,
                      memo: dict | None = None) -> dict[int, float]:
    """Per example index: the longest share of the base's greedy output after the example's prompt part (its first
    match_tokens tokens, fewer when the example continues for fewer, cut after EOS) that some member's own greedy
    output reproduces from the start (SpecInfer's test; 1.0: the outputs match).

    memo: a dict kept from call to call while the members only grow (boost's stages: the members so far, then one
    more). It keeps the base's greedy output and each example's best match, so a call with one member more runs
    the base on nothing and only the new member, on the examples the earlier ones do not match whole: over 5 stages
    the base generates once, not 5 times, and the members 5 times, not 15. Other members start it afresh; calls on
    other examples than the last (indices) run on them whatever members they have not seen."""
    dev = next(base.parameters()).device
    idx = list(range(len(examples))) if indices is None else indices
    memo = _memo_for(memo, members)
    ref, length, best, upto = (memo.setdefault(k, {}) for k in ("ref", "length", "best", "upto"))
    todo = [i for i in idx if i not in ref or (upto[i] < len(members) and best[i] < length[i])]
    eos = set(eos_ids or [])
    for s in range(0, len(todo), batch_size):
        part = todo[s:s + batch_size]
        plen = [prompt_length(examples[i]) for i in part]
        want = [min(match_tokens, len(examples[i]["input_ids"]) - p) for i, p in zip(part, plen)]
        P, n = max(plen), max(want)
        ids = torch.full((len(part), P), pad_id or 0, dtype=torch.long, device=dev)  # pads are masked out
        att = torch.zeros(len(part), P, dtype=torch.long, device=dev)
        for r, (i, p) in enumerate(zip(part, plen)):  # left-padded, so every row's next token is at the end
            ids[r, P - p:] = torch.tensor(examples[i]["input_ids"][:p], device=dev)
            att[r, P - p:] = 1
        new = [r for r, i in enumerate(part) if i not in ref]  # rows the base runs on
        if new:
            for r, out in zip(new, _greedy(base, ids[new], att[new], n).tolist()):
                out = out[: want[r]]
                i = part[r]
                # the base's output ends at its EOS (included)
                ref[i], best[i], upto[i] = out, 0, 0
                length[i] = next((k + 1 for k, t in enumerate(out) if t in eos), len(out))
        target = torch.full((len(part), n), -1, dtype=torch.long, device=dev)
        for r, i in enumerate(part):
            target[r, : len(ref[i])] = torch.tensor(ref[i], device=dev)
        cap = torch.tensor([length[i] for i in part], device=dev)
        held = torch.tensor([best[i] for i in part], device=dev)
        for k, m in enumerate(members):
            rows = [r for r, i in enumerate(part) if upto[i] <= k]  # the members not yet run on the example
            if rows:
                same = (_greedy(m.lm, ids[rows], att[rows], n) == target[rows]).int().cumprod(-1).sum(-1)
                held[rows] = torch.maximum(held[rows], torch.minimum(same, cap[rows]))  # matching prefix
        best.update(zip(part, held.tolist()))
        upto.update((i, len(members)) for i in part)
    return {i: best[i] / max(length[i], 1) for i in idx}


def example_scores(e, base, members: list, examples: list[dict], tok, batch_size: int,
                   indices: list[int] | None = None, memo: dict | None = None) -> dict[int, float]:
    """The scores of ensemble.score (generation or coverage) for the examples at indices (memo: see
    generation_scores and coverage_scores)."""
    if e.score == "generation":
        return generation_scores(base, members, examples, tok.pad_token_id, stop_token_ids(base, tok), e.match_tokens,
                                 batch_size, indices, memo)
    return coverage_scores(base, members, examples, tok.pad_token_id, batch_size, indices, memo)


def _gather(scores: dict, world: int) -> dict:
    if world == 1 or not torch.distributed.is_initialized():
        return scores
    parts = [None] * world
    torch.distributed.all_gather_object(parts, scores)
    return {k: v for p in parts for k, v in p.items()}


@torch.no_grad()
def ensemble_tau(base, members: list, prompts: list[list[int]], eos, node_budget: int, max_new_tokens: int = 64) -> float:
    """Accept length of the merged ensemble (chains of 4) on held-out prompts, greedy."""
    from ..decode.decoder import SpeculativeDecoder
    from ..decode.tree import Tree
    from ..drafters.ensemble import EnsembleDrafter
    from ..drafters.ssm import SSMDrafter

    if not prompts:
        return 0.0
    drafter = EnsembleDrafter([SSMDrafter(m.lm, Tree.chain(4)) for m in members], mode="merge", node_budget=node_budget)
    committed = rows = 0
    for p in prompts:
        r = SpeculativeDecoder(base, drafter).generate([p], max_new_tokens=max_new_tokens, eos_token_id=eos)
        committed, rows = committed + sum(r.committed), rows + sum(r.rows_per_step)
    return committed / max(rows, 1)


def train_ensemble(recipe: Recipe, overwrite: bool = False, stop_after_steps: int | None = None) -> dict:
    """Train (or resume) every stage of an ensemble recipe, then write the ensemble export."""
    from accelerate import PartialState

    from ..base import load_recipe_base
    from ..data import load_examples
    from ..procs import die_with_parent
    from ..drafters import EnsembleDraft, LookupDraft
    from ..interop.export import load_export, save_export
    from .loop import train_draft
    from .run_dir import prepare_run_dir

    e, out = recipe.ensemble, Path(recipe.output_dir)
    examples = lambda tok: load_examples(recipe.data, tok, seed=recipe.train.seed, worker_init=die_with_parent)
    state = PartialState(cpu=not torch.cuda.is_available() and recipe.distributed.strategy != "deepspeed")
    main = state.is_main_process
    if main:
        prepare_run_dir(recipe, overwrite)
        if overwrite:
            import shutil

            shutil.rmtree(out / "stages", ignore_errors=True)
        write_run_config(out, recipe)  # (whole: a resume checks it; a STOP file left from an earlier invocation goes)
    state.wait_for_everyone()
    metrics = out / "metrics.jsonl"
    recorded = {r["stage"] for r in resume_records(metrics, fix=state.is_main_process) if "stage" in r}
    b = recipe.base
    base = tok = train_ex = eval_ex = None
    members, stages = [], []
    scored: dict = {}  # number of members -> every training example's score under them
    for i in range(e.members):
        sr = stage_recipe(recipe, i)
        sdir = Path(sr.output_dir)
        subset_file = sdir / "examples.json"
        if not (sdir / "export" / "draftlab.json").is_file():
            subset = None
            if e.boost and i > 0:
                if not subset_file.is_file():
                    if base is None:
                        base, tok = load_recipe_base(b, state.device)
                        train_ex, eval_ex, _ = examples(tok)
                    subset = _next_examples(recipe, members, base, tok, train_ex, i, state, scored)
                    if main:
                        sdir.mkdir(parents=True, exist_ok=True)
                        subset_file.with_suffix(".tmp").write_text(json.dumps(subset))
                        os.replace(subset_file.with_suffix(".tmp"), subset_file)
                    state.wait_for_everyone()
                subset = json.loads(subset_file.read_text())["kept"]
            # The ensemble's split (its seed), whatever the member's own seed: the subset indexes that split's
            # training examples, and no member trains on the held-out examples the stages are scored on.
            # The ensemble's STOP file (what slurm/train.sbatch touches) stops the stage as its own does.
            summary = train_draft(sr, overwrite=False, stop_after_steps=stop_after_steps, example_subset=subset,
                                  split_seed=recipe.train.seed, stop_dirs=(out,))
            if not summary["finished"]:
                return {**summary, "stage": i + 1, "members": e.members, "output_dir": str(out)}
        member, _ = load_export(sdir / "export")
        members.append(member)
        if i + 1 not in recorded:
            if base is None:
                base, tok = load_recipe_base(b, state.device)
                train_ex, eval_ex, _ = examples(tok)
            rec = _stage_record(recipe, members, base, tok, train_ex, eval_ex, i, subset_file, state, scored)
            if main:
                with open(metrics, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        stages.append(i + 1)
    summary = {"step": e.members, "total_steps": e.members, "finished": True, "stopped": False, "output_dir": str(out)}
    if main:
        if base is None:
            base, tok = load_recipe_base(b, state.device)
            train_ex, _, _ = examples(tok)
        names = [f"member{i + 1}" for i in range(e.members)]
        if e.lookup:
            store, total = [], 0
            for ex in train_ex:
                if total >= e.lookup_datastore_tokens:
                    break
                store.append(ex["input_ids"])
                total += len(ex["input_ids"])
            members.append(LookupDraft(datastore=store))
            names.append("lookup")
        records = resume_records(metrics, fix=False)
        ensemble = EnsembleDraft(members, names, {"mode": e.mode, "node_budget": e.node_budget})
        first = out / "stages" / "member1" / "export" / "draftlab.json"  # (every member reads the same records)
        formats = json.loads(first.read_text()).get("training", {}).get("data_formats") if first.is_file() else None
        summary["export"] = str(save_export(ensemble, base, out / "export", b.name_or_path, tokenizer=tok, extra={
            "training": {"stages": records, "recipe": recipe.model_dump(mode="json"),
                         **({"data_formats": formats} if formats is not None else {})}},
            chat_template=template_to_ship(tok, b.chat_template)))
        summary["stages"] = records
    state.wait_for_everyone()
    return summary


def _scores(recipe: Recipe, members: list, base, tok, train_ex: list, state, cache: dict) -> dict:
    """Every training example's score under members, scored in shards across processes; the same member set is
    scored once (a stage's record and the next stage's selection share it), and a set with one member more runs
    only that member (the scores' memo; a resumed run starts it afresh)."""
    if len(members) not in cache:
        dev = next(base.parameters()).device
        for m in members:
            m.to(dev)
        mine = list(range(state.process_index, len(train_ex), state.num_processes))
        cache[len(members)] = _gather(example_scores(recipe.ensemble, base, members, train_ex, tok,
                                                     recipe.train.batch_size, mine, cache.setdefault("memo", {})),
                                      state.num_processes)
    return cache[len(members)]


def _next_examples(recipe: Recipe, members: list, base, tok, train_ex: list, i: int, state, cache: dict) -> dict:
    """The examples stage i trains on: those the first i members do not cover, and covered ones at the downweight
    rate; with the covered examples it dropped and the test that decided."""
    e = recipe.ensemble
    scores = _scores(recipe, members, base, tok, train_ex, state, cache)
    covered = [j for j in range(len(train_ex)) if scores[j] >= e.threshold]
    kept = [j for j in range(len(train_ex)) if scores[j] < e.threshold]
    if e.weighting == "downweight" and covered:
        rng = random.Random(recipe.train.seed * 7919 + i)
        kept += rng.sample(covered, max(1, round(e.downweight * len(covered))))
    if not kept:  # everything is covered: the stage still trains, on everything
        kept = list(range(len(train_ex)))
    dropped = sorted(set(range(len(train_ex))) - set(kept))
    return {"kept": sorted(kept), "dropped": dropped, "covered": len(covered), "examples": len(train_ex),
            "score": e.score, "threshold": e.threshold, "mean_score": sum(scores.values()) / len(scores)}


def _stage_record(recipe: Recipe, members: list, base, tok, train_ex, eval_ex, i: int, subset_file: Path,
                  state, cache: dict) -> dict:
    """What stage i dropped and trained on, the coverage of the ensemble after it (what the next stage would drop),
    and tau."""
    e = recipe.ensemble
    scores = _scores(recipe, members, base, tok, train_ex, state, cache)
    covered = sum(s >= e.threshold for s in scores.values())
    subset = json.loads(subset_file.read_text()) if subset_file.is_file() else {}
    trained_on = subset.get("kept", list(range(len(train_ex))))
    prompts = [ex["input_ids"][: max(2, min(32, len(ex["input_ids"]) // 2))] for ex in eval_ex[: e.tau_prompts]]
    stops = stop_token_ids(base, tok)
    tau = ensemble_tau(base, members, prompts, stops, e.node_budget) if state.is_main_process else None
    return {"stage": i + 1, "event": "stage", "member": f"member{i + 1}", "trained_on_examples": len(trained_on),
            "dropped_examples": len(train_ex) - len(trained_on),
            "examples_file": str(subset_file) if subset_file.is_file() else None,
            "examples": len(train_ex), "score": e.score, "threshold": e.threshold,
            "mean_coverage": round(sum(scores.values()) / len(scores), 4),
            "covered_examples": covered, "remaining_examples": len(train_ex) - covered,
            "tau": round(tau, 4) if tau is not None else None, "boost": e.boost}
