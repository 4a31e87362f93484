"""Bases other than Llama's layout (found by a walk-through with a user's own bases): Phi-3 packs q, k and v in one
projection, and Phi-4-mini (like Phi-2, StableLM, GLM-4 and Qwen3-Next) rotates part of each head only."""

import json
import random
import shutil

import pytest
import torch

from test_decoder import plain_greedy
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.tree import DynamicTree, Tree
from draftlab.drafters import build_draft, make_drafter


def phi3(partial: float = 1.0, vocab: int = 64, seed: int = 0, **config):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    cfg = Phi3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     partial_rotary_factor=partial, bos_token_id=1, eos_token_id=2, pad_token_id=0, **config)
    model = Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked logits: wide top-2 margins
        model.lm_head.weight.mul_(8)
    return model


def noisy(d):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d.eval()


HEADS = {"hydra++": ({"type": "hydra", "num_heads": 3, "num_layers": 1, "prefix_attention": True}, Tree.chain(3)),
         "eagle3": ({"type": "eagle3"}, DynamicTree(3, 4, 10)),
         "dflash": ({"type": "dflash", "dflash": {"num_layers": 2, "block_size": 4}}, Tree.chain(3))}


@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
@pytest.mark.parametrize("kind", list(HEADS))
def test_drafters_on_a_phi3_base_decode_its_greedy_tokens(kind, partial):
    """Hydra++'s prefix layer read q_proj's dtype (Phi-3 has qkv_proj: AttributeError); EAGLE-3's and DFlash's layers
    applied the base's partial rotary table to whole heads (a size mismatch at 0.75, and at 0.5 the half-head
    widening meant for gpt-oss). A draft layer now rotates its whole head at the base's theta, as the engines'
    Llama layer does from the export's config (the table is computed here from its definition); every kind
    decodes the base's greedy tokens (which catches a crash, not a wrong rotation: greedy is kept whatever is
    drafted)."""
    base = phi3(partial)
    head, tree = HEADS[kind]
    d = noisy(build_draft(head, base))
    if kind != "hydra++":
        assert "partial_rotary_factor" not in d.cfg["rope_parameters"]
        hd, theta = d.cfg["head_dim"], base.config.rope_parameters["rope_theta"]
        angles = torch.arange(7.0)[:, None] / theta ** (torch.arange(0, hd, 2) / hd)
        x = torch.zeros(1, 7, 32)
        cos, sin = d.rope(x, torch.arange(7)[None])
        torch.testing.assert_close(cos[0], torch.cat([angles, angles], -1).cos())
        torch.testing.assert_close(sin[0], torch.cat([angles, angles], -1).sin())
    rng = random.Random(0)
    dec = SpeculativeDecoder(base, make_drafter(d, tree))
    prompts = [[rng.randrange(3, 64) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    for p, got in zip(prompts, dec.generate(prompts, max_new_tokens=16).tokens):
        assert got == plain_greedy(base, p, 16), (kind, partial, p)


def test_an_eagle3_export_of_a_partial_rotary_base_is_read_alike_by_the_engines(tiny_base_dir, tmp_path):
    """The export's config.json carries the base's theta without its partial factor, and the engines' reading of the
    files (a Llama layer rotating its whole head from that config) drafts what draftlab drafts."""
    from draftlab.base import load_base
    from draftlab.interop.check import check_export
    from draftlab.interop.export import save_export

    d = tmp_path / "phi4mini"
    d.mkdir()
    for f in tiny_base_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, d / f.name)
    src = json.loads((tiny_base_dir / "config.json").read_text())
    model = phi3(0.75, vocab=src["vocab_size"])
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = (
        src["bos_token_id"], src["eos_token_id"], src["pad_token_id"])
    model.save_pretrained(d)
    base, tok = load_base(str(d), "float32")
    draft = noisy(build_draft({"type": "eagle3"}, base))
    exp = save_export(draft, base, tmp_path / "export", str(d),
                      extra={"training": {"recipe": {"base": {"name_or_path": str(d)}}}})
    assert "partial_rotary_factor" not in json.dumps(json.loads((exp / "config.json").read_text()))
    checks = {c["name"]: c for c in check_export(exp, engine="vllm")["checks"]}
    assert checks["rope"]["ok"] is True, checks["rope"]
    assert checks["proposals"]["ok"] is True, checks["proposals"]


@pytest.mark.slow  # compiles the base and the drafter: ~90 s
def test_an_eagle3_drafter_of_a_partial_rotary_base_compiles_to_the_same_tokens():
    base = phi3(0.75)
    head, tree = HEADS["eagle3"]
    dec = SpeculativeDecoder(base, make_drafter(noisy(build_draft(head, base)), tree), compile=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 64) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    for p, got in zip(prompts, dec.generate(prompts, max_new_tokens=16).tokens):
        assert got == plain_greedy(base, p, 16), p


def test_a_draft_made_before_keeps_its_table_and_longrope_partial_bases_are_refused():
    """A draft whose config keeps the base's factor (made before 2026-12-03: a GLM-4-like 0.5 base, the half table
    repeated) decodes as it was trained, and check fails its export (engines rotate that part). A partial base with
    longrope scaling (Phi-3.5 / Phi-4-mini), whose factors are per rotated frequency, is refused for EAGLE-3 and
    DFlash (a size mismatch; the engines would fail the same way on such an export)."""
    from draftlab.drafters.eagle import Eagle3Draft
    from draftlab.interop.check import check_rope

    base = phi3(0.5)
    cfg = Eagle3Draft.settings({"type": "eagle3"}, base)
    old = Eagle3Draft({**cfg, "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": 0.5}}, base)
    x, pos = torch.zeros(1, 5, 32), torch.arange(5)[None]
    half, _ = base.model.rotary_emb(x, pos)
    torch.testing.assert_close(old.rope(x, pos)[0], torch.cat([half, half], -1))
    bad = check_rope(old.engine_config(), base.config.to_dict(), "eagle3", ["vllm"])
    assert bad.ok is False and "config.json keeps partial_rotary_factor 0.5" in bad.message
    assert check_rope(Eagle3Draft(cfg, base).engine_config(), base.config.to_dict(), "eagle3", ["vllm"]).ok

    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 3, "long_factor": [2.0] * 3,
                "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75}
    base = phi3(0.75, rope_parameters=longrope)
    for head in ({"type": "eagle3"}, HEADS["dflash"][0]):
        with pytest.raises(ValueError, match="with longrope scaling, whose factors are per rotated frequency"):
            build_draft(head, base)
