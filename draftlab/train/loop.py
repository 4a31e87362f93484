"""The one training loop: frozen base -> hidden states -> draft module -> its loss (Accelerate).

`train_draft` reads as its phases, each a function below: start the processes, load the base, the data and the
draft, build the optimizer, resume, run the steps (logging, evaluating, checkpointing), export.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..base import load_recipe_base, set_seed, teacher_transform, template_to_ship
from ..config import Recipe
from ..data import collate, load_examples
from ..drafters import build_draft
from ..drafters.base import closest_transform
from ..interop.export import save_export
from ..procs import die_with_parent
from ..progress import progress
from .accept import AcceptEstimator, BestDraft, selection_value
from .examples_cache import cached_examples
from .distributed import (StopRequest, any_rank, deepspeed_plugin, local_fraction, node_of, outside_deepspeed,
                          single_process_group_env, whole_copy)
from .objectives import DraftObjective, JointObjective, base_features, evaluate
from .run_dir import (Metrics, RunDirError, latest_checkpoint, prepare_run_dir, resume_records, resume_step,
                      save_checkpoint, write_run_config)


@dataclass
class Run:
    """What the phases share."""

    recipe: Recipe
    out_dir: Path
    accelerator: object
    use_deepspeed: bool
    ds_plugin: object = None  # DeepSpeed's plugin (None for DDP / FSDP)
    sharded: bool = False  # the base is FSDP-sharded: its forward is a collective
    base: object = None
    tok: object = None
    draft: object = None
    objective: object = None
    train_ex: list = field(default_factory=list)
    eval_ex: list = field(default_factory=list)
    stats: object = None
    optimizer: object = None
    scheduler: object = None
    params: list = field(default_factory=list)
    micro_per_epoch: int = 0
    total_steps: int = 0
    lm_weight: object = None  # the teacher's output embedding: evaluation always reports agreement with it
    base_weight: object = None  # the same, when the loss distills from the teacher
    teacher_transform: object = None  # what the base does to its lm_head's product (base.teacher_transform)
    cache: object = None  # the hidden-state cache, or None
    accept: object = None  # the accept-length estimator (accept.AcceptEstimator)
    stop_dirs: tuple = ()  # more directories whose STOP file stops the run (an ensemble's, for its stages)
    best: object = None  # the best draft so far by its estimate (accept.BestDraft), checkpointed
    stopper: object = None  # the stop request (signals, STOP files) while the steps run

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def partitioned(self) -> bool:
        """DeepSpeed ZeRO-3: the draft's parameters are partitioned across ranks."""
        return self.use_deepspeed and self.recipe.distributed.zero_stage == 3

    def whole_objective(self):
        """The trained objective with whole parameters, to read weights from outside its forward (the accept
        estimate, the best weights, the export): the module itself, or under ZeRO-3 a gathered copy (a collective:
        every rank calls this)."""
        objective = self.accelerator.unwrap_model(self.objective)
        if not self.partitioned:
            return objective

        def build():  # (the structure alone: whole_copy loads the gathered weights over it)
            with outside_deepspeed(self.ds_plugin):
                live = objective.draft
                draft = (live.empty_like() if hasattr(live, "empty_like") else
                         build_draft(self.recipe.head.model_dump(), self.base)).float()
            return DraftObjective(draft, self.recipe.loss, self.teacher_transform).to(self.accelerator.device)

        return whole_copy(objective, build)


