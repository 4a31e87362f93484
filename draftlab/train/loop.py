"""The one training loop: frozen base -> hidden states -> draft module (heads or an SSM) -> chunked losses (Accelerate)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn
from .progress import progress

from .base import base_hidden, base_states, load_base, set_seed
from .config import RESUMABLE_KEYS, Recipe, dump_recipe, diff_recipes, build_recipe
from .data import collate, load_examples
from .export import save_export
from .drafters import build_draft
from .losses import draft_losses

import yaml


class RunDirError(ValueError):
    """output_dir holds a different run; says what differs and how to proceed."""


class StopRequest:
    """A polite stop: SIGTERM / SIGUSR1 to this process, or a file `STOP` in the run directory.

    Slurm sends a signal before a time limit or preemption; launchers do not always forward it to
    every worker, so the sbatch scripts also touch OUTPUT_DIR/STOP. All ranks agree on the flag
    (one all-reduce per optimizer step) and stop together after a checkpoint.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, out_dir: Path, accelerator):
        import signal
        import threading

        self.file, self.accelerator, self.flag, self.old = out_dir / "STOP", accelerator, False, {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self.old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.flag = True

    def requested(self) -> bool:
        return any_rank(self.flag or self.file.exists(), self.accelerator)

    def close(self) -> None:
        import signal

        for sig, old in self.old.items():
            signal.signal(sig, old)


def local_fraction(model) -> float:
    """Share of the model's parameters this rank holds (1.0 unless FSDP shards them)."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for p in model.parameters():
        total += p.numel()
        held += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return held / max(total, 1)


def any_rank(flag: bool, accelerator) -> bool:
    """True on every rank when flag is true on any (one all-reduce; none in a single process)."""
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor([float(flag)], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


class DraftObjective(nn.Module):
    """The draft module plus its loss, so that DDP/FSDP wrap one forward that returns the loss."""

    def __init__(self, draft: nn.Module, loss_cfg):
        super().__init__()
        self.draft = draft
        self.loss_cfg = loss_cfg

    def forward(self, hidden, input_ids, loss_mask, attention_mask=None, base_weight=None):
        if hasattr(self.draft, "objective"):  # drafters with their own training procedure (EAGLE-3's unrolled test)
            B, S, _ = hidden.shape
            return self.draft.objective(hidden.view(B, S, -1, self.draft.hidden_size), input_ids, loss_mask,
                                        attention_mask, base_weight, self.loss_cfg)
        feats = self.draft.train_hidden(hidden, input_ids, attention_mask)
        c = self.loss_cfg
        return draft_losses(feats, [lm.weight for lm in self.draft.lm_heads], input_ids, loss_mask,
                            base_hidden=hidden, base_weight=base_weight, head_decay=c.head_decay,
                            distill_weight=c.distill_weight, chunk_size=c.chunk_size, topk=c.topk,
                            shifts=getattr(self.draft, "shifts", None), divergence=c.divergence)


class JointObjective(DraftObjective):
    """Medusa-2: the heads and a LoRA adapter on the base in one module (so DDP / DeepSpeed wrap both).

    loss = base loss + heads_weight * heads loss, where the base loss is the KL from the original base (the
    adapter disabled, same step, no gradient) to the adapted one (self_distill), or CE on the data tokens; the
    heads read the adapted base's final state. While `heads_only` is set (the warm-up) the base runs without
    gradient and only the heads' loss counts. Checkpoints hold the trainable tensors only, not the frozen base."""

    def __init__(self, draft: nn.Module, loss_cfg, base, lora_cfg):
        super().__init__(draft, loss_cfg)
        self.base = base
        self.lora_cfg = lora_cfg
        self.heads_only = False
        self._register_state_dict_hook(JointObjective._trainable_only)

    @staticmethod
    def _trainable_only(module, state, prefix, local_metadata):
        frozen = {prefix + n for n, p in module.named_parameters() if not p.requires_grad}
        for k in [k for k in state if k in frozen]:
            del state[k]
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        frozen = {n for n, p in self.named_parameters() if not p.requires_grad}
        real = [k for k in missing if k not in frozen]
        if strict and (real or unexpected):
            raise RuntimeError(f"checkpoint does not match the model: missing {real[:5]}, unexpected {unexpected[:5]}")
        from torch.nn.modules.module import _IncompatibleKeys

        return _IncompatibleKeys(real, unexpected)  # the frozen base is not in checkpoints, by design

    def forward(self, hidden, input_ids, loss_mask, attention_mask=None, base_weight=None):
        from .losses import head_loss

        c, lc = self.loss_cfg, self.lora_cfg
        with torch.no_grad() if self.heads_only else nullcontext():
            h = base_hidden(self.base, input_ids, attention_mask)  # the adapted base's final state [B, S, H]
        w = self.base.get_output_embeddings().weight
        heads = draft_losses(self.draft.train_hidden(h, input_ids, attention_mask), [lm.weight for lm in self.draft.lm_heads],
                             input_ids, loss_mask, base_hidden=h.detach(), base_weight=w if base_weight is not None else None,
                             head_decay=c.head_decay, distill_weight=c.distill_weight, chunk_size=c.chunk_size, topk=c.topk,
                             divergence=c.divergence)
        if self.heads_only:
            return heads
        sel = loss_mask[:, 1:].bool()  # the base predicts x_{t+1} at t
        if lc.self_distill:
            with torch.no_grad(), self.base.disable_adapter():
                teacher = base_hidden(self.base, input_ids, attention_mask)[:, :-1][sel]
        else:
            teacher = None
        own, _, _, _ = head_loss(h[:, :-1][sel], w, input_ids[:, 1:][sel], teacher, w, 1.0 if lc.self_distill else 0.0,
                                 c.chunk_size, c.topk, "fkl")
        base_loss = own / sel.sum().clamp(min=1)
        heads["base_loss"] = base_loss.detach()
        heads["loss"] = base_loss + lc.heads_weight * heads["loss"]
        return heads


def base_features(base, draft, input_ids, attention_mask=None) -> torch.Tensor:
    """What the draft trains on: the base's final hidden state [B, S, H], or for drafters that read several
    base layers (`draft.base_layers`) those layers' states and the final one, flattened to [B, S, (n+1) * H]."""
    layers = getattr(draft, "base_layers", None)
    if not layers:
        return base_hidden(base, input_ids, attention_mask)
    return base_states(base, input_ids, attention_mask, layers).flatten(2)


def micro_batch_indices(n: int, batch_size: int, epoch: int, seed: int, rank: int, world: int) -> list[list[int]]:
    """This rank's micro-batches of one epoch: a seeded permutation, cut evenly across ranks."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    per_rank = n // (batch_size * world)
    return [perm[(j * world + rank) * batch_size:(j * world + rank + 1) * batch_size] for j in range(per_rank)]


def _single_process_group_env() -> None:
    """One process without a launcher: DeepSpeed still wants a process group (of one)."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", str(port))})


