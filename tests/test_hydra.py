import random

import pytest
import torch

from conftest import tiny_llama
from test_decoder import plain_greedy, random_tree
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.search import default_tree
from draftlab.decode.tree import Tree
from draftlab.decode.acceptance import Sampling
from draftlab.drafters import PromptState, StepResult, build_draft, make_drafter
from draftlab.drafters.heads import HeadsDrafter


def hydra(base, prefix: bool, heads=3, layers=2, noise=0.05, seed=0):
    torch.manual_seed(seed)
    d = build_draft({"type": "hydra", "num_heads": heads, "num_layers": layers, "prefix_attention": prefix},
                    base).to(torch.float64)
    for p in d.parameters():
        p.data += noise * torch.randn_like(p)
    return d.eval()


def test_fresh_hydra_head_predicts_like_the_base():
    base = tiny_llama()
    d = build_draft({"type": "hydra", "num_heads": 2, "num_layers": 1}, base).double()
    h = torch.randn(3, 32, dtype=torch.float64)
    path = torch.randint(0, 64, (3, 2))
    torch.testing.assert_close(d.head_logits(1, h, path), base.lm_head(h))


@pytest.mark.parametrize("prefix", [False, True])
def test_training_features_equal_decoding_features(prefix):
    """Teacher-forced training features at position t == what the decoder computes for the same tokens."""
    base = tiny_llama(seed=2)
    d = hydra(base, prefix)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        hidden = base(ids, output_hidden_states=True).hidden_states[-1]  # [1, S, H]
        feats = d.train_hidden(hidden, ids, torch.ones_like(ids))
        t = 6  # the decoder state after committing x_0..x_t
        drafter = HeadsDrafter(d, Tree.chain(3))
        drafter.begin(prompt_state(hidden[:, : t + 1]), Sampling(), None)
        h = drafter.hidden
        for k in range(3):
            path = ids[:, t + 1: t + k + 2]  # root x_{t+1} and k drafted tokens
            dec = d.head_logits(k, h, path)
            train = d.heads[k].lm_head(feats[k][:, t])
            torch.testing.assert_close(dec, train)


def prompt_state(hidden):
    B, L, _ = hidden.shape
    valid = torch.ones(B, L, dtype=torch.bool)
    return PromptState(torch.zeros(B, L, dtype=torch.long), valid, torch.arange(L)[None].expand(B, L), {-1: hidden})


@pytest.mark.parametrize("prefix", [False, True])
def test_prefix_state_advance_equals_full_prefix_pass(prefix):
    """The drafter's state after committing 4 more tokens == the prefix layer over all 9 states at once."""
    base = tiny_llama(seed=3)
    d = hydra(base, prefix)
    hidden = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        full = d.context(hidden)
        drafter = HeadsDrafter(d, Tree.chain(3))
        drafter.begin(prompt_state(hidden[:, :5]), Sampling(), None)
        keep = torch.arange(4)[None].expand(2, 4)
        ones = torch.ones(2, 4, dtype=torch.bool)
        drafter.commit(StepResult(torch.zeros(2, 4, dtype=torch.long), [[0, 1, 2, 3]] * 2, keep, ones,
                                  torch.tensor([3, 3]), torch.arange(5, 9)[None].expand(2, 4),
                                  torch.ones(2, 5, dtype=torch.bool), torch.zeros(2, dtype=torch.long),
                                  torch.ones(2, dtype=torch.bool), {-1: hidden[:, 5:]}))
    torch.testing.assert_close(drafter.hidden, full[:, 8])


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_hydra_greedy_equals_plain_greedy(prefix, seed):
    rng = random.Random(seed)
    base = tiny_llama(seed=seed)
    d = hydra(base, prefix, seed=seed)
    for tree in [default_tree(3, 12), Tree.chain(3), random_tree(rng, 3), Tree.from_paths([])]:
        dec = SpeculativeDecoder(base, make_drafter(d, tree))
        for B in (1, 3):
            prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 9))] for _ in range(B)]
            res = dec.generate(prompts, max_new_tokens=20)
            for p, got in zip(prompts, res.tokens):
                assert got == plain_greedy(base, p, 20), (prefix, tree.paths, p)