def train_draft(recipe: Recipe, overwrite: bool = False, stop_after_steps: int | None = None,
                example_subset: list[int] | None = None, split_seed: int | None = None,
                stop_dirs: tuple = ()) -> dict:
    """Run (or resume) a recipe's draft training; a summary with the export path and the final eval figures.

    stop_after_steps ends this invocation early (after saving a checkpoint) to simulate preemption.
    example_subset trains on those training examples only (a boost-tuning stage); split_seed: the seed of the
    train / held-out split (default train.seed; a stage's is its ensemble's, which its subset indexes);
    stop_dirs: more directories whose STOP file stops the run, as its own does (a stage: its ensemble's).
    """
    check_teacher(recipe)  # (before the run directory is made: a refused recipe leaves nothing behind)
    run, ds_plugin = start(recipe, overwrite)
    run.stop_dirs = tuple(stop_dirs)
    load_models_and_data(run, ds_plugin, example_subset, recipe.train.seed if split_seed is None else split_seed)
    build_optimizer(run)
    open_hidden_cache(run)
    open_accept_estimate(run)
    def seed_rank(*at: int):
        torch.manual_seed(rank_seed(recipe.train.seed, run.accelerator.process_index, *at))

    if run.accelerator.process_index:  # (rank 0 goes on with its stream: a one-process run is what it was)
        seed_rank()
    # (restores each rank's generators, and reseeds ranks above 0 of a checkpoint from before per-rank streams)
    step = resume_step(run.accelerator, run.out_dir, run.total_steps, reseed=seed_rank)
    done = finished_before(run, step)
    if done is not None:  # the same command again after the run ended: nothing to redo
        return done
    metrics = Metrics(recipe, run.out_dir, run.accelerator)
    if run.is_main:
        print(run.stats.summary(recipe.data.max_len), file=sys.stderr, flush=True)
    if run.is_main and step == 0:
        s = run.stats
        metrics.log({"step": 0, "event": "start", "train_examples": s.train_examples, "eval_examples": s.eval_examples,
                     "train_tokens": s.train_tokens, "loss_tokens": s.loss_tokens, "skipped": s.skipped,
                     "truncated": s.truncated, "cut_at_max_len": s.cut_at_max_len,
                     "total_steps": run.total_steps, "processes": run.accelerator.num_processes,
                     "base_params_local": round(local_fraction(run.base), 4)})
    try:
        step, stopped, last_eval = run_steps(run, step, stop_after_steps, metrics)
    finally:  # (a step that raised left the signal handlers, Ctrl-C's too, in place)
        if run.stopper is not None:
            run.stopper.close()
    summary = finish(run, step, stopped, last_eval, metrics)
    metrics.close()
    return summary


def rank_seed(seed: int, rank: int, *more: int) -> int:
    """The seed of rank > 0's torch generator while it trains: dropout, LoRA dropout and DFlash's anchors draw from
    it, so each rank draws its own (with one seed every rank dropped out the same units and drew the same anchor
    positions). The draft is built before this, from train.seed on every rank. more: the step a resumed checkpoint
    from before per-rank streams was saved at (run_dir.resume_step)."""
    return int(np.random.SeedSequence([seed % 2**63, rank, *more]).generate_state(1, np.uint64)[0] % 2**63)


def check_teacher(recipe: Recipe, config=None, head=None) -> tuple | None:
    """Distillation takes the base's distribution from its final hidden states h: losses.lm_logits, the lm_head's
    product with what the base does after it (base.teacher_transform: Gemma-2's soft cap, Cohere's and Granite's
    scales). Refused for a base whose logits that cannot reproduce (an lm_head bias, an unknown model type's scale).
    config: the base's (default: read from its files; one that cannot be read now is checked once loaded).
    Returns the transform (None: the product itself, or no distillation)."""
    if not uses_base_logits(recipe):
        return None
    if config is None:
        from transformers import AutoConfig

        b = recipe.base
        try:
            config = AutoConfig.from_pretrained(b.name_or_path, revision=b.revision,
                                                trust_remote_code=b.trust_remote_code)
        except (OSError, ValueError):  # (loading the base says why)
            return None
    try:
        return teacher_transform(config, head)
    except ValueError as e:
        raise teacher_error(recipe, f"transforms its logits after its lm_head's product in a way draftlab does not "
                                    f"reproduce ({e})") from None


def uses_base_logits(recipe: Recipe) -> bool:
    """Whether the loss computes the base's logits from its hidden states: distillation (EAGLE-3 always distils:
    Eagle3Draft.needs_teacher) or Medusa-2's adapter (its own loss is on the base's logits)."""
    return recipe.head.type == "eagle3" or recipe.loss.distill_weight > 0 or recipe.lora is not None


def teacher_error(recipe: Recipe, what: str) -> ValueError:
    return ValueError(f"base {recipe.base.name_or_path} {what}: distillation takes the base's distribution from its "
                      "hidden states, and "
                      + ("EAGLE-3 always distils, so it cannot train on this base: train Hydra++, an SSM or DFlash "
                         "with loss.distill_weight: 0" if recipe.head.type == "eagle3" else
                         "set loss.distill_weight: 0" + (" and drop the lora section (Medusa-2's adapter trains on "
                                                         "the base's logits too)" if recipe.lora is not None else "")))


def probe_teacher(recipe: Recipe, base, transform: tuple | None) -> tuple | None:
    """The transform with which the teacher's logits are the base's own (drafters.base.closest_transform: the
    config's or the bare product, checked on one forward); neither: refused (a transform draftlab does not know of)."""
    t, ok = closest_transform(base, transform)
    if ok:
        return t
    how = f" (scale, soft cap) {transform}" if transform else ""
    raise teacher_error(recipe, f"gives logits that its lm_head's product{how} does not reproduce from its final "
                                "hidden states (checked on one forward of 16 tokens)")


