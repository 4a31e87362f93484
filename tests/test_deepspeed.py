"""DeepSpeed through Accelerate's plugin: the config the recipe produces, the error without DeepSpeed, and a
ZeRO-2 and a ZeRO-3 run on CPU where DeepSpeed can run here (one process: Accelerate runs
multi-process DeepSpeed on GPUs only, and a multi-process CPU launch is refused, tested here too) (skips with the reason otherwise)."""

import json
import sys

import pytest
import torch

from conftest import launch_train
from test_train import recipe, weights
from draftlab.config import build_recipe, dump_recipe
from draftlab.train.distributed import RunDirError, deepspeed_plugin


def ds_recipe(base, data, out, kind="medusa", **dist):
    r = recipe(base, data, out, kind, max_steps=2, grad_accum_steps=2)
    return build_recipe({**r.model_dump(mode="json"), "distributed": {"strategy": "deepspeed", **dist}})


def test_missing_deepspeed_is_a_clear_error(tiny_base_dir, data_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import fails as if not installed
    with pytest.raises(RunDirError, match=r"needs DeepSpeed: pip install -e '.\[deepspeed\]'"):
        deepspeed_plugin(ds_recipe(tiny_base_dir, data_file, tmp_path))


def test_plugin_config_follows_the_recipe(tiny_base_dir, data_file, tmp_path):
    pytest.importorskip("deepspeed")
    assert deepspeed_plugin(recipe(tiny_base_dir, data_file, tmp_path)) is None  # ddp
    cfg = deepspeed_plugin(ds_recipe(tiny_base_dir, data_file, tmp_path, zero_stage=3, offload="cpu")).deepspeed_config
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_clipping"] == 1.0
    z2 = deepspeed_plugin(ds_recipe(tiny_base_dir, data_file, tmp_path, offload="cpu")).deepspeed_config
    assert z2["zero_optimization"]["stage"] == 2 and "offload_param" not in z2["zero_optimization"]


def test_a_stale_build_lock_is_named(tmp_path, monkeypatch, capsys):
    """A killed JIT build leaves torch's `lock` file and DeepSpeed then waits forever: the run names the file."""
    import os
    import time

    from draftlab.train.distributed import _warn_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for f in (stale, fresh):
        f.parent.mkdir()
        f.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    _warn_stale_build_locks()
    err = capsys.readouterr().err
    assert f"warning: {stale} is 60 min old" in err and str(fresh) not in err


# The ZeRO runs (each a launched training run, about 30 s on 2 cores) run with the slow tests.
@pytest.mark.slow  # whole training runs; CI runs the slow tests
@pytest.mark.parametrize("kind,stage", [("medusa", 2), ("medusa", 3), ("ssm", 2), ("ssm", 3), ("eagle3", 3),
                                        ("medusa2", 2), ("dflash", 2)])
def test_zero_training_run_on_cpu(tiny_base_dir, data_file, tmp_path, stage, kind):
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds"
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(ds_recipe(tiny_base_dir, data_file, out, kind, zero_stage=stage)))
    p = launch_train(cfg, json_out=True)
    if p.returncode != 0 and not (out / "metrics.jsonl").exists() and "draftlab train: error" not in p.stderr:
        # DeepSpeed's CPU backend (a JIT-built communication op, or oneCCL) could not start before training.
        pytest.skip("DeepSpeed could not start on this CPU machine: " + p.stderr.strip().splitlines()[-1][:200])
    assert p.returncode == 0, p.stderr[-3000:]
    assert weights(out)
    ck = out / "checkpoints" / "step_2"
    assert list(ck.rglob("*zero_pp_rank_0*optim_states.pt")), sorted(p.name for p in ck.rglob("*"))  # a ZeRO checkpoint
    losses = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert len(losses) == 2 and all(x == x for x in losses)


