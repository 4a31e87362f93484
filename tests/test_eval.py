"""`draftlab eval mt-bench` / `eval compare` on stories260K (its chat template comes from the importer)."""

import json
import time

import pytest
import torch

from conftest import DATA
from test_decoder import noisy_heads
from draftlab.eval.mt_bench import EvalError, compare_runs, load_questions, run_mt_bench

MT = DATA / "mt_bench" / "question.jsonl"
SPEC = DATA / "spec_bench" / "question.jsonl"


@pytest.fixture(scope="module")
def export(stories_dir, tmp_path_factory):
    from draftlab.base import load_base
    from draftlab.interop.export import save_export

    base, _ = load_base(str(stories_dir), "float32")
    return str(save_export(noisy_heads(base, num_heads=4, noise=0.02), base,
                           tmp_path_factory.mktemp("exp") / "export", str(stories_dir)))


def lines(path):
    return [json.loads(l) for l in open(path)]


def test_questions_formats_and_errors(tmp_path):
    mt = load_questions(str(MT))
    assert len(mt) == 80 and {q["category"] for q in mt} >= {"writing", "coding", "math"}
    assert all(len(q["turns"]) == 2 for q in mt)
    spec = load_questions(str(SPEC), categories=["translation", "rag"], limit=5)
    assert len(spec) == 5 and {q["category"] for q in spec} == {"translation"}
    with pytest.raises(EvalError, match="--category poetry: not in .*categories: coding"):
        load_questions(str(MT), categories=["poetry"])
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n{"question_id": 2, "turns": ["a"]}\n')
    with pytest.raises(EvalError, match=r"q.jsonl:2: question record lacks category"):
        load_questions(str(bad))
    with pytest.raises(EvalError, match="no such file, and not a hub dataset id"):
        load_questions("nothing-here.jsonl")
    twice = tmp_path / "twice.jsonl"  # (answers are kept by id: one counted under both categories before)
    twice.write_text('{"question_id": 1, "category": "a", "turns": ["hi"]}\n'
                     '{"question_id": 1, "category": "b", "turns": ["yo"]}\n')
    with pytest.raises(EvalError, match="twice.jsonl:2: question_id 1 again"):
        load_questions(str(twice))
    scalar = tmp_path / "scalar.jsonl"  # (a TypeError, and datasets' offline traceback: walk-through)
    scalar.write_text('{"question_id": 1, "category": "a", "turns": ["hi"]}\n5\n')
    with pytest.raises(EvalError, match="scalar.jsonl:2: a question record is a JSON object .*not int"):
        load_questions(str(scalar))
    with pytest.raises(EvalError, match="'nobody/no-such-questions': no such file here, and the hub dataset does not"):
        load_questions("nobody/no-such-questions")


