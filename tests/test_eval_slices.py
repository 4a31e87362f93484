"""Per-slice reports (issue 24, part 2): slicing of eval records, slices in a real run, `eval compare A B`."""

import json
from pathlib import Path

import pytest

from conftest import DATA
from test_eval import export  # noqa: F401  (the module-scoped stories260K + noisy-heads export fixture)
from draftlab.eval.compare import compare_slices
from draftlab.eval.mt_bench import EvalError
from draftlab.eval.slices import bucket, slice_report, step_positions, turn_records

MT = DATA / "mt_bench" / "question.jsonl"


def test_buckets_and_step_positions():
    assert [bucket(n) for n in (0, 31, 32, 63, 64, 127, 128, 300, 1024)] == [
        "0-31", "0-31", "32-63", "32-63", "64-127", "64-127", "128-255", "256-511", "1024-2047"]
    assert step_positions([4, 1, 3, 2]) == [1, 5, 6, 9]  # position 0: the prefill's token
    assert step_positions([4, 1], start=0) == [0, 4]


def _turns(committed, context, wall, **kw):
    """A hand-made per-turn choice entry as the runner writes it."""
    return {"step_committed": committed, "context_tokens": context, "wall_time": wall,
            "new_tokens": 1 + sum(committed), "steps": len(committed),  # + the prefill's token
            "accept_length": round(sum(committed) / len(committed), 4), **kw}


def _answer(qid, turns):
    ch = {"index": 0, "turns": ["x"] * len(turns)}
    for k in turns[0]:
        ch[k] = [t[k] for t in turns]
    return {"question_id": qid, "choices": [ch]}


def hand_made():
    """Two questions: `writing` (two turns) and `math` (one turn), with plain-decoding answers beside them."""
    qs = [{"question_id": 1, "category": "writing", "turns": ["a", "b"], "level": "hard"},
          {"question_id": 2, "category": "math", "turns": ["c"], "level": "easy"}]
    # Token 0 of each answer is the prefill's. q1 turn 1: steps start at 1, 5, ..., 25, then one at 29 that
    # commits 5 (tokens 29-33, across the 32 edge: it counts wholly in 0-31, where it starts), then two single
    # tokens at 34 and 35.
    t11 = _turns([4] * 7 + [5, 1, 1], context=20, wall=1.0)
    t12 = _turns([2] * 20, context=70, wall=1.0)  # steps at 1, 3, ..., 39: 16 start in 0-31, 4 in 32-63
    t21 = _turns([1] * 40, context=40, wall=2.0)  # steps at 1..40: 31 in 0-31, 9 in 32-63
    d = {1: _answer(1, [t11, t12]), 2: _answer(2, [t21])}
    b = {1: _answer(1, [{"new_tokens": 36, "wall_time": 2.0}, {"new_tokens": 41, "wall_time": 1.5}]),
         2: _answer(2, [{"new_tokens": 41, "wall_time": 1.64}])}
    return qs, d, b


