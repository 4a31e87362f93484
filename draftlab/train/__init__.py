"""Training: a recipe in, an export out.

    loop.py          the one Accelerate loop, as its phases (start, load, optimizer, resume, steps, export)
    objectives.py    the draft and its loss as one module, Medusa-2's joint objective, held-out evaluation
    run_dir.py       the run directory: recipe, checkpoints, resume, metrics.jsonl
    finished.py      `python -m draftlab.train.finished OUTPUT_DIR`: has the run finished? (Slurm's requeue)
    preflight.py     what `validate` checks against the base's config (the draft on a meta-device base)
    distributed.py   DeepSpeed's plugin and what ranks agree on (flags, stop requests)
    boost.py         boost-tuning: an ensemble's members trained in stages on what the others miss
    distill.py       self-distilled data: the base's own answers to the data's prompts
    hidden_cache.py  the base's features per example, computed once
    sharding.py      FSDP for the frozen base
"""

from __future__ import annotations

from ..config import Recipe
from .run_dir import RunDirError  # noqa: F401 (raised by train)


def train(recipe: Recipe, overwrite: bool = False, stop_after_steps: int | None = None) -> dict:
    """Run (or resume) the recipe; a summary with the export path and the final eval figures. A recipe with an
    `ensemble` section trains its members in stages (boost.py); any other trains one draft (loop.py).
    stop_after_steps ends this invocation early, after saving a checkpoint (a stand-in for preemption)."""
    if recipe.base.chat_template:  # a template that cannot be read is refused before a run directory is made
        from ..base import chat_template_text

        chat_template_text(recipe.base.chat_template)
    if recipe.ensemble is not None:
        from .boost import train_ensemble

        return train_ensemble(recipe, overwrite, stop_after_steps)
    from .loop import train_draft

    return train_draft(recipe, overwrite, stop_after_steps)