def test_mt_bench_greedy_answers_report_and_resume(export, stories_dir, tmp_path):
    from draftlab.base import load_base

    out = tmp_path / "run"
    kw = dict(max_new_tokens=24, progress=False)
    s = run_mt_bench(export, str(MT), str(out), limit=3, **kw)
    d, b = lines(s["answers"]["draftlab"]), lines(s["answers"]["plain"])
    assert [r["question_id"] for r in d] == [81, 82, 83] == [r["question_id"] for r in b]
    rec = d[0]
    assert set(rec) >= {"question_id", "answer_id", "model_id", "choices", "tstamp"}
    # What Spec-Bench's evaluation/speed.py reads: the category, and the tokens committed per step over the turns
    assert rec["category"] == "writing" and b[0]["category"] == "writing"
    assert rec["choices"][0]["accept_lengths"] == [n for t in rec["choices"][0]["step_committed"] for n in t]
    ch = rec["choices"][0]
    assert ch["index"] == 0 and len(ch["turns"]) == 2 and all(isinstance(t, str) for t in ch["turns"])
    assert len(ch["new_tokens"]) == len(ch["steps"]) == len(ch["wall_time"]) == 2
    assert all(r["identical"] for r in d) and d[0]["choices"][0]["turns"] == b[0]["choices"][0]["turns"]
    o = s["overall"]
    assert o["identical_share"] == 1.0 and s["differences"] == [] and o["answers"] == 3 and o["turns"] == 6
    assert list(s["categories"]) == ["writing"]
    steps = sum(sum(r["choices"][0]["steps"]) for r in d)
    hist = s["accept_histogram"]  # steps by tokens committed: the overall accept length is its mean
    assert sum(hist.values()) == steps
    assert o["accept_length"] == pytest.approx(sum(int(k) * v for k, v in hist.items()) / steps, abs=1e-3)
    assert o["accept_length"] > 1, o  # some drafted tokens are accepted (1.09 here): the heads take part
    assert o["speedup"] == pytest.approx(o["tokens_per_s"] / o["baseline_tokens_per_s"], rel=1e-2)
    report = (out / "report.md").read_text()
    assert "| writing | 3 |" in report and "Every answer is identical" in report
    assert (out / "speedup_per_category.png").stat().st_size > 0 and (out / "accept_length_hist.png").is_file()
    from draftlab.interop.convert import model_card  # (export --eval: the card gives the command and the figures)
    from draftlab.interop.export import read_meta

    card = model_card(read_meta(export), "vllm-medusa", str(out), "other")
    assert f"--questions {MT} --limit 3 --max-new-tokens 24 --temperature 0.0` on " in card
    assert ", 3 answers (± a standard error over the questions):" in card
    se = s["slices"]["all_records"]  # (3 questions: the errors of eval compare, beside the figures)
    assert f"- accept length {o['accept_length']} ± {se['accept_length_se']} (tokens" in card
    assert f"- {o['speedup']}x ± {se['speedup_se']} draftlab's eager plain decoding" in card and "compiled" not in card
    # The figures are draftlab's tree's, not vLLM's top-1 chain's (the card read as the engine's: walk-through)
    assert f"- measured with draftlab's decoder and its {s['tree_size']}-token tree; an engine that drafts one top-1 " \
        "chain (vLLM's Medusa) accepts fewer" in card
    # export --eval on files the run did not measure (retrained since, or another export) is refused: the card gave
    # the old weights' figures as the new ones' (walk-through). A copy is the same files, whatever their times (a copy
    # that did not keep them was refused until 2026-12-03).
    import os
    import shutil

    from draftlab.interop.convert import ConvertError, export_to

    same = shutil.copytree(export, tmp_path / "same")
    assert export_to(same, "vllm-medusa", tmp_path / "served", str(out))
    os.utime(same / "draft.safetensors", ns=(time.time_ns(), time.time_ns()))
    assert export_to(same, "vllm-medusa", tmp_path / "served1", str(out))
    weights = bytearray((same / "draft.safetensors").read_bytes())
    weights[-1] ^= 1  # (other weights, same size)
    (same / "draft.safetensors").write_bytes(bytes(weights))
    with pytest.raises(ConvertError, match=f"--eval {out} measured other files than {same} holds now"):
        export_to(same, "vllm-medusa", tmp_path / "served2", str(out))
    # A summary from before 2026-12-03 knows the files by their times, and is still read so
    summary = json.loads((out / "summary.json").read_text())
    old = tmp_path / "old-eval"
    old.mkdir()
    (old / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "export_content"}))
    with pytest.raises(ConvertError, match="or a copy that did not keep the files' modification times"):
        export_to(same, "vllm-medusa", tmp_path / "served3", str(old))

    # The second turn sees the first answer through the chat template: replay the plain turn 2 by hand.
    base, tok = load_base(str(stories_dir), "float32")
    q = load_questions(str(MT), limit=1)[0]
    msgs = [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": b[0]["choices"][0]["turns"][0]},
            {"role": "user", "content": q["turns"][1]}]
    ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids
    gen = base.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    if tok.eos_token_id in gen:
        gen = gen[: gen.index(tok.eos_token_id)]
    assert tok.decode(gen, skip_special_tokens=True).strip() == b[0]["choices"][0]["turns"][1]

    # A finished run again: the kept answers counted, not "0 question, 0 question/s" (walk-through)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        run_mt_bench(export, str(MT), str(out), limit=3, max_new_tokens=24, progress=True)
    assert "mt-bench: 3/3 question (100%), all done before this run" in err.getvalue()

    # Resume: a crash after the plain answer of question 84 but before the draftlab one.
    s = run_mt_bench(export, str(MT), str(out), limit=4, **kw)
    ids_before = [r["answer_id"] for r in lines(s["answers"]["draftlab"])]
    with open(s["answers"]["draftlab"]) as f:
        kept = f.readlines()[:3]
    open(s["answers"]["draftlab"], "w").writelines(kept)
    s = run_mt_bench(export, str(MT), str(out), limit=4, **kw)
    d2, b2 = lines(s["answers"]["draftlab"]), lines(s["answers"]["plain"])
    assert [r["question_id"] for r in d2] == [81, 82, 83, 84] == [r["question_id"] for r in b2]
    assert [r["answer_id"] for r in d2][:3] == ids_before[:3] and d2[3]["answer_id"] != ids_before[3]
    assert s["overall"]["answers"] == 4
    bch = [r["choices"][0] for r in b2]
    plain_tps = sum(sum(c["new_tokens"]) for c in bch) / sum(sum(c["wall_time"]) for c in bch)
    assert s["overall"]["baseline_tokens_per_s"] == pytest.approx(plain_tps, abs=0.01)

    # A kill in the middle of writing a record leaves a torn last line: the resume rewrites both files from their
    # whole records, so every line stays one JSON record (found by review: the next record was appended to the torn
    # one, a line no JSON reader, FastChat's judge included, could read).
    with open(s["answers"]["draftlab"], "a") as f:
        f.write('{"question_id": 85, "answer_id": "x", "cho')
    s = run_mt_bench(export, str(MT), str(out), limit=5, **kw)
    assert [r["question_id"] for r in lines(s["answers"]["draftlab"])] == [81, 82, 83, 84, 85]

    with pytest.raises(EvalError, match="other settings .*max_new_tokens: 24 -> 16"):
        run_mt_bench(export, str(MT), str(out), limit=5, max_new_tokens=16, progress=False)
    with pytest.raises(EvalError, match="other settings .*dtype: None -> 'float64'"):
        run_mt_bench(export, str(MT), str(out), limit=5, dtype="float64", **kw)

    # An export retrained in place (same path, other weights) made new answers; the old ones were kept and reported
    # as its own (found by review). So does another machine or thread count, whose timings would be mixed.
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(export, moved)
    s = run_mt_bench(str(moved), str(MT), str(tmp_path / "m"), limit=1, **kw)
    (moved / "draft.safetensors").write_bytes((moved / "draft.safetensors").read_bytes())  # (rewritten: mtime)
    run_mt_bench(str(moved), str(MT), str(tmp_path / "m"), limit=1, **kw)  # (the same contents: the same export)
    weights = bytearray((moved / "draft.safetensors").read_bytes())
    weights[-1] ^= 1
    (moved / "draft.safetensors").write_bytes(bytes(weights))
    with pytest.raises(EvalError, match="other settings .*export_content"):
        run_mt_bench(str(moved), str(MT), str(tmp_path / "m"), limit=1, **kw)
    settings = json.loads((tmp_path / "m" / "run.json").read_text())
    (tmp_path / "m" / "run.json").write_text(json.dumps({**settings, "export_content": None, "hardware": "elsewhere"}))
    with pytest.raises(EvalError, match="other settings .*hardware: 'elsewhere'"):
        run_mt_bench(str(moved), str(MT), str(tmp_path / "m"), limit=1, **kw)
    # --overwrite removes the old summary and report at once: a run killed before writing its own left the old ones,
    # which `eval compare` read as this run's
    from draftlab.eval.mt_bench import _settings_file

    assert (tmp_path / "m" / "summary.json").is_file() and (tmp_path / "m" / "report.md").is_file()
    (tmp_path / "m" / "accept_length_hist.png").write_bytes(b"old")
    _settings_file(tmp_path / "m", settings, overwrite=True)
    assert not (tmp_path / "m" / "summary.json").exists() and not (tmp_path / "m" / "report.md").exists()
    assert not list((tmp_path / "m").glob("*.png"))  # (the old plots, beside a --no-plots report: walk-through)



