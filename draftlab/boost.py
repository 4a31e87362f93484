"""Collective boost-tuning of an SSM ensemble (SpecInfer): members are trained one after another, each stage a run
of the one training loop, stage i on the training examples that members 1..i-1 do not yet cover.

An example's score is the share of its supervised positions where some member's top-1 token is the base's
top-1 token (how often the ensemble would have the base's greedy token among its drafts); examples scoring at
least ensemble.threshold are covered and dropped (or kept at the ensemble.downweight rate) for later stages.
Each stage lives in OUTPUT_DIR/stages/memberN (its own checkpoints, metrics.jsonl and export, plus
examples.json: the examples it trains on), so a run killed in stage 3 resumes in stage 3 with stages 1-2
untouched. After each stage, OUTPUT_DIR/metrics.jsonl gets the ensemble's coverage, the examples left for the
next stage and tau (the merged ensemble's accept length on held-out prompts). The ensemble export
(OUTPUT_DIR/export) holds the members as Hugging Face directories and a draftlab.json that lists them.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from .config import Recipe, build_recipe, dump_recipe


def stage_recipe(recipe: Recipe, i: int) -> Recipe:
    """Member i's recipe: head.ssm with its architecture override, its own run directory and seed, no ensemble."""
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


@torch.no_grad()
def coverage_scores(base, members: list, examples: list[dict], pad_id: int, batch_size: int = 8,
                    indices: list[int] | None = None) -> dict[int, float]:
    """Per example index: the share of its supervised positions (predicting token t+1 at position t) where some
    member's top-1 equals the base's top-1."""
    from .base import base_hidden
    from .data import collate

    dev = next(base.parameters()).device
    w_base = base.get_output_embeddings().weight
    idx = list(range(len(examples))) if indices is None else indices
    scores = {}
    for s in range(0, len(idx), batch_size):
        part = idx[s:s + batch_size]
        b = {k: v.to(dev) for k, v in collate([examples[i] for i in part], pad_id).items()}
        target = _argmax(base_hidden(base, b["input_ids"], b["attention_mask"]), w_base)  # [B, S]
        hit = torch.zeros_like(target, dtype=torch.bool)
        for m in members:
            h = m.lm.base_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
            hit |= _argmax(h.to(w_base.dtype), m.lm.get_output_embeddings().weight) == target
        sup = b["loss_mask"][:, 1:].bool()  # position t is supervised when token t+1 is
        covered = (hit[:, :-1] & sup).sum(-1).float() / sup.sum(-1).clamp(min=1).float()
        scores.update(zip(part, covered.tolist()))
    return scores


def _gather(scores: dict, world: int) -> dict:
    if world == 1 or not torch.distributed.is_initialized():
        return scores
    parts = [None] * world
    torch.distributed.all_gather_object(parts, scores)
    return {k: v for p in parts for k, v in p.items()}