def test_slices_of_hand_made_records_are_exact():
    qs, d, b = hand_made()
    recs = turn_records(qs, d, b)
    assert [(r["question_id"], r["turn"], r["context_tokens"], r["committed"]) for r in recs] == [
        (1, 1, 20, 35), (1, 2, 70, 40), (2, 1, 40, 40)]
    assert recs[0]["tokens_per_s"] == 36.0 and recs[0]["plain_tokens_per_s"] == 18.0
    sl = slice_report(recs)
    cat = sl["category"]
    assert list(cat) == ["math", "writing"]
    # Standard errors: none for one question (writing's two records are question 1's two turns)
    assert cat["writing"] == {"records": 2, "steps": 30, "committed": 75, "new_tokens": 77, "accept_length": 2.5,
                              "accept_length_se": None, "tokens_per_s": 38.5, "plain_tokens_per_s": 22.0,
                              "speedup": 1.75, "speedup_se": None,
                              "by_question": {"accept_length": {"1": [75, 30]}, "speedup": {"1": [77, 3.5, 2.0, 77]}}}
    assert cat["math"] == {"records": 1, "steps": 40, "committed": 40, "new_tokens": 41, "accept_length": 1.0,
                           "accept_length_se": None, "tokens_per_s": 20.5, "plain_tokens_per_s": 25.0,
                           "speedup": 0.82, "speedup_se": None,
                           "by_question": {"accept_length": {"2": [40, 40]}, "speedup": {"2": [41, 1.64, 2.0, 41]}}}
    assert {k: (v["records"], v["steps"], v["accept_length"]) for k, v in sl["turn"].items()} == {
        "1": (2, 50, 1.5), "2": (1, 20, 2.0)}
    # speedup of turn 1: (77 tokens / 3.0 s) / (77 tokens / 3.64 s)
    assert sl["turn"]["1"]["speedup"] == 1.2133
    # Turn 1 holds two questions: the delta method over them. Accept length sqrt(2 x (20^2 + 20^2)) / 50 (residuals
    # 35 - 1.5 x 10 and 40 - 1.5 x 40); speedup 1.2133 x sqrt(2 x 2 x (2/3.64 - 1/3)^2) (the new tokens cancel).
    assert sl["turn"]["1"]["accept_length_se"] == 0.8
    assert sl["turn"]["1"]["speedup_se"] == pytest.approx(1.2133 * 2 * (2 / 3.64 - 1 / 3), abs=1e-4)
    assert {k: (v["records"], v["accept_length"]) for k, v in sl["context_tokens"].items()} == {
        "0-31": (1, 3.5), "32-63": (1, 1.0), "64-127": (1, 2.0)}
    assert list(sl["context_tokens"]) == ["0-31", "32-63", "64-127"]  # by lower edge, not by string
    # 0-31: 8 + 16 + 31 steps committing 33 + 32 + 31 tokens; 32-63: 2 + 4 + 9 steps committing 2 + 8 + 9.
    assert {k: {f: v[f] for f in ("records", "steps", "committed", "accept_length")}
            for k, v in sl["output_position"].items()} == {
        "0-31": {"records": 3, "steps": 55, "committed": 96, "accept_length": 1.7455},
        "32-63": {"records": 3, "steps": 15, "committed": 19, "accept_length": 1.2667}}
    # Every slicing's steps-weighted accept length is the whole run's: 115 tokens in 70 steps.
    for name in ("category", "turn", "context_tokens", "output_position"):
        rows = sl[name].values()
        assert (sum(r["steps"] for r in rows), sum(r["committed"] for r in rows)) == (70, 115), name

    by_level = slice_report(turn_records(qs, d, b, "level"), "level")
    assert by_level["category_field"] == "level" and list(by_level["category"]) == ["easy", "hard"]
    assert by_level["category"]["hard"] == sl["category"]["writing"]
    # Without plain decoding: no speedup anywhere; answers from before per-slice records: no position slices.
    old = {1: _answer(1, [{k: v for k, v in t.items() if k not in ("step_committed", "context_tokens")}
                          for t in (_turns([3, 1], 5, 1.0), _turns([2], 5, 1.0))])}
    sl = slice_report(turn_records(qs, old, {}))
    assert sl["category"]["writing"]["accept_length"] == 2.0 and "speedup" not in sl["category"]["writing"]
    assert sl["output_position"] == {} and sl["context_tokens"] == {}


def test_compiled_runs_slice_the_speedup_over_compiled_plain_too():
    """A --compile run's slices give the speedup over compiled plain decoding beside the one over HF's eager
    generate (the per-category table did; the slices gave the eager one only)."""
    from draftlab.eval.slices import slice_tables

    qs, d, b = hand_made()
    for qid, walls in ((1, [0.5, 0.25]), (2, [1.0])):
        ch = d[qid]["choices"][0]
        ch["compiled_plain_new_tokens"], ch["compiled_plain_wall_time"] = list(ch["new_tokens"]), walls
    sl = slice_report(turn_records(qs, d, b))
    # writing: 77 tokens in 2.0 s against the same 77 in 0.75 s compiled plain; math: 41 in 2.0 s against 1.0 s.
    assert sl["category"]["writing"]["speedup_vs_compiled_plain"] == 0.375
    assert sl["category"]["math"]["compiled_plain_tokens_per_s"] == 41.0
    assert sl["turn"]["1"]["speedup_vs_compiled_plain"] == 0.5
    assert sl["category"]["writing"]["speedup"] == 1.75  # (the eager baseline's, unchanged)
    text = "\n".join(slice_tables(sl))
    assert "| speedup | vs compiled plain |" in text and "| 0.38x |" in text
    # Standard errors where a slice holds two questions or more (turn 1 here; writing is one question's two turns)
    assert "| 1 | 2 | 50 | 1.50 ± 0.80 |" in text and "| 1.21x ± 0.52 |" in text
    assert "| writing | 2 | 30 | 2.50 |" in text
    assert "vs compiled plain" not in "\n".join(slice_tables(slice_report(turn_records(*hand_made()))))