def test_a_run_refused_before_answering_leaves_its_folder_usable(export, tmp_path, monkeypatch):
    """A --max-new-tokens past the base's context failed after run.json was written, and the corrected rerun into
    the same folder was refused as 'other settings' though it held no answer (walk-through: the default 1024 fails on
    stories260K's 512-token context, spoiling the default folder). --no-baseline's report shows '-' for what was not
    measured, not 0% identical."""
    out = tmp_path / "r"
    with pytest.raises(EvalError, match="--max-new-tokens 1024 leaves .* prompt tokens"):
        run_mt_bench(export, str(MT), str(out), limit=1, max_new_tokens=1024, progress=False, plots=False)
    assert not (out / "run.json").exists()
    (out / "answers").mkdir(parents=True)  # (a run killed before its first answer: its settings bind nothing)
    (out / "run.json").write_text(json.dumps({"max_new_tokens": 99}))
    s = run_mt_bench(export, str(MT), str(out), limit=1, max_new_tokens=8, progress=False, plots=False,
                     baseline=False)
    assert s["overall"]["answers"] == 1
    row = next(l for l in open(s["report"]).read().splitlines() if l.startswith("| writing |"))
    assert row.endswith("| - | - | - |") and "0%" not in row, row

    # The same questions named relatively and --tree default resume that run (they were refused as other settings)
    monkeypatch.chdir(MT.parent)
    again = run_mt_bench(export, MT.name, str(out), limit=1, max_new_tokens=8, progress=False, plots=False,
                         baseline=False, tree="default")
    assert again["overall"]["answers"] == 1 and again["questions"] == str(MT.resolve())
    # A run.json written before (questions as given, tree "default") resumes with the same command (review)
    from draftlab.eval.mt_bench import _settings_file

    settings = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**settings, "questions": MT.name, "tree": "default"}))
    _settings_file(out, settings, overwrite=False)


