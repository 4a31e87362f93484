"""Small drafter LMs (SSMs): exact greedy decoding, their KV cache following the text, lossless sampling with
sampled drafts (and a wrong residual caught), dynamic per-row trees in the verifier, training and export."""

import random

import pytest
import torch

from conftest import tiny_llama
from test_decoder import _joint_first_two, _sample_joint, chi_square, plain_greedy, random_tree
from draftlab.decode import acceptance
from draftlab.decode.acceptance import Sampling, accept_greedy, accept_sampling, warp
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.tree import Tree, TreeError, TreeView
from draftlab.drafters import Drafter, Proposal
from draftlab.drafters.ssm import SSMDrafter


def small_lm(seed=1, layers=1, hidden=16, vocab=64):
    """A different, smaller Llama over the same vocabulary: a bad but honest drafter."""
    return tiny_llama(vocab=vocab, hidden=hidden, layers=layers, seed=seed)


# --- greedy exactness -------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_ssm_greedy_equals_plain_greedy(seed):
    rng = random.Random(seed)
    base = tiny_llama(seed=seed)
    trees = [Tree.chain(1), Tree.chain(5), Tree.expansion([2, 2, 1]), Tree.expansion([1, 3]), random_tree(rng, 4)]
    for lm in (small_lm(seed + 10), tiny_llama(seed=seed)):  # a poor drafter, and the base itself (all accepted)
        for tree in trees:
            if tree.depth == 0:
                continue
            dec = SpeculativeDecoder(base, SSMDrafter(lm, tree))
            for B in (1, 3):
                prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 10))] for _ in range(B)]
                res = dec.generate(prompts, max_new_tokens=20)
                for p, got in zip(prompts, res.tokens):
                    assert got == plain_greedy(base, p, 20), (tree.paths, p)


def test_the_base_as_its_own_drafter_accepts_every_token():
    base = tiny_llama(seed=0)
    dec = SpeculativeDecoder(base, SSMDrafter(tiny_llama(seed=0), Tree.chain(4)))
    res = dec.generate([[1, 2, 3], [7]], max_new_tokens=40)
    # 10 steps of 4 drafted + 1 bonus per row (40 tokens: the prefill's 1, then 39 = 7 full steps + 4).
    assert res.accept_length > 4.5


def test_ssm_drafts_follow_the_committed_text():
    """Each step's chain equals the SSM's own greedy continuation of the committed text computed from scratch:
    its KV cache holds exactly the committed tokens after every accept, reject, accepted leaf and bonus."""
    base = tiny_llama(seed=5)
    lm = small_lm(seed=6, layers=2)
    drafter = SSMDrafter(lm, Tree.chain(3))
    steps = []
    propose, commit = drafter.propose, drafter.commit

    def spy_propose(root):
        prop = propose(root)
        steps.append({"tokens": prop.tokens.clone()})
        return prop

    def spy_commit(step):
        steps[-1].update(paths=step.paths, bonus=step.bonus.tolist())
        commit(step)
    drafter.propose, drafter.commit = spy_propose, spy_commit
    prompts = [[4, 9, 2], [11, 3, 5, 8, 1]]
    res = SpeculativeDecoder(base, drafter).generate(prompts, max_new_tokens=16)
    text = [p + r[:1] for p, r in zip(prompts, res.tokens)]  # prompt + the prefill's token (the first root)
    checked = 0
    for st in steps:
        for b in range(2):
            done = text[b][len(prompts[b]):]
            if len(done) >= len(res.tokens[b]):
                continue  # this row had ended
            assert st["tokens"][b, 1:].tolist() == plain_greedy(lm, text[b], 3), (b, text[b])
            checked += 1
            if "paths" in st:
                text[b] += [int(st["tokens"][b, n]) for n in st["paths"][b][1:]] + [st["bonus"][b]]
    assert checked >= 6


# --- sampling with sampled drafts -------------------------------------------------------------------

