"""`draftlab recipes list` and `draftlab recipes copy NAME [DEST]`: the recipes that ship with draftlab."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..shipped import CHECKOUT, recipe_names, recipe_path, recipe_summary, recipes_dir

# Recipe values that name a local file or folder (the rest are hub ids, settings or outputs).
LOCAL_KEYS = (("base", "name_or_path"), ("data", "path"), ("head", "ssm", "name_or_path"))


def add_recipes_args(sub) -> None:
    s = sub.add_parser("list", help="the shipped recipes, one line each")
    s.add_argument("--json", action="store_true", help="print [{name, path, summary}] as one JSON line")
    c = sub.add_parser("copy", help="copy a shipped recipe to edit and run",
                       description="Copy a shipped recipe (see `draftlab recipes list`) to DEST: a file, or a folder "
                                   "to copy it into (default: the current folder). The recipe's first lines are the "
                                   "commands that run it; its paths are relative to where you run them.")
    c.add_argument("name", help="recipe name, e.g. stories260k-medusa")
    c.add_argument("dest", nargs="?", default=".", help="file or folder (default: .)")
    c.add_argument("--force", action="store_true", help="overwrite DEST if it exists")


def _shipped_data(value: str) -> str:
    """Where a recipe's data/... path is: the checkout's data/ holds the repository's files (a wheel has none)."""
    if not (CHECKOUT / "data").is_dir():
        return "shipped in draftlab's repository under data/, not with the installed package"
    if (CHECKOUT / value).exists():
        return f"shipped in draftlab's repository under data/: {CHECKOUT / value}"
    return "your own: draftlab's data/ has no such file either"


def missing_paths(recipe: Path | dict, cwd: Path) -> list[str]:
    """Local paths the recipe (a file, or its sections as a dict) reads (base.name_or_path, data.path,
    head.ssm.name_or_path) that do not exist relative to cwd."""
    import yaml

    raw = recipe if isinstance(recipe, dict) else yaml.safe_load(recipe.read_text()) or {}
    out = []
    for keys in LOCAL_KEYS:
        value = raw
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        if not isinstance(value, str):
            continue
        local = value.startswith(("/", "./", "../", "~")) or value.split("/", 1)[0] in ("data", "runs") or \
            value.endswith((".json", ".jsonl", ".txt"))
        if local and not (cwd / Path(value).expanduser()).exists():
            first = value.split("/", 1)[0]
            where = ("made by the commands at the top of the recipe" if first == "runs" and keys[0] == "base" else
                     _shipped_data(value) if first == "data" else "your own")
            out.append(f"{'.'.join(keys)} = {value} ({where})")
    return out


def recipes_command(a) -> int:
    if a.recipes_cmd == "list":
        rows = [{"name": n, "path": str(recipe_path(n)), "summary": recipe_summary(recipe_path(n))}
                for n in recipe_names()]
        if a.json:
            print(json.dumps(rows), flush=True)
            return 0
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            s = r["summary"]
            print(f"{r['name']:<{width}}  {s if len(s) <= 100 else s[:99] + '…'}")
        print(f"\n({len(rows)} recipes in {recipes_dir()}; `draftlab recipes copy NAME` copies one here)")
        return 0
    src = recipe_path(a.name)
    dest = Path(a.dest)
    if dest.is_dir() or a.dest.endswith(("/", os.sep)):  # (a new folder named with its slash: walk-through)
        dest = dest / src.name
    if dest.exists() and not a.force:
        raise ValueError(f"{dest} exists; pass --force to overwrite it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    print(f"wrote {dest}")
    for m in missing_paths(dest, Path.cwd()):
        print(f"note: not here (paths are relative to where you run draftlab): {m}")
    return 0
