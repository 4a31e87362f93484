"""Collective boost-tuning: stages through the one training loop, covered examples dropped for later stages,
resumable stage by stage, an ensemble export that decodes exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftlab.config import ConfigError, build_recipe
from draftlab.train import train


def ensemble_recipe(base_dir, data, out, **ensemble):
    return build_recipe({
        "base": {"name_or_path": str(base_dir), "dtype": "float32"},
        "head": {"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}},
        "loss": {"distill_weight": 1.0},
        "data": {"path": str(data), "max_len": 64, "eval_size": 4},
        "train": {"lr": 1e-2, "warmup_steps": 1, "batch_size": 2, "max_steps": 4, "save_every_steps": 1,
                  "eval_every_steps": 4, "log_every_steps": 1},
        "ensemble": {"members": 3, "threshold": 0.5, "tau_prompts": 2, "node_budget": 12,
                     "architectures": [{}, {"num_layers": 2}], **ensemble},
        "output_dir": str(out)})


def member_weights(out):
    return [load_file(out / "export" / f"member{i}" / "model.safetensors") for i in (1, 2, 3)]


@pytest.mark.slow  # three training stages, a killed run resumed, the export decoded: a whole pipeline
def test_boost_stages_resume_and_export(tiny_base_dir, data_file, tmp_path):
    from draftlab.base import load_base
    from draftlab.train.boost import example_scores
    from draftlab.data import load_examples
    from draftlab.interop.export import load_export

    straight = tmp_path / "straight"
    s = train(ensemble_recipe(tiny_base_dir, data_file, straight))
    assert s["finished"] and len(s["stages"]) == 3
    # Stage 2 trained exactly on the examples member 1 does not cover.
    r = ensemble_recipe(tiny_base_dir, data_file, straight)
    base, tok = load_base(str(tiny_base_dir), "float32")
    train_ex, _, _ = load_examples(r.data, tok, seed=0)
    m1, _ = load_export(straight / "stages" / "member1" / "export")
    scores = example_scores(r.ensemble, base, [m1], train_ex, tok, batch_size=5)
    sel = json.loads((straight / "stages" / "member2" / "examples.json").read_text())
    kept = sel["kept"]
    assert (sel["score"], sel["threshold"]) == ("generation", 0.5)  # SpecInfer's test by default
    assert kept == [j for j in range(len(train_ex)) if scores[j] < 0.5] or (
        len(kept) == len(train_ex) and all(v >= 0.5 for v in scores.values()))
    assert sel["dropped"] == sorted(set(range(len(train_ex))) - set(kept))
    start = json.loads((straight / "stages" / "member2" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["train_examples"] == len(kept)
    recs = [json.loads(l) for l in (straight / "metrics.jsonl").read_text().splitlines()]
    # tau counts the bonus token, so it is >= 1 by construction: > 1 says some drafted token was accepted.
    assert [x["stage"] for x in recs] == [1, 2, 3] and all(x["tau"] > 1 for x in recs)
    assert recs[1]["trained_on_examples"] == len(kept) and recs[0]["trained_on_examples"] == len(train_ex)
    assert [x["dropped_examples"] for x in recs[:2]] == [0, len(train_ex) - len(kept)]
    assert all(x["score"] == "generation" for x in recs)
    # Killed (stopped) in every stage: resumes stage by stage to the same weights, finished stages untouched.
    out = tmp_path / "stopped"
    stage1 = None
    for _ in range(10):
        res = train(ensemble_recipe(tiny_base_dir, data_file, out), stop_after_steps=2)
        if stage1 is None and (out / "stages" / "member1" / "export" / "draftlab.json").is_file():
            stage1 = (out / "stages" / "member1" / "export" / "model.safetensors").stat().st_mtime_ns
        if res["finished"]:
            break
    assert res["finished"] and (out / "stages" / "member1" / "export" / "model.safetensors").stat().st_mtime_ns == stage1
    for a, b in zip(member_weights(straight), member_weights(out)):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    meta = json.loads((out / "export" / "draftlab.json").read_text())
    assert [m["name"] for m in meta["head"]["members"]] == ["member1", "member2", "member3"]
    assert meta["head"]["members"][1]["head"]["num_layers"] == 2 and len(meta["training"]["stages"]) == 3
    assert meta["training"]["data_formats"] == {"sharegpt": 24}  # (the first member's: all read the same records)


def _greedy_unbatched(lm, prompt, n):
    ids = list(prompt)
    for _ in range(n):  # no cache, no padding: the plainest greedy decoding there is
        ids.append(int(lm(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_generation_scores_are_spec_infers_test_batched():
    """SpecInfer's test: the share of the base's greedy output (after the prompt part, up to match_tokens, cut
    after EOS) that a member's own greedy output reproduces from the start; batched and left-padded, it equals
    plain one-by-one greedy decoding."""
    from types import SimpleNamespace

    from conftest import tiny_llama
    from draftlab.train.boost import generation_scores, prompt_length

    def peaked(noise=0.0):  # the base, or a slightly perturbed copy that agrees with it for a while
        lm = tiny_llama(seed=0)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in lm.parameters():
                p.add_(noise * torch.randn_like(p))
            lm.lm_head.weight.mul_(30)
        return lm

    base, twin, other = peaked(), SimpleNamespace(lm=peaked()), SimpleNamespace(lm=peaked(0.01))
    g = torch.Generator().manual_seed(0)
    examples = []
    for p, r in [(3, 9), (8, 2), (5, 12), (1, 6)]:  # chat-like: a prompt part, then supervised tokens
        ids = torch.randint(3, 64, (p + r,), generator=g).tolist()
        examples.append({"input_ids": ids, "loss_mask": [0] * p + [1] * r})
    examples.append({"input_ids": torch.randint(3, 64, (20,), generator=g).tolist(), "loss_mask": [1] * 20})  # text
    assert [prompt_length(e) for e in examples] == [3, 8, 5, 1, 10]
    twin_scores = generation_scores(base, [twin], examples, 0, [], match_tokens=6, batch_size=3)
    assert twin_scores == {i: 1.0 for i in range(5)}
    got = generation_scores(base, [other], examples, 0, [], match_tokens=6, batch_size=3)
    want, eos_case = {}, {}
    for i, e in enumerate(examples):
        p = prompt_length(e)
        n = min(6, len(e["input_ids"]) - p)
        ref, out = _greedy_unbatched(base, e["input_ids"][:p], n), _greedy_unbatched(other.lm, e["input_ids"][:p], n)
        same = next((k for k in range(n) if ref[k] != out[k]), n)
        want[i] = same / n
        eos_case[i] = (ref, same)
    assert got == pytest.approx(want) and any(0 < v < 1 for v in want.values())  # partial matches counted
    # An EOS in the base's output ends it: what follows is not compared, so a member that matched up to the EOS
    # covers the example.
    i = next(i for i, v in want.items() if 0 < v < 1)
    ref, same = eos_case[i]
    assert generation_scores(base, [other], examples[i:i + 1], 0, [ref[same - 1]], match_tokens=6)[0] == 1.0

    # Boost's stages score the members so far, then one more: with a memo the base generates once and each call
    # runs only the new member, on the examples not matched whole (review: every stage ran the base and every
    # member again), with the scores of a call without it.
    from draftlab.train import boost

    calls = []
    real = boost._greedy
    boost._greedy = lambda lm, ids, att, n: calls.append((lm, ids.shape[0])) or real(lm, ids, att, n)
    try:
        memo, third = {}, SimpleNamespace(lm=peaked(0.02))
        for members in ([other], [other, twin], [other, twin, third]):
            calls.clear()
            got = generation_scores(base, members, examples, 0, [], 6, 3, memo=memo)
            ran = list(calls)
            assert got == generation_scores(base, members, examples, 0, [], 6, 3)
            rows = {id(lm): 0 for lm in (base, other.lm, twin.lm, third.lm)}
            for lm, b in ran:
                rows[id(lm)] += b
            if len(members) == 1:
                assert rows[id(base)] == rows[id(other.lm)] == 5
            else:  # nothing for the base and the earlier members; the new one only where no match was whole
                assert rows[id(base)] == rows[id(other.lm)] == rows[id(twin.lm)] * (len(members) == 3) == 0
                assert rows[id(members[-1].lm)] == (sum(v < 1 for v in want.values()) if len(members) == 2 else 0)
        memo = {}  # a member added on some examples only: the next call runs it on the others
        generation_scores(base, [other], examples, 0, [], 6, 3, memo=memo)
        generation_scores(base, [other, third], examples, 0, [], 6, 3, indices=[0, 1], memo=memo)
        assert generation_scores(base, [other, third], examples, 0, [], 6, 3, indices=[2, 3, 4], memo=memo) == {
            i: v for i, v in generation_scores(base, [other, third], examples, 0, [], 6, 3).items() if i > 1}
    finally:
        boost._greedy = real


def test_coverage_scores_with_a_memo_run_only_the_new_member():
    """Coverage (the share of supervised positions where some member's top-1 is the base's): with a memo, boost's
    calls with one member more run neither the base nor the earlier members again, only the new member on the
    examples not covered everywhere, and give the scores of a call without it (each call ran the base and every
    member on every example before)."""
    from types import SimpleNamespace

    from conftest import tiny_llama
    from draftlab.train import boost

    base = tiny_llama(seed=0)
    members = [SimpleNamespace(lm=tiny_llama(seed=s)) for s in (1, 2)] + [SimpleNamespace(lm=base)]
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, 64, (n,), generator=g).tolist(), "loss_mask": [0] * 2 + [1] * (n - 2)}
                for n in (9, 4, 14, 7, 11)]
    rows, real = {}, boost._argmax
    boost._argmax = lambda h, w: rows.update({id(w): rows.get(id(w), 0) + h.shape[0]}) or real(h, w)
    try:
        memo = {}
        for k in (1, 2, 3):
            rows.clear()
            got = boost.coverage_scores(base, members[:k], examples, 0, batch_size=2, memo=memo)
            ran = dict(rows)
            assert got == boost.coverage_scores(base, members[:k], examples, 0, batch_size=2), k
            new = members[k - 1].lm.lm_head.weight
            if k == 1:
                assert ran == {id(base.lm_head.weight): 5, id(new): 5} and all(v < 1 for v in got.values())
            else:  # only the new member, on the examples not covered everywhere before
                assert ran == {id(new): sum(v < 1 for v in before.values())}
            before = got
        assert got == {i: 1.0 for i in range(5)}  # the base itself is a member now: every position covered
        # Calls on other examples than the last (a member added on some only) run what each example has not seen.
        memo = {}
        boost.coverage_scores(base, members[:1], examples, 0, batch_size=2, memo=memo)
        boost.coverage_scores(base, members[:2], examples, 0, batch_size=2, indices=[0, 1], memo=memo)
        assert boost.coverage_scores(base, members[:2], examples, 0, batch_size=2, indices=[2, 3, 4], memo=memo) == {
            i: v for i, v in boost.coverage_scores(base, members[:2], examples, 0, batch_size=2).items() if i > 1}
    finally:
        boost._argmax = real


def test_a_stage_drops_the_covered_examples_and_says_which(tiny_base_dir, data_file, tmp_path):
    """Examples scoring at least the threshold are dropped (or kept at the downweight rate); examples.json lists
    the dropped ones and the test that dropped them."""
    from draftlab.train.boost import _next_examples

    scores = {0: 1.0, 1: 0.2, 2: 0.5, 3: 0.49, 4: 0.9}
    train_ex = [{}] * 5  # the scores are given (as a finished stage's record leaves them), no model runs
    sel = _next_examples(ensemble_recipe(tiny_base_dir, data_file, tmp_path), ["member1"], None, None, train_ex, 1,
                         None, {1: scores})
    assert (sel["kept"], sel["dropped"], sel["covered"]) == ([1, 3], [0, 2, 4], 3)
    assert (sel["score"], sel["threshold"]) == ("generation", 0.5)
    down = ensemble_recipe(tiny_base_dir, data_file, tmp_path, weighting="downweight", downweight=0.34)
    sel = _next_examples(down, ["member1"], None, None, train_ex, 1, None, {1: scores})
    assert len(sel["dropped"]) == 2 and set(sel["dropped"]) < {0, 2, 4} and sorted(sel["kept"] + sel["dropped"]) == [0, 1, 2, 3, 4]


def test_ensemble_export_decodes_exactly(tiny_base_dir, data_file, tmp_path, capsys):
    from draftlab.cli import main

    out = tmp_path / "e"
    train(ensemble_recipe(tiny_base_dir, data_file, out, members=2, lookup=True, boost=False, architectures=[]))
    assert not (out / "stages" / "member2" / "examples.json").exists()  # independent: every member on all data
    assert (out / "export" / "lookup" / "datastore.safetensors").is_file()
    assert (out / "export" / "member1" / "tokenizer.json").is_file()
    for opts in ([], ["--ensemble-mode", "vote", "--length", "3"], ["--ensemble-mode", "vote", "--adaptive"],
                 ["--node-budget", "4"]):
        assert main(["generate", str(out / "export"), "--prompt", "Once upon", "--max-new-tokens", "12", "--compare",
                     "--json", *opts]) == 0
        rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rep["identical_to_baseline"] is True and rep["drafter"]["kind"] == "ensemble", opts
        assert len(rep["drafter"]["members"]) == 3


def test_ensemble_recipe_errors(tiny_base_dir, data_file, tmp_path):
    with pytest.raises(ConfigError, match="ensemble: trains SSMs; set head.type: ssm"):
        build_recipe({**ensemble_recipe(tiny_base_dir, data_file, tmp_path).model_dump(mode="json"),
                      "head": {"type": "medusa"}})
    with pytest.raises(ConfigError, match=r"ensemble.architectures\[1\] = \{'num_layers': 0\}"):
        ensemble_recipe(tiny_base_dir, data_file, tmp_path, architectures=[{}, {"num_layers": 0}])
    with pytest.raises(ConfigError, match="lists 4 members but ensemble.members is 3"):
        ensemble_recipe(tiny_base_dir, data_file, tmp_path, architectures=[{}] * 4)


def test_every_stage_keeps_the_ensembles_held_out_split(tiny_base_dir, data_file, tmp_path, monkeypatch):
    """A stage trains with a seed of its own (its weights and data order), but splits the data as its ensemble does:
    the subset the last stages chose indexes that split's training examples, and the held-out examples the stages
    are scored on are never trained on (found by review: stage i split with seed + i, so half the held-out examples
    of 40 records were in a later member's training set, and the subset picked other examples)."""
    import draftlab.train.examples_cache as loop  # (where training loads its examples)

    splits = []

    def recording(data_cfg, tok, seed=0, **kw):
        train_ex, eval_ex, stats = real(data_cfg, tok, seed=seed, **kw)
        splits.append((seed, [e["input_ids"] for e in eval_ex]))
        return train_ex, eval_ex, stats
    real = loop.load_examples
    monkeypatch.setattr(loop, "load_examples", recording)
    r = ensemble_recipe(tiny_base_dir, data_file, tmp_path / "e", members=2, architectures=[])
    r = build_recipe({**r.model_dump(mode="json"), "train": {**r.train.model_dump(), "max_steps": 1,
                                                             "eval_every_steps": 1}})
    train(r)
    assert len(splits) == 2 and {seed for seed, _ in splits} == {r.train.seed}
    assert splits[0][1] == splits[1][1]


def test_the_ensemble_s_stop_file_stops_the_stage_it_trains(tiny_base_dir, data_file, tmp_path, monkeypatch):
    """slurm/train.sbatch asks for a stop by touching OUTPUT_DIR/STOP; a stage of an ensemble looked at its own
    directory's only and trained on until the job was killed, losing what it did since its last checkpoint (found
    by review). The stage now stops at the ensemble's file too, and the run then counts as not finished."""
    import draftlab.train.loop as loop
    from draftlab.train.run_dir import run_finished

    out = tmp_path / "e"
    (out).mkdir()
    (out / "STOP").touch()  # left from an earlier invocation: not this one's request (removed at its start)

    class AskedMidStage(loop.StopRequest):
        def __init__(self, out_dir, accelerator, also=()):
            super().__init__(out_dir, accelerator, also)
            (out / "STOP").touch()  # the job's signal arrives while the stage trains

    monkeypatch.setattr(loop, "StopRequest", AskedMidStage)
    r = ensemble_recipe(tiny_base_dir, data_file, out, members=2, architectures=[])
    summary = train(r)
    assert not summary["finished"] and summary["stage"] == 1 and summary["step"] == 1
    assert not run_finished(out)
