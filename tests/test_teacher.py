"""The teacher distillation trains towards: the base's own distribution, computed from its hidden states. Bases that
transform their logits after the lm_head's product (Gemma-2's soft cap, Cohere's and Granite's scales) were refused
for distillation and for EAGLE-3; now the transform is applied, checked against the base's own forward."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from draftlab.base import base_hidden, teacher_transform
from draftlab.losses import head_loss, lm_logits


def _tiny(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "minicpm3":
        common.update(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **common, **extra)).eval()
    with torch.no_grad():  # logits of some size, so that a soft cap or a scale shows
        model.get_output_embeddings().weight.mul_(20)
    return model


CASES = {  # model type: (config, the transform expected)
    "gemma2": ({"final_logit_softcapping": 2.0, "head_dim": 16}, (1.0, 2.0)),
    "cohere": ({"logit_scale": 0.125}, (0.125, None)),
    "granite": ({"logits_scaling": 8.0}, (0.125, None)),
    "minicpm3": ({"dim_model_base": 8}, (0.25, None)),  # (its logits_scaling: hidden_size / dim_model_base)
    "hyperclovax": ({"logits_scaling": 3.0}, (3.0, None)),
}


@pytest.mark.parametrize("model_type", list(CASES))
def test_the_transform_reproduces_each_base_s_own_logits(model_type):
    """From the final hidden states, lm_logits with teacher_transform gives the base's own logits; the product
    alone does not (so the case tests something). Granite divides by logits_scaling and HyperCLOVA X multiplies:
    the same key, read by model type."""
    extra, want = CASES[model_type]
    try:
        model = _tiny(model_type, **extra)
    except (ValueError, KeyError, ImportError) as e:  # (a transformers without that model)
        pytest.skip(f"{model_type}: {e}")
    t = teacher_transform(model.config, model.get_output_embeddings())
    assert t == pytest.approx(want)
    ids = torch.randint(3, 96, (2, 7))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        h = base_hidden(model, ids)
    w = model.get_output_embeddings().weight
    torch.testing.assert_close(lm_logits(h, w, t), own, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(lm_logits(h, w), own, rtol=1e-2, atol=1e-2)


def test_what_cannot_be_reproduced_is_named():
    from transformers import LlamaConfig

    assert teacher_transform(LlamaConfig()) is None
    with pytest.raises(ValueError, match="logits_scaling 8"):  # (an unknown model type: multiplied or divided?)
        teacher_transform(LlamaConfig(logits_scaling=8))
    with pytest.raises(ValueError, match="an lm_head bias"):
        teacher_transform(LlamaConfig(), torch.nn.Linear(4, 8, bias=True))
    # Found by review: keys the first version did not read at all (a wrong teacher wherever the probe does not run).
    with pytest.raises(ValueError, match="output_logit_soft_cap 30"):
        teacher_transform(LlamaConfig(output_logit_soft_cap=30))

    class OwnHead(torch.nn.Linear):  # (Dory's head scales each token's logit inside its forward)
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(ValueError, match="an output head of its own"):
        teacher_transform(LlamaConfig(), OwnHead(4, 8, bias=False))
    from transformers import AutoConfig

    for model_type, extra, want in (("recurrent_gemma", {"logits_soft_cap": 30.0}, (1.0, 30.0)),
                                    ("falcon_h1", {"lm_head_multiplier": 0.25}, (0.25, None))):
        try:
            cfg = AutoConfig.for_model(model_type, **extra)
        except (ValueError, KeyError) as e:
            pytest.skip(f"{model_type}: {e}")
        assert teacher_transform(cfg) == want, model_type


def test_the_distillation_loss_is_towards_the_transformed_distribution():
    torch.manual_seed(0)
    h, th, w = torch.randn(6, 8), 4 * torch.randn(6, 8), torch.randn(20, 8)
    target = torch.randint(0, 20, (6,))
    t = (0.5, 3.0)
    teacher = torch.softmax(torch.tanh(0.5 * (th @ w.t()) / 3.0) * 3.0, -1)
    want = -(teacher * torch.log_softmax(h @ w.t(), -1)).sum()
    got = head_loss(h, w, target, th, w, distill_weight=1.0, chunk_size=4, teacher_transform=t)[0]
    torch.testing.assert_close(got, want)
    assert not torch.allclose(head_loss(h, w, target, th, w, distill_weight=1.0, chunk_size=4)[0], want)


def _saved(model, tiny_base_dir, d):
    d.mkdir()
    for f in tiny_base_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, d / f.name)
    model.save_pretrained(d)
    return d


def test_eagle3_trains_on_a_soft_capped_base_towards_its_own_distribution(tiny_base_dir, data_file, tmp_path,
                                                                         capsys):
    """EAGLE-3 (which always distils) and distillation on a Gemma-2 base were refused; they train, the objective's
    teacher being the base's capped distribution. A config key the model's code does not read (a Llama config with
    final_logit_softcapping) is caught by the probe, which finds the product alone reproduces the base."""
    from test_train import recipe

    from draftlab.config import build_recipe
    from draftlab.train import loop

    vocab = json.loads((tiny_base_dir / "config.json").read_text())["vocab_size"]
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, final_logit_softcapping=30.0, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    base = _saved(gemma, tiny_base_dir, tmp_path / "gemma2")
    seen = []
    original = loop.probe_teacher
    loop.probe_teacher = lambda *a: seen.append(original(*a)) or seen[-1]
    try:
        r = recipe(base, data_file, tmp_path / "e", max_steps=1)
        eagle = build_recipe({**r.model_dump(mode="json"), "head": {"type": "eagle3"}})
        assert loop.train_draft(eagle)["finished"] and seen == [(1.0, 30.0)]
        err = capsys.readouterr().err
        assert ("teacher: the base's logits are soft-capped at 30 after its lm_head's product; the teacher does the "
                "same (checked on one forward)") in err  # (train said nothing of it)
        assert ("warning: vLLM 0.34.0 and SGLang 0.5.23 do not capture EAGLE-3's layers from a Gemma2ForCausalLM "
                "target, so they refuse this draft at load") in err  # (said before training, not only by check)
        gemma3 = SimpleNamespace(architectures=["Gemma3ForCausalLM"])  # (SGLang 0.5.23 serves it)
        assert loop.unserved_eagle3_target(eagle, gemma3).startswith("vLLM 0.34.0 does not capture EAGLE-3's layers "
                                                                     "from a Gemma3ForCausalLM target, so it refuses")
        assert loop.unserved_eagle3_target(eagle, SimpleNamespace(architectures=["Qwen3ForCausalLM"])) is None
        capped = tmp_path / "capped"
        shutil.copytree(tiny_base_dir, capped)
        cfg = json.loads((capped / "config.json").read_text())
        (capped / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 0.5}))
        r = recipe(capped, data_file, tmp_path / "l", max_steps=1)
        distill = build_recipe({**r.model_dump(mode="json"), "loss": {**r.loss.model_dump(), "distill_weight": 1.0}})
        assert loop.train_draft(distill)["finished"] and seen[-1] is None  # (LlamaForCausalLM does not cap)
        assert ("config says its logits are soft-capped at 0.5, but one forward gives the bare product"
                in capsys.readouterr().err)
    finally:
        loop.probe_teacher = original


def test_a_base_whose_logits_the_product_does_not_give_is_refused(tiny_base_dir, data_file, tmp_path):
    """A transform draftlab does not know of (here a hook scaling the lm_head's output) is found by the probe."""
    from test_train import recipe

    from draftlab.base import load_base
    from draftlab.train.loop import check_teacher, probe_teacher, train_draft

    base, _ = load_base(str(tiny_base_dir), "float32")
    r = recipe(tiny_base_dir, data_file, tmp_path / "r", kind="eagle3", max_steps=1)
    assert check_teacher(r, base.config, base.get_output_embeddings()) is None
    assert probe_teacher(r, base, None) is None
    # A config's soft cap the model's code does not read, on a bf16 base whose logits sit far below the cap: both
    # candidates pass the tolerance there, and the closer one (the bare product) is taken (review: the first was).
    assert probe_teacher(r, load_base(str(tiny_base_dir), "bfloat16")[0], (1.0, 30.0)) is None
    base.get_output_embeddings().register_forward_hook(lambda m, i, o: o * 3)
    with pytest.raises(ValueError, match="does not reproduce from its final hidden states.*EAGLE-3 always distils"):
        probe_teacher(r, base, None)
    cfg = json.loads((tiny_base_dir / "config.json").read_text())
    odd = tmp_path / "odd"
    shutil.copytree(tiny_base_dir, odd)
    (odd / "config.json").write_text(json.dumps({**cfg, "logits_scaling": 8.0}))
    with pytest.raises(ValueError, match="logits_scaling 8.0.*EAGLE-3 always distils"):
        train_draft(recipe(odd, data_file, tmp_path / "o", kind="eagle3", max_steps=1))
    assert not (tmp_path / "o").exists()



@pytest.mark.parametrize("model_type", ["minicpm3", "gemma2", "cohere"])
def test_a_new_ssm_keeps_none_of_its_base_s_transforms(model_type):
    """A draft built from the recipe drafts with its lm_head's product; on a MiniCPM3 base the clearing set a
    read-only property (logits_scaling: hidden_size / dim_model_base) and failed."""
    from draftlab.drafters import build_draft

    extra, _ = CASES[model_type]
    try:
        base = _tiny(model_type, **extra)
    except (ValueError, KeyError, ImportError) as e:
        pytest.skip(f"{model_type}: {e}")
    assert build_draft({"type": "ssm", "ssm": {"num_layers": 1}}, base).logit_transform is None


def test_the_zero3_copy_of_the_objective_keeps_the_transform(tiny_base_dir, data_file, tmp_path, monkeypatch):
    """Under ZeRO-3 the accept estimate, the best weights and the export read a rebuilt, gathered copy of the
    objective (Run.whole_objective): it is built with the base's transform as the trained one is."""
    from test_train import recipe

    from draftlab.base import load_base
    from draftlab.config import build_recipe
    from draftlab.train import loop

    r = recipe(tiny_base_dir, data_file, tmp_path / "o")
    r = build_recipe({**r.model_dump(mode="json"), "distributed": {"strategy": "deepspeed", "zero_stage": 3}})
    base, _ = load_base(str(tiny_base_dir), "float32")
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu"))
    run = loop.Run(r, tmp_path / "o", accelerator, use_deepspeed=True, base=base, teacher_transform=(0.5, 7.0))
    run.objective = object()  # (the engine's, partitioned: never read here)
    monkeypatch.setattr(loop, "whole_copy", lambda module, build: build())
    run.objective = SimpleNamespace(draft=loop.build_draft(r.head.model_dump(), base))
    assert run.partitioned and run.whole_objective().teacher_transform == (0.5, 7.0)
    # A pretrained SSM's copy is built from its config: not loaded from its files and probed again at every accept
    # estimate (review); the same structure, and the draft model's own transform.
    import draftlab.base
    from conftest import tiny_llama

    ssm_dir = tmp_path / "small"
    tiny_llama(vocab=base.config.vocab_size, layers=1).save_pretrained(ssm_dir)
    r = build_recipe({**r.model_dump(mode="json"), "head": {"type": "ssm", "ssm": {"name_or_path": str(ssm_dir)}}})
    run = loop.Run(r, tmp_path / "o", accelerator, use_deepspeed=True, base=base, teacher_transform=None)
    run.objective = SimpleNamespace(draft=loop.build_draft(r.head.model_dump(), base))
    run.objective.draft.logit_transform = (2.0, None)
    monkeypatch.setattr(draftlab.base, "pretrained_lm", lambda *a, **k: pytest.fail("the SSM was loaded again"))
    copy = run.whole_objective().draft
    assert copy.logit_transform == (2.0, None) and copy is not run.objective.draft
    assert {k: v.shape for k, v in copy.state_dict().items()} == \
        {k: v.shape for k, v in run.objective.draft.state_dict().items()}


@pytest.mark.parametrize("kind", ["medusa", "eagle3", "dflash", "medusa2"])
def test_every_objective_hands_its_teacher_the_base_s_transform(tiny_base_dir, kind, monkeypatch):
    """Found by review: dropping the transform from EAGLE-3's or DFlash's objective, the heads' or Medusa-2's own
    loss went unnoticed by the tests. Each objective's every teacher (and Medusa-2's own logits) gets it."""
    from peft import LoraConfig, get_peft_model

    from draftlab import losses
    from draftlab.base import load_base
    from draftlab.config import LoraSection, LossSection
    from draftlab.drafters import build_draft
    from draftlab.train.objectives import DraftObjective, JointObjective, base_features
    from test_train import KINDS

    base, _ = load_base(str(tiny_base_dir), "float32")
    spec = KINDS[kind]
    head = {"type": "medusa", **spec["head"]}
    if kind == "eagle3":  # (the full vocabulary: every argmax draftable, so every position is supervised)
        head["eagle"] = {"ttt_steps": 3}
    draft = build_draft(head, base)
    if hasattr(draft, "fit_vocab"):
        draft.fit_vocab([{"input_ids": torch.arange(3, 60)}])
    loss = LossSection(distill_weight=0.0 if kind == "eagle3" else 1.0)
    t = (0.5, 7.0)
    if kind == "medusa2":
        lc = LoraSection(**{**spec["lora"], "self_distill": True})
        peft = get_peft_model(base, LoraConfig(r=lc.r, lora_alpha=lc.alpha, target_modules=list(lc.target_modules)))
        objective = JointObjective(draft, loss, peft, lc, t)
    else:
        objective = DraftObjective(draft, loss, t)
    calls, real = [], losses.head_loss
    monkeypatch.setattr(losses, "head_loss", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    ids = torch.randint(3, base.config.vocab_size, (2, 24))
    hidden = None if kind == "medusa2" else base_features(base, draft, ids)
    objective(hidden, ids, torch.ones_like(ids), torch.ones_like(ids), base.get_output_embeddings().weight)
    teachers = [(a, k) for a, k in calls if (a[3] if len(a) > 3 else k.get("teacher_h")) is not None]
    assert teachers, kind
    for a, k in teachers:
        assert (a[9] if len(a) > 9 else k.get("teacher_transform")) == t, kind
    if kind == "medusa2":  # (the adapted base's own logits too)
        assert any((a[10] if len(a) > 10 else k.get("transform")) == t for a, k in calls)