def test_a_system_message_opens_every_conversation(export, stories_dir, tmp_path):
    """--system: both methods' prompts start with it (FastChat's templates carry one; published accept lengths are
    measured with it), a run directory keeps one system message, and a template that refuses or drops it is said."""
    from draftlab.base import load_base
    from draftlab.eval.mt_bench import _check_system

    _, tok = load_base(str(stories_dir), "float32")
    system = "Once upon a time there was a helpful cat."
    s = run_mt_bench(export, str(MT), str(tmp_path / "r"), limit=1, max_new_tokens=8, progress=False, plots=False,
                     system=system)
    q = load_questions(str(MT), limit=1)[0]
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": q["turns"][0]}]
    want = len(tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids)
    for path in s["answers"].values():
        assert lines(path)[0]["choices"][0]["context_tokens"][0] == want
    assert s["system"] == system and s["overall"]["identical_share"] == 1.0
    assert "Plots: none (--no-plots)." in open(s["report"]).read()  # (it listed PNGs never drawn: walk-through)
    with pytest.raises(EvalError, match="other settings .*system: 'Once upon"):
        run_mt_bench(export, str(MT), str(tmp_path / "r"), limit=1, max_new_tokens=8, progress=False, plots=False)

    class Tok:  # Gemma's template raises on a system turn; some others leave it out
        def __init__(self, refuse):
            self.refuse = refuse

        def apply_chat_template(self, msgs, **kw):
            if self.refuse and msgs[0]["role"] == "system":
                raise ValueError("System role not supported")
            return "".join(m["content"] for m in msgs if m["role"] != "system")

    with pytest.raises(EvalError, match="refuses a system message .System role not supported"):
        _check_system(Tok(True), system, "gemma")
    with pytest.raises(EvalError, match="leaves the system message out"):
        _check_system(Tok(False), system, "other")

def test_a_turn_that_compiled_is_decoded_again_until_nothing_compiles(monkeypatch):
    """answer_question's timing on the compiled path, with a stand-in decoder that compiles in its first runs: the
    turn is decoded again until a run compiles nothing (at most RETIMES more runs), that run's time is the turn's
    wall_time and the rest its compile_s; a turn that compiled nothing runs once; the compiled plain baseline is
    timed the same way."""
    from types import SimpleNamespace

    import draftlab.decode.compiled as compiled
    import draftlab.eval.mt_bench as mt

    graphs = [0]
    monkeypatch.setattr(compiled, "compiled_graphs", lambda: graphs[0])

    class Decoder:  # its first `compiles` runs compile (and take longer)
        device, base = torch.device("cpu"), None

        def __init__(self, compiles):
            self.compiles, self.calls = compiles, 0

        def generate(self, prompts, max_new_tokens, **kw):
            self.calls += 1
            if self.calls <= self.compiles:
                graphs[0] += 1
                time.sleep(0.05)
            return SimpleNamespace(tokens=[[5, 6]], steps=1, accept_length=2.0, committed=[2])

    class Tok:
        eos_token_id = 0
        apply_chat_template = staticmethod(lambda msgs, **kw: " ".join(m["content"] for m in msgs))
        __call__ = staticmethod(lambda text, **kw: SimpleNamespace(input_ids=[1] * len(text.split())))
        decode = staticmethod(lambda ids, **kw: "ok")

    q = {"question_id": 1, "turns": ["a b", "c"]}
    # (runs compiling, calls over the two turns, turn 1's timed run compiled nothing, turn 2 compiled)
    for compiles, calls, clean, second in ((0, 2, True, False), (1, 3, True, False), (2, 4, True, False),
                                           (9, 2 + 2 * mt.RETIMES, False, True)):
        dec, plain = Decoder(compiles), Decoder(compiles)
        turns, _ = mt.answer_question(q, dec, Tok(), mt.Sampling(), 2, 0, 100, baseline=False, plain_compiled=plain)
        assert dec.calls == plain.calls == calls, compiles
        assert (turns[0]["compile_s"] is None) == (compiles == 0) and (turns[1]["compile_s"] is not None) == second
        assert (turns[0]["wall_time"] < 0.05) == clean, compiles  # the timed run is the first that compiled nothing
        if compiles in (1, 2):
            assert turns[0]["compile_s"] >= 0.04  # the first run's extra time


