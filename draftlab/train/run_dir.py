"""A run's directory: its recipe, checkpoints (written atomically, the newest few kept), resuming, metrics.jsonl,
and polite stop requests (signals or a STOP file)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import yaml

from ..config import RESUMABLE_KEYS, Recipe, build_recipe, diff_recipes, unread_settings
from ..data import rewrite_lines


class RunDirError(ValueError):
    """output_dir holds a different run; says what differs and how to proceed."""


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, TypeError, ValueError):
        return 1 << 62  # a torn line from a killed process: dropped


def resume_records(path: Path, fix: bool = True) -> list[dict]:
    """The JSON records of a file written a line at a time (metrics, distilled data), for a run that resumes it: a
    line a killed process tore (its last, unfinished write) is passed over and, with `fix` (the one process that
    writes the file), dropped from it, so that the next record appended does not join it, and said on stderr."""
    if not path.is_file():
        return []
    records, torn = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    if torn and fix:
        rewrite_lines(path, [json.dumps(r) for r in records])
        print(f"draftlab: {path}: dropped {torn} unfinished line(s) a killed run left", file=sys.stderr)
    return records


def latest_checkpoint(output_dir: Path) -> Path | None:
    """Newest complete checkpoint (one whose trainer_state.json was written last, after the weights)."""
    ckpts = [p for p in (output_dir / "checkpoints").glob("step_*")
             if p.name[5:].isdigit() and (p / "trainer_state.json").is_file()]  # never a half-renamed step_N.tmp
    return max(ckpts, key=lambda p: int(p.name.split("_")[1]), default=None)


def run_finished(output_dir: Path) -> bool:
    """Whether the run in output_dir has finished: its export is there and no checkpoint is newer than it (a run
    that trained on past an earlier finish, a larger train.max_steps or epochs, and stopped, has not). An ensemble's
    export is written after its last stage: there, the export alone. What slurm/train.sbatch asks before it
    requeues a stopped job (`python -m draftlab.train.finished OUTPUT_DIR`: exit status 0 when finished)."""
    meta = Path(output_dir) / "export" / "draftlab.json"
    if not meta.is_file():
        return False
    steps = json.loads(meta.read_text()).get("training", {}).get("steps")
    newest = latest_checkpoint(Path(output_dir))
    return steps is None or newest is None or steps >= int(newest.name.split("_")[1])


def prepare_run_dir(recipe: Recipe, overwrite: bool) -> Path:
    """Create output_dir, or check that the run there is this recipe's (resuming), or wipe it (overwrite: the
    launch's first process alone, RANK 0; every process calls this before the process group exists, and a late one
    would delete what the first had written since)."""
    out = Path(recipe.output_dir)
    saved = out / "config.yaml"
    # A run that stopped before it trained anything (a wrong data.path, say) leaves its config.yaml and nothing to
    # resume: the fixed recipe starts there rather than being refused as another run.
    trained = latest_checkpoint(out) is not None or (out / "export").exists() or (out / "stages").exists()
    if saved.is_file() and not overwrite and trained:
        raw = yaml.safe_load(saved.read_text())
        # A config.yaml written before unread settings were refused may hold one other than its default: dropped
        # (it was never read), else the run could not resume.
        head = raw.get("head") if isinstance(raw, dict) else None
        for key in unread_settings(head.get("type", "medusa") if isinstance(head, dict) else "medusa"):
            section, f = key.split(".")
            if isinstance(raw.get(section), dict):
                raw[section].pop(f, None)
        previous = build_recipe(raw, source=str(saved))
        diffs = diff_recipes(previous, recipe, ignore=RESUMABLE_KEYS)
        if diffs:
            raise RunDirError(f"{out} holds a run made with a different recipe ({'; '.join(diffs)}). Use another "
                              "output_dir, or pass --overwrite to discard that run.")
    elif overwrite and out.exists() and os.environ.get("RANK", "0") == "0":
        for sub in ("checkpoints", "export", "logs"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("metrics.jsonl", "config.yaml"):
            (out / f).unlink(missing_ok=True)
    return out


def write_run_config(out_dir: Path, recipe: Recipe) -> None:
    """The resolved recipe goes to config.yaml (what a resume is checked against); a STOP file left from an earlier
    invocation belongs to the run it stopped."""
    from ..config import dump_recipe

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "config.yaml.tmp"  # whole or not at all: the other processes read it to check a resume
    tmp.write_text(dump_recipe(recipe))
    os.replace(tmp, out_dir / "config.yaml")
    (out_dir / "STOP").unlink(missing_ok=True)


def forget_metrics_after(out_dir: Path, step: int) -> None:
    """Records logged after the checkpoint a run resumes from (by a run killed later) are about to be redone."""
    mf = out_dir / "metrics.jsonl"
    if mf.is_file():
        rewrite_lines(mf, [l for l in mf.read_text().splitlines() if l.strip() and _logged_step(l) <= step])


def save_checkpoint(accelerator, out_dir: Path, step: int, total_steps: int, keep: int) -> None:
    """Accelerate's state for this step in checkpoints/step_N, written to a .tmp folder and renamed when complete;
    only the newest `keep` checkpoints stay. Every rank calls it (the state save is collective)."""
    is_main = accelerator.is_main_process
    final = out_dir / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if is_main:
        # trainer_state.json is written last: a directory without it is never taken as a checkpoint.
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "total_steps": total_steps,
                                                            "processes": accelerator.num_processes,
                                                            "rank_streams": True}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted((p for p in final.parent.glob("step_*") if not p.name.endswith(".tmp")),
                      key=lambda p: int(p.name.split("_")[1]))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def resume_step(accelerator, out_dir: Path, total_steps: int, reseed=None) -> int:
    """Load the newest complete checkpoint, if any, into the prepared objects; the step it was saved at (0 if none:
    the records a run killed before its first checkpoint logged are dropped, as it starts again). A checkpoint made
    with another number of processes is refused: the data order, the steps per epoch and the schedule follow it.
    reseed(step): called on ranks above 0 after loading a multi-process checkpoint saved before each rank had its
    own random stream (no `rank_streams` in trainer_state.json), whose ranks' generators are all the same state."""
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        if accelerator.is_main_process:
            forget_metrics_after(out_dir, -1)
        return 0
    state = json.loads((ckpt / "trainer_state.json").read_text())
    made = state.get("processes")  # (checkpoints before 2026-11-30 do not say)
    if made is not None and made != accelerator.num_processes:
        raise RunDirError(f"{ckpt} was saved by a run of {made} processes, and this one has "
                          f"{accelerator.num_processes}: each process's share of the data, the steps per epoch and "
                          f"the learning-rate schedule follow the number of processes, so resuming would not "
                          f"continue that run. Resume it with {made} processes, or start again in another "
                          "output_dir (or with --overwrite).")
    if state["step"] > total_steps:  # (the overrides it was started with, left out: the run "finished" at once)
        raise RunDirError(f"{ckpt} was saved at step {state['step']} of {state.get('total_steps', '?')}, past the "
                          f"{total_steps} steps this recipe trains (train.max_steps / train.epochs): give the overrides "
                          "the run was started with again (`draftlab train RECIPE key=value ...`), or a larger "
                          "train.max_steps to train on; --overwrite starts again")
    accelerator.load_state(str(ckpt))
    step = state["step"]
    shared = accelerator.num_processes > 1 and not state.get("rank_streams") and reseed is not None
    if shared and accelerator.process_index:
        reseed(step)
    if accelerator.is_main_process:
        print(f"resuming from {ckpt} (step {step} of {total_steps})" + (
            "; it was saved before each process drew from its own random stream, so the processes above the first "
            "are given theirs now" if shared else ""))
        forget_metrics_after(out_dir, step)
    return step


