"""Build hook; the project's configuration is in pyproject.toml.

A wheel carries the shipped recipes and the MT-Bench questions as package data (draftlab/recipes/*.yaml,
draftlab/questions/mt_bench.jsonl), so an installed draftlab finds them without a checkout (draftlab/shipped.py).
Their one source stays in the repository, recipes/ and data/mt_bench/, where the docs, tests and Slurm scripts
name them: build_py copies them into the package when a wheel is built. Second copies kept under draftlab/ would
drift, and a symlink does not survive in a wheel. An editable install reads them from the checkout instead.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def shipped_files() -> list[tuple[Path, str]]:
    """(file in the repository, its path inside the draftlab package) for every non-code file the wheel carries."""
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    if not recipes:
        raise FileNotFoundError(f"no recipes in {ROOT / 'recipes'}: build from a checkout or an sdist (MANIFEST.in)")
    files = [(p, f"recipes/{p.name}") for p in recipes]
    files += [(ROOT / "data" / "mt_bench" / "question.jsonl", "questions/mt_bench.jsonl"),
              (ROOT / "data" / "mt_bench" / "SOURCE.md", "questions/SOURCE.md")]
    for src, _ in files:
        if not src.is_file():
            raise FileNotFoundError(f"{src} is missing: build from a checkout or an sdist (MANIFEST.in)")
    return files


class BuildPyWithShippedFiles(build_py):
    """build_py, then the shipped recipes and questions copied into the built package."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # draftlab/shipped.py finds them in the checkout
        for src, rel in shipped_files():
            dest = Path(self.build_lib) / "draftlab" / rel
            self.mkpath(str(dest.parent))
            self.copy_file(str(src), str(dest), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs += [str(Path(self.build_lib) / "draftlab" / rel) for _, rel in shipped_files()]
        return outputs


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import shipped_files() from it
    setup(cmdclass={"build_py": BuildPyWithShippedFiles})
