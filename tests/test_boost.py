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


def test_boost_stages_resume_and_export(tiny_base_dir, data_file, tmp_path):
    from draftlab.base import load_base
    from draftlab.boost import coverage_scores
    from draftlab.data import load_examples
    from draftlab.export import load_export

    straight = tmp_path / "straight"
    s = train(ensemble_recipe(tiny_base_dir, data_file, straight))
    assert s["finished"] and len(s["stages"]) == 3
    # Stage 2 trained exactly on the examples member 1 does not cover.
    r = ensemble_recipe(tiny_base_dir, data_file, straight)
    base, tok = load_base(str(tiny_base_dir), "float32")
    train_ex, _, _ = load_examples(r.data, tok, seed=0)
    m1, _ = load_export(straight / "stages" / "member1" / "export")
    scores = coverage_scores(base, [m1], train_ex, tok.pad_token_id)
    kept = json.loads((straight / "stages" / "member2" / "examples.json").read_text())["kept"]
    assert kept == [j for j in range(len(train_ex)) if scores[j] < 0.5] or (
        len(kept) == len(train_ex) and all(v >= 0.5 for v in scores.values()))
    start = json.loads((straight / "stages" / "member2" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["train_examples"] == len(kept)
    recs = [json.loads(l) for l in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [x["stage"] for x in recs] == [1, 2, 3] and all(x["tau"] >= 1 for x in recs)
    assert recs[1]["trained_on_examples"] == len(kept) and recs[0]["trained_on_examples"] == len(train_ex)
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


def test_ensemble_export_decodes_exactly(tiny_base_dir, data_file, tmp_path, capsys):
    from draftlab.cli import main

    out = tmp_path / "e"
    train(ensemble_recipe(tiny_base_dir, data_file, out, members=2, lookup=True, boost=False, architectures=[]))
    assert not (out / "stages" / "member2" / "examples.json").exists()  # independent: every member on all data
    assert (out / "export" / "lookup" / "datastore.json").is_file() and (out / "export" / "member1" / "tokenizer.json").is_file()
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
