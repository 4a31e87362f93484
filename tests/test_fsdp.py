"""distributed.strategy: fsdp shards the frozen base across ranks; training must not notice."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import launch_train
from test_train import weights
from draftlab.config import build_recipe, dump_recipe


SSM = {"head": {"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}},
       "loss": {"distill_weight": 1.0, "divergence": "tvd"}}


def hydra_pp_recipe(base_dir, data, out, strategy, draft=None):
    # Hydra++ (prefix layer copied from the base's last layer, embeddings read from the base), teacher
    # distillation (the base's lm_head), and the hidden-state cache over 2 epochs: 19 training examples in
    # global batches of 4 leave 3 uncached after epoch 1, so in epoch 2 ranks disagree about cache hits.
    # 5 held-out examples give the two ranks different numbers of evaluation batches. Distillation also runs the
    # teacher's probe (one forward of the base) on every rank of the sharded base (it was skipped under FSDP).
    return build_recipe({
        "base": {"name_or_path": str(base_dir), "dtype": "float32"},
        "head": {"type": "hydra", "num_heads": 2, "num_layers": 2, "prefix_attention": True},
        "loss": {"distill_weight": 0.5},
        **(draft or {}),
        "data": {"path": str(data), "max_len": 64, "eval_size": 5},
        "train": {"lr": 1e-2, "warmup_steps": 1, "batch_size": 2, "max_steps": 8, "save_every_steps": 4,
                  "eval_every_steps": 3, "log_every_steps": 1, "cache_hidden": True},
        "distributed": {"strategy": strategy}, "output_dir": str(out)})


@pytest.mark.slow  # multi-process training runs; CI runs the slow tests
@pytest.mark.parametrize("kind", ["hydra++", "ssm"])
def test_fsdp_sharded_base_trains_the_same_heads_as_ddp(tiny_base_dir, data_file, tmp_path, kind):
    runs, local = {}, {}
    for strategy in ("ddp", "fsdp"):
        cfg = tmp_path / f"{strategy}.yaml"
        cfg.write_text(dump_recipe(hydra_pp_recipe(tiny_base_dir, data_file, tmp_path / strategy, strategy,
                                                   SSM if kind == "ssm" else None)))
        p = launch_train(cfg, processes=2, timeout=300, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-4000:]
        runs[strategy] = weights(tmp_path / strategy)
        start = json.loads((tmp_path / strategy / "metrics.jsonl").read_text().splitlines()[0])
        local[strategy] = start["base_params_local"]
    assert local["ddp"] == 1.0 and local["fsdp"] < 0.95  # rank 0 really held only part of the base
    assert runs["ddp"].keys() == runs["fsdp"].keys()
    for k in runs["ddp"]:
        torch.testing.assert_close(runs["fsdp"][k], runs["ddp"][k], rtol=0, atol=1e-6)
    assert any(("prefix_layer" if kind == "hydra++" else "layers.0") in k for k in runs["fsdp"])
    evals = [l for l in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines() if '"eval"' in l]
    assert evals and '"eval_positions"' in evals[-1]


def test_fsdp_validates_like_the_other_strategies():
    from pydantic import ValidationError

    base = {"base": {"name_or_path": "x"}, "data": {"path": "d.jsonl"}, "output_dir": "o"}
    assert build_recipe({**base, "distributed": {"strategy": "fsdp"}}).distributed.strategy == "fsdp"
    with pytest.raises((ValidationError, ValueError), match="DeepSpeed settings"):
        build_recipe({**base, "distributed": {"strategy": "fsdp", "offload": "cpu"}})
