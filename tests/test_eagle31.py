"""EAGLE-3.1 options on the EAGLE-3 drafter: fc_norm (an RMSNorm per base layer before the fusion) and norm_output (the
normalised output is what lm_head reads and what the next step is fed), as SpecForge / speculators name them; both
off is EAGLE-3 unchanged."""

import json

import torch

from conftest import tiny_llama
from test_decoder import plain_greedy
from draftlab.base import base_states
from draftlab.config import LossSection
from draftlab.decode.acceptance import Sampling
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.tree import DynamicTree
from draftlab.drafters import PromptState, build_draft, make_drafter
from draftlab.interop.export import load_export, save_export


def eagle(base, seed=0, **opts):
    torch.manual_seed(seed)
    d = build_draft({"type": "eagle3", "eagle": opts}, base).to(torch.float64).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return d


def test_defaults_are_eagle3():
    base = tiny_llama(layers=4, seed=1)
    d = eagle(base)
    assert not any(k.startswith("fc_norm") for k in d.state_dict()) and not d.norm_output
    feats = torch.randn(2, 5, 3, 32, dtype=torch.float64)
    torch.testing.assert_close(d.fuse(feats), d.fc(feats.flatten(-2)))
    out = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(d.head_input(out), d.norm(out))


def test_fc_norm_normalises_each_layer_before_the_fusion(tmp_path):
    base = tiny_llama(layers=4, seed=2)
    d = eagle(base, seed=2, fc_norm=True)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(d.state_dict())
    feats = torch.randn(2, 5, 3, 32, dtype=torch.float64) * torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)[:, None]
    want = d.fc(torch.cat([d.fc_norm[i](feats[..., i, :]) for i in range(3)], -1))
    torch.testing.assert_close(d.fuse(feats), want)
    # Scaling one layer's features leaves the fused features unchanged (its norm absorbs it); not so in EAGLE-3.
    scaled = feats.clone()
    scaled[..., 2, :] *= 7.0
    torch.testing.assert_close(d.fuse(scaled), want, rtol=1e-4, atol=1e-5)  # up to the norm's eps
    plain = eagle(base, seed=2)
    assert not torch.allclose(plain.fuse(scaled), plain.fuse(feats))
    out = save_export(d, base, tmp_path / "e", "tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is False
    loaded, _ = load_export(out, base=base)
    torch.testing.assert_close(loaded.double().fuse(feats), want, rtol=1e-5, atol=1e-6)  # the export is float32


def test_norm_output_feeds_the_normalised_state_forward():
    """With norm_output every unrolled step yields the normalised output (unit RMS at the norm's initial weight), and
    the next step reads it; the drafter after the prompt holds training step 0's state at the last slot."""
    base = tiny_llama(layers=4, seed=3)
    d = eagle(base, seed=3, norm_output=True)
    with torch.no_grad():
        d.norm.weight.fill_(1.0)
    ids = torch.randint(3, 64, (1, 12))
    with torch.no_grad():
        st = base_states(base, ids, torch.ones_like(ids), d.base_layers)
        outs = list(d.unroll(d.fuse(st[:, :, :3]), ids, torch.ones_like(ids, dtype=torch.bool), 3))
    for o in outs:
        torch.testing.assert_close(o.pow(2).mean(-1), torch.ones_like(o[..., 0]), atol=1e-4, rtol=0)
    L = 8
    dr = make_drafter(d, DynamicTree(2, 2, 4))
    out = base(input_ids=ids[:, :L], output_hidden_states=True)
    dr.begin(PromptState(ids[:, :L], torch.ones(1, L, dtype=torch.bool), torch.arange(L)[None],
                         {l: out.hidden_states[l] for l in d.base_layers}), Sampling(), None)
    with torch.no_grad():
        dr.propose(ids[:, L])
    torch.testing.assert_close(dr.out[0], outs[0][0, L - 1])
    loss = d.train().objective(st, ids, torch.ones_like(ids), None, base.lm_head.weight, LossSection())["loss"]
    assert torch.isfinite(loss) and loss > 0


def test_eagle31_decodes_exactly_like_the_base():
    base = tiny_llama(layers=3, seed=4)
    d = eagle(base, seed=4, fc_norm=True, norm_output=True)
    prompts = [[5, 9, 3], [7], [1, 2, 3, 4, 5, 6]]
    for opts in ({}, {"static": True}):
        res = SpeculativeDecoder(base, make_drafter(d, DynamicTree(3, 3, 8)), **opts).generate(prompts, max_new_tokens=16)
        for p, got in zip(prompts, res.tokens):
            assert got == plain_greedy(base, p, 16), (opts, p)