@pytest.mark.slow  # compiles (graph capture) a base, heads and the plain decoder: ~15 s
def test_compiled_turns_that_compile_are_timed_again(export, tmp_path, monkeypatch):
    """On the compiled path a turn that meets a new shape compiles while decoding; it is decoded again and the
    second run timed, the compile time reported beside the figures (compile_s), and the answers stay plain's;
    draftlab's plain decoding on the compiled path answers the same turns, the second baseline."""
    import draftlab.eval.mt_bench as mt

    monkeypatch.setenv("DRAFTLAB_COMPILE_BACKEND", "eager")  # graph capture without code generation: fast
    calls = []
    load = mt.load_decoder

    def counting(*a, **k):
        decoder, tok, meta = load(*a, **k)
        run = decoder.generate
        decoder.generate = lambda *x, **y: calls.append(1) or run(*x, **y)
        return decoder, tok, meta

    monkeypatch.setattr(mt, "load_decoder", counting)
    s = run_mt_bench(export, str(MT), str(tmp_path / "run"), limit=1, max_new_tokens=8, progress=False,
                     plots=False, compile=True)
    o = s["overall"]
    assert s["compiled"] and o["identical_share"] == 1.0 and s["differences"] == [] and o["turns"] == 2
    # The warm-up's short prompt leaves the questions' prompt widths to compile inside the answers.
    assert o["turns_compiled"] >= 1 and o["compile_s"] > 0, o
    assert len(calls) == 1 + o["turns"] + o["turns_compiled"]  # warm-up, every turn, the turns decoded again
    ch = [r["choices"][0] for r in lines(s["answers"]["draftlab"])]
    assert sum(x is not None for c in ch for x in c["compile_s"]) == o["turns_compiled"]
    # The second baseline: draftlab's plain decoding on the compiled path, over the same turns.
    plain = [r["choices"][0] for r in lines(s["answers"]["plain"])]
    assert [c["compiled_plain_new_tokens"] for c in ch] == [c["new_tokens"] for c in plain]
    assert o["speedup_vs_compiled_plain"] == pytest.approx(o["tokens_per_s"] / o["compiled_plain_tokens_per_s"],
                                                           rel=1e-2)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "compiled while decoding" in report and "| vs compiled plain |" in report
    # inductor's on-disk cache in the summary and report: this process's counts (the "eager" backend builds nothing)
    from draftlab.decode.compiled import compile_cache_report

    c = s["compile_cache"]
    assert c == compile_cache_report()
    assert f"{c['hits']} loaded from the on-disk cache, {c['misses']} built (`{c['dir']}`" in report
    assert "| vs compiled plain |" in compare_runs([str(tmp_path / "run")])[0]
    # The model card of `export --eval` on this run: the command that reproduces it (--limit, --compile), the
    # answer count, and the speedup over compiled plain decoding beside the eager one (it gave the eager one only).
    from draftlab.interop.convert import model_card
    from draftlab.interop.export import read_meta

    card = model_card(read_meta(export), "vllm-medusa", str(tmp_path / "run"), "other")
    assert f"`draftlab eval mt-bench {export} --questions {MT} --limit 1 --max-new-tokens 8 " in card
    assert "--compile`" in card and ", 1 answer:" in card and s["limit"] == 1 and s["category"] is None  # (no ±)
    assert f"; {o['speedup_vs_compiled_plain']}x its compiled plain decoding" in card


