"""The docs: figure tables agree with benchmarks/results/*.json, links resolve, set-up matches CI (no torch)."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _tables():
    spec = importlib.util.spec_from_file_location("draftlab_doc_tables", ROOT / "benchmarks" / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (where brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"`([^`]*)`", r"\1", m[1])
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = "".join(c for c in title.lower() if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return out


def test_tables_agree_with_results():
    problems = _tables().run(write=False)
    assert not problems, "\n".join(problems)


def test_tables_check_catches_a_changed_figure(tmp_path, monkeypatch):
    tables = _tables()
    doc = tmp_path / "benchmarks.md"
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    m = re.search(r"(<!-- tables:begin decode -->\n.*?\| )(\d+\.\d+)( \|)", text, re.S)
    assert m, "docs/benchmarks.md has no decode table"
    doc.write_text(text[: m.start(2)] + "9" + m[2] + text[m.end(2):])
    monkeypatch.setattr(tables, "DOCS", [doc])
    monkeypatch.setattr(tables, "BENCHMARKS_DOC", tmp_path / "absent.md")  # --write appends nothing elsewhere
    problems = tables.run(write=False)
    assert any("disagree" in p for p in problems), problems
    tables.run(write=True)
    assert doc.read_text() == text


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(f"{target}: no heading `#{anchor}` in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_docs_do_not_point_outside_the_repository():
    hits = [f"{d.relative_to(ROOT)}:{i}" for d in DOCS for i, line in enumerate(d.read_text().splitlines(), 1)
            if "../shared" in line]
    assert not hits, f"paths outside the repository (use data/...): {hits}"


def command_options(parser, name: str = ""):
    """(command, option) for every long option of every (sub)command of the parser."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from command_options(p, f"{name} {sub}".strip())
        else:
            yield from ((name, o) for o in action.option_strings if o.startswith("--") and o != "--help")


def test_every_command_option_is_documented():
    """Each option of each command is named in the docs (a review found 16, e.g. `simulate --tokens`, `generate
    --chat`, `distill-data --timeout`, in no page)."""
    from draftlab.cli import build_parser

    text = "\n".join(d.read_text() for d in DOCS)
    missing = [f"{c} {o}" for c, o in command_options(build_parser()) if not re.search(re.escape(o) + r"(?![\w-])", text)]
    assert not missing, f"options no page of the docs names: {missing}"


def test_the_recipe_key_table_is_the_schemas():
    """docs/recipes.md's table of every key is the schema's own (eight keys, e.g. base.revision, data.max_records and
    log.run_name, were in no page, and train.final_lr_ratio and head.dropout not in the recipe page)."""
    from draftlab.config import key_reference

    text = (ROOT / "docs" / "recipes.md").read_text()
    table = text.split("<!-- keys:begin -->\n", 1)[1].split("\n<!-- keys:end -->", 1)[0]
    assert table == key_reference(), "docs/recipes.md's key table is stale: `python -m draftlab.config` prints it"
    assert "| `train.final_lr_ratio` | `0.0` |" in table and "| `output_dir` | `required` |" in table


def test_readme_setup_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert len(blocks) == 2, "the README's Set-up has two commands"
    installs = [part.strip() for part in blocks[1].strip().split("&&") if part.strip().startswith("pip install")]
    assert installs and all(i in ci for i in installs), f"{installs} not in .ci/run"