def unserved_eagle3_target(recipe: Recipe, config) -> str | None:
    """For an EAGLE-3 recipe whose base architecture no engine read captures the draft's layers for: what to know
    (draftlab trains and decodes the draft; vLLM and SGLang refuse it at load)."""
    from ..interop.targets import EAGLE3_READ_FROM, EAGLE3_TARGETS

    arch = (getattr(config, "architectures", None) or [None])[0]
    if recipe.head.type != "eagle3" or arch is None:
        return None
    missing = [who for e, who in EAGLE3_READ_FROM.items() if arch not in EAGLE3_TARGETS[e]]
    if not missing:
        return None
    one = len(missing) == 1
    return (f"{' and '.join(missing)} do{'es' * one} not capture EAGLE-3's layers from a {arch} target, so "
            f"{'it refuses' if one else 'they refuse'} this draft at load; draftlab trains and decodes it "
            "(docs/interop.md, `target`)")


def over_context(recipe: Recipe, config, *examples) -> str | None:
    """Where data.max_len passes the base's context (max_position_embeddings; none under dynamic RoPE scaling): how
    many of the examples do (or, given none, that they could). Positions past it train the draft on features the
    base computes past what it was trained for (a 512-position base under the default max_len 2048 did in
    silence)."""
    from ..drafters.base import config_context

    ctx = config_context(config)
    if not ctx or recipe.data.max_len <= ctx:
        return None
    fix = f"set data.max_len: {ctx}, which cuts them there"
    if not examples:
        return (f"data.max_len {recipe.data.max_len} is above the base's context ({ctx} tokens): examples longer "
                f"than that would train past it; {fix}")
    n = sum(int((ex.lengths > ctx).sum()) for ex in examples)
    return (f"{n} examples are longer than the base's context ({ctx} tokens; data.max_len is "
            f"{recipe.data.max_len}): their positions past it train on what the base computes past its trained "
            f"positions; {fix}") if n else None