def test_a_difference_at_a_near_tie_is_told_from_a_bug():
    """explain_difference reads the base's own logits where greedy outputs part: a top-2 margin within rounding,
    with the other token the runner-up, is a near tie; a wide margin or a token outside the top two is not."""
    from types import SimpleNamespace

    from draftlab.eval.mt_bench import explain_difference

    class Fixed(torch.nn.Module):  # logits [5, 5 - gap, 1, ...] at every position
        def __init__(self, gap):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.gap = gap

        def forward(self, input_ids, attention_mask):
            logits = torch.ones(1, input_ids.shape[1], 6)
            logits[..., 0], logits[..., 1] = 5.0, 5.0 - self.gap
            return SimpleNamespace(logits=logits)

    tie = explain_difference(Fixed(2e-6), [3, 4], [0, 0, 0], [0, 1, 2], 1)
    assert tie["near_tie"] and tie["top2"] == [0, 1] and tie["tokens"] == [0, 1]
    assert tie["margin"] == pytest.approx(2e-6, rel=0.5)
    assert not explain_difference(Fixed(0.5), [3, 4], [0, 0, 0], [0, 1, 2], 1)["near_tie"]  # a real margin
    assert not explain_difference(Fixed(2e-6), [3, 4], [0, 0, 0], [0, 2, 2], 1)["near_tie"]  # not the runner-up
    assert not explain_difference(Fixed(2e-6), [3, 4], [0, 0, 0], [0], 1)["near_tie"]  # it stopped early


def test_a_turn_after_a_differing_turn_is_not_judged_against_plains_prompt():
    """Each method's second turn follows its own first answer, so after a difference in turn 1 the turns' prompts
    differ: turn 2 is marked as following it rather than explained against plain's prompt (found by review: a near
    tie in turn 1 made turn 2 read "NOT a near tie: a bug" and the command exit 1)."""
    from types import SimpleNamespace

    from draftlab.eval.mt_bench import turn_differences

    class Tie(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask):
            logits = torch.zeros(1, input_ids.shape[1], 4)
            logits[..., 0], logits[..., 1] = 5.0, 5.0 - 1e-6
            return SimpleNamespace(logits=logits)

    d = [{"tokens": [0, 1, 3]}, {"tokens": [2, 2]}]
    b = [{"tokens": [0, 0, 3], "prompt_ids": [3]}, {"tokens": [1, 1], "prompt_ids": [3, 0, 0, 3, 3]}]
    diffs = turn_differences(Tie(), d, b, [1, 0])
    assert diffs[0]["turn"] == 1 and diffs[0]["near_tie"]
    assert diffs[1] == {"turn": 2, "position": 0, "after_earlier_difference": True}
    assert turn_differences(Tie(), d, b, [None, 0])[0]["turn"] == 2 and "margin" in turn_differences(
        Tie(), d, b, [None, 0])[0]  # a first difference in turn 2 is explained


def test_the_plain_baseline_sets_the_bases_generation_config_aside(stories_dir):
    """The baseline decodes with the sampling draftlab decodes with and nothing else: a repetition penalty in the
    base's generation_config.json changed plain's tokens, and the difference was blamed on the drafter (found by
    review). The base's own config is back after the call."""
    from draftlab.base import load_base
    from draftlab.decode.acceptance import Sampling
    from draftlab.serve.generate import plain_generate

    base, tok = load_base(str(stories_dir), "float32")
    prompts = [tok("Once upon a time", add_special_tokens=True).input_ids]
    ref, _ = plain_generate(base, prompts, 24, Sampling(), tok.eos_token_id)
    base.generation_config.repetition_penalty = 1.3
    got, _ = plain_generate(base, prompts, 24, Sampling(), tok.eos_token_id)
    assert got == ref and base.generation_config.repetition_penalty == 1.3


