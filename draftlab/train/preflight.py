"""What `validate` can check of a recipe against its base without loading the base's weights: the base's config
(config.json only) and the draft built on a meta-device copy of the base (shapes, no memory), so settings that
`train` would refuse only after loading the base (an SSM width its head count does not divide, a truncate init
deeper than the base, DFlash or EAGLE-3 layer ids past its depth, LoRA target modules it lacks) are named first."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..base import looks_like_path
from ..config import Recipe
from ..drafters import build_draft
from .loop import check_teacher, lora_problems, over_context, unserved_eagle3_target


def base_problems(recipe: Recipe) -> tuple[list[str], list[str]]:
    """(problems train would refuse, notes) for the recipe against its base's config; a base whose config cannot
    be read here gives one note and no problems (train checks the rest when it loads the base)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    b = recipe.base
    local = Path(b.name_or_path).expanduser().is_dir()
    try:  # (the directory or the hub cache only: online without a network the hub client took half a minute)
        config = AutoConfig.from_pretrained(b.name_or_path, revision=b.revision, trust_remote_code=b.trust_remote_code,
                                            local_files_only=True)
    except (OSError, ValueError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = (f"its config.json cannot be read ({why})" if local else
                 "no such directory" if looks_like_path(b.name_or_path) else
                 "not in the hub cache (validate reads no network)")
        return [], [f"the base's config is not readable here ({b.name_or_path}: {where}); the settings that depend on "
                    "the base (the draft's shape and layer ids, the teacher's logits) are checked when train loads it"]
    problems, notes = [], []
    try:
        check_teacher(recipe, config)
    except ValueError as e:
        problems.append(str(e))
    unserved = unserved_eagle3_target(recipe, config)
    if unserved:
        notes.append(unserved)
    longer = over_context(recipe, config)
    if longer:
        notes.append(longer)
    try:
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config, trust_remote_code=b.trust_remote_code)
    except Exception as e:  # (a config whose model cannot be built on the meta device: train will say)
        return problems, notes + [f"the base's shape could not be built from its config ({type(e).__name__}: {e}); "
                                  "the draft's settings are checked when train loads the base"]
    for where, head in heads_to_build(recipe):
        if head["type"] == "ssm" and head["ssm"].get("name_or_path"):
            continue  # (a pretrained SSM keeps its own shape; loading it is train's)
        with warnings.catch_warnings(record=True) as said, torch.device("meta"):
            warnings.simplefilter("always")
            try:
                build_draft(head, base)
            except ValueError as e:
                problems.append(f"{where}{e}")
            except Exception as e:  # (a base whose config lacks what the kind reads: a traceback before, as in train)
                notes.append(f"{where}the {head['type']} draft could not be built on this base's shape "
                             f"({type(e).__name__}: {e}); train builds it the same way and would stop there")
        notes += [f"{where}{w.message}" for w in said if issubclass(w.category, UserWarning)]
    if recipe.lora is not None:
        refused, said = lora_problems(recipe, base)
        problems, notes = problems + refused, notes + said
    return problems, notes


def heads_to_build(recipe: Recipe) -> list[tuple[str, dict]]:
    """(prefix for messages, head section) of each draft the recipe trains: an ensemble's members as their stages
    train them (boost.stage_recipe), else the one head."""
    if recipe.ensemble is None:
        return [("", recipe.head.model_dump())]
    from .boost import stage_recipe

    return [(f"ensemble member {i + 1}: ", stage_recipe(recipe, i).head.model_dump())
            for i in range(recipe.ensemble.members)]
