"""DFlash-style block drafters: which base layers they read, the many-blocks training forward against one block at
a time, the drafter's block against the training forward, exact greedy and eager = static = compiled tokens over
chains and trees, the loss's position weights, and the checkpoint layout SGLang loads (keys, config, logits)."""

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import tiny_llama
from test_decoder import plain_greedy
from draftlab.base import base_states
from draftlab.config import LossSection
from draftlab.decode.acceptance import Sampling
from draftlab.decode.cache import static_slots
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.tree import Tree
from draftlab.drafters import PromptState, build_draft, kind_of, make_drafter
from draftlab.drafters.dflash import DFlashDraft, default_gamma, default_layers
from draftlab.interop.export import load_export, save_export


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tensors are tiny, and idle threads spinning on a busy machine slow them down."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def dflash(base, seed=0, scale=1.0, **cfg):
    torch.manual_seed(seed)
    d = build_draft({"type": "dflash", "dflash": {"num_layers": 2, "block_size": 5, **cfg}}, base)
    d = d.to(next(base.parameters()).dtype).eval()
    with torch.no_grad():
        for p in d.parameters():  # proposals that differ from row to row and step to step
            p.add_(torch.randn_like(p) * 0.05 * scale)
    return d


def test_layer_ids_are_dflash_target_layers_shifted_to_hidden_states_ids():
    """DFlash reads the OUTPUT of decoder layers 1 .. L-3 spread over as many as it has draft layers (one: L // 2);
    draftlab's ids are hidden_states indices, one more."""
    assert default_layers(36, 5) == [2, 10, 18, 26, 34]  # Qwen3-8B's DFlash draft: target_layer_ids 1, 9, 17, 25, 33
    assert default_layers(32, 1) == [17] and default_layers(28, 3) == [2, 14, 26]
    assert all(1 <= i <= 4 for i in default_layers(5, 3))  # a shallow base still gets ids of real layer outputs
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    # ... and distinct ones (a new user's 2-layer base trained on [1, 1], which `check` then passed; review)
    assert all(len(set(default_layers(L, n))) == n for L in range(2, 9) for n in range(1, L))
    from draftlab.interop.check import check_aux

    # a base too shallow for distinct layers trains with a word (draftlab decodes it; the engines cannot)
    with pytest.warns(UserWarning, match=r"reads layers \[1, 1\], which repeat.*num_layers at most 1"):
        DFlashDraft.settings({"type": "dflash", "dflash": {"num_layers": 2}}, tiny_llama(layers=2))
    with pytest.raises(ValueError, match=r"head.dflash.layers \[1, 5\].*ids 1..4"):
        DFlashDraft.settings({"type": "dflash", "dflash": {"num_layers": 2, "layers": [1, 5]}}, tiny_llama(layers=4))
    # a mask token past the vocabulary is named, not an IndexError in the first step (walk-through)
    with pytest.raises(ValueError, match=r"mask_token_id=9999: the base's vocabulary has 64 tokens"):
        DFlashDraft.settings({"type": "dflash", "dflash": {"num_layers": 1, "mask_token_id": 9999}},
                             tiny_llama(vocab=64, layers=4))
    cfg = {"dflash_config": {"target_layer_ids": [0, 0]}}
    assert check_aux(cfg, {"head": {"type": "dflash", "layers": [1, 1]}}, ["sglang"], 2).ok is False


def _one_block(d: DFlashDraft, states, ids, a):
    """Block anchored at a, computed alone: its context is cut at a (positions 0..a-1) and it sees only itself."""
    c = d.context(states[:, :a])
    kv = d.context_kv(c, torch.arange(a)[None])
    T = d.block_size
    block = d.block_input(ids[:, a])
    return d.draft(block, a + torch.arange(T)[None], kv, torch.ones(1, T, a, dtype=torch.bool))[0]


def test_many_blocks_in_one_forward_equal_each_block_alone():
    base = tiny_llama(layers=4, seed=2)
    d = dflash(base, seed=3, scale=5.0)
    ids = torch.randint(3, 64, (1, 14))
    states = base_states(base, ids, torch.ones_like(ids), d.base_layers)[:, :, :-1]
    anchor = torch.tensor([[1, 4, 5, 11]])
    with torch.no_grad():
        many = d.block_outputs(states, ids, torch.ones_like(ids, dtype=torch.bool), anchor)
        for j, a in enumerate(anchor[0].tolist()):
            torch.testing.assert_close(many[0, j], _one_block(d, states, ids, a))