def test_sampling_run_and_compare(export, tmp_path):
    a = run_mt_bench(export, str(SPEC), str(tmp_path / "a"), categories=["translation"], limit=2, max_new_tokens=16,
                     temperature=0.8, progress=False, plots=False)
    answers = [r["choices"][0] for r in lines(a["answers"]["draftlab"])]
    assert "identical_share" not in a["overall"]
    assert a["overall"]["new_tokens"] == sum(sum(c["new_tokens"]) for c in answers)
    assert max(n for c in answers for n in c["new_tokens"]) <= 16  # --max-new-tokens holds (EOS may end a turn early)
    assert len(lines(a["answers"]["draftlab"])[0]["choices"][0]["turns"]) == 1  # Spec-Bench: one turn
    run_mt_bench(export, str(SPEC), str(tmp_path / "b"), categories=["translation"], limit=2, max_new_tokens=16,
                 tree="chain", progress=False, plots=False)
    table, runs = compare_runs([str(tmp_path / "a"), str(tmp_path / "b")])
    assert len(runs) == 2 and table.splitlines()[0].endswith("| identical | translation |")
    rows = table.splitlines()[2:4]
    assert rows[0].split(" | ")[2] == str(runs[0]["tree_size"]) and rows[1].split(" | ")[2] == "5"
    assert rows[0].split(" | ")[6] == "-" and rows[1].split(" | ")[6] == "100%"  # sampled vs greedy run
    assert "Sampling: speculative and plain decoding draw from their own random streams" in (
        tmp_path / "a" / "report.md").read_text()
    # Other questions of the same file are not a comparison of the same text (found by review: not said)
    run_mt_bench(export, str(SPEC), str(tmp_path / "c"), categories=["translation"], limit=1, max_new_tokens=16,
                 tree="chain", progress=False, plots=False)
    _, runs = compare_runs([str(tmp_path / "b"), str(tmp_path / "c")])
    from draftlab.eval.compare import held_fixed

    assert any(line.startswith("questions_answered:") for line in held_fixed(runs))
    with pytest.raises(EvalError, match="no summary.json"):
        compare_runs([str(tmp_path)])
    (tmp_path / "bad.json").write_text("{")  # (json's message without the file, and a KeyError: walk-through)
    (tmp_path / "other.json").write_text('{"overall": {}}')
    with pytest.raises(EvalError, match="bad.json: not valid JSON"):
        compare_runs([str(tmp_path / "bad.json"), str(tmp_path / "b")])
    with pytest.raises(EvalError, match="other.json: not an `eval mt-bench` summary \\(no categories\\)"):
        compare_runs([str(tmp_path / "other.json"), str(tmp_path / "b")])


def test_eval_cli_json(export, tmp_path, capsys):
    from draftlab.cli import main

    # No --questions: the MT-Bench questions that ship with draftlab (data/mt_bench/question.jsonl in a checkout).
    rc = main(["eval", "mt-bench", export, "--limit", "1", "--max-new-tokens", "8",
               "--out", str(tmp_path / "r"), "--category", "coding", "--json"])
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and s["overall"]["identical_share"] == 1.0 and list(s["categories"]) == ["coding"]
    assert s["questions"] == str(MT)
    assert main(["eval", "compare", str(tmp_path / "r")]) == 0
    assert "coding" in capsys.readouterr().out
    assert main(["eval", "mt-bench", export, "--questions", str(MT), "--category", "poetry", "--json"]) == 2
    # Typical acceptance's epsilon / alpha (Hydra's sweep) reach the decoder and the run's settings.
    rc = main(["eval", "mt-bench", export, "--limit", "1", "--max-new-tokens", "8", "--out", str(tmp_path / "t"),
               "--category", "coding", "--temperature", "0.7", "--typical", "--typical-epsilon", "0.25",
               "--no-baseline", "--no-plots", "--json"])
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and (s["typical_epsilon"], s["typical_alpha"]) == (0.25, 0.5)
    assert "typical acceptance (epsilon 0.25, alpha 0.5: not lossless)" in (tmp_path / "t" / "report.md").read_text()
    rc = main(["eval", "mt-bench", export, "--limit", "1", "--max-new-tokens", "8", "--out", str(tmp_path / "n"),
               "--category", "coding", "--no-baseline", "--no-plots", "--json"])
    report = (tmp_path / "n" / "report.md").read_text()  # greedy without a baseline claims nothing it did not check
    assert rc == 0 and "identical to plain" not in report and "losslessness was not checked" in report
    with pytest.raises(SystemExit):  # --limit 0 ran every question (found by review)
        main(["eval", "mt-bench", export, "--limit", "0", "--json"])
    assert main(["eval", "mt-bench", export, "--typical-epsilon", "0.2", "--json"]) == 2