def test_questions_keep_the_slice_field(tmp_path):
    from draftlab.eval.mt_bench import load_questions

    f = tmp_path / "q.jsonl"
    f.write_text('{"question_id": 1, "category": "a", "turns": ["hi"], "lang": "de"}\n'
                 '{"question_id": 2, "category": "b", "turns": ["ho"]}\n')
    with pytest.raises(EvalError, match=r"q.jsonl:2: --slice-field lang: .*no such field \(fields: category, "):
        load_questions(str(f), slice_field="lang")
    f.write_text(f.read_text().replace('"ho"]', '"ho"], "lang": ["en"]'))
    assert load_questions(str(f), slice_field="lang") == [
        {"question_id": 1, "category": "a", "turns": ["hi"], "lang": "de"},
        {"question_id": 2, "category": "b", "turns": ["ho"], "lang": ["en"]}]
    assert "lang" not in load_questions(str(f))[0]


def _summary(tmp, name, overall, slices):
    d = tmp / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"head": "medusa", "tree_size": 9, "overall": overall,
                                                "categories": {}, "slices": slices}))
    return str(d)


def hand_made_pair(tmp):
    row = lambda n, acc, sp=None: {"records": n, "accept_length": acc, **({"speedup": sp} if sp else {})}
    a = _summary(tmp, "a", {"turns": 10, "accept_length": 2.0, "tokens_per_s": 10.0, "speedup": 1.5},
                 {"category_field": "category",
                  "category": {"coding": row(4, 2.0, 1.5), "math": row(4, 2.0, 1.5), "writing": row(2, 2.0, 1.5)},
                  "turn": {"1": row(5, 2.0, 1.5), "2": row(5, 2.0, 1.5)},
                  "context_tokens": {"32-63": row(10, 2.0, 1.5)},
                  "output_position": {"0-31": {"steps": 40, "accept_length": 2.0},
                                      "32-63": {"steps": 20, "accept_length": 2.0}}})
    b = _summary(tmp, "b", {"turns": 10, "accept_length": 1.94, "tokens_per_s": 10.0, "speedup": 1.5},
                 {"category_field": "category",
                  # coding: accept length -4% (inside 5%); math: -10% accept length; writing: speedup -6%.
                  "category": {"coding": row(4, 1.92, 1.5), "math": row(4, 1.8, 1.5), "writing": row(2, 2.0, 1.41)},
                  "turn": {"1": row(5, 2.0, 1.6), "2": row(5, 1.0, 1.0)},  # turn 2: both worse
                  "context_tokens": {"32-63": row(6, 2.0, 1.5), "64-127": row(4, 0.5, 0.5)},  # a new slice: unmarked
                  "output_position": {"0-31": {"steps": 40, "accept_length": 2.1},
                                      "32-63": {"steps": 25, "accept_length": 1.8}}})
    return a, b