def test_the_drafter_drafts_what_training_saw():
    """After a prompt x_0..x_{L-1} and root x_L, the drafter's block is the training block anchored at L."""
    base = tiny_llama(layers=4, seed=4)
    d = dflash(base, seed=5, scale=5.0)
    ids = torch.randint(3, 64, (1, 12))
    L = 8
    states = base_states(base, ids, torch.ones_like(ids), d.base_layers)[:, :, :-1]
    dr = make_drafter(d, Tree.chain(4))
    out = base(input_ids=ids[:, :L], output_hidden_states=True)
    dr.begin(PromptState(ids[:, :L], torch.ones(1, L, dtype=torch.bool), torch.arange(L)[None],
                         {l: out.hidden_states[l] for l in d.base_layers}), Sampling(), None)
    with torch.no_grad():
        got = dr._block(ids[:, L])
        want = d.logits(_one_block(d, states, ids, L)[1:])
    torch.testing.assert_close(got[0], want.float())


def test_greedy_over_chains_and_trees_equals_plain_greedy():
    rng = random.Random(0)
    base = tiny_llama(layers=3, seed=0)
    d = dflash(base, seed=10, scale=3.0)
    for tree in (Tree.chain(4), Tree.from_paths([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0], [0, 1]])):
        dec = SpeculativeDecoder(base, make_drafter(d, tree))
        for B in (1, 3):
            prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 10))] for _ in range(B)]
            res = dec.generate(prompts, max_new_tokens=20)
            for p, got in zip(prompts, res.tokens):
                assert got == plain_greedy(base, p, 20), (tree, p)


def _peaked():
    base = tiny_llama(vocab=32, layers=2, seed=4)
    with torch.no_grad():
        base.lm_head.weight.mul_(4)  # wide top-2 margins
    return base


def _row_ends(drafter) -> list[int]:
    """Each row's end in the drafter's context cache, on the device, with a last commit the static path has staged
    (written at the next proposal) counted."""
    ends = drafter.row_n.tolist()
    if drafter.staged is not None:
        ends = [e + int(k) for e, k in zip(ends, drafter.staged[2].sum(-1).tolist())]
    return ends


@pytest.mark.parametrize("window_min", [256, 4])
def test_block_logits_at_every_step_are_the_same_on_the_static_path(window_min, monkeypatch):
    """On the static path a commit's context entries are written in the next proposal's call (padded to one width,
    the padding holes; windows of 8-32 slots with window_min 4): the block's logits at every step equal the eager
    path's, finer than tokens."""
    from draftlab.drafters.dflash import DFlashDrafter

    monkeypatch.setattr("draftlab.decode.cache.WINDOW_MIN", window_min)
    base = _peaked()
    d = dflash(base, seed=3, block_size=4).eval()
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    seen, block = [], DFlashDrafter._block

    def recording(self, *args):
        out = block(self, *args)
        seen[-1].append(out.clone())
        return out
    monkeypatch.setattr(DFlashDrafter, "_block", recording)
    used = []
    for opts in ({}, {"static": True}):
        seen.append([])
        dec = SpeculativeDecoder(base, make_drafter(d, tree), **opts)
        res = dec.generate(prompts, max_new_tokens=21)
        used.append(_row_ends(dec.drafter))
        L = max(map(len, prompts))  # each row's entries: the (padded) prompt and its own text, not the batch's
        assert all(end <= L + len(t) + tree.depth for end, t in zip(used[-1], res.tokens)), (used[-1], opts)
        assert dec.drafter.valid.shape[1] == static_slots(dec.drafter.slots)  # (never regrown in the run)
    assert len(seen[0]) == len(seen[1]) > 5
    for a, b in zip(*seen):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The static path's context cache holds each row's paths, as the eager one does (found by review: it grew by the
    # tree's width every step, holes kept, reallocated as it filled; then by the batch's longest path, one end shared
    # by every row, which filled it twice as fast as the text with 6 rows).
    assert used[0] == used[1]


PROMPTS3 = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]  # uneven: left-padded rows
TREE5 = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])


