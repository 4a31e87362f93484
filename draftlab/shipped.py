"""Files draftlab ships besides code: the recipes and the MT-Bench questions.

Their one source is the repository (recipes/*.yaml, data/mt_bench/question.jsonl). A wheel carries copies made
when it is built (setup.py) as package data, draftlab/recipes/ and draftlab/questions/, so an installed draftlab
finds them without a checkout; a checkout (or an editable install) has no such copies and reads the repository's.
"""

from __future__ import annotations

import difflib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent


class ShippedFileError(FileNotFoundError):
    """A shipped recipe or data file that is not there (a broken install or an unknown name)."""


def _first(*candidates: Path) -> Path | None:
    return next((c for c in candidates if c.exists()), None)


def recipes_dir() -> Path:
    """The folder of the shipped recipes: the installed package's copy, else the checkout's recipes/."""
    found = _first(PACKAGE / "recipes", CHECKOUT / "recipes")
    if found is None or not any(found.glob("*.yaml")):
        raise ShippedFileError(f"no shipped recipes in {PACKAGE / 'recipes'} or {CHECKOUT / 'recipes'}: "
                               "reinstall draftlab (pip install draftlab) or run from a checkout")
    return found


def recipe_names() -> list[str]:
    """Names of the shipped recipes (file names without .yaml), sorted."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The shipped recipe called name (with or without .yaml); an unknown name lists the known ones."""
    stem = name[:-5] if name.endswith(".yaml") else name
    names = recipe_names()
    if stem not in names:
        close = difflib.get_close_matches(stem, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ShippedFileError(f"no shipped recipe {name!r}; {hint}the shipped recipes are: {', '.join(names)}")
    return recipes_dir() / f"{stem}.yaml"


def recipe_summary(path: Path) -> str:
    """The first sentence of a recipe's description (the comment paragraph after its launch commands)."""
    prose = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if text.startswith(("draftlab ", "accelerate ", "torchrun ", "sbatch ", "python ")):
            continue  # a launch command
        if not text:
            if prose:
                break
            continue
        prose.append(text)
    sentence = " ".join(prose).split(". ")[0].rstrip(".")
    return sentence + "." if sentence else ""


def mt_bench_questions() -> Path:
    """FastChat's 80 MT-Bench questions (data/mt_bench/question.jsonl; SOURCE.md beside it gives origin and
    license), the default of `draftlab eval mt-bench`."""
    found = _first(PACKAGE / "questions" / "mt_bench.jsonl", CHECKOUT / "data" / "mt_bench" / "question.jsonl")
    if found is None:
        raise ShippedFileError(f"the MT-Bench questions are not in {PACKAGE / 'questions'} or "
                               f"{CHECKOUT / 'data' / 'mt_bench'}: reinstall draftlab or give --questions FILE")
    return found