def test_eval_cli_exit_code_when_answers_differ(monkeypatch, tmp_path, capsys):
    """A greedy answer that differs from plain decoding exits 1, with --json too (the summary printed first),
    unless the difference is at a near tie of the base's logits (reported, exit 0)."""
    import draftlab.cli.eval as cli_eval
    from draftlab.cli import main

    report = tmp_path / "report.md"
    report.write_text("# report\n")
    summary = {"greedy": True, "baseline": True, "differences": [{"question_id": 81, "turn": 0}],
               "report": str(report), "answers": {"draftlab": str(tmp_path / "a.jsonl")}}
    monkeypatch.setattr(cli_eval, "run_mt_bench", lambda *a, **k: dict(summary))
    argv = ["eval", "mt-bench", "EXPORT", "--out", str(tmp_path / "r")]
    assert main(argv + ["--json"]) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["differences"] == summary["differences"]
    assert main(argv) == 1 and "1 turns differ" in capsys.readouterr().out
    tie = {"differences": [{"question_id": 81, "turn": 2, "margin": 2e-6, "near_tie": True}]}
    monkeypatch.setattr(cli_eval, "run_mt_bench", lambda *a, **k: {**summary, **tie})
    assert main(argv) == 0 and "1 of them at a near tie" in capsys.readouterr().out  # told, not failed
    assert main(argv + ["--json"]) == 0
    later = {"differences": [{"question_id": 81, "turn": 1, "margin": 2e-6, "near_tie": True},
                             {"question_id": 81, "turn": 2, "position": 0, "after_earlier_difference": True}]}
    monkeypatch.setattr(cli_eval, "run_mt_bench", lambda *a, **k: {**summary, **later})
    assert main(argv) == 0 and "1 after an earlier turn's difference" in capsys.readouterr().out
    for same in ({"differences": []}, {"greedy": False}, {"baseline": False}):  # nothing to flag: exit 0
        monkeypatch.setattr(cli_eval, "run_mt_bench", lambda *a, s=same, **k: {**summary, **s})
        assert main(argv + ["--json"]) == 0 and main(argv) == 0
    capsys.readouterr()


def test_mt_bench_with_an_ssm_export(stories_dir, tmp_path):
    """eval mt-bench takes an SSM export unchanged: answers identical to plain greedy, the drafter recorded."""
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    ssm = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base)
    exp = save_export(ssm, base, tmp_path / "ssm", str(stories_dir), tokenizer=tok)
    s = run_mt_bench(str(exp), str(MT), str(tmp_path / "r"), limit=2, max_new_tokens=24, tree="chain:3",
                     progress=False, plots=False)
    assert s["head"] == "ssm" and s["tree_size"] == 4
    hist = s["accept_histogram"]  # an untrained SSM (top-1 agreement about 8%) may accept nothing here
    steps = sum(sum(r["choices"][0]["steps"]) for r in lines(s["answers"]["draftlab"]))
    assert s["overall"]["identical_share"] == 1.0 and sum(hist.values()) == steps
    assert s["overall"]["accept_length"] == pytest.approx(sum(int(k) * v for k, v in hist.items()) / sum(hist.values()), abs=1e-3)


def test_progress_line_shows_the_runs_running_totals(export, tmp_path, capsys, monkeypatch):
    """The mt-bench progress line gives tokens and mean accept length of the run so far, not the last question's."""
    from draftlab.eval.mt_bench import running_totals

    run = {"new_tokens": 0, "steps": 0, "committed": 0.0}
    assert running_totals(run, [{"new_tokens": 10, "steps": 5, "accept_length": 2.0}]) == {"tokens": 10, "accept": "2.00"}
    assert running_totals(run, [{"new_tokens": 4, "steps": 4, "accept_length": 1.0},
                                {"new_tokens": 6, "steps": 1, "accept_length": 6.0}]) == {"tokens": 20, "accept": "2.00"}
    monkeypatch.setenv("DRAFTLAB_PROGRESS_SECONDS", "1000")  # a log (stderr is no terminal): only the closing line
    s = run_mt_bench(export, str(MT), str(tmp_path / "r"), limit=3, max_new_tokens=16, baseline=False, plots=False)
    line = [l for l in capsys.readouterr().err.splitlines() if l.startswith("mt-bench:")][-1]
    figures = dict(kv.split("=") for kv in line.split(", ") if "=" in kv)
    last = sum(lines(s["answers"]["draftlab"])[-1]["choices"][0]["new_tokens"])
    assert int(figures["tokens"]) == s["overall"]["new_tokens"] > last
    assert float(figures["accept"]) == pytest.approx(s["overall"]["accept_length"], abs=0.006)
