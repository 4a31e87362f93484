"""Medusa-2: heads trained jointly with a LoRA adapter on the base (peft): the warm-up, the combined loss with
self-distillation, checkpoints without the frozen base, the export's adapter and decoding against the adapted
base (greedy output equals the adapted base's own), and the recipe errors."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_train import recipe
from draftlab.config import ConfigError, build_recipe
from draftlab.decode.acceptance import Sampling
from draftlab.serve.generate import load_decoder, plain_generate
from draftlab.interop.export import read_meta
from draftlab.train import train


def medusa2(base, data, out, **lora):
    r = recipe(base, data, out, "medusa2", max_steps=4, lr=3e-2)
    raw = r.model_dump(mode="json")
    raw["lora"] = {**raw["lora"], **lora}
    return build_recipe(raw)


def test_warm_up_then_joint_training_and_the_export(tiny_base_dir, data_file, tmp_path):
    out = tmp_path / "m2"
    train(medusa2(tiny_base_dir, data_file, out, heads_warmup_steps=2))
    logs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {l["step"]: l for l in logs if "loss" in l}
    assert "base_loss" not in steps[1] and "base_loss" not in steps[2]  # warm-up: heads only
    # The cross-entropy to the original base: before LoRA's first update (its B starts at zero) it is that base's
    # own entropy, so at most log(vocab); a loss summed over positions or against the wrong target would exceed it.
    vocab = json.loads((Path(tiny_base_dir) / "config.json").read_text())["vocab_size"]
    assert 0 < steps[3]["base_loss"] <= math.log(vocab) and steps[4]["base_loss"] > 0
    meta = read_meta(out / "export")
    assert meta["adapter"] == "adapter"
    cfg = json.loads((out / "export" / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and set(cfg["target_modules"]) == {"q_proj", "v_proj"}
    lora = load_file(out / "export" / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora.items())  # the adapter trained (B starts at 0)
    # Checkpoints hold the heads and the adapter, not the frozen base.
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    saved = load_file(next(ckpt.glob("model*.safetensors")))
    assert any("lora_" in k for k in saved) and not any("embed_tokens" in k or "base_layer" in k for k in saved)
    # An engine format carries the adapter, and its card says to serve the heads with the merged base (found by
    # review: the heads alone, under a card that promised the original base's output).
    from draftlab.interop.convert import export_to

    rep = export_to(out / "export", "vllm-medusa", tmp_path / "vllm")
    assert "adapter/adapter_model.safetensors" in rep["files"]
    assert load_file(tmp_path / "vllm" / "adapter" / "adapter_model.safetensors").keys() == lora.keys()
    card = (tmp_path / "vllm" / "README.md").read_text()
    assert "Medusa-2" in card and "merge_and_unload" in card and "the adapted base's greedy output" in card


def test_warm_up_leaves_the_adapter_untouched(tiny_base_dir, data_file, tmp_path):
    out = tmp_path / "w"
    train(medusa2(tiny_base_dir, data_file, out, heads_warmup_steps=10))
    lora = load_file(out / "export" / "adapter" / "adapter_model.safetensors")
    assert all(v.abs().max() == 0 for k, v in lora.items() if "lora_B" in k)


def test_decoding_follows_the_adapted_base(tiny_base_dir, data_file, tmp_path):
    out = tmp_path / "d"
    train(medusa2(tiny_base_dir, data_file, out, heads_warmup_steps=1, self_distill=False, lr=0.2))
    decoder, tok, _ = load_decoder(str(out / "export"), device="cpu")
    from draftlab.base import load_base
    from peft import PeftModel

    original, _ = load_base(str(tiny_base_dir), "float32")
    adapted = PeftModel.from_pretrained(load_base(str(tiny_base_dir), "float32")[0], out / "export" / "adapter").merge_and_unload()
    prompts = [[tok.bos_token_id] + tok("Once upon a time the cat").input_ids, [tok.bos_token_id, 5, 9]]
    got = decoder.generate(prompts, 24).tokens
    want, _ = plain_generate(adapted, prompts, 24, Sampling(), None)
    assert got == want
    for (name, p), (_, q) in zip(decoder.base.named_parameters(), adapted.named_parameters()):
        torch.testing.assert_close(p, q)
    # The adapter moved the base: some weight the LoRA targets differs from the original.
    assert any(not torch.equal(p, q) for (n, p), (_, q) in zip(adapted.named_parameters(), original.named_parameters())
               if "q_proj" in n or "v_proj" in n)


@pytest.mark.parametrize("change,msg", [({"head": {"type": "ssm"}}, "set head.type: medusa"),
                                        ({"train": {"cache_hidden": True}}, "cannot be cached"),
                                        ({"distributed": {"strategy": "fsdp"}}, "not fsdp")])
def test_recipe_errors(tiny_base_dir, data_file, tmp_path, change, msg):
    raw = medusa2(tiny_base_dir, data_file, tmp_path).model_dump(mode="json")
    for k, v in change.items():
        raw[k] = {**raw[k], **v}
    with pytest.raises(ConfigError, match=msg):
        build_recipe(raw)


def test_target_modules_the_base_lacks(tiny_base_dir, data_file, tmp_path, capsys):
    """A misspelt target module: peft adapted the others in silence, or failed with its own words once none
    matched; train names the base's linear layers (validate does too, from the base's config: test_cli)."""
    from draftlab.base import load_base
    from draftlab.train.loop import lora_problems

    with pytest.raises(ValueError, match=r"lora.target_modules \['qproj'\]: no module of the base has that name \(its "
                                         r"layers: embed_tokens, q_proj, k_proj, v_proj, o_proj, gate_proj"):
        train(medusa2(tiny_base_dir, data_file, tmp_path / "none", target_modules=["qproj"]))
    base, _ = load_base(str(tiny_base_dir), "float32")
    refused, said = lora_problems(medusa2(tiny_base_dir, data_file, tmp_path, target_modules=["q_proj", "vproj"]), base)
    assert refused == [] and said == ["lora.target_modules ['vproj']: no module of the base has that name (its layers: "
                                      "embed_tokens, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
                                      "lm_head); the adapter goes on the others only"]
    assert lora_problems(medusa2(tiny_base_dir, data_file, tmp_path), base) == ([], [])
    # peft's own rule: a name that ends a module's dotted name, any layer type it adapts (review: a qualified name
    # and GPT-2's Conv1D c_attn were refused, and train then refused a recipe peft takes)
    assert lora_problems(medusa2(tiny_base_dir, data_file, tmp_path, target_modules=["self_attn.q_proj", "v_proj"]),
                         base) == ([], [])
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50))
    assert lora_problems(medusa2(tiny_base_dir, data_file, tmp_path, target_modules=["c_attn", "c_proj"]),
                         gpt2) == ([], [])