def test_compare_marks_exactly_the_slices_that_got_worse(tmp_path):
    from draftlab.eval.compare import format_comparison
    from draftlab.eval.mt_bench import load_summary

    a, b = hand_made_pair(tmp_path)
    cmp = compare_slices(load_summary(a), load_summary(b), threshold=0.05)
    assert cmp["worse"] == [{"slicing": "category", "slice": "math", "worse": ["accept_length"]},
                            {"slicing": "category", "slice": "writing", "worse": ["speedup"]},
                            {"slicing": "turn", "slice": "2", "worse": ["accept_length", "speedup"]},
                            {"slicing": "output_position", "slice": "32-63", "worse": ["accept_length"]}]
    rows = {r["slice"]: r for r in cmp["slicings"]["category"]}
    assert rows["coding"]["accept_change"] == -0.04 and rows["coding"]["worse"] == []
    new = cmp["slicings"]["context_tokens"][1]
    assert new["slice"] == "64-127" and new["a"]["records"] is None and new["b"]["records"] == 4 and new["worse"] == []
    assert cmp["slicings"]["overall"][0]["worse"] == []  # -3%
    assert compare_slices(load_summary(a), load_summary(b), threshold=0.2)["worse"] == [
        {"slicing": "turn", "slice": "2", "worse": ["accept_length", "speedup"]}]
    text = format_comparison(cmp, a, b)
    assert text.count("**worse**") == 4 and "4 slices got worse" in text
    assert "| 2 | 5 | 5 | 2.00 | 1.00 | -50.0% | 1.50x | 1.00x | -33.3% | **worse** (accept length, speedup) |" in text
    assert "| 64-127 | - | 4 | - | 0.50 | - | - | 0.50x | - |  |" in text
    assert "| slice | steps A | steps B |" in text  # output position counts steps