@contextmanager
def outside_deepspeed(ds_plugin):
    """Build models whole: with a DeepSpeed plugin in place transformers' from_pretrained / from_config would
    partition them as ZeRO-3 parameters (zero.Init) on creation. The frozen base runs outside DeepSpeed's
    engine; a draft LM must exist whole to be checked and initialised from the base (the engine shards it)."""
    if ds_plugin is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if getattr(ds_plugin, "dschf", None) is not None:
            set_hf_deepspeed_config(ds_plugin.dschf)


def deepspeed_plugin(recipe: Recipe):
    """Accelerate's DeepSpeed plugin for the heads (ZeRO 2/3, optional CPU offload), or None for DDP."""
    d, t = recipe.distributed, recipe.train
    if d.strategy != "deepspeed":
        return None
    try:
        import deepspeed  # noqa: F401  (only checking that it is installed)
    except ImportError:
        raise RunDirError("distributed.strategy: deepspeed needs DeepSpeed: pip install -e '.[deepspeed]'") from None
    from accelerate.utils import DeepSpeedPlugin

    _warn_stale_build_locks()
    zero: dict = {"stage": d.zero_stage, "overlap_comm": True, "contiguous_gradients": True}
    if d.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if d.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": t.mixed_precision == "bf16"},
        "fp16": {"enabled": t.mixed_precision == "fp16"},
        "steps_per_print": 1 << 30,
    }
    return DeepSpeedPlugin(hf_ds_config=config)


