"""data/: every file is the one its SOURCE.md describes, and draftlab's readers take each of them."""

import hashlib
import json

from conftest import DATA
from draftlab.data import detect_format, read_records, to_messages
from draftlab.eval.mt_bench import load_questions

FILES = sorted(p for p in DATA.rglob("*") if p.is_file() and p.suffix != ".md")


def _source_of(path):
    """The SOURCE.md of the file's folder or the nearest folder above it inside data/."""
    for d in path.parents:
        if (d / "SOURCE.md").is_file():
            return d / "SOURCE.md"
        if d == DATA:
            return None


def test_every_file_is_listed_with_its_sha256_and_license():
    assert FILES, "data/ is empty"
    bad = []
    for f in FILES:
        src = _source_of(f)
        text = src.read_text() if src else ""
        if hashlib.sha256(f.read_bytes()).hexdigest() not in text:
            bad.append(f"{f.relative_to(DATA)}: sha256 not in {src.relative_to(DATA) if src else 'any SOURCE.md'}")
        elif "License" not in text or "Used by" not in text:
            bad.append(f"{src.relative_to(DATA)}: names no license or no user")
    assert not bad, bad
    readme = (DATA / "README.md").read_text()
    assert all(f"{f.relative_to(DATA).parts[0]}/" in readme for f in FILES)


def test_mt_bench_and_spec_bench_questions_and_reference_answers():
    mt = load_questions(str(DATA / "mt_bench" / "question.jsonl"))
    assert len(mt) == 80 and all(len(q["turns"]) == 2 for q in mt)
    spec = load_questions(str(DATA / "spec_bench" / "question.jsonl"))
    assert len(spec) == 480 and [q["turns"] for q in spec[:80]] == [q["turns"] for q in mt]
    refs = [json.loads(l) for l in open(DATA / "mt_bench" / "reference_answer" / "gpt-4.jsonl")]
    cats = {q["question_id"]: q["category"] for q in mt}
    assert len(refs) == 30 and {cats[r["question_id"]] for r in refs} == {"reasoning", "math", "coding"}
    assert all(len(r["choices"][0]["turns"]) == 2 for r in refs)


def test_chat_samples_read_as_conversations():
    """ShareGPT, Alpaca and LIMA samples through the training data reader: every record is usable."""
    expect = {"sharegpt/sharegpt_sample.json": ("sharegpt", 50, 0), "alpaca/alpaca_en_demo.json": ("alpaca", 999, 0),
              "lima/lima.json": ("alpaca", 1029, 29)}
    for rel, (fmt, n, multi) in expect.items():
        recs = [r for _, _, r in read_records(str(DATA / rel))]
        assert len(recs) == n and {detect_format(r) for r in recs} == {fmt}, rel
        convs = [to_messages(r, fmt) for r in recs]
        assert all(m[-1]["role"] == "assistant" and m[-1]["content"].strip() for m in convs), rel
        assert sum(len(m) > 2 for m in convs) == multi, rel
    alpaca = [r for _, _, r in read_records(str(DATA / "alpaca" / "alpaca_en_demo.json"))]
    with_input = next(r for r in alpaca if r["input"])
    assert to_messages(with_input, "alpaca")[0]["content"] == f"{with_input['instruction']}\n\n{with_input['input']}"


def test_tinystories_sample_reads_as_stories():
    docs = [r["text"] for _, _, r in read_records(str(DATA / "tinystories" / "tinystories_sample.txt"))]
    assert len(docs) > 2000 and docs[0].startswith("One day, a little girl named Lily found a needle in her room.")