def test_slice_standard_errors_match_the_spread_of_repeated_runs():
    """The standard errors of a slice's accept length and speedup are what the figures spread by between runs of the
    same kind: 400 simulated runs of 30 records (steps, tokens per step and timings drawn per record), the spread of
    each figure across runs against the mean of its estimated error (a wrong influence term, e.g. ignoring the plain
    side's time or the records' lengths, misses by far more than the 15% allowed)."""
    import random
    import statistics

    from draftlab.eval.slices import _record_slice

    rng = random.Random(0)
    acc, acc_se, sp, sp_se = [], [], [], []
    for _ in range(400):
        recs = []
        for _ in range(30):
            steps = rng.randint(5, 60)
            committed = sum(1 + min(rng.expovariate(0.6), 6) // 1 for _ in range(steps))
            wall = steps * rng.uniform(0.008, 0.012) + rng.uniform(0.0, 0.05)
            plain_wall = committed * rng.uniform(0.004, 0.006)
            recs.append({"question_id": len(recs), "steps": steps, "committed": int(committed),
                         "new_tokens": int(committed) + 1,
                         "wall_time": wall, "plain_new_tokens": int(committed) + 1, "plain_wall_time": plain_wall})
        row = _record_slice(recs)
        acc.append(row["accept_length"]), acc_se.append(row["accept_length_se"])
        sp.append(row["speedup"]), sp_se.append(row["speedup_se"])
    assert statistics.stdev(acc) == pytest.approx(statistics.mean(acc_se), rel=0.15)
    assert statistics.stdev(sp) == pytest.approx(statistics.mean(sp_se), rel=0.15)
    # Identical samples do not spread, whatever the figure's shape (uncentred influences gave a ratio of one sum over
    # two, sum(a) / (sum(b) sum(c)), an error here: found by review).
    from draftlab.eval.slices import ratio_se

    assert ratio_se([(1.0, 2.0, 3.0)] * 5) == 0.0 and ratio_se([(1.0, 2.0)] * 5) == 0.0
    assert ratio_se([(1.0, 2.0)]) is None and ratio_se([(1.0, 0.0), (2.0, 0.0)]) is None


def test_compare_tells_a_drop_from_noise_where_the_runs_give_errors(tmp_path):
    """With standard errors in both summaries, a drop past the threshold is marked worse only beyond `noise` errors of
    the difference; within them it reads as within noise. (It was marked whatever the slice's size.)"""
    from draftlab.eval.compare import format_comparison
    from draftlab.eval.mt_bench import load_summary

    row = lambda n, acc, se, sp=None, sp_se=None: {"records": n, "accept_length": acc, "accept_length_se": se,
                                                   "speedup": sp, "speedup_se": sp_se}
    slices = lambda cat, allr: {"category_field": "category", "category": cat, "turn": {}, "context_tokens": {},
                                "output_position": {}, "all_records": allr}
    a = _summary(tmp_path, "a", {"turns": 40, "accept_length": 2.0, "tokens_per_s": 10.0, "speedup": 1.5},
                 slices({"small": row(3, 2.0, 0.3, 1.5, 0.2), "large": row(37, 2.0, 0.02, 1.5, 0.01),
                         "lone": row(1, 2.0, None, 1.5, None)}, row(40, 2.0, 0.02, 1.5, 0.01)))
    b = _summary(tmp_path, "b", {"turns": 40, "accept_length": 1.8, "tokens_per_s": 10.0, "speedup": 1.5},
                 slices({"small": row(3, 1.6, 0.3, 1.2, 0.2), "large": row(37, 1.8, 0.02, 1.5, 0.01),
                         "lone": row(1, 1.6, None, 1.5, None)}, row(40, 1.8, 0.02, 1.5, 0.01)))
    A, B = load_summary(a), load_summary(b)
    cmp = compare_slices(A, B, threshold=0.05)
    # small: -20% accept length, 0.4 against 2 x sqrt(0.3^2 + 0.3^2) = 0.85; speedup -20%, 0.3 against 0.57.
    # large: -10%, 0.2 against 0.057. lone: one record, no error: the threshold alone.
    assert cmp["worse"] == [{"slicing": "overall", "slice": "all", "worse": ["accept_length"]},
                            {"slicing": "category", "slice": "large", "worse": ["accept_length"]},
                            {"slicing": "category", "slice": "lone", "worse": ["accept_length"]}]
    rows = {r["slice"]: r for r in cmp["slicings"]["category"]}
    assert rows["small"]["worse"] == [] and rows["small"]["within_noise"] == ["accept_length", "speedup"]
    text = format_comparison(cmp, a, b)
    # (± beside a change: the difference's error, here sqrt(0.3^2 + 0.3^2) / 2.00 and sqrt(0.2^2 + 0.2^2) / 1.50)
    assert "| small | 3 | 3 | 2.00 ± 0.30 | 1.60 ± 0.30 | -20.0% ± 21.2% | 1.50x ± 0.20 | 1.20x ± 0.20 | " \
           "-20.0% ± 18.9% | within noise (accept length, speedup) |" in text
    assert "the runs taken as independent" in text
    # noise 0: the threshold alone, as before.
    assert {(w["slicing"], w["slice"]) for w in compare_slices(A, B, threshold=0.05, noise=0)["worse"]} == {
        ("overall", "all"), ("category", "small"), ("category", "large"), ("category", "lone")}


def test_compare_cli(tmp_path, capsys):
    from draftlab.cli import main

    a, b = hand_made_pair(tmp_path)
    assert main(["eval", "compare", a, b + "/summary.json", "--json"]) == 0  # exit 0 although slices got worse
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert obj["threshold"] == 0.05 and len(obj["worse"]) == 4 and [r["dir"] for r in obj["runs"]] == [a, b + "/summary.json"]
    assert main(["eval", "compare", a, b, "--threshold", "0.6"]) == 0
    out = capsys.readouterr().out
    assert "0 slices got worse" in out and "### output position" in out and "**worse**" not in out
    assert main(["eval", "compare", a, b, "--threshold", "1.5"]) == 2
    assert "--threshold 1.5" in capsys.readouterr().err
    assert main(["eval", "compare", a, b, "--noise", "-1"]) == 2
    assert "--noise -1" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text(json.dumps({"head": "hydra", "tree_size": 5, "categories": {},
                                                                "overall": {"turns": 2, "accept_length": 1.5,
                                                                            "tokens_per_s": 3.0}}))
    # A run from before slices: the overview still compares them, and a line says how to add its slices.
    assert main(["eval", "compare", a, str(tmp_path / "old")]) == 0
    out = capsys.readouterr().out
    assert "no per-slice section" in out and "### output position" not in out


def test_compare_says_where_runs_were_measured_under_other_conditions(tmp_path, capsys):
    """`eval compare` compared any two runs silently (found by review): another base, length limit, sampling or
    machine made a "worse" slice of what was the conditions' doing. It says what differs; the export does not."""
    from draftlab.cli import main
    from draftlab.eval.compare import held_fixed
    from draftlab.eval.mt_bench import load_summary

    a, b = hand_made_pair(tmp_path)
    common = {"base": "b0", "max_new_tokens": 256, "temperature": 0.0, "hardware": "H200", "export": "x"}
    for d, extra in ((a, {}), (b, {"max_new_tokens": 1024, "hardware": "AMD EPYC CPU x2 threads", "export": "y"})):
        f = Path(d) / "summary.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), **common, **extra}))
    assert held_fixed([load_summary(a), load_summary(b)]) == ["max_new_tokens: 256 / 1024",
                                                              "hardware: 'H200' / 'AMD EPYC CPU x2 threads'"]
    assert held_fixed([load_summary(a), load_summary(a)]) == []
    assert main(["eval", "compare", a, b]) == 0
    out = capsys.readouterr().out
    assert out.startswith("warning: these runs differ") and "- max_new_tokens: 256 / 1024" in out
    assert main(["eval", "compare", a, b, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["not_comparable"]) == 2


def test_run_writes_slices_that_add_up(export, tmp_path, capsys):  # noqa: F811
    """A real run (stories260K, noisy heads): slices come from the answers and agree with the overall figures."""
    from draftlab.cli import main

    picked, seen = [], set()
    for line in open(MT):  # one question of each of three categories, plus a field of our own to slice by
        q = json.loads(line)
        if q["category"] not in seen and len(seen) < 3:
            seen.add(q["category"])
            picked.append({**q, "length": "long" if len(q["turns"][0]) > 150 else "short"})
    qf = tmp_path / "q.jsonl"
    qf.write_text("".join(json.dumps(q) + "\n" for q in picked))
    out = tmp_path / "run"
    rc = main(["eval", "mt-bench", export, "--questions", str(qf), "--max-new-tokens", "48", "--out", str(out),
               "--slice-field", "length", "--json"])
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and s["overall"]["identical_share"] == 1.0
    sl, o = s["slices"], s["overall"]
    assert sl["category_field"] == "length" and set(sl["category"]) <= {"long", "short"}
    assert list(sl["turn"]) == ["1", "2"]
    answers = [json.loads(l)["choices"][0] for l in open(s["answers"]["draftlab"])]
    plain = [json.loads(l)["choices"][0] for l in open(s["answers"]["plain"])]
    steps = sum(sum(c["steps"]) for c in answers)
    new = sum(sum(c["new_tokens"]) for c in answers)
    for c, p in zip(answers, plain):  # the per-step record is the whole answer, in order
        assert [1 + sum(x) for x in c["step_committed"]] == c["new_tokens"]  # + the prefill's token
        assert list(map(len, c["step_committed"])) == c["steps"]
        assert c["context_tokens"] == p["context_tokens"] and c["context_tokens"][1] > c["context_tokens"][0]
    assert max(n for c in answers for n in c["new_tokens"]) > 32  # some answers reach the second position bucket
    assert len(sl["output_position"]) >= 2
    for name in ("category", "turn", "context_tokens", "output_position"):
        rows = sl[name].values()
        assert sum(r["steps"] for r in rows) == steps, name
        assert sum(r["committed"] for r in rows) == new - o["turns"], name  # emitted tokens but the prefill's
        assert sum(r["committed"] for r in rows) / steps == pytest.approx(o["accept_length"], abs=1e-3), name
    assert sum(r["records"] for r in sl["turn"].values()) == o["turns"] == 6
    for r in sl["turn"].values():  # speedup per slice: the slice's tokens/s against its plain tokens/s
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"], rel=1e-2)
    for name in ("category", "turn", "context_tokens", "output_position"):
        assert (out / f"slices_{name}.png").stat().st_size > 0
    assert "### by length" in (out / "report.md").read_text()
    # The run against itself: nothing got worse; against a run without the field, an error that names it.
    assert main(["eval", "compare", str(out), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["worse"] == []
    assert main(["eval", "mt-bench", export, "--questions", str(MT), "--slice-field", "length", "--limit", "1",
                 "--out", str(tmp_path / "r2"), "--json"]) == 2
    assert "--slice-field length" in capsys.readouterr().err


def _paired_runs(rng, questions: int, drop: float = 0.0):
    """Records of two runs over the same questions: each question has its own accept length and speed (shared by the
    runs, as the same prompts give), each run draws its steps, tokens and timings around them; B's accept length is
    `drop` lower."""
    runs = ([], [])
    for q in range(questions):
        acc, step_s = rng.uniform(1.2, 4.0), rng.uniform(0.008, 0.02)
        for recs, scale in zip(runs, (1.0, 1.0 - drop)):
            steps = rng.randint(20, 60)
            committed = round(steps * acc * scale * rng.uniform(0.93, 1.07))
            recs.append({"question_id": q, "category": "all", "turn": 1, "context_tokens": 40, "steps": steps,
                         "committed": committed, "new_tokens": committed + 1, "step_committed": None,
                         "wall_time": steps * step_s * rng.uniform(0.95, 1.05),
                         "plain_new_tokens": committed + 1, "plain_wall_time": (committed + 1) * step_s / 2.2})
    return runs


def test_paired_errors_match_the_spread_of_the_difference():
    """The paired error of B - A (two runs over the same questions) is what the difference spreads by between
    repeated pairs of runs, for accept length and speedup; the independent one is several times wider, since the
    questions' own difficulty, shared by both runs, is most of each run's error."""
    import random
    import statistics

    from draftlab.eval.compare import diff_se
    from draftlab.eval.slices import _record_slice

    rng = random.Random(1)
    diffs = {"accept_length": [], "speedup": []}
    paired = {"accept_length": [], "speedup": []}
    apart = {"accept_length": [], "speedup": []}
    for _ in range(300):
        a, b = (_record_slice(r) for r in _paired_runs(rng, 30))
        for f in diffs:
            diffs[f].append(b[f] - a[f])
            se, is_paired = diff_se(a, b, f)
            assert is_paired
            paired[f].append(se)
            strip = lambda r: {k: v for k, v in r.items() if k != "by_question"}
            se, is_paired = diff_se(strip(a), strip(b), f)
            assert not is_paired
            apart[f].append(se)
    for f in diffs:
        assert statistics.stdev(diffs[f]) == pytest.approx(statistics.mean(paired[f]), rel=0.15), f
        assert statistics.mean(apart[f]) > 3 * statistics.mean(paired[f]), f


def test_compare_pairs_questions_and_finds_a_drop_the_independent_margin_misses(tmp_path):
    """A 10% drop in accept length (and so in speedup) over 30 questions of very different difficulty: paired by
    question it is far outside the noise and marked worse; the runs taken as independent (summaries without
    per-question terms), the questions' spread hides it (within noise)."""
    import random

    from draftlab.eval.compare import compare_slices, format_comparison
    from draftlab.eval.slices import slice_report

    ra, rb = _paired_runs(random.Random(2), 30, drop=0.1)
    runs = []
    for name, recs in (("a", ra), ("b", rb)):
        sl = slice_report(recs)
        runs.append({"dir": name, "overall": {**{k: sl["all_records"][k] for k in ("accept_length", "speedup")},
                                               "turns": len(recs)}, "slices": sl})
    cmp = compare_slices(*runs, threshold=0.05)
    row = cmp["slicings"]["category"][0]
    assert row["diff_se"]["accept_length"]["paired"] and row["worse"] == ["accept_length", "speedup"]
    assert {"slicing": "overall", "slice": "all", "worse": ["accept_length", "speedup"]} in cmp["worse"]
    assert "paired by question" in format_comparison(cmp, "a", "b")

    def without_terms(r):
        sl = {k: ({s: {f: v for f, v in row.items() if f != "by_question"} for s, row in v.items()}
                  if k in ("category", "turn", "context_tokens", "output_position") else v)
              for k, v in r["slices"].items()}
        sl["all_records"] = {f: v for f, v in sl["all_records"].items() if f != "by_question"}
        return {**r, "slices": sl}

    cmp = compare_slices(*map(without_terms, runs), threshold=0.05)
    row = cmp["slicings"]["category"][0]
    assert not row["diff_se"]["accept_length"]["paired"] and row["worse"] == []
    assert row["within_noise"] == ["accept_length", "speedup"]