def _two_level_trials(n, p1, p2, q1, q2, widths, g, s):
    """n verifications (one step over n rows, each row one independent trial) of a two-level tree whose children are
    drawn i.i.d. from the draft's q; the base's conditionals are p1 (after the root) and p2[x] (after x). Returns
    the first two committed tokens of each trial, as a [n, 2] tensor."""
    V = p1.shape[0]
    k1, k2 = widths
    first = torch.multinomial(q1, n * k1, replacement=True, generator=g).view(n, k1)
    second = torch.multinomial(q2[first.flatten()], k2, replacement=True, generator=g).view(n, k1 * k2)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), first, second], 1)  # node j's children after all of depth 1
    parents = torch.tensor([-1] + [0] * k1 + [1 + j for j in range(k1) for _ in range(k2)])
    qi = torch.tensor([-1] + [0] * k1 + [1 + j for j in range(k1) for _ in range(k2)])
    N = tokens.shape[1]
    logits = torch.zeros(n, N, V)  # depth-2 leaves: any p (their bonus is not looked at)
    logits[:, 0] = p1.log()
    logits[:, 1: 1 + k1] = p2[first].log()
    q = torch.cat([q1.expand(n, 1, V), q2[first]], 1)  # [n, 1 + k1, V]
    view = TreeView.of_parents(parents.expand(n, N))
    paths, bonus = accept_sampling(tokens, logits, view, s, g, q, qi.expand(n, N))
    out = torch.empty(n, 2, dtype=torch.long)
    for r, path in enumerate(paths):
        got = [int(tokens[r, m]) for m in path[1:]] + [int(bonus[r])]
        out[r, : min(2, len(got))] = torch.tensor(got[:2])
    alone = torch.tensor([len(path) == 1 for path in paths])  # nothing accepted: the token after the bonus comes
    out[alone, 1] = torch.multinomial(p2[out[alone, 0]], 1, generator=g)[:, 0]  # from the next step, drawn from p2
    return out


def _joint_counts(out, V):
    return torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V).view(V, V).float()


@pytest.mark.parametrize("widths", [(1, 1), (3, 2)])
def test_multi_step_speculative_sampling_keeps_the_joint_law(widths):
    torch.manual_seed(0)
    V, s = 6, Sampling(temperature=1.0)
    p1 = torch.softmax(torch.randn(V) * 1.5, -1)
    p2 = torch.softmax(torch.randn(V, V) * 1.5, -1)
    q1 = torch.softmax(torch.randn(V) * 1.5, -1)  # a draft that disagrees with the base
    q2 = torch.softmax(torch.randn(V, V) * 1.5, -1)
    g = torch.Generator().manual_seed(1)
    counts = _joint_counts(_two_level_trials(6000, p1, p2, q1, q2, widths, g, s), V)
    stat, df = chi_square(counts, p1[:, None] * p2)
    assert df >= 20
    assert stat < df + 4 * (2 * df) ** 0.5, (stat, df)


def test_a_wrong_residual_fails_the_same_check(monkeypatch):
    """Renormalising p after a rejection instead of taking max(p - q, 0) (sampled drafts) is caught."""
    monkeypatch.setattr(acceptance, "residual", lambda p, q: p)
    torch.manual_seed(0)
    V, s = 6, Sampling(temperature=1.0)
    p1 = torch.softmax(torch.randn(V) * 1.5, -1)
    p2 = torch.softmax(torch.randn(V, V) * 1.5, -1)
    q1 = torch.softmax(torch.randn(V) * 1.5, -1)
    q2 = torch.softmax(torch.randn(V, V) * 1.5, -1)
    g = torch.Generator().manual_seed(1)
    counts = _joint_counts(_two_level_trials(6000, p1, p2, q1, q2, (3, 2), g, s), V)
    stat, df = chi_square(counts, p1[:, None] * p2)
    assert stat > df + 4 * (2 * df) ** 0.5, (stat, df)