class Metrics:
    """metrics.jsonl (main process) and the recipe's trackers (TensorBoard, wandb): one record per call."""

    def __init__(self, recipe: Recipe, out_dir: Path, accelerator):
        self.accelerator, self.trackers = accelerator, bool(recipe.log.trackers)
        if self.trackers:
            from ..config import dump_recipe

            flat = {k: v for k, v in yaml.safe_load(dump_recipe(recipe)).items() if not isinstance(v, dict)}
            flat.update({f"{s}.{k}": v for s, sec in recipe.model_dump(mode="json").items() if isinstance(sec, dict)
                         for k, v in sec.items() if isinstance(v, (int, float, str, bool))})
            accelerator.init_trackers(recipe.log.project, config=flat,
                                      init_kwargs={"wandb": {"name": recipe.log.run_name or out_dir.name}})
        self.file = open(out_dir / "metrics.jsonl", "a") if accelerator.is_main_process else None

    def log(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.trackers:  # lists (per head) become one scalar per head
            scalars = {}
            for k, v in record.items():
                if isinstance(v, list):
                    scalars.update({f"{k}/head{i}": x for i, x in enumerate(v)})
                elif isinstance(v, (int, float)) and k != "step":
                    scalars[k] = v
            self.accelerator.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        self.accelerator.wait_for_everyone()
        if self.trackers:
            self.accelerator.end_training()
