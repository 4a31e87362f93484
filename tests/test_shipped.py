"""What ships besides code: the recipes and the MT-Bench questions, in a checkout and as an installed package."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from draftlab.cli import main
from draftlab.shipped import mt_bench_questions, recipe_names, recipe_path, recipes_dir

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
NAMES = sorted(p.stem for p in RECIPES)


def _setup_module():
    spec = importlib.util.spec_from_file_location("draftlab_setup", REPO / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # __name__ is not __main__: defines shipped_files() without building
    return mod


def test_a_checkout_serves_its_own_recipes_and_questions():
    assert recipes_dir() == REPO / "recipes" and recipe_names() == NAMES
    assert mt_bench_questions() == REPO / "data" / "mt_bench" / "question.jsonl"
    assert recipe_path("stories260k-medusa.yaml") == recipe_path("stories260k-medusa") == REPO / "recipes" / \
        "stories260k-medusa.yaml"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipes_read_only_files_inside_the_repository(path):
    """Every data/... path a recipe names (in its keys or its header commands) is in the repository."""
    text = path.read_text()
    raw = yaml.safe_load(text)
    named = set(re.findall(r"(?<![\w/.])data/[\w./+-]+", text))
    named |= {v for v in [(raw.get("data") or {}).get("path"), (raw.get("base") or {}).get("name_or_path")]
              if isinstance(v, str) and v.startswith("data/")}
    assert "../shared" not in text
    assert all((REPO / p).exists() for p in named if not p.startswith("data/ShareGPT")), named


def test_recipes_list_and_copy(tmp_path, capsys, monkeypatch):
    assert main(["recipes", "list"]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^{re.escape(p.stem)}  ", out, re.M) for p in RECIPES)
    assert "stories260k-medusa" in out and "Medusa heads on the 260K-parameter TinyStories Llama" in out
    assert main(["recipes", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["name"] for r in rows] == NAMES and all(r["summary"] for r in rows)

    monkeypatch.chdir(tmp_path)  # a folder without the repository's data/ and runs/
    assert main(["recipes", "copy", "stories260k-medusa"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "stories260k-medusa.yaml").read_bytes() == (REPO / "recipes" / "stories260k-medusa.yaml").read_bytes()
    assert "wrote stories260k-medusa.yaml" in out
    assert "base.name_or_path = runs/stories260k-base (made by the commands at the top of the recipe)" in out
    assert ("data.path = data/tinystories/tinystories_sample.txt (shipped in draftlab's repository under data/: "
            f"{REPO / 'data/tinystories/tinystories_sample.txt'})") in out
    # a mistyped data/ path is not said to ship with draftlab (walk-through)
    assert main(["validate", "stories260k-medusa.yaml", "data.path=data/nope.txt"]) == 0
    assert "data.path = data/nope.txt (your own: draftlab's data/ has no such file either)" in capsys.readouterr().err
    assert main(["recipes", "copy", "stories260k-medusa"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["recipes", "copy", "stories260k-medusa", "--force"]) == 0
    assert main(["recipes", "copy", "vicuna7b-hydra", "sub/mine.yaml"]) == 0
    assert (tmp_path / "sub" / "mine.yaml").read_text() == (REPO / "recipes" / "vicuna7b-hydra.yaml").read_text()
    assert main(["recipes", "copy", "vicuna7b-hydra", "new/"]) == 0  # a folder to make (it wrote a file `new`)
    assert (tmp_path / "new" / "vicuna7b-hydra.yaml").is_file()
    capsys.readouterr()
    assert main(["recipes", "copy", "stories260k-medusa3"]) == 2
    assert "no shipped recipe 'stories260k-medusa3'; did you mean 'stories260k-medusa'?" in capsys.readouterr().err


def test_the_wheel_layout_serves_the_packaged_copies(tmp_path):
    """The package as setup.py lays it out in a wheel (code + copied recipes and questions), imported from
    outside any checkout, finds its own copies."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "draftlab", site / "draftlab", ignore=shutil.ignore_patterns("__pycache__"))
    for src, rel in _setup_module().shipped_files():
        dest = site / "draftlab" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    code = ("import json; from draftlab import shipped as s; "
            "print(json.dumps([str(s.recipes_dir()), s.recipe_names(), str(s.mt_bench_questions())]))")
    env = {**os.environ, "PYTHONPATH": str(site)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    rdir, names, questions = json.loads(p.stdout)
    assert rdir == str(site / "draftlab" / "recipes") and names == NAMES
    assert questions == str(site / "draftlab" / "questions" / "mt_bench.jsonl")
    assert (site / "draftlab" / "questions" / "mt_bench.jsonl").read_bytes() == mt_bench_questions().read_bytes()


@pytest.mark.slow
def test_the_built_wheel_carries_the_recipes_and_questions(tmp_path):
    """pip builds the wheel through setup.py's hook; installed on its own it lists and copies recipes."""
    import zipfile

    build = tmp_path / "src"
    shutil.copytree(REPO, build, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info",
                                                             "__pycache__", "benchmarks"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "whl"), str(build)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    wheel, = (tmp_path / "whl").glob("draftlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"draftlab/recipes/{r.name}" for r in RECIPES} <= names
    assert {"draftlab/questions/mt_bench.jsonl", "draftlab/questions/SOURCE.md", "draftlab/shipped.py"} <= names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    p = subprocess.run([sys.executable, "-m", "draftlab.cli", "recipes", "copy", "stories260k-hydra"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "stories260k-hydra.yaml").read_bytes() == (REPO / "recipes" / "stories260k-hydra.yaml").read_bytes()