@pytest.mark.slow  # one sample per call; test_sampling_law checks SSM trees' law batched in the default run
@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.expansion([2, 2])])
def test_ssm_speculative_sampling_matches_plain_sampling_end_to_end(tree):
    base = tiny_llama(vocab=16, seed=4)
    lm = small_lm(seed=7, vocab=16)
    with torch.no_grad():
        base.lm_head.weight.mul_(6)  # peaked, so the test has power with few samples
        lm.lm_head.weight.mul_(4)
    dec = SpeculativeDecoder(base, SSMDrafter(lm, tree))
    s = Sampling(temperature=0.8, top_p=0.9)
    joint = _joint_first_two(base, [1, 5], s)
    stat, df = chi_square(_sample_joint(dec, [1, 5], s, 2000, seed=0), joint)
    assert df >= 5
    assert stat < df + 4 * (2 * df) ** 0.5, (stat, df)


# --- dynamic trees in the verifier ------------------------------------------------------------------

class RandomTreeDrafter(Drafter):
    """A different random tree per row and per step (padded to the largest), tokens from a heads-free rule:
    mostly random, sometimes the base's true next token, so some paths are accepted."""

    def __init__(self, base, seed=0, max_nodes=9):
        self.base, self.rng, self._max = base, random.Random(seed), max_nodes
        self.sizes = []

    @property
    def max_nodes(self):
        return self._max

    def begin(self, prompt, sampling, generator):
        self.text = [[int(t) for t, v in zip(r, m) if v] for r, m in zip(prompt.ids, prompt.valid)]

    def propose(self, root):
        B, V = root.shape[0], self.base.config.vocab_size
        rows = []
        for b in range(B):
            n = self.rng.randint(1, self._max)
            parents = [-1] + [self.rng.randrange(i) for i in range(1, n)]
            ctx = self.text[b] + [int(root[b])]
            tokens = [int(root[b])]
            for i in range(1, n):
                tokens.append(self.rng.randrange(V))
            # Make one path the true continuation now and then.
            if n > 1 and self.rng.random() < 0.7:
                guess = plain_greedy(self.base, ctx, 1)[0]
                tokens[[i for i in range(1, n) if parents[i] == 0][0]] = guess
            rows.append((tokens, parents))
        N = max(len(t) for t, _ in rows)
        self.sizes.append([len(t) for t, _ in rows])
        tok = torch.zeros(B, N, dtype=torch.long)
        par = torch.full((B, N), -1, dtype=torch.long)
        ok = torch.zeros(B, N, dtype=torch.bool)
        for b, (t, p) in enumerate(rows):
            tok[b, : len(t)], par[b, : len(p)], ok[b, : len(t)] = torch.tensor(t), torch.tensor(p), True
        return Proposal(tok, TreeView.of_parents(par, ok))

    def commit(self, step):
        for b, path in enumerate(step.paths):
            self.text[b] += [int(step.tokens[b, n]) for n in path] if bool(step.live[b]) else []


@pytest.mark.parametrize("seed", range(3))
def test_per_row_per_step_trees_are_exact(seed):
    rng = random.Random(seed)
    base = tiny_llama(seed=seed)
    drafter = RandomTreeDrafter(base, seed)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 8))] for _ in range(3)]
    res = SpeculativeDecoder(base, drafter).generate(prompts, max_new_tokens=18)
    for p, got in zip(prompts, res.tokens):
        assert got == plain_greedy(base, p, 18)
    assert res.accept_length > 1.1  # the true tokens planted in the trees were accepted
    assert any(len(set(s)) > 1 for s in drafter.sizes)  # rows really had different trees


def test_tree_view_from_parents_and_padding():
    par = torch.tensor([[-1, 0, 0, 1, 3, -1], [-1, 0, 1, -1, -1, -1]])
    ok = torch.tensor([[True] * 5 + [False], [True] * 3 + [False] * 3])
    v = TreeView.of_parents(par, ok)
    assert v.depth[0].tolist()[:5] == [0, 1, 1, 2, 3] and v.depth[1].tolist()[:3] == [0, 1, 2]
    assert v.path_to(0, 4) == [0, 1, 3, 4] and v.children(0)[1] == [3]
    assert not v.ancestors[0, 4, 2] and v.ancestors[0, 5].tolist() == [False] * 5 + [True]  # padding: itself only
    # Greedy acceptance never picks a padded node even if it "matches".
    logits = torch.zeros(2, 6, 8)
    tokens = torch.zeros(2, 6, dtype=torch.long)  # argmax of zeros is 0: every token matches
    paths, _ = accept_greedy(tokens, logits, v)
    assert paths == [[0, 1, 3, 4], [0, 1, 2]]
    with pytest.raises(TreeError, match="topological order"):
        TreeView.of_parents(torch.tensor([[-1, 2, 0]]))
    with pytest.raises(TreeError, match="padded node is the parent"):
        TreeView.of_parents(torch.tensor([[-1, 0, 1]]), torch.tensor([[True, False, True]]))