@pytest.mark.slow  # a launched training run (about 40 s on 2 cores); CI runs the slow tests
@pytest.mark.parametrize("kind", ["medusa", "eagle3", "ssm"])
def test_zero3_partitioned_draft_is_estimated_and_exported_whole(tiny_base_dir, data_file, tmp_path, kind):
    """With every parameter partitioned (persistence threshold 0: a tiny draft's parameters would otherwise stay
    whole, as small ones do at scale), the accept estimate and the export read a gathered copy: figures like a
    DDP run's, and an export whose tensors are whole (not ZeRO-3's empty local views)."""
    pytest.importorskip("deepspeed")
    from draftlab.config import build_recipe
    from draftlab.interop.export import load_export

    out = tmp_path / "ds"
    r = ds_recipe(tiny_base_dir, data_file, out, kind, zero_stage=3,
                  zero_extra={"stage3_param_persistence_threshold": 0}).model_dump(mode="json")
    r["train"].update(eval_every_steps=1, accept_prompts=2, accept_max_new_tokens=12, measure_accept_every=1)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(build_recipe(r)))
    p = launch_train(cfg, json_out=True)
    if p.returncode != 0 and not (out / "metrics.jsonl").exists() and "draftlab train: error" not in p.stderr:
        pytest.skip("DeepSpeed could not start on this CPU machine: " + p.stderr.strip().splitlines()[-1][:200])
    assert p.returncode == 0, p.stderr[-3000:]
    w = weights(out)
    assert w and all(t.numel() > 0 for t in w.values()), {k: tuple(t.shape) for k, t in w.items() if not t.numel()}
    evals = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in l]
    assert len(evals) == 2
    for e in evals:
        assert e["measured_accept_length"] >= 1.0 and e["expected_accept_length_chain"] >= 1.0
        if kind == "medusa":  # a static default tree: the replay is what the decoder measured
            assert e["expected_accept_length"] == pytest.approx(e["measured_accept_length"], abs=1e-9)
    # The export decodes with the weights the run chose, loaded whole.
    draft, _ = load_export(out / "export")
    assert sum(t.numel() for t in draft.state_dict().values()) >= sum(t.numel() for t in w.values())


@pytest.mark.slow  # a two-process launch importing DeepSpeed (about 40 s on 2 cores); CI runs the slow tests
def test_multi_process_deepspeed_on_cpu_is_refused(tiny_base_dir, data_file, tmp_path):
    pytest.importorskip("deepspeed")
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(ds_recipe(tiny_base_dir, data_file, tmp_path / "ds")))
    p = launch_train(cfg, processes=2)
    assert p.returncode != 0
    assert "launched 2 processes but Accelerate runs 1" in p.stderr and "use distributed.strategy: ddp" in p.stderr
    assert not (tmp_path / "ds" / "checkpoints").exists()


@pytest.mark.slow  # two training runs, one launched with DeepSpeed (about 30 s on 2 cores); CI runs the slow tests
def test_zero_with_gradient_accumulation_steps_once_per_step_as_ddp_does(tiny_base_dir, data_file, tmp_path):
    """Under DeepSpeed every micro-batch was an accumulation boundary (Accelerate's sync flag stayed on), so the
    engine stepped the optimizer on each: grad_accum_steps=2 made twice the optimizer steps, each on one
    micro-batch, under a schedule stepped once per two (found by review). The weights now equal the same recipe's
    run without DeepSpeed."""
    pytest.importorskip("deepspeed")
    from draftlab.train import train

    ddp = recipe(tiny_base_dir, data_file, tmp_path / "ddp", max_steps=2, grad_accum_steps=2, lr=1e-2)
    train(ddp)
    out = tmp_path / "ds"
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(build_recipe({**ddp.model_dump(mode="json"), "output_dir": str(out),
                                             "distributed": {"strategy": "deepspeed", "zero_stage": 2}})))
    p = launch_train(cfg, json_out=True)
    if p.returncode != 0 and not (out / "metrics.jsonl").exists() and "draftlab train: error" not in p.stderr:
        pytest.skip("DeepSpeed could not start on this CPU machine: " + p.stderr.strip().splitlines()[-1][:200])
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = weights(tmp_path / "ddp"), weights(out)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