@torch.no_grad()
def ensemble_tau(base, members: list, prompts: list[list[int]], eos, node_budget: int, max_new_tokens: int = 64) -> float:
    """Accept length of the merged ensemble (chains of 4) on held-out prompts, greedy."""
    from .decode.decoder import SpeculativeDecoder
    from .decode.tree import Tree
    from .drafters.ensemble import EnsembleDrafter
    from .drafters.ssm import SSMDrafter

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

    from .base import load_base
    from .data import load_examples
    from .drafters import EnsembleDraft, LookupDraft
    from .export import load_export, save_export
    from .train import prepare_run_dir, train

    e, out = recipe.ensemble, Path(recipe.output_dir)
    state = PartialState(cpu=not torch.cuda.is_available() and recipe.distributed.strategy != "deepspeed")
    main = state.is_main_process
    if main:
        prepare_run_dir(recipe, overwrite)
        if overwrite:
            import shutil

            shutil.rmtree(out / "stages", ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_recipe(recipe))
    state.wait_for_everyone()
    metrics = out / "metrics.jsonl"
    recorded = {json.loads(l)["stage"] for l in metrics.read_text().splitlines() if l.strip()} if metrics.is_file() else set()
    b = recipe.base
    base = tok = train_ex = eval_ex = None
    members, stages = [], []
    for i in range(e.members):
        sr = stage_recipe(recipe, i)
        sdir = Path(sr.output_dir)
        subset_file = sdir / "examples.json"
        if not (sdir / "export" / "draftlab.json").is_file():
            subset = None
            if e.boost and i > 0:
                if not subset_file.is_file():
                    if base is None:
                        base, tok = load_base(b.name_or_path, b.dtype, state.device)
                        train_ex, eval_ex, _ = load_examples(recipe.data, tok, seed=recipe.train.seed)
                    subset = _next_examples(recipe, members, base, tok, train_ex, i, state)
                    if main:
                        sdir.mkdir(parents=True, exist_ok=True)
                        subset_file.with_suffix(".tmp").write_text(json.dumps(subset))
                        os.replace(subset_file.with_suffix(".tmp"), subset_file)
                    state.wait_for_everyone()
                subset = json.loads(subset_file.read_text())["kept"]
            summary = train(sr, overwrite=False, stop_after_steps=stop_after_steps, example_subset=subset)
            if not summary["finished"]:
                return {**summary, "stage": i + 1, "members": e.members, "output_dir": str(out)}
        member, _ = load_export(sdir / "export")
        members.append(member)
        if i + 1 not in recorded:
            if base is None:
                base, tok = load_base(b.name_or_path, b.dtype, state.device)
                train_ex, eval_ex, _ = load_examples(recipe.data, tok, seed=recipe.train.seed)
            rec = _stage_record(recipe, members, base, tok, train_ex, eval_ex, i, subset_file, state)
            if main:
                with open(metrics, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        stages.append(i + 1)
    summary = {"step": e.members, "total_steps": e.members, "finished": True, "stopped": False, "output_dir": str(out)}
    if main:
        if base is None:
            base, tok = load_base(b.name_or_path, b.dtype, state.device)
            train_ex, _, _ = load_examples(recipe.data, tok, seed=recipe.train.seed)
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
        records = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
        ensemble = EnsembleDraft(members, names, {"mode": e.mode, "node_budget": e.node_budget})
        summary["export"] = str(save_export(ensemble, base, out / "export", b.name_or_path, tokenizer=tok, extra={
            "training": {"stages": records, "recipe": recipe.model_dump(mode="json")}}))
        summary["stages"] = records
    state.wait_for_everyone()
    return summary


def _next_examples(recipe: Recipe, members: list, base, tok, train_ex: list, i: int, state) -> dict:
    """The examples stage i trains on: those the first i members do not cover, and covered ones at the downweight
    rate; scored in shards across processes."""
    e = recipe.ensemble
    mine = list(range(state.process_index, len(train_ex), state.num_processes))
    for m in members:
        m.to(next(base.parameters()).device)
    scores = _gather(coverage_scores(base, members, train_ex, tok.pad_token_id, recipe.train.batch_size, mine),
                     state.num_processes)
    covered = [j for j in range(len(train_ex)) if scores[j] >= e.threshold]
    kept = [j for j in range(len(train_ex)) if scores[j] < e.threshold]
    if e.weighting == "downweight" and covered:
        rng = random.Random(recipe.train.seed * 7919 + i)
        kept += rng.sample(covered, max(1, round(e.downweight * len(covered))))
    if not kept:  # everything is covered: the stage still trains, on everything
        kept = list(range(len(train_ex)))
    return {"kept": sorted(kept), "covered": len(covered), "examples": len(train_ex),
            "mean_score": sum(scores.values()) / len(scores)}


def _stage_record(recipe: Recipe, members: list, base, tok, train_ex, eval_ex, i: int, subset_file: Path,
                  state) -> dict:
    """Coverage of the ensemble after stage i, what the next stage would train on, and tau."""
    e = recipe.ensemble
    dev = next(base.parameters()).device
    for m in members:
        m.to(dev)
    mine = list(range(state.process_index, len(train_ex), state.num_processes))
    scores = _gather(coverage_scores(base, members, train_ex, tok.pad_token_id, recipe.train.batch_size, mine),
                     state.num_processes)
    covered = sum(s >= e.threshold for s in scores.values())
    trained_on = json.loads(subset_file.read_text())["kept"] if subset_file.is_file() else list(range(len(train_ex)))
    prompts = [ex["input_ids"][: max(2, min(32, len(ex["input_ids"]) // 2))] for ex in eval_ex[: e.tau_prompts]]
    tau = ensemble_tau(base, members, prompts, tok.eos_token_id, e.node_budget) if state.is_main_process else None
    return {"stage": i + 1, "event": "stage", "member": f"member{i + 1}", "trained_on_examples": len(trained_on),
            "examples": len(train_ex), "mean_coverage": round(sum(scores.values()) / len(scores), 4),
            "covered_examples": covered, "remaining_examples": len(train_ex) - covered,
            "tau": round(tau, 4) if tau is not None else None, "boost": e.boost}