@pytest.mark.parametrize("N", [2, 9, 70])
def test_tree_view_ancestors_equal_a_walk_up_the_parents(N):
    """Random trees (a deep chain among them: depth N - 1), padded rows, and the max_depth bound a drafter passes."""
    g = torch.Generator().manual_seed(N)
    par = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]),
                       torch.arange(-1, N - 1)])
    ok = torch.ones(2, N, dtype=torch.bool)
    ok[0, N // 2 + 1:] = ~(par[0, N // 2 + 1:] > N // 2) & (torch.rand(N - N // 2 - 1, generator=g) < 0.7)
    ok[0] &= ok[0].gather(0, par[0].clamp(min=0))  # a padded node parents no valid node
    want = torch.zeros(2, N, N, dtype=torch.bool)
    for b in range(2):
        for i in range(N):
            j = i
            while j >= 0 and ok[b, i]:
                want[b, i, j], j = True, int(par[b, j])
            want[b, i, i] = True
    depth = want.sum(-1) - 1
    v = TreeView.of_parents(par, ok)
    assert torch.equal(v.ancestors, want) and torch.equal(v.depth, depth)
    bounded = TreeView.of_parents(par[:1], ok[:1], max_depth=int(depth[0].max()))
    assert torch.equal(bounded.ancestors, want[:1])


# --- building, exporting, loading --------------------------------------------------------------------

def test_init_from_the_base(tiny_base_dir):
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.drafters.ssm import SSMError

    base, _ = load_base(str(tiny_base_dir), "float32")
    ids = torch.randint(0, base.config.vocab_size, (2, 9))
    # All of the base's layers copied: the SSM is the base.
    full = build_draft({"type": "ssm", "ssm": {"num_layers": 2, "init": "truncate"}}, base)
    torch.testing.assert_close(full.lm(ids).logits, base(ids).logits)
    one = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base)
    torch.testing.assert_close(one.lm.base_model.layers[0].self_attn.q_proj.weight,
                               base.base_model.layers[0].self_attn.q_proj.weight)
    same = build_draft({"type": "ssm", "ssm": {"num_layers": 1}}, base)  # auto: embeddings
    torch.testing.assert_close(same.lm.get_input_embeddings().weight, base.get_input_embeddings().weight)
    narrow = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}}, base)  # auto: project
    E, Es = base.get_input_embeddings().weight, narrow.lm.get_input_embeddings().weight
    assert Es.shape == (E.shape[0], 16)
    # The projection keeps the embeddings' geometry as far as 16 directions can: similar tokens stay similar.
    c = lambda M: torch.nn.functional.normalize(M - M.mean(0), dim=1) @ torch.nn.functional.normalize(M - M.mean(0), dim=1).t()
    assert torch.corrcoef(torch.stack([c(E).flatten(), c(Es).flatten()]))[0, 1] > 0.5
    with pytest.raises(SSMError, match="16 wide and the base 32; use init: project"):
        build_draft({"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16, "init": "embeddings"}}, base)


def test_a_vocabulary_mismatch_names_both_sizes(tiny_base_dir, tmp_path):
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.drafters.ssm import SSMError

    base, _ = load_base(str(tiny_base_dir), "float32")
    other = tiny_llama(vocab=48, hidden=16, layers=1, dtype=torch.float32)
    other.save_pretrained(tmp_path / "other")
    V = base.config.vocab_size
    with pytest.raises(SSMError, match=f"vocabulary of 48 tokens and the base {V}"):
        build_draft({"type": "ssm", "ssm": {"name_or_path": str(tmp_path / "other")}}, base)
    # A pretrained model keeps its shape: the fields that shape a built one are refused beside it (num_layers: 1
    # trained a 2-layer model without a word; walk-through)
    from draftlab.config import ConfigError, build_recipe

    with pytest.raises(ConfigError, match="head.ssm.num_layers=1: these shape an SSM built from the base's config"):
        build_recipe({"base": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}, "output_dir": "o",
                      "head": {"type": "ssm", "ssm": {"name_or_path": "small", "num_layers": 1}}})
    # A directory that is not there is named as one (it was reported as a malformed hub id; walk-through)
    from draftlab.base import BaseModelError

    with pytest.raises(BaseModelError, match="head.ssm.name_or_path=.*: no such directory"):
        build_draft({"type": "ssm", "ssm": {"name_or_path": str(tmp_path / "gone")}}, base)


def test_a_draft_model_trains_on_the_logits_it_drafts_with(tiny_base_dir):
    """The SSM drafts with the model's own logits, and trained on softmax(h @ W): a bias, soft-capping or a logit
    scale made the two differ (found by review: a Phi-style bias left 20% of argmaxes agreeing), so such drafts were
    refused, Gemma-2-2B for Gemma-2-27B among them. Training now applies the model's soft cap or scale
    (SSMDraft.logit_transform) and gets the model's own logits; a bias is still refused."""
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.drafters.ssm import SSMError, check_vocab
    from draftlab.losses import lm_logits

    base, _ = load_base(str(tiny_base_dir), "float32")
    lm = tiny_llama(vocab=base.config.vocab_size, hidden=16, layers=1, dtype=torch.float32)
    check_vocab(lm, base, "plain")
    lm.lm_head.bias = torch.nn.Parameter(torch.zeros(base.config.vocab_size))
    with pytest.raises(SSMError, match="biased: .*an lm_head bias.*build one from the recipe"):
        check_vocab(lm, base, "biased")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=base.config.vocab_size, hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=8, final_logit_softcapping=1.5)).eval()
    with torch.no_grad():
        gemma.lm_head.weight.mul_(20)
    check_vocab(gemma, base, "gemma")
    from draftlab.drafters.ssm import SSMDraft

    draft = SSMDraft(gemma)
    ids = torch.randint(3, base.config.vocab_size, (2, 9))
    with torch.no_grad():
        h = draft.train_hidden(None, ids)[0]
        got = lm_logits(h, draft.lm_heads[0].weight, draft.logit_transform)
        torch.testing.assert_close(got, gemma(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        assert draft.logit_transform == (1.0, 1.5) and not torch.allclose(lm_logits(h, gemma.lm_head.weight), got)
        from draftlab.config import LossSection
        from draftlab.train.objectives import DraftObjective

        loss = DraftObjective(draft, LossSection())(None, ids, torch.ones_like(ids))["loss_sum"][0]
        own = torch.nn.functional.cross_entropy(gemma(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                                reduction="sum")
        torch.testing.assert_close(loss, own)
    base.config.final_logit_softcapping = 30.0  # a draft built from the recipe keeps none of a base's
    assert build_draft({"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}}, base).logit_transform is None


def test_a_pretrained_draft_model_s_logits_are_checked_on_a_forward(tiny_base_dir, tmp_path, monkeypatch):
    """A pretrained draft model's transform was taken from its config alone: a config key its code does not read was
    applied in training, and logits changed in a way no key names went unnoticed. One forward decides."""
    import draftlab.base as dbase
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.drafters.ssm import SSMError
    from transformers import Gemma2Config, Gemma2ForCausalLM

    base, _ = load_base(str(tiny_base_dir), "float32")
    V = base.config.vocab_size
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           final_logit_softcapping=1.5))
    with torch.no_grad():
        gemma.lm_head.weight.mul_(20)
    gemma.save_pretrained(tmp_path / "gemma")
    assert build_draft({"type": "ssm", "ssm": {"name_or_path": str(tmp_path / "gemma")}}, base).logit_transform == \
        (1.0, 1.5)
    llama = tiny_llama(vocab=V, hidden=16, layers=1, dtype=torch.float32)
    llama.config.final_logit_softcapping = 0.5  # (LlamaForCausalLM does not read it)
    llama.save_pretrained(tmp_path / "llama")
    ssm = {"type": "ssm", "ssm": {"name_or_path": str(tmp_path / "llama")}}
    assert build_draft(ssm, base).logit_transform is None
    real = dbase.pretrained_lm

    def doubled(*a, **k):  # logits changed by the model's code under no key draftlab reads
        lm = real(*a, **k)
        lm.lm_head.register_forward_hook(lambda m, i, out: out * 2)
        return lm

    monkeypatch.setattr(dbase, "pretrained_lm", doubled)
    with pytest.raises(SSMError, match="own logits are not its lm_head's product, nor"):
        build_draft(ssm, base)


def test_every_pretrained_load_asks_for_transformers_torch_layers(tiny_base_dir, tmp_path, monkeypatch):
    """From 5.25 transformers swaps layers for Hub kernels unless from_pretrained is told use_kernels=False: fetched
    from the Hub as the model loads (an offline node fails) and rounding otherwise than the layers draftlab trains
    and checks. The base, a pretrained SSM and an SSM export all load with transformers' torch layers."""
    from transformers import AutoModelForCausalLM

    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import load_export, save_export

    asked, load = [], AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        asked.append(kwargs.get("use_kernels"))
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    base, tok = load_base(str(tiny_base_dir), "float32")
    ssm = build_draft({"type": "ssm", "ssm": {"name_or_path": str(tiny_base_dir)}}, base)
    load_export(save_export(ssm, base, tmp_path / "exp", str(tiny_base_dir), tokenizer=tok), base=base)
    assert asked == [False, False, False]


def test_ssm_export_loads_on_its_own_and_decodes(tiny_base_dir, tmp_path, capsys):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftlab.base import load_base
    from draftlab.cli import main
    from draftlab.drafters import build_draft
    from draftlab.interop.export import ExportError, load_export, read_meta, save_export

    base, tok = load_base(str(tiny_base_dir), "float32")
    ssm = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}}, base).eval()
    exp = save_export(ssm, base, tmp_path / "exp", str(tiny_base_dir), tokenizer=tok)
    meta = read_meta(exp)
    assert meta["head"]["type"] == "ssm" and meta["head"]["num_layers"] == 1 and meta["base"]["hidden_size"] == 32
    import os

    # safetensors 0.8 wrote the weights 0600: an engine running as another user could not read them (walk-through)
    mask = os.umask(0o022)
    try:
        save_export(ssm, base, tmp_path / "exp2", str(tiny_base_dir), tokenizer=tok)
    finally:
        os.umask(mask)
    assert (tmp_path / "exp2" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    # A plain Hugging Face directory: what assisted generation, vLLM or SGLang take as a draft model.
    hf = AutoModelForCausalLM.from_pretrained(exp)
    assert len(AutoTokenizer.from_pretrained(exp)) == len(tok)
    ids = torch.randint(0, base.config.vocab_size, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ssm.lm(ids).logits)
    again, _ = load_export(exp, base=base)
    # An SSM reads only the base's tokens: a base of another width with its vocabulary serves it; another vocabulary
    # does not.
    load_export(exp, base=tiny_llama(vocab=base.config.vocab_size, hidden=48, dtype=torch.float32))
    with pytest.raises(ExportError, match=f"vocab_size: export has {base.config.vocab_size}, base has"):
        load_export(exp, base=tiny_llama(vocab=base.config.vocab_size + 8, dtype=torch.float32))
    for tree in ("default", "chain:2", "expansion:2,1"):
        assert main(["generate", str(exp), "--prompt", "Once upon", "--max-new-tokens", "10", "--tree", tree,
                     "--compare", "--json"]) == 0
        rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rep["identical_to_baseline"] is True and rep["drafter"]["kind"] == "ssm", rep
    assert main(["generate", str(exp), "--prompt", "x", "--temperature", "0.8", "--json"]) == 0
    (exp / "model.safetensors").unlink()
    with pytest.raises(ExportError, match="incomplete ssm export, missing model.safetensors"):
        read_meta(exp)