def _warn_stale_build_locks(older_than_s: float = 600.0) -> None:
    """DeepSpeed JIT-builds its ops (on CPU its shared-memory communication op) under torch's extension folder,
    guarded by a `lock` file; a build that was killed leaves the file behind and every later load waits on it
    forever, without a word. Name such a lock so a hang has an explanation."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time()
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:  # ROOT/op/lock, or ROOT/py311_cpu/op/lock
        age = now - lock.stat().st_mtime
        if age > older_than_s:
            print(f"warning: {lock} is {age / 60:.0f} min old; if no other process is building this op, delete it "
                  "(a killed build leaves it, and DeepSpeed then waits on it forever)", file=sys.stderr)


def lr_lambda(warmup: int, total: int, final: float = 0.0):
    """Linear warmup then cosine decay to `final` (a fraction of the peak lr), as a multiplier of the peak lr."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, TypeError, ValueError):
        return 1 << 62  # a torn line from a killed process: dropped


def latest_checkpoint(output_dir: Path) -> Path | None:
    """Newest complete checkpoint (one whose trainer_state.json was written last, after the weights)."""
    ckpts = [p for p in (output_dir / "checkpoints").glob("step_*")
             if p.name[5:].isdigit() and (p / "trainer_state.json").is_file()]  # never a half-renamed step_N.tmp
    return max(ckpts, key=lambda p: int(p.name.split("_")[1]), default=None)