@pytest.fixture(scope="module")
def trained():
    """The peaked base and a block drafter trained for a few steps on its own greedy text: it accepts several tokens
    per step, some rows more than others."""
    base = _peaked()
    d = dflash(base, seed=1, block_size=4, num_anchors=64)
    text = torch.tensor([[1] + plain_greedy(base, [1], 40), [1, 5] + plain_greedy(base, [1, 5], 39)])
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    d.train()
    with torch.no_grad():
        st = base_states(base, text, torch.ones_like(text), d.base_layers)
    for _ in range(60):
        loss = d.objective(st, text, torch.ones_like(text), None, None, LossSection())["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return base, d.eval()


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_every_step_s_block_is_the_training_block_at_that_row_s_root(trained, static, monkeypatch):
    """Past the first step and with several rows (uneven prompts, partial accepts): each row's block in the decoder
    equals the training forward's block anchored at its root's position over that row's own text, so the drafter's
    context and positions follow each row (a wrong one would only lower acceptance, which the exactness tests do
    not see; found by review: only the first step of one row was compared)."""
    from draftlab.drafters.dflash import DFlashDrafter

    base, d = trained
    seen, block = [], DFlashDrafter._block

    def recording(self, root, window=None, next_pos=None):
        out = block(self, root, window, next_pos)
        seen.append((root.clone(), (self.next_pos if next_pos is None else next_pos).clone(), out.clone()))
        return out

    monkeypatch.setattr(DFlashDrafter, "_block", recording)
    res = SpeculativeDecoder(base, make_drafter(d, TREE5), static=static).generate(PROMPTS3, max_new_tokens=21)
    assert res.accept_length > 1.5 and len(seen) > 5
    compared = 0
    for b, p in enumerate(PROMPTS3):
        full = torch.tensor([p + res.tokens[b]])
        states = base_states(base, full, torch.ones_like(full), d.base_layers)[:, :, :-1]
        for root, pos, logits in seen:
            a = int(pos[b])
            if a < full.shape[1] - 1:  # (a row that has ended drafts nothing that counts)
                assert int(root[b]) == int(full[0, a])
                with torch.no_grad():
                    want = d.logits(_one_block(d, states, full, a)[1:]).float()
                torch.testing.assert_close(logits[b], want, atol=1e-4, rtol=1e-4)
                compared += 1
    assert compared > 15


@pytest.mark.parametrize("path,window_min", [({"static": True}, 256), ({"static": True}, 4),
                                             pytest.param({"compile": "eager"}, 256, marks=pytest.mark.slow)])
def test_static_and_compiled_paths_give_the_eager_tokens_and_accept_more_than_one(path, window_min, monkeypatch,
                                                                                  trained):
    """A block drafter trained for a few steps on the base's own greedy text accepts several tokens per step;
    the static-shape path (and, with the slow tests, the compiled one: dynamo's graph capture) gives the eager
    tokens and steps, with EOS in the middle of a block. window_min 4: the block reads windows of 8, 16 and 32 of
    its 256 context slots as the text grows."""
    monkeypatch.setattr("draftlab.decode.cache.WINDOW_MIN", window_min)
    base, d = trained
    prompts, tree = PROMPTS3, TREE5
    eager = SpeculativeDecoder(base, make_drafter(d, tree)).generate(prompts, max_new_tokens=21)
    assert eager.accept_length > 1.5, eager.accept_length
    eos = eager.tokens[0][9]
    ref = SpeculativeDecoder(base, make_drafter(d, tree)).generate(prompts, max_new_tokens=21, eos_token_id=eos)
    for p, got in zip(prompts, eager.tokens):
        assert got == plain_greedy(base, p, 21)
    dec = SpeculativeDecoder(base, make_drafter(d, tree), **path)
    ref_dec = SpeculativeDecoder(base, make_drafter(d, tree))
    for e, r in ((None, eager), (eos, ref)):
        got = dec.generate(prompts, max_new_tokens=21, eos_token_id=e)
        assert got.tokens == r.tokens and got.steps == r.steps, (path, e)
        ref_dec.generate(prompts, max_new_tokens=21, eos_token_id=e)
        assert _row_ends(dec.drafter) == _row_ends(ref_dec.drafter)  # the context cache holds what the eager one does


def test_the_compiled_block_call_traces_as_one_graph():
    """The drafter's compiled call (the last commit's entries, the block, the greedy tree's tokens) has no graph break:
    a break would run Python between its pieces on every step. It once had one: it read Tree.depth (a max() with a
    default, which dynamo cannot trace)."""
    from torch._dynamo.utils import counters

    base = tiny_llama(layers=4, seed=2)
    counters["graph_break"].clear()
    dec = SpeculativeDecoder(base, make_drafter(dflash(base, seed=3), Tree.from_paths([[0], [1], [0, 0]])),
                             compile="eager")
    assert len(dec.generate([[1, 5, 7, 9, 5, 7], [1, 3]], max_new_tokens=12).tokens[0]) == 12
    assert not counters["graph_break"], list(counters["graph_break"])


def test_loss_weights_decay_over_block_positions_and_anchors_need_supervision():
    base = tiny_llama(layers=4, seed=6)
    d = dflash(base, seed=6, block_size=4, loss_decay_gamma=2.0)
    ids = torch.randint(3, 64, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :9] = 0  # row 0: a prompt; only x_9.. are supervised
    states = base_states(base, ids, torch.ones_like(ids), d.base_layers)
    anchor, ok = d.anchors(ids, mask, torch.ones_like(ids, dtype=torch.bool))
    assert set(anchor[0][ok[0]].tolist()) == set(range(9, 15))  # x_a and x_{a+1} supervised, a + 1 < S
    assert set(anchor[1][ok[1]].tolist()) == set(range(1, 15))
    out = d.objective(states, ids, mask, None, None, LossSection())
    per = out["loss_sum"] / out["count"]
    w = torch.tensor([math.exp(-k / 2.0) for k in range(3)])
    # The loss is SpecForge's: weighted sum over positions divided by the summed weights.
    torch.testing.assert_close(out["loss"].float(), (w * out["loss_sum"]).sum().float() / (w * out["count"]).sum().float())
    assert out["count"].tolist() == [20.0, 18.0, 16.0]  # anchors whose position k target lies inside the text
    assert bool(torch.isfinite(per).all())


def test_evaluation_anchors_are_the_same_per_batch_every_time_and_differ_between_batches():
    base = tiny_llama(layers=4, seed=6)
    d = dflash(base, seed=6, block_size=4, num_anchors=4).eval()
    a, b = torch.randint(3, 64, (2, 32), generator=torch.Generator().manual_seed(1)), torch.randint(
        3, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    mask, valid = torch.ones_like(a), torch.ones_like(a, dtype=torch.bool)
    first = d.anchors(a, mask, valid)[0]
    torch.manual_seed(5)  # the global stream does not move them
    assert torch.equal(d.anchors(a, mask, valid)[0], first)
    assert not torch.equal(d.anchors(b, mask, valid)[0], first)


def test_distillation_targets_the_base_distribution():
    """With loss.distill_weight 1 the target is the base's distribution at a+k-1 (speculators'), not the data token:
    on random text, a draft that outputs exactly the base's next-token logits there has zero divergence."""
    base = tiny_llama(layers=4, seed=7)
    d = dflash(base, seed=7, block_size=3)
    ids = torch.randint(3, 64, (1, 12))
    states = base_states(base, ids, torch.ones_like(ids), d.base_layers)
    w = base.get_output_embeddings().weight
    teacher_loss = d.objective(states, ids, torch.ones_like(ids), None, w, LossSection(distill_weight=1.0))
    data_loss = d.objective(states, ids, torch.ones_like(ids), None, w, LossSection(distill_weight=0.0))
    assert not torch.allclose(teacher_loss["loss"], data_loss["loss"])
    assert teacher_loss["agree1"].shape == (2,)


def _engine_block_logits(t: dict, cfg: dict, feats, ctx_pos, block_ids, block_pos, embed, lm_head, rope):
    """Logits of a block computed from the checkpoint's tensors the way SGLang's DFlash model does: fc then
    hidden_norm over the target layers' features; per layer the context's k / v from that layer's k_proj / v_proj
    (RoPE at their positions), queries and the block's own k / v from input_layernorm(x); non-causal attention."""
    def rms(x, w, eps=cfg["rms_norm_eps"]):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rot(x, cos, sin):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    assert cfg["dflash_config"]["target_layer_ids"] == [i - 1 for i in cfg["_draftlab_layers"]]
    h, nh, kvh, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ctx = rms(feats @ t["fc.weight"].t(), t["hidden_norm.weight"])  # [C, H]
    x = embed(block_ids)
    cc, sc = rope(ctx_pos)
    cb, sb = rope(block_pos)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        y = rms(x, t[p + "input_layernorm.weight"])
        q = (y @ t[p + "self_attn.q_proj.weight"].t()).view(-1, nh, hd).transpose(0, 1)
        k = torch.cat([ctx, y]) @ t[p + "self_attn.k_proj.weight"].t()
        v = torch.cat([ctx, y]) @ t[p + "self_attn.v_proj.weight"].t()
        k = k.view(-1, kvh, hd).transpose(0, 1)
        v = v.view(-1, kvh, hd).transpose(0, 1)
        q, k = rms(q, t[p + "self_attn.q_norm.weight"]), rms(k, t[p + "self_attn.k_norm.weight"])  # per head
        k = rot(k, torch.cat([cc, cb]), torch.cat([sc, sb]))
        q = rot(q, cb, sb)
        k, v = k.repeat_interleave(nh // kvh, 0), v.repeat_interleave(nh // kvh, 0)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v
        x = x + a.transpose(0, 1).reshape(len(block_ids), -1) @ t[p + "self_attn.o_proj.weight"].t()
        y = rms(x, t[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(y @ t[p + "mlp.gate_proj.weight"].t()) * (y @ t[p + "mlp.up_proj.weight"].t())) @ \
            t[p + "mlp.down_proj.weight"].t()
    return rms(x, t["norm.weight"])[1:] @ lm_head.t()


def test_export_is_the_dflash_checkpoint_layout(tmp_path):
    base = tiny_llama(layers=6, seed=9)
    d = dflash(base, seed=9, scale=5.0, mask_token_id=5)
    out = save_export(d, base, tmp_path / "e", "tiny")
    t = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight"}
    assert set(t) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2)
                                                                             for n in per_layer}
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_hidden_layers"] == 2
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 5 and cfg["dflash_config"]["mask_token_id"] == 5
    assert cfg["num_target_layers"] == 6 and t["fc.weight"].shape == (32, 32 * len(cfg["dflash_config"]["target_layer_ids"]))
    # Logits from the files, the engine's way, equal draftlab's.
    loaded, _ = load_export(out, base=base)
    loaded = loaded.double().eval()
    ids = torch.randint(3, 64, (1, 10))
    st = base_states(base, ids, torch.ones_like(ids), loaded.base_layers)[0, :, :-1]
    cfg["_draftlab_layers"] = list(loaded.base_layers)
    a = 7
    block = torch.tensor([int(ids[0, a])] + [5] * 4)
    ref = _engine_block_logits({k: v.double() for k, v in t.items()}, cfg, st[:a].flatten(-2), torch.arange(a),
                               block, a + torch.arange(5), base.model.embed_tokens, base.lm_head.weight,
                               lambda pos: tuple(x[0] for x in loaded.rope(st[None, :1, 0], pos[None])))
    dr = make_drafter(loaded, Tree.chain(4))
    out_h = base(input_ids=ids[:, :a], output_hidden_states=True)
    dr.begin(PromptState(ids[:, :a], torch.ones(1, a, dtype=torch.bool), torch.arange(a)[None],
                         {l: out_h.hidden_states[l] for l in loaded.base_layers}), Sampling(), None)
    with torch.no_grad():
        torch.testing.assert_close(dr._block(ids[:, a])[0].double(), ref)


def test_recipe_errors_name_the_key_and_the_fix():
    from draftlab.config import ConfigError, build_recipe

    with pytest.raises(ConfigError) as e:
        build_recipe({"base": {"name_or_path": "x"}, "head": {"type": "dflash", "dflash": {"block_sise": 8}},
                      "data": {"path": "d.txt"}, "output_dir": "o"})
    assert "head.dflash.block_sise" in str(e.value) and "block_size" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_recipe({"base": {"name_or_path": "x"}, "head": {"type": "medusa", "dflash": {}},
                      "data": {"path": "d.txt"}, "output_dir": "o"})
    assert "head.type: dflash" in str(e.value)


def test_trees_deeper_than_the_block_are_refused():
    base = tiny_llama(layers=3, seed=1)
    d = dflash(base, block_size=3)
    with pytest.raises(ValueError, match="depth <= 2"):
        make_drafter(d, Tree.chain(3))
    assert kind_of("dflash").default_tree(d).paths == Tree.chain(2).paths


# --- sampling: drafts drawn from the block's q per position --------------------------------------------------------

def test_sampled_block_drafts_keep_the_base_law_over_several_steps():
    """Sampled drafts (each depth-d node an i.i.d. draw from the block's q_d, handed to verification) keep the base's
    law at every position of 8-token continuations, with depth >= 2 accepts, through generate's own streams."""
    from test_sampling_law import (PROMPTS, assert_deep_accepts, assert_fits, assert_rejects, law_checks,
                                   law_statistic, peaked_base, prompts, sample)
    from law import conditional_laws

    base = peaked_base(layers=3)
    d = dflash(base, seed=8, block_size=4, num_anchors=64, num_layers=1).train()
    torch.manual_seed(0)
    with torch.no_grad():
        ids = base.generate(torch.tensor([PROMPTS[0]] * 32), attention_mask=torch.ones(32, 2, dtype=torch.long),
                            do_sample=True, max_new_tokens=14, temperature=1.0, top_k=0, top_p=1.0)
        states = base_states(base, ids, torch.ones_like(ids), d.base_layers)
    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    ones = torch.ones_like(ids)
    for _ in range(40):
        loss = d.objective(states, ids, ones, None, base.lm_head.weight, LossSection(distill_weight=1.0))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    s = Sampling(temperature=0.7, top_k=5)
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    x, res, log = sample(SpeculativeDecoder(base, make_drafter(d.eval(), tree)), 600, 8, s)
    assert_deep_accepts(res, log)
    p = conditional_laws(base, prompts(600), x, s)
    assert_fits(law_checks(x, p))
    assert_rejects(law_statistic(x, conditional_laws(base, prompts(600), x, Sampling(1.2, top_k=5))))


# --- search-tree: the rank statistics of a block drafter ----------------------------------------------------------

def fitted(d, base, seqs, steps=40):
    """d trained for a few steps on the base's own text seqs (equal lengths)."""
    text = torch.tensor(seqs)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    with torch.no_grad():
        st = base_states(base, text, torch.ones_like(text), d.base_layers)
    for _ in range(steps):
        loss = d.train().objective(st, text, torch.ones_like(text), None, None, LossSection())["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


def test_search_statistics_replay_the_decoder_exactly():
    """The ranks search-tree collects for a block drafter, replayed along trees, give the accept length the decoder
    measures on the same prompts."""
    from draftlab.decode.search import RankStats, grow_tree, replay_accept_length
    from draftlab.serve.tree_search import collect_ranks, greedy_continuations, measure

    base = _peaked()
    prompts = [[1, 5, 7], [1, 3], [2, 9, 4, 4], [1]]
    seqs = greedy_continuations(base, prompts, 20, None)
    d = fitted(dflash(base, seed=1, block_size=4, num_anchors=64), base, [s[:18] for s in seqs])
    per_text = collect_ranks(base, d, seqs, [len(p) for p in prompts], 3)
    measured = []
    for tree in (Tree.chain(3), Tree.chain(1), grow_tree(RankStats(torch.cat(per_text), 3), 5)):
        m = measure(SpeculativeDecoder(base, make_drafter(d, tree)), prompts, 1, 20, None)
        assert replay_accept_length(tree, per_text) == pytest.approx(m["accept_length"], abs=1e-12)
        measured.append(m["accept_length"])
    assert max(measured) > 1.5


def test_generate_cli_decodes_a_dflash_export_like_plain_greedy(tiny_base_dir, tmp_path, capsys):
    from draftlab.base import load_base
    from draftlab.cli import main

    b, tok = load_base(str(tiny_base_dir), "float32")
    save_export(dflash(b, block_size=4).float(), b, tmp_path / "exp", str(tiny_base_dir), tokenizer=tok)
    for tree in ("default", "chain", "chain:2"):
        assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once upon a time", "--max-new-tokens", "12",
                     "--tree", tree, "--compare", "--json"]) == 0
        rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rep["identical_to_baseline"] is True and rep["tree_size"] == (3 if tree == "chain:2" else 4), (tree, rep)