def lora_problems(recipe: Recipe, base) -> tuple[list[str], list[str]]:
    """Medusa-2's adapter: target modules no module of the base matches, by peft's rule (a module's name equals the
    target or ends with "." + target). peft refuses the recipe once the base is loaded when none matches, and
    adapts the others in silence when some do."""
    names = [n for n, _ in base.named_modules()]
    missing = [t for t in recipe.lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return [], []
    from transformers.pytorch_utils import Conv1D

    layers = dict.fromkeys(n.rsplit(".", 1)[-1] for n, m in base.named_modules()
                           if isinstance(m, (torch.nn.Linear, torch.nn.Embedding, Conv1D)))
    said = f"lora.target_modules {missing}: no module of the base has that name (its layers: {', '.join(layers)})"
    if len(missing) == len(recipe.lora.target_modules):
        return [said], []
    return [], [said + "; the adapter goes on the others only"]


def describe_transform(named: tuple, used: tuple | None) -> str:
    """The line train prints when the base's config names a transform of its logits: what the teacher applies."""
    scale, cap = named
    what = " and ".join(([f"multiplied by {scale:g}"] if scale != 1 else []) +
                        ([f"soft-capped at {cap:g}"] if cap else []))
    if used is None:
        return (f"teacher: the base's config says its logits are {what}, but one forward gives the bare product of "
                "its lm_head; the teacher takes the product")
    return (f"teacher: the base's logits are {what} after its lm_head's product; the teacher does the same (checked "
            "on one forward)")


def start(recipe: Recipe, overwrite: bool):
    """Check or prepare the run directory, start Accelerate (DDP, FSDP or DeepSpeed), write the resolved recipe."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    t = recipe.train
    out_dir = prepare_run_dir(recipe, overwrite)
    ds_plugin = deepspeed_plugin(recipe)
    if ds_plugin is not None:
        single_process_group_env()
    accelerator = Accelerator(
        # Without CUDA, cpu=True is what makes Accelerate run several processes over gloo (DeepSpeed
        # brings its own CPU backend and must not be turned off by it).
        cpu=not torch.cuda.is_available() and recipe.distributed.strategy != "deepspeed",
        mixed_precision=t.mixed_precision, log_with=recipe.log.trackers or None, project_dir=str(out_dir / "logs"),
        # Medusa-2's warm-up leaves the adapter without gradients for a while.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=recipe.lora is not None),
                         InitProcessGroupKwargs(timeout=timedelta(minutes=recipe.distributed.timeout_minutes))],
        deepspeed_plugin=ds_plugin,
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        # Every process would train alone and all would write the same run directory.
        raise RunDirError(
            f"launched {launched} processes but Accelerate runs {accelerator.num_processes}"
            + ("; Accelerate runs multi-process DeepSpeed on GPUs only, use distributed.strategy: ddp on CPU"
               if ds_plugin is not None and not torch.cuda.is_available() else ""))
    if accelerator.is_main_process:
        write_run_config(out_dir, recipe)
    accelerator.wait_for_everyone()
    set_seed(t.seed)
    run = Run(recipe, out_dir, accelerator, use_deepspeed=ds_plugin is not None, ds_plugin=ds_plugin,
              sharded=recipe.distributed.strategy == "fsdp" and accelerator.num_processes > 1)
    return run, ds_plugin


def load_models_and_data(run: Run, ds_plugin, example_subset: list[int] | None, split_seed: int) -> None:
    """The frozen base (FSDP-sharded or whole), the tokenised data, the draft module and its objective."""
    recipe, accelerator, b = run.recipe, run.accelerator, run.recipe.base
    if run.sharded:
        from .sharding import load_sharded_base

        run.base, run.tok = load_sharded_base(b, accelerator, keep_last_layer=bool(recipe.head.prefix_attention))
    else:  # (fsdp in a single process has nothing to shard over)
        with outside_deepspeed(ds_plugin):
            run.base, run.tok = load_recipe_base(b, accelerator.device)
    named = run.teacher_transform = check_teacher(recipe, run.base.config, run.base.get_output_embeddings())
    if uses_base_logits(recipe):  # (every rank probes: a sharded base's forward is a collective)
        run.teacher_transform = probe_teacher(recipe, run.base, run.teacher_transform)
    if named and uses_base_logits(recipe) and run.is_main:
        print(describe_transform(named, run.teacher_transform), file=sys.stderr, flush=True)
    unserved = unserved_eagle3_target(recipe, run.base.config)
    if unserved and run.is_main:  # (before hours of training, not at `check`)
        print(f"warning: {unserved}", file=sys.stderr, flush=True)
    if recipe.data.cache:  # tokenized once, by the main process; the others and every resume read the file
        run.train_ex, run.eval_ex, run.stats = cached_examples(recipe.data, run.tok, split_seed, run.out_dir,
                                                               accelerator, worker_init=die_with_parent)
    else:
        with accelerator.main_process_first():
            run.train_ex, run.eval_ex, run.stats = load_examples(recipe.data, run.tok, seed=split_seed,
                                                                 worker_init=die_with_parent)
    longer = over_context(recipe, run.base.config, run.train_ex, run.eval_ex)
    if longer and run.is_main:
        print(f"warning: {longer}", file=sys.stderr, flush=True)
    if example_subset is not None:
        run.train_ex = run.train_ex.take(example_subset)
        s = run.stats
        s.train_examples, s.train_tokens, s.loss_tokens = len(run.train_ex), run.train_ex.tokens(), \
            run.train_ex.loss_tokens()
    with outside_deepspeed(ds_plugin):  # built whole (and checked, initialised from the base); ZeRO-3 shards it later
        run.draft = draft = build_draft(recipe.head.model_dump(), run.base).float()
    if hasattr(draft, "fit_vocab"):  # EAGLE-3's draft vocabulary: the training data's most frequent tokens
        draft.fit_vocab(run.train_ex)
    if recipe.lora is not None:  # Medusa-2: a LoRA adapter on the base, trained with the heads
        from peft import LoraConfig, get_peft_model

        refused, said = lora_problems(recipe, run.base)  # (peft adapted the others of a misspelt list in silence)
        if refused:
            raise ValueError(refused[0])
        if said and run.is_main:
            print(f"warning: {said[0]}", file=sys.stderr, flush=True)
        lc = recipe.lora
        run.base = get_peft_model(run.base, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                                       target_modules=list(lc.target_modules), bias="none"))
        run.objective = JointObjective(draft, recipe.loss, run.base, lc, run.teacher_transform)
    else:
        run.objective = DraftObjective(draft, recipe.loss, run.teacher_transform)
    if run.use_deepspeed and recipe.distributed.zero_stage == 3:
        from deepspeed.runtime.zero import register_external_parameter

        # The chunked loss reads the heads' lm_head weights outside their own forward: ZeRO-3 must gather them.
        for lm in draft.lm_heads:
            register_external_parameter(run.objective, lm.weight)
    run.lm_weight = run.base.get_output_embeddings().weight
    teacher = recipe.loss.distill_weight > 0 or getattr(draft, "needs_teacher", False)
    run.base_weight = run.lm_weight if teacher else None


def build_optimizer(run: Run) -> None:
    """AdamW over the draft (and Medusa-2's adapter, at its own lr), the warm-up + cosine schedule, the step count;
    the objective and optimizer prepared by Accelerate."""
    recipe, t, accelerator = run.recipe, run.recipe.train, run.accelerator
    run.params = [p for p in run.objective.parameters() if p.requires_grad]
    groups = [{"params": [p for p in run.draft.parameters() if p.requires_grad]}]
    if recipe.lora is not None:
        groups.append({"params": [p for p in run.base.parameters() if p.requires_grad],
                       "lr": recipe.lora.lr or t.lr / 4})
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    world = accelerator.num_processes
    run.micro_per_epoch = len(run.train_ex) // (t.batch_size * world)
    if run.micro_per_epoch == 0:
        raise ValueError(f"data gives {len(run.train_ex)} training examples, fewer than one global batch "
                         f"(train.batch_size={t.batch_size} x {world} processes); lower train.batch_size")
    run.total_steps = t.max_steps or max(1, math.ceil(t.epochs * run.micro_per_epoch / t.grad_accum_steps))
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.warmup_steps, run.total_steps,
                                                                           t.final_lr_ratio))
    run.objective, run.optimizer = accelerator.prepare(run.objective, optimizer)
    # The scheduler is stepped by hand once per optimizer step; registering (not preparing) it
    # checkpoints it without Accelerate's per-process stepping.
    accelerator.register_for_checkpointing(run.scheduler)


def open_hidden_cache(run: Run) -> None:
    """train.cache_hidden: the base's features per training example, computed once and read back later."""
    t = run.recipe.train
    if not t.cache_hidden:
        return
    from .hidden_cache import HiddenCache

    layers = tuple(getattr(run.draft, "base_layers", None) or ())
    width = run.base.config.hidden_size * (len(layers) + 1)
    cache_dir = Path(t.hidden_cache_dir or run.out_dir / "hidden_cache")
    node, nodes, first = node_of(run.accelerator)
    if nodes > 1:  # a cache per node: a node-local disk is not seen by the other nodes, and on a shared file system
        cache_dir = cache_dir / f"node{node}"  # a memory map is not kept coherent across machines
    dtype = next(run.base.parameters()).dtype
    for turn in (True, False):  # each node's first process creates or validates its files, then the others open them
        if first == turn:
            run.cache = HiddenCache(cache_dir, run.train_ex, width, dtype, run.recipe.base.name_or_path, create=first,
                                    layers=layers, revision=run.recipe.base.revision)
        run.accelerator.wait_for_everyone()


BEST_STATE = "custom_checkpoint_1.pkl"  # Accelerate's file for the second registered object (after the scheduler)


def open_accept_estimate(run: Run) -> None:
    """The accept-length estimator over the held-out prompts, and the best draft so far, registered for
    checkpointing after the scheduler (so every checkpoint holds the best as of its step)."""
    run.accept = AcceptEstimator(run.recipe, run.base, run.tok, run.draft, run.eval_ex, run.accelerator, run.sharded)
    run.best = BestDraft(keep_weights=run.is_main)  # weights on the main process only, which exports
    run.accelerator.register_for_checkpointing(run.best)
    ckpt = latest_checkpoint(run.out_dir)
    if run.is_main and ckpt is not None and not (ckpt / BEST_STATE).is_file():
        # A checkpoint of a draftlab from before the best draft was checkpointed: resume with no best so far.
        torch.save(run.best.state_dict(), ckpt / (BEST_STATE + ".tmp"))  # (whole or not at all: the checkpoint
        os.replace(ckpt / (BEST_STATE + ".tmp"), ckpt / BEST_STATE)  # is complete already, and resume loads it)
    run.accelerator.wait_for_everyone()


def micro_step(run: Run, idx: list[int], sync: bool, step: int, share: float) -> tuple[dict, int]:
    """Forward and backward on one micro-batch (gradients synchronised across ranks only when `sync`), its loss
    weighted by `share` (window_shares); the objective's outputs and the batch's token count."""
    accelerator, recipe = run.accelerator, run.recipe
    batch = collate([run.train_ex[i] for i in idx], run.tok.pad_token_id)
    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
    hidden = run.cache.get(idx, batch["input_ids"].shape[1], accelerator.device) if run.cache else None
    if recipe.lora is not None:  # the joint objective runs the (adapted) base itself
        accelerator.unwrap_model(run.objective).heads_only = step < recipe.lora.heads_warmup_steps
    # A sharded base's forward is a collective: if any rank missed the cache, every rank runs it.
    elif any_rank(hidden is None, accelerator) if run.sharded else hidden is None:
        with torch.no_grad():
            hidden = base_features(run.base, run.draft, batch["input_ids"], batch["attention_mask"])  # [B, S, (n+1)H]
        if run.cache:
            run.cache.put(idx, hidden)
    ga = recipe.train.grad_accum_steps
    # Whether this micro-batch ends an accumulation: DeepSpeed's engine steps its optimizer at every backward
    # Accelerate calls a boundary (this flag), and Accelerate's optimizer steps only with it set.
    accelerator.sync_gradients = sync
    with nullcontext() if sync else accelerator.no_sync(run.objective):
        with accelerator.autocast():
            out = run.objective(hidden, batch["input_ids"], batch["loss_mask"], batch["attention_mask"],
                                run.base_weight)
        # DeepSpeed's engine divides by its gradient_accumulation_steps itself.
        accelerator.backward(out["loss"] * (share * ga if run.use_deepspeed else share))
    return out, int(batch["attention_mask"].sum())


def window_shares(run: Run, batches: list[list[int]]) -> list[float]:
    """Each micro-batch's weight in an optimizer step: its supervised tokens (loss_mask) over those of the step's
    micro-batches on every rank, times the number of ranks (the gradient is averaged over them). Each objective is a
    mean over its micro-batch's supervised positions, so the step's gradient is that of the mean over all of them,
    whatever the batch size, accumulation and rank count (with 1 / grad_accum_steps instead, a token in a
    micro-batch of short answers weighed several times one of long answers, and the layout changed the objective).
    One all-reduce a step."""
    counts = [sum(int(sum(run.train_ex[i]["loss_mask"])) for i in idx) for idx in batches]
    accelerator = run.accelerator
    total = torch.tensor([float(sum(counts))], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    total = max(float(total[0]), 1.0)
    return [c * accelerator.num_processes / total for c in counts]


def optimizer_step(run: Run):
    """Clip, step the optimizer and the schedule; the gradient norm (None without clipping)."""
    t = run.recipe.train
    grad_norm = run.accelerator.clip_grad_norm_(run.params, t.max_grad_norm) if t.max_grad_norm > 0 else None
    run.optimizer.step()
    if not getattr(run.optimizer, "step_was_skipped", False):  # (fp16: a step the loss scaler skipped on an
        run.scheduler.step()  # overflow leaves the schedule where it was, as Accelerate's own scheduler wrapper does)
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def run_steps(run: Run, step: int, stop_after_steps: int | None, metrics: Metrics):
    """Optimizer steps until the end (or stop_after_steps, or a stop request), logging every log_every_steps,
    evaluating every eval_every_steps, checkpointing every save_every_steps. (step, stopped, last eval)."""
    t, accelerator = run.recipe.train, run.accelerator
    world, rank, ga = accelerator.num_processes, accelerator.process_index, t.grad_accum_steps
    run.objective.train()
    bar = progress(total=run.total_steps, initial=step, disable=not run.is_main, desc="train", unit="step")
    window = Window()
    last_eval, stopped = None, False
    postfix: dict = {}  # the bar's figures: the last logged loss and tokens/s, the last evaluation's accept length
    end_step = run.total_steps if stop_after_steps is None else min(run.total_steps, step + stop_after_steps)
    stopper = run.stopper = StopRequest(run.out_dir, accelerator, run.stop_dirs)
    micro = step * ga
    order: dict[int, list] = {}  # the micro-batches of this epoch (and of the next, where a window reaches it)

    def batch_at(m: int) -> list[int]:
        epoch, j = divmod(m, run.micro_per_epoch)
        if epoch not in order:
            order.update({epoch: micro_batch_indices(len(run.train_ex), t.batch_size, epoch, t.seed, rank, world)})
            for old in [e for e in order if e < epoch - 1]:
                del order[old]
        return order[epoch][j]

    while step < end_step:
        if micro % ga == 0:
            shares = window_shares(run, [batch_at(micro + m) for m in range(ga)])
        sync = (micro + 1) % ga == 0
        share = shares[micro % ga]
        out, tokens = micro_step(run, batch_at(micro), sync, step, share)
        window.add(out["loss"].item() * share, tokens * world)
        micro += 1
        if not sync:
            continue
        grad_norm = optimizer_step(run)
        step += 1
        window.n += 1
        bar.update(1)
        if step % t.log_every_steps == 0 or step == end_step:
            rec = window.record(step, micro / run.micro_per_epoch, run.scheduler.get_last_lr()[0], out, grad_norm,
                                accelerator)
            metrics.log(rec)
            postfix.update(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            bar.set_postfix(postfix)
            window = Window()
        # Evaluations and checkpoints stay out of the next record's tokens/s (the first record after one counted it:
        # walk-through); the stop check between them stays in (its all-reduce waits for the step's kernels).
        evaluating = run.eval_ex and (step % t.eval_every_steps == 0 or step == run.total_steps)
        if evaluating and accelerator.device.type == "cuda":
            torch.cuda.synchronize(accelerator.device)  # (the step's queued kernels are the step's time)
        t_eval = time.perf_counter()
        if evaluating:
            last_eval = evaluate_run(run, step)
            metrics.log({"step": step, "event": "eval", **last_eval})
            accept = selection_value(last_eval)  # what the export would decode at (None: not measured here)
            if accept is not None:
                postfix["accept"] = f"{accept:.2f}"
                bar.set_postfix(postfix)
        paused = time.perf_counter() - t_eval
        stopped = step < end_step and stopper.requested()
        t_save = time.perf_counter()  # (after the stop check's all-reduce, which waited for the step's kernels)
        if step % t.save_every_steps == 0 or step == end_step or stopped:
            save_checkpoint(accelerator, run.out_dir, step, run.total_steps, t.keep_checkpoints)
        window.t0 += paused + time.perf_counter() - t_save
        if stopped:
            metrics.log({"step": step, "event": "stopped", "reason": "stop requested (signal or STOP file)"})
            if run.is_main:
                print(f"\nstop requested: checkpoint saved at step {step}; `draftlab train` on this recipe, with the "
                      "overrides it was started with and without --overwrite, resumes it")
            break
    bar.close()
    return step, stopped, last_eval


class Window:
    """Loss and tokens since the last log record."""

    def __init__(self):
        self.loss, self.tokens, self.n, self.t0 = 0.0, 0, 0, time.perf_counter()

    def add(self, loss: float, tokens: int) -> None:
        self.loss += loss
        self.tokens += tokens

    def record(self, step: int, epoch: float, lr: float, out: dict, grad_norm, accelerator) -> dict:
        """The log record: the loss averaged over the window's steps and over the ranks (each rank's is its
        micro-batches' weighted by their shares of the step's supervised tokens, as the gradient weighs them),
        train_top1 over every rank's last micro-batch. Every rank calls it at the same steps (one all-reduce)."""
        device = accelerator.device
        loss = torch.tensor([self.loss / self.n], dtype=torch.float64, device=device)
        top = torch.stack([out["top1"], out["count"]]).float()
        if accelerator.num_processes > 1:
            loss, top = accelerator.reduce(loss, reduction="mean"), accelerator.reduce(top, reduction="sum")
        rec = {"step": step, "epoch": round(epoch, 3), "loss": float(loss[0]), "lr": lr,
               "tokens_per_s": self.tokens / (time.perf_counter() - self.t0),
               "train_top1": (top[0] / top[1].clamp(min=1)).tolist()}
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
        if "base_loss" in out:
            rec["base_loss"] = float(out["base_loss"])
        if device.type == "cuda":  # peak so far on this rank: what batch size / max_len cost
            rec["gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        return rec


def evaluate_run(run: Run, step: int) -> dict:
    """Held-out losses and agreement, the accept-length figures, and whether this is the best draft so far."""
    rec = evaluate(run.objective, run.base, run.eval_ex, run.recipe.train.batch_size, run.tok.pad_token_id,
                   run.accelerator, run.lm_weight, run.draft)
    if run.accept.active:  # (no figure otherwise, and offer() keeps nothing without one)
        whole = run.whole_objective()
        rec.update(run.accept.evaluate([run.objective, whole], math.ceil(step / run.recipe.train.eval_every_steps),
                                       draft=whole.draft))
        run.best.offer(step, selection_value(rec), whole, rec, rows=run.accept.rows)
    if run.best.step is not None:
        rec["best_step"] = run.best.step
    return rec


def finish(run: Run, step: int, stopped: bool, last_eval: dict | None, metrics: Metrics) -> dict:
    """At the last step: the final evaluation (if none ran at it) and the export; the run's summary."""
    summary = {"step": step, "total_steps": run.total_steps, "output_dir": str(run.out_dir),
               "finished": step >= run.total_steps, "stopped": stopped}
    if step < run.total_steps:
        return summary
    if last_eval is None and run.eval_ex:
        last_eval = evaluate_run(run, step)
    recipe = run.recipe
    chosen = export_choice(run, step)
    # The figures of the weights exported: the best evaluation's when an earlier one was better.
    exported_eval = run.best.record if chosen["step"] != step and run.best.record else last_eval
    objective = run.whole_objective()  # (under ZeRO-3 a gathered copy: every rank takes part)
    if run.is_main:
        if chosen["step"] != step:  # train.export: best, and an earlier evaluation was better
            run.best.restore(objective)  # (the run ends here: the last weights are in the last checkpoint)
        tree, tree_info = export_tree(run, run.best.rows if chosen["step"] != step else run.accept.rows)
        summary["default_tree"] = tree_info
        export = save_export(objective.draft, run.base, run.out_dir / "export", recipe.base.name_or_path,
                             default_tree=tree,
                             extra={"training": {"steps": step, "recipe": recipe.model_dump(mode="json"),
                                                 "eval": exported_eval, "export": chosen,
                                                 "data_formats": run.stats.formats,
                                                 **({"default_tree": tree_info} if tree_info else {})}},
                             tokenizer=run.tok,
                             adapter=run.base if recipe.lora is not None else None,
                             chat_template=template_to_ship(run.tok, recipe.base.chat_template))
        summary["export"] = str(export)
    summary["eval"], summary["last_eval"] = exported_eval, last_eval
    summary["export_step"] = chosen["step"]
    if run.is_main and last_eval:
        metrics.log({"step": step, "event": "end", **last_eval, "export_step": chosen["step"],
                     "export_value": chosen["value"]})
    return summary


def export_tree(run: Run, rows: list | None) -> tuple[list | None, dict | None]:
    """The export's default tree (paths; None: the kind's) and what decided it (train.grow_tree; None where the
    kind's tree is not grown): grown from the exported evaluation's rank vectors where it decodes held-out texts
    better (decode.search.fitted_tree), with its accept length replayed on all of them."""
    from ..decode.search import fitted_tree, replay_accept_length

    if not run.accept.grows or rows is None:
        return None, None
    tree, info = fitted_tree(run.accept.tree, rows)
    if info["source"] != "grown":
        return None, info
    info["expected_accept_length"] = replay_accept_length(tree, rows)  # (on the texts it was grown on)
    info["kind_expected_accept_length"] = replay_accept_length(run.accept.tree, rows)
    return [list(p) for p in tree.paths], info


def finished_before(run: Run, step: int) -> dict | None:
    """The summary of a run that had already finished at `step` (its export written at that step, by the same
    train.export choice, and, when it evaluates, its end record logged), or None. A run killed between its last
    checkpoint and its end record redoes its end; a longer schedule (train.max_steps, epochs) trains on."""
    from ..interop.export import META

    meta_file = run.out_dir / "export" / META
    if step < run.total_steps or not meta_file.is_file():
        return None
    training = json.loads(meta_file.read_text()).get("training", {})
    ends = [r for r in resume_records(run.out_dir / "metrics.jsonl", fix=False) if r.get("event") == "end"]
    end = ends[-1] if ends and ends[-1].get("step") == step else None
    made_with = training.get("recipe", {}).get("train", {})
    asked = run.recipe.train
    if training.get("steps") != step or (run.eval_ex and end is None) or made_with.get("export") != asked.export or \
            made_with.get("grow_tree", asked.grow_tree) != asked.grow_tree:
        return None  # (train.export or grow_tree changed since: the export is made again, as the recipe now asks)
    if run.is_main:
        print(f"{run.out_dir} finished at step {step}; its export is {meta_file.parent} (a larger train.max_steps or "
              "epochs trains on; --overwrite trains again)")
    last_eval = None if end is None else {k: v for k, v in end.items()
                                          if k not in ("step", "event", "export_step", "export_value")}
    return {"step": step, "total_steps": run.total_steps, "output_dir": str(run.out_dir), "finished": True,
            "stopped": False, "already_finished": True, "export": str(meta_file.parent),
            "eval": training.get("eval"), "last_eval": last_eval, "export_step": training.get("export", {}).get("step"),
            "default_tree": training.get("default_tree")}


def export_choice(run: Run, step: int) -> dict:
    """Which weights the export holds: train.export best (the best evaluation's, when one had a figure) or last."""
    best = run.best
    if run.recipe.train.export == "best" and best.step is not None:
        return {"step": best.step, "value": best.value, "chosen": "best",
                "by": "expected_accept_length" if run.accept.tree is not None else "measured_accept_length"}
    why = "last" if run.recipe.train.export == "last" else "last (no evaluation had an accept-length figure)"
    return {"step": step, "value": None, "chosen": why}


def micro_batch_indices(n: int, batch_size: int, epoch: int, seed: int, rank: int, world: int) -> list[list[int]]:
    """This rank's micro-batches of one epoch: a seeded permutation, cut evenly across ranks."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    per_rank = n // (batch_size * world)
    return [perm[(j * world + rank) * batch_size:(j * world + rank + 1) * batch_size] for j in range(per_rank)]




def lr_lambda(warmup: int, total: int, final: float = 0.0):
    """Linear warmup then cosine decay to `final` (a fraction of the peak lr), as a multiplier of the peak lr."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