def prepare_run_dir(recipe: Recipe, overwrite: bool) -> Path:
    """Create output_dir, or check that the run there is this recipe's (resuming), or wipe it (overwrite)."""
    out = Path(recipe.output_dir)
    saved = out / "config.yaml"
    if saved.is_file() and not overwrite:
        previous = build_recipe(yaml.safe_load(saved.read_text()), source=str(saved))
        diffs = diff_recipes(previous, recipe, ignore=RESUMABLE_KEYS)
        if diffs:
            raise RunDirError(f"{out} holds a run made with a different recipe ({'; '.join(diffs)}). Use another "
                              "output_dir, or pass --overwrite to discard that run.")
    elif overwrite and out.exists():
        for sub in ("checkpoints", "export", "logs"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("metrics.jsonl", "config.yaml"):
            (out / f).unlink(missing_ok=True)
    return out


@torch.no_grad()
def evaluate(objective, base, examples, batch_size, pad_id, accelerator, base_weight, draft) -> dict:
    """Per-head loss, top-1 / top-k accuracy on the data tokens and top-1 agreement with the base (the draft's
    first choice equals the base's) on the held-out examples, sharded across ranks."""
    objective.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = examples[rank::world]
    sums = None
    # Every rank takes as many base forwards as rank 0 (which has the most examples): with a sharded base
    # each forward is a collective, and a rank that ran out joins it with a one-token stand-in.
    joint = isinstance(getattr(objective, "module", objective), JointObjective)  # it runs the (adapted) base itself
    for s in range(0, len(examples[0::world]), batch_size):
        if s >= len(mine):
            base_hidden(base, torch.ones(1, 1, dtype=torch.long, device=accelerator.device))
            continue
        b = {k: v.to(accelerator.device) for k, v in collate(mine[s:s + batch_size], pad_id).items()}
        h = None if joint else base_features(base, draft, b["input_ids"], b["attention_mask"])
        with accelerator.autocast():
            out = objective(h, b["input_ids"], b["loss_mask"], b["attention_mask"], base_weight)
        part = torch.stack([out["loss_sum"], out["count"], out["top1"], out["topk"], out["agree1"]])  # [5, K]
        sums = part if sums is None else sums + part
    objective.train()
    if sums is None:
        sums = torch.zeros(5, objective_num_heads(objective), device=accelerator.device)
    sums = accelerator.reduce(sums, reduction="sum")
    n = sums[1].clamp(min=1)
    return {"eval_loss": (sums[0] / n).tolist(), "top1": (sums[2] / n).tolist(), "topk": (sums[3] / n).tolist(),
            "agree1": (sums[4] / n).tolist(), "eval_positions": sums[1].tolist()}


def objective_num_heads(objective) -> int:
    return getattr(objective, "module", objective).draft.num_heads


def train(recipe: Recipe, overwrite: bool = False, stop_after_steps: int | None = None,
          example_subset: list[int] | None = None) -> dict:
    """Run (or resume) the recipe; returns a summary with the export path and final eval figures.

    stop_after_steps ends this invocation early (after saving a checkpoint) to simulate preemption.
    example_subset trains on those training examples only (a boost-tuning stage). A recipe with an
    `ensemble` section trains its members in stages (draftlab.boost).
    """
    if recipe.ensemble is not None and example_subset is None:
        from .boost import train_ensemble

        return train_ensemble(recipe, overwrite, stop_after_steps)
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    t = recipe.train
    out_dir = prepare_run_dir(recipe, overwrite)
    ds_plugin = deepspeed_plugin(recipe)
    if ds_plugin is not None:
        _single_process_group_env()
    accelerator = Accelerator(
        # Without CUDA, cpu=True is what makes Accelerate run several processes over gloo (DeepSpeed
        # brings its own CPU backend and must not be turned off by it).
        cpu=not torch.cuda.is_available() and recipe.distributed.strategy != "deepspeed",
        mixed_precision=t.mixed_precision, log_with=recipe.log.trackers or None, project_dir=str(out_dir / "logs"),
        # Medusa-2's warm-up leaves the adapter without gradients for a while.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=recipe.lora is not None)],
        deepspeed_plugin=ds_plugin,
    )
    use_deepspeed = ds_plugin is not None
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        # Every process would train alone and all would write the same run directory.
        raise RunDirError(
            f"launched {launched} processes but Accelerate runs {accelerator.num_processes}"
            + ("; Accelerate runs multi-process DeepSpeed on GPUs only, use distributed.strategy: ddp on CPU"
               if use_deepspeed and not torch.cuda.is_available() else ""))
    is_main = accelerator.is_main_process
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_recipe(recipe))
        (out_dir / "STOP").unlink(missing_ok=True)  # a stop request belongs to the run it stopped
    accelerator.wait_for_everyone()
    set_seed(t.seed)

    b = recipe.base
    world, rank = accelerator.num_processes, accelerator.process_index
    sharded = recipe.distributed.strategy == "fsdp" and world > 1
    if sharded:
        from .sharding import load_sharded_base

        base, tok = load_sharded_base(b, accelerator, keep_last_layer=bool(recipe.head.prefix_attention))
    else:  # (fsdp in a single process has nothing to shard over)
        with outside_deepspeed(ds_plugin):
            base, tok = load_base(b.name_or_path, b.dtype, accelerator.device, b.revision, b.trust_remote_code,
                                  b.attn_implementation)
    with accelerator.main_process_first():
        train_ex, eval_ex, stats = load_examples(recipe.data, tok, seed=t.seed)
    if example_subset is not None:
        train_ex = [train_ex[i] for i in example_subset]
        stats.train_examples, stats.train_tokens = len(train_ex), sum(len(e["input_ids"]) for e in train_ex)
        stats.loss_tokens = sum(sum(e["loss_mask"]) for e in train_ex)
    pad_id = tok.pad_token_id
    H = base.config.hidden_size
    with outside_deepspeed(ds_plugin):  # built whole (and checked, initialised from the base); ZeRO-3 shards it later
        draft = build_draft(recipe.head.model_dump(), base).float()
    if hasattr(draft, "fit_vocab"):  # EAGLE-3's draft vocabulary: the training data's most frequent tokens
        draft.fit_vocab(train_ex)
    if recipe.lora is not None:  # Medusa-2: a LoRA adapter on the base, trained with the heads
        from peft import LoraConfig, get_peft_model

        lc = recipe.lora
        base = get_peft_model(base, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                               target_modules=list(lc.target_modules), bias="none"))
        objective = JointObjective(draft, recipe.loss, base, lc)
    else:
        objective = DraftObjective(draft, recipe.loss)
    if use_deepspeed and recipe.distributed.zero_stage == 3:
        from deepspeed.runtime.zero import register_external_parameter

        # The chunked loss reads the heads' lm_head weights outside their own forward: ZeRO-3 must gather them.
        for lm in draft.lm_heads:
            register_external_parameter(objective, lm.weight)
    params = [p for p in objective.parameters() if p.requires_grad]
    groups = [{"params": [p for p in draft.parameters() if p.requires_grad]}]
    if recipe.lora is not None:
        groups.append({"params": [p for p in base.parameters() if p.requires_grad], "lr": recipe.lora.lr or t.lr / 4})
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)

    micro_per_epoch = len(train_ex) // (t.batch_size * world)
    if micro_per_epoch == 0:
        raise ValueError(f"data gives {len(train_ex)} training examples, fewer than one global batch "
                         f"(train.batch_size={t.batch_size} x {world} processes); lower train.batch_size")
    total_steps = t.max_steps or max(1, math.ceil(t.epochs * micro_per_epoch / t.grad_accum_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.warmup_steps, total_steps, t.final_lr_ratio))
    objective, optimizer = accelerator.prepare(objective, optimizer)
    # The scheduler is stepped by hand once per optimizer step; registering (not preparing) it
    # checkpoints it without Accelerate's per-process stepping.
    accelerator.register_for_checkpointing(scheduler)
    lm_weight = base.get_output_embeddings().weight  # the teacher's; evaluation always reports agreement with it
    base_weight = lm_weight if recipe.loss.distill_weight > 0 or getattr(draft, "needs_teacher", False) else None
    width = H * (len(getattr(draft, "base_layers", None) or ()) + 1)  # per-token features base_features returns
    cache = None
    if t.cache_hidden:
        from .hidden_cache import HiddenCache

        cache_dir = t.hidden_cache_dir or str(out_dir / "hidden_cache")
        dtype = next(base.parameters()).dtype
        with accelerator.main_process_first():  # the main process creates or validates the files first
            cache = HiddenCache(cache_dir, train_ex, width, dtype, b.name_or_path, create=is_main)

    step = 0
    ckpt = latest_checkpoint(out_dir)
    if ckpt is not None:
        accelerator.load_state(str(ckpt))
        step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
        if is_main:
            print(f"resuming from {ckpt} (step {step} of {total_steps})")
            # Records logged after that checkpoint (by a run killed later) are about to be redone.
            mf = out_dir / "metrics.jsonl"
            if mf.is_file():
                keep = [l for l in mf.read_text().splitlines() if l.strip() and _logged_step(l) <= step]
                mf.write_text("".join(l + "\n" for l in keep))

    if recipe.log.trackers:
        flat = {k: v for k, v in yaml.safe_load(dump_recipe(recipe)).items() if not isinstance(v, dict)}
        flat.update({f"{s}.{k}": v for s, sec in recipe.model_dump(mode="json").items() if isinstance(sec, dict)
                     for k, v in sec.items() if isinstance(v, (int, float, str, bool))})
        accelerator.init_trackers(recipe.log.project, config=flat,
                                  init_kwargs={"wandb": {"name": recipe.log.run_name or out_dir.name}})
    metrics_f = open(out_dir / "metrics.jsonl", "a") if is_main else None

    def log(record: dict) -> None:
        if is_main:
            metrics_f.write(json.dumps(record) + "\n")
            metrics_f.flush()
        scalars = {}
        for k, v in record.items():
            if isinstance(v, list):
                scalars.update({f"{k}/head{i}": x for i, x in enumerate(v)})
            elif isinstance(v, (int, float)) and k != "step":
                scalars[k] = v
        if recipe.log.trackers:
            accelerator.log(scalars, step=record["step"])

    if is_main and step == 0:
        log({"step": 0, "event": "start", "train_examples": stats.train_examples,
             "eval_examples": stats.eval_examples, "train_tokens": stats.train_tokens,
             "loss_tokens": stats.loss_tokens, "skipped": stats.skipped, "total_steps": total_steps,
             "processes": world, "base_params_local": round(local_fraction(base), 4)})

    def save_checkpoint(step: int) -> None:
        final = out_dir / "checkpoints" / f"step_{step}"
        tmp = final.with_name(final.name + ".tmp")
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if is_main:
            # trainer_state.json is written last: a directory without it is never taken as a checkpoint.
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "total_steps": total_steps}))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            done = sorted((p for p in final.parent.glob("step_*") if not p.name.endswith(".tmp")),
                          key=lambda p: int(p.name.split("_")[1]))
            for old in done[:-t.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()

    ga = t.grad_accum_steps
    objective.train()
    bar = progress(total=total_steps, initial=step, disable=not is_main, desc="train", unit="step")
    window = {"loss": 0.0, "tokens": 0, "t0": time.perf_counter(), "n": 0}
    last_eval = None
    end_step = total_steps if stop_after_steps is None else min(total_steps, step + stop_after_steps)
    stopper = StopRequest(out_dir, accelerator)
    stopped = False
    micro = step * ga
    batches_cache: dict[int, list] = {}
    while step < end_step:
        epoch, j = divmod(micro, micro_per_epoch)
        if epoch not in batches_cache:
            batches_cache = {epoch: micro_batch_indices(len(train_ex), t.batch_size, epoch, t.seed, rank, world)}
        idx = batches_cache[epoch][j]
        batch = collate([train_ex[i] for i in idx], pad_id)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        sync = (micro + 1) % ga == 0
        hidden = cache.get(idx, batch["input_ids"].shape[1], accelerator.device) if cache else None
        if recipe.lora is not None:  # the joint objective runs the (adapted) base itself
            accelerator.unwrap_model(objective).heads_only = step < recipe.lora.heads_warmup_steps
        # A sharded base's forward is a collective: if any rank missed the cache, every rank runs it.
        elif any_rank(hidden is None, accelerator) if sharded else hidden is None:
            with torch.no_grad():
                hidden = base_features(base, draft, batch["input_ids"], batch["attention_mask"])  # [B, S, H or (n+1)H]
            if cache:
                cache.put(idx, hidden)
        with nullcontext() if sync else accelerator.no_sync(objective):
            with accelerator.autocast():
                out = objective(hidden, batch["input_ids"], batch["loss_mask"], batch["attention_mask"], base_weight)
            # DeepSpeed's engine divides by its gradient_accumulation_steps itself.
            accelerator.backward(out["loss"] if use_deepspeed else out["loss"] / ga)
        window["loss"] += out["loss"].item() / ga
        window["tokens"] += int(batch["attention_mask"].sum()) * world
        micro += 1
        if not sync:
            continue
        grad_norm = accelerator.clip_grad_norm_(params, t.max_grad_norm) if t.max_grad_norm > 0 else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window["n"] += 1
        bar.update(1)
        if step % t.log_every_steps == 0 or step == end_step:
            dt = time.perf_counter() - window["t0"]
            n = out["count"].clamp(min=1)
            rec = {"step": step, "epoch": round(micro / micro_per_epoch, 3), "loss": window["loss"] / window["n"],
                   "lr": scheduler.get_last_lr()[0],
                   "tokens_per_s": window["tokens"] / dt, "train_top1": (out["top1"] / n).tolist()}
            if grad_norm is not None:
                rec["grad_norm"] = float(grad_norm)
            if "base_loss" in out:
                rec["base_loss"] = float(out["base_loss"])
            if accelerator.device.type == "cuda":  # peak so far on this rank: what batch size / max_len cost
                rec["gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(accelerator.device) / 2**30, 2)
            log(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            window = {"loss": 0.0, "tokens": 0, "t0": time.perf_counter(), "n": 0}
        if eval_ex and (step % t.eval_every_steps == 0 or step == total_steps):
            last_eval = evaluate(objective, base, eval_ex, t.batch_size, pad_id, accelerator, lm_weight, draft)
            log({"step": step, "event": "eval", **last_eval})
        stopped = step < end_step and stopper.requested()
        if step % t.save_every_steps == 0 or step == end_step or stopped:
            save_checkpoint(step)
        if stopped:
            log({"step": step, "event": "stopped", "reason": "stop requested (signal or STOP file)"})
            if is_main:
                print(f"\nstop requested: checkpoint saved at step {step}; run the same command to resume")
            break
    bar.close()
    stopper.close()

    summary = {"step": step, "total_steps": total_steps, "output_dir": str(out_dir), "finished": step >= total_steps,
               "stopped": stopped}
    if step >= total_steps:
        if last_eval is None and eval_ex:
            last_eval = evaluate(objective, base, eval_ex, t.batch_size, pad_id, accelerator, lm_weight, draft)
        if is_main:
            export = save_export(accelerator.unwrap_model(objective).draft, base, out_dir / "export", b.name_or_path,
                                 extra={"training": {"steps": step, "recipe": recipe.model_dump(mode="json"),
                                                     "eval": last_eval}}, tokenizer=tok,
                                 adapter=base if recipe.lora is not None else None)
            summary["export"] = str(export)
        summary["eval"] = last_eval
        if is_main and last_eval:
            log({"step": step, "event": "end", **last_eval})
    if metrics_f:
        metrics_f.close()
    accelerator.wait_for_everyone()
    if recipe.log.trackers:
        accelerator.end_training()
    return summary