def test_hydra_export_round_trip_needs_the_base(tiny_base_dir, tmp_path):
    from draftlab.base import load_base
    from draftlab.interop.export import load_export, save_export

    base, _ = load_base(str(tiny_base_dir), "float32")
    d = build_draft({"type": "hydra", "num_heads": 2, "num_layers": 4, "prefix_attention": True}, base)
    for p in d.parameters():
        p.data += 0.01
    save_export(d, base, tmp_path / "e", str(tiny_base_dir))
    again, meta = load_export(tmp_path / "e", base=base)
    assert meta["head"]["prefix_attention"] is True
    sd = d.state_dict()
    assert any(k.startswith("prefix_layer.") for k in sd)
    assert not any("embed" in k for k in sd)  # the frozen base's embedding is not exported
    for k, v in again.state_dict().items():
        torch.testing.assert_close(v, sd[k])


def test_distill_data_is_batched_resumable_and_trainable(tiny_base_dir, tmp_path):
    import json

    from draftlab.config import DataSection
    from draftlab.base import load_tokenizer
    from draftlab.data import load_examples
    from draftlab.train.distill import distill_data

    src = tmp_path / "prompts.json"
    src.write_text(json.dumps([{"instruction": f"Tell me about cat {i}", "output": "ignored"} for i in range(5)]))
    out = tmp_path / "distilled.jsonl"
    first = distill_data(str(tiny_base_dir), str(src), str(out), max_new_tokens=6, batch_size=2, max_records=3)
    assert first["written"] == 3
    again = distill_data(str(tiny_base_dir), str(src), str(out), max_new_tokens=6, batch_size=2)
    assert again == {**again, "written": 2, "skipped_existing": 3}
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert sorted(r["source_index"] for r in recs) == [0, 1, 2, 3, 4]
    assert recs[0]["conversations"][0]["from"] == "human" and recs[0]["conversations"][-1]["from"] == "gpt"
    # Greedy answers are the base's own continuation of the chat prompt (here one prompt at a time, unpadded).
    from draftlab.base import load_base

    base, tok = load_base(str(tiny_base_dir), "float32")
    for r in recs:
        text = tok.apply_chat_template([{"role": "user", "content": r["conversations"][0]["value"]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        gen = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                            temperature=None, top_p=None, top_k=None, pad_token_id=tok.pad_token_id)
        assert r["conversations"][-1]["value"] == tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
    # Every record trains (load_examples drops those whose answer has no token left after truncation).
    train, _, _ = load_examples(DataSection(path=str(out), eval_size=0), load_tokenizer(str(tiny_base_dir)))
    assert len(train) == 5


def test_head_dropout_acts_in_training_only():
    base = tiny_llama(seed=6)
    d = build_draft({"type": "hydra", "num_heads": 2, "num_layers": 3, "dropout": 0.5}, base).double()
    plain = build_draft({"type": "hydra", "num_heads": 2, "num_layers": 3}, base).double()
    plain.load_state_dict(d.state_dict())  # dropout has no weights: same keys, exports stay compatible
    h, path = torch.randn(4, 32, dtype=torch.float64), torch.randint(0, 64, (4, 2))
    d.train()
    assert not torch.equal(d.head_logits(1, h, path), d.head_logits(1, h, path))
    d.eval()
    plain.eval()
    torch.testing.assert_close(d.head_logits(1, h, path), plain.head_logits(1, h, path))
    assert d.config()["dropout"] == 0.5


def test_cosine_schedule_floor():
    from draftlab.train.loop import lr_lambda

    f = lr_lambda(10, 110, final=0.33)
    assert f(0) < f(9) < 1 and f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.665)
    assert f(110) == pytest.approx(0.33) and f(500) == pytest.approx(0.33)
    assert lr_lambda(10, 110)(110) == pytest.approx(0.0)


def test_the_prefix_layer_attends_with_sdpa_under_a_flash_attention_base():
    """A base loaded with attn_implementation flash_attention_2 (a training recipe's) gave the Hydra++ prefix layer,
    a copy of its last layer, flash attention too: a float32 layer under an explicit 4D mask, which flash attention
    takes neither of. The layer now attends with sdpa; the base keeps its own attention."""
    base = tiny_llama(seed=3)
    base.config._attn_implementation = "flash_attention_2"  # (as loaded for training; not run here)
    d = build_draft({"type": "hydra", "num_heads": 2, "num_layers": 2, "prefix_attention": True}, base)
    assert d.prefix_layer.self_attn.config._attn_implementation == "sdpa"
    assert base.config._attn_implementation == "flash_attention_2"
    h = torch.randn(2, 5, base.config.hidden_size)
    out = d.context(h, torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    assert out.shape == h.shape and torch.isfinite(out).all()
