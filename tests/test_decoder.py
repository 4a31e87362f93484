import random

import pytest
import torch

from conftest import tiny_llama
from draftlab.decode.cache import cache_arg
from draftlab.decode.acceptance import Sampling, accept_sampling, draw, sample, warp
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.search import default_tree
from draftlab.decode.tree import Tree, TreeError, TreeView
from draftlab.drafters import Drafter, Proposal, make_drafter
from draftlab.drafters.heads import MedusaHeads


def noisy_heads(base, num_heads=3, noise=0.05, seed=0):
    torch.manual_seed(seed)
    H, V = base.config.hidden_size, base.config.vocab_size
    d = MedusaHeads(H, V, num_heads, 1).to(next(base.parameters()).dtype)
    d.init_from_base(base)
    for p in d.parameters():
        p.data += noise * torch.randn_like(p)
    return d.eval()


def random_tree(rng, depth, max_rank=3, max_paths=14):
    paths = set()
    for _ in range(rng.randint(0, max_paths)):
        p = tuple(rng.randint(0, max_rank - 1) for _ in range(rng.randint(1, depth)))
        paths.update(p[:i] for i in range(1, len(p) + 1))
    return Tree.from_paths([list(p) for p in paths])


def plain_greedy(model, prompt, n):
    # An explicit mask: generate() would otherwise mask prompt tokens equal to pad_token_id.
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                         top_k=None)
    return out[0, len(prompt):].tolist()


# --- trees ----------------------------------------------------------------------------------------

def test_tree_derivations():
    t = Tree.from_paths([[1], [0], [0, 0], [0, 1], [1, 0]])
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0)) and t.size == 6 and t.depth == 2
    b = t.buffers()
    assert b.depth.tolist() == [0, 1, 1, 2, 2, 2] and b.parent.tolist() == [-1, 0, 0, 1, 1, 2]
    assert b.mask[3].tolist() == [True, True, False, True, False, False]
    assert b.leaf_paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert t.topk_per_depth() == [2, 2]
    assert Tree.chain(3).paths == ((0,), (0, 0), (0, 0, 0))


@pytest.mark.parametrize("paths,msg", [
    ([[0, 1]], "has no parent [0]"),
    ([[0], [0]], "appears twice"),
    ([[0], [-1]], "non-negative integer ranks"),
    ([[]], "non-empty list"),
    ("x", "expected a list of paths"),
])
def test_invalid_trees(paths, msg):
    with pytest.raises(TreeError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        Tree.from_paths(paths)


def test_tree_files_round_trip(tmp_path):
    t = default_tree(4, 12)
    t.save(tmp_path / "t.json")
    again = Tree.load(tmp_path / "t.json")
    assert again.paths == t.paths and again.metadata["expected_accept_length"] > 1
    (tmp_path / "t.yaml").write_text("paths: [[0], [0, 0], [1]]\nmetadata: {name: x}\n")
    assert Tree.load(tmp_path / "t.yaml").size == 4 and Tree.load(tmp_path / "t.yaml").metadata["name"] == "x"
    (tmp_path / "plain.json").write_text("[[0], [1]]")  # (a file's tree without a name is named by the file)
    assert Tree.load(tmp_path / "plain.json").metadata["name"] == "plain"
    # An expansion's widths below 1 are said to be so (they were said not to be integers: walk-through)
    from draftlab.serve.generate import _resolve_tree

    meta = {"head": {"type": "medusa", "num_heads": 2}}
    with pytest.raises(TreeError, match=r"--tree expansion:0: expansion \[0\]: needs one or more widths >= 1"):
        _resolve_tree("expansion:0", meta)
    with pytest.raises(TreeError, match="expansion widths must be integers"):
        _resolve_tree("expansion:a", meta)
    (tmp_path / "bad.json").write_text("[[0, 0]]")
    with pytest.raises(TreeError, match="bad.json: path"):
        Tree.load(tmp_path / "bad.json")


# --- greedy exactness -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_plain_greedy_random_trees_tiny_llama(seed):
    rng = random.Random(seed)
    base = tiny_llama(seed=seed)
    heads = noisy_heads(base, seed=seed)
    trees = [random_tree(rng, 3), Tree.from_paths([]), Tree.chain(3), default_tree(3, 10)]
    for tree in trees:
        dec = SpeculativeDecoder(base, make_drafter(heads, tree))
        for B in (1, 3):
            prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 12))] for _ in range(B)]
            res = dec.generate(prompts, max_new_tokens=24)
            for p, got in zip(prompts, res.tokens):
                assert got == plain_greedy(base, p, 24), (tree.paths, p)


class OracleDrafter(Drafter):
    """Drafts the true continuation of one known sequence as a chain of `depth` tokens (long accepted paths)."""

    def __init__(self, seq, prompt_len, depth):
        self.seq, self.depth, self.pos = seq, depth, prompt_len

    @property
    def max_nodes(self):
        return self.depth + 1

    def begin(self, prompt, sampling, generator):
        self.pos = prompt.ids.shape[1]  # index of the root in seq

    def propose(self, root):
        nxt = [self.seq[j] if j < len(self.seq) else 0 for j in range(self.pos + 1, self.pos + 1 + self.depth)]
        tokens = torch.tensor([[int(root[0])] + nxt])
        return Proposal(tokens, TreeView.of_static(Tree.chain(self.depth).buffers(), 1))

    def commit(self, step):
        self.pos += len(step.paths[0])


def test_greedy_with_good_heads_accepts_more_than_one_token():
    # A base whose greedy continuation is predictable from h_t: heads equal to the base's own
    # lm_head on a model that repeats itself still give exact output; acceptance comes from real
    # training in other tests. Here: exactness when nearly every draft token is accepted.
    base = tiny_llama(seed=3)
    prompt = [5, 6, 7]
    ref = plain_greedy(base, prompt, 30)

    dec = SpeculativeDecoder(base, OracleDrafter(prompt + ref, len(prompt), 3))
    res = dec.generate([prompt], max_new_tokens=30)
    assert res.tokens[0] == ref
    assert res.accept_length > 3.5  # 3 drafted + bonus accepted nearly every step
    # Accept length counts emitted tokens only: the last step accepts 4 but max_new_tokens leaves room for 1
    # (the prefill's token is not a verification step's).
    assert sum(res.committed) == len(res.tokens[0]) - 1


def test_kv_cache_after_acceptance_equals_plain_cache():
    from transformers import DynamicCache

    base = tiny_llama(seed=1)
    heads = noisy_heads(base, noise=0.0)
    prompt = [3, 9, 4, 1]
    tree = default_tree(3, 8)
    dec = SpeculativeDecoder(base, make_drafter(heads, tree))
    res = dec.generate([prompt], max_new_tokens=12)
    seq = prompt + res.tokens[0]
    # One step by hand with the decoder's parts: verify the heads' tree, keep the accepted path, and compare
    # the next step's logits with a fresh plain forward over the same committed tokens.
    from draftlab.decode.acceptance import accept_greedy
    from draftlab.decode.cache import SlotCache
    from draftlab.drafters import PromptState

    target = SlotCache(base)
    ids = torch.tensor([prompt])
    valid = torch.ones_like(ids, dtype=torch.bool)
    out, pos = target.prefill(ids, valid, hidden=True)
    root = out.logits[:, -1].argmax(-1)
    drafter = make_drafter(heads, tree)
    drafter.begin(PromptState(ids, valid, pos, {-1: out.hidden_states[-1]}), Sampling(), None)
    prop = drafter.propose(root)
    logits = target.forward(prop.tokens, prop.view.ancestors, prop.view.depth).logits
    paths, bonus = accept_greedy(prop.tokens, logits, prop.view)
    keep = torch.tensor([paths[0]])
    target.keep(len(prompt), keep, torch.ones_like(keep, dtype=torch.bool))
    committed = prompt + prop.tokens[0, paths[0]].tolist()
    assert target.cache.get_seq_length() == len(committed)
    nxt = bonus[None]
    step = base(nxt, **cache_arg(base, target.cache), use_cache=True).logits[0, -1]
    fresh = base(torch.tensor([committed + [int(bonus)]])).logits[0, -1]
    torch.testing.assert_close(step, fresh)
    assert committed[len(prompt):] + [int(bonus)] == seq[len(prompt): len(committed) + 1]


def test_eos_max_new_tokens_and_stop():
    base = tiny_llama(seed=2)
    heads = noisy_heads(base)
    dec = SpeculativeDecoder(base, make_drafter(heads, default_tree(3, 10)))
    ref = plain_greedy(base, [1, 2, 3], 20)
    eos = ref[5]
    res = dec.generate([[1, 2, 3]], max_new_tokens=20, eos_token_id=eos)
    assert res.tokens[0] == ref[: ref.index(eos) + 1]
    res = dec.generate([[1, 2, 3]], max_new_tokens=7)
    assert res.tokens[0] == ref[:7]
    res = dec.generate([[1, 2, 3]], max_new_tokens=20, stop=lambda b, toks: 4 if len(toks) >= 4 else None)
    assert res.tokens[0] == ref[:4]
    streamed = []
    dec.generate([[1, 2, 3]], max_new_tokens=20, on_tokens=lambda b, new: streamed.extend(new))
    assert streamed == ref


def test_tree_deeper_than_heads_is_refused():
    base = tiny_llama()
    with pytest.raises(ValueError, match="4 deep but the draft module has 3 heads"):
        make_drafter(noisy_heads(base), Tree.chain(4))


# --- stochastic losslessness ----------------------------------------------------------------------

def _tv_first_tokens(sample_fn, n, V):
    counts = torch.zeros(V)
    for i in range(n):
        counts[sample_fn(i)] += 1
    return counts / n


def test_sampling_acceptance_keeps_the_base_distribution():
    """One verification step over a tree: the first committed token after the root follows p exactly."""
    torch.manual_seed(0)
    V, s = 8, Sampling(temperature=1.0)
    tree = Tree.from_paths([[0], [1], [2], [0, 0]])
    view = TreeView.of_static(tree.buffers(), 1)
    logits = torch.randn(1, tree.size, V) * 1.5
    p = warp(logits[0, 0], s)
    # Draft candidates: the three most likely under a *different* distribution (a bad draft).
    tokens = torch.tensor([[0, 5, 1, 6, 2]])
    g = torch.Generator().manual_seed(1)
    n = 20000  # one step over n rows of the same tree: each row is one independent trial
    paths, bonus = accept_sampling(tokens.expand(n, -1), logits.expand(n, -1, -1), TreeView.of_static(tree.buffers(), n),
                                   s, g)
    first = [int(tokens[0, path[1]]) if len(path) > 1 else int(bonus[b]) for b, path in enumerate(paths)]
    emp = _tv_first_tokens(lambda i: first[i], n, V)
    tv = 0.5 * (emp - p).abs().sum().item()
    assert tv < 0.02, (emp, p)


def test_sampled_acceptance_tries_siblings_in_node_order_within_its_bounds():
    """sampling_decision's children table: each node's index among its siblings in node order, per row (trees that
    differ per row, padding excluded), and the loop bounds (most children, depth) from a static tree's buffers or
    from per-row trees. A tree whose every child is certain (p one-hot on it) accepts the whole root path to the
    first child of the first child, in every row."""
    from draftlab.decode.acceptance import sibling_rank, sampling_decision, tree_bounds

    parents = torch.tensor([[-1, 0, 0, 1, 0, 3, -1], [-1, 0, 1, 1, 1, 2, 0]])
    valid = torch.tensor([[True] * 6 + [False], [True] * 7])
    assert sibling_rank(parents, valid).tolist() == [[0, 0, 1, 0, 2, 0, 0], [0, 0, 0, 1, 2, 0, 1]]
    view = TreeView.of_parents(parents, valid)
    assert tree_bounds(view) == (3, 3) and tree_bounds(view, rounded=True) == (4, 4)  # (for a compiled rule)
    assert tree_bounds(TreeView.of_static(Tree.from_paths([[0], [1], [2], [0, 0]]).buffers(), 2)) == (3, 2)
    V = 8
    tokens = torch.tensor([[0, 3, 4, 5, 6, 7, 0], [0, 2, 3, 4, 5, 6, 7]])
    logits = torch.full((2, 7, V), -1e4)
    for b in range(2):  # the base is certain of each node's first child's token
        for n in range(1, 7):
            if valid[b, n] and sibling_rank(parents, valid)[b, n] == 0:
                logits[b, parents[b, n], tokens[b, n]] = 0.0
    logits[:, :, 1] = torch.where(logits.max(-1).values < -1, 0.0, -1e4)  # leaves: the bonus is token 1
    last, bonus = sampling_decision(tokens, logits, view.parents, view.valid, Sampling(temperature=1.0),
                                    torch.rand(2, 8), K=3, D=3)
    assert last.tolist() == [5, 5] and bonus.tolist() == [1, 1]


def test_a_wrong_rule_fails_the_same_check():
    """Accepting a candidate with probability 1 whenever p(x) > 0 (a common bug) is caught."""
    torch.manual_seed(0)
    V, s = 8, Sampling(temperature=1.0)
    logits = torch.randn(1, 5, V) * 1.5
    p = warp(logits[0, 0], s)
    g = torch.Generator().manual_seed(1)

    def wrong(_):
        return 5 if p[5] > 0 else int(torch.multinomial(p, 1, generator=g))
    emp = _tv_first_tokens(wrong, 5000, V)
    assert 0.5 * (emp - p).abs().sum().item() > 0.1


def test_sample_residual_draws_from_the_residual_and_from_p_when_it_is_empty():
    """normalize(max(p - q, 0)) when it has mass; p itself when p == q (the rejection then had probability 0)."""
    from draftlab.decode.acceptance import sample_residual

    g = torch.Generator().manual_seed(0)
    p, q = torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.5, 0.0, 0.5, 0.0])
    assert {sample_residual(p, q, g) for _ in range(50)} == {1}
    p = torch.tensor([0.0, 0.25, 0.0, 0.75])
    draws = torch.tensor([sample_residual(p, p.clone(), g) for _ in range(2000)])
    assert set(draws.tolist()) == {1, 3} and abs((draws == 3).float().mean().item() - 0.75) < 0.05
    one = torch.tensor([0.0, 0.0, 1.0, 0.0])  # a deterministic proposal removing the only token p has
    assert sample_residual(one, one, g) == 2


def test_a_rejection_that_leaves_no_residual_does_not_raise():
    """p <= q everywhere after rounding (here a q whose mass exceeds 1, exaggerated so that every other try is
    rejected) leaves max(p - q, 0) empty: the bonus is then drawn from p instead of torch.multinomial raising."""
    V, s = 4, Sampling(temperature=1.0)
    tree = Tree.from_paths([[0]])
    n = 2000  # rows of one step, each an independent trial
    view = TreeView.of_static(tree.buffers(), n)
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))[None, None].expand(n, 2, V)
    p = warp(logits[0, 0], s)
    q = (2 * p)[None, None].expand(n, 1, V)  # [B, Q, V]
    tokens, q_index = torch.tensor([[0, 3]]).expand(n, -1), torch.tensor([[-1, 0]]).expand(n, -1)
    g = torch.Generator().manual_seed(0)
    paths, bonus = accept_sampling(tokens, logits, view, s, g, q, q_index)
    rejected = torch.tensor([len(path) == 1 for path in paths])
    accepted, counts = n - int(rejected.sum()), torch.bincount(bonus[rejected], minlength=V).float()
    assert abs(accepted / n - 0.5) < 0.05  # accepted with probability p(3) / q(3) = 1/2
    assert 0.5 * (counts / counts.sum() - p).abs().sum().item() < 0.05  # after a rejection: p, unchanged


def test_a_point_mass_child_rejected_with_nothing_left_keeps_p(monkeypatch):
    """A deterministic child x whose removal leaves p empty (p(x) < 1 only through rounding; exaggerated here to
    p = 0.5 one-hot(x)) keeps p as it was, so the bonus is x, instead of raising."""
    from draftlab.decode import acceptance

    V = 4
    monkeypatch.setattr(acceptance, "warp", lambda logits, s: torch.tensor([0.0, 0.0, 0.5, 0.0]).expand(logits.shape))
    view = TreeView.of_static(Tree.from_paths([[0]]).buffers(), 1)
    tokens, logits = torch.tensor([[0, 2]]), torch.zeros(1, 2, V)
    g = torch.Generator().manual_seed(0)
    firsts = set()
    for _ in range(40):
        paths, bonus = acceptance.accept_sampling(tokens, logits, view, Sampling(temperature=1.0), g)
        firsts.add(2 if len(paths[0]) > 1 else int(bonus[0]))
    assert firsts == {2}


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of counts against probs; cells expected below min_expected are pooled."""
    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten()
    big = exp >= min_expected
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    keep = e > 0
    return float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


def _joint_first_two(base, prompt, s):
    with torch.no_grad():
        p1 = warp(base(torch.tensor([prompt])).logits[0, -1], s)  # [V]
        V = p1.shape[0]
        ctx = torch.tensor([prompt + [t] for t in range(V)])
        p2 = warp(base(ctx).logits[:, -1], s)  # [V, V]
    return p1[:, None] * p2  # [V, V]


def _sample_joint(dec, prompt, s, n, seed, accept=None):
    g = torch.Generator().manual_seed(seed)
    V = dec.base.config.vocab_size
    counts = torch.zeros(V, V)
    for _ in range(n):
        toks = dec.generate([prompt], max_new_tokens=2, sampling=s, generator=g).tokens[0]
        counts[toks[0], toks[1]] += 1
    return counts


def test_speculative_sampling_matches_plain_sampling_end_to_end():
    """Joint law of the first two generated tokens (the second goes through tree acceptance) = the base's."""
    base = tiny_llama(vocab=16, seed=4)
    with torch.no_grad():
        base.lm_head.weight.mul_(6)  # a peaked base, so the test has power with few samples
    heads = noisy_heads(base, noise=0.3, seed=4)
    dec = SpeculativeDecoder(base, make_drafter(heads, Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])))
    s = Sampling(temperature=0.8, top_p=0.9)
    prompt = [1, 5]
    joint = _joint_first_two(base, prompt, s)
    counts = _sample_joint(dec, prompt, s, 2000, seed=0)
    stat, df = chi_square(counts, joint)
    assert df >= 5
    assert stat < df + 4 * (2 * df) ** 0.5, (stat, df)


def test_the_drafter_draws_from_a_stream_of_its_own():
    """One generator handed to generate(): the verifier draws from it, the drafter from a stream derived from it,
    so the first draft and the sampled root never share a uniform (the pipeline / DSI collision, by construction)."""
    from draftlab.drafters.ssm import SSMDrafter

    base = tiny_llama(vocab=16, seed=4)
    drafter = SSMDrafter(tiny_llama(vocab=16, seed=4), Tree.chain(2))
    got, begin = [], drafter.begin
    drafter.begin = lambda prompt, sampling, gen: (got.append(gen), begin(prompt, sampling, gen))
    g = torch.Generator().manual_seed(0)
    SpeculativeDecoder(base, drafter).generate([[1, 5]], max_new_tokens=3, sampling=Sampling(temperature=0.8), generator=g)
    assert got[0] is not None and got[0] is not g
    first = torch.rand(4, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(torch.rand(4, generator=got[0]), first)  # not a copy of the verifier's stream


@pytest.mark.slow  # 14 s: the check's own power; the law tests themselves run by default
def test_end_to_end_check_catches_a_biased_acceptance(monkeypatch):
    """The same check fails when acceptance ignores p (accepting every drafted child with p(x) > 0)."""
    import draftlab.decode.decoder as decoder_mod

    def biased(tokens, logits, view, s, generator=None, q=None, q_index=None):
        paths, bonus = [], torch.empty(tokens.shape[0], dtype=torch.long)
        for b in range(tokens.shape[0]):
            node, path = 0, [0]
            children = view.children(b)
            while children[node]:
                c = children[node][0]
                if warp(logits[b, node], s)[tokens[b, c]] <= 0:
                    break
                node = c
                path.append(c)
            bonus[b] = torch.multinomial(warp(logits[b, node], s), 1, generator=generator)[0]
            paths.append(path)
        return paths, bonus
    monkeypatch.setattr(decoder_mod, "accept_sampling", biased)
    base = tiny_llama(vocab=16, seed=4)
    with torch.no_grad():
        base.lm_head.weight.mul_(6)
    heads = noisy_heads(base, noise=0.3, seed=4)
    dec = SpeculativeDecoder(base, make_drafter(heads, Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])))
    s = Sampling(temperature=0.8, top_p=0.9)
    joint = _joint_first_two(base, [1, 5], s)
    stat, df = chi_square(_sample_joint(dec, [1, 5], s, 2000, seed=0), joint)
    assert stat > df + 4 * (2 * df) ** 0.5


def test_typical_acceptance_is_exact_greedy_at_temperature_zero():
    """Medusa falls back to greedy verification at T=0, so typical mode is lossless there."""
    base = tiny_llama(seed=5)
    heads = noisy_heads(base)
    dec = SpeculativeDecoder(base, make_drafter(heads, default_tree(3, 10)))
    res = dec.generate([[1, 2, 3], [9, 4]], max_new_tokens=16, sampling=Sampling(typical=True))
    assert res.tokens == [plain_greedy(base, [1, 2, 3], 16), plain_greedy(base, [9, 4], 16)]


def test_typical_rule_at_positive_temperature_follows_medusa():
    """Thresholds min(eps, alpha exp(-H)) with H = -sum p log(p + 1e-5); ties in depth go to the most likely
    path; the bonus (the next step's first token) is the base's argmax, as in Medusa's default code."""
    from draftlab.decode.acceptance import accept_typical

    V = 6
    s = Sampling(temperature=1.0, typical=True, posterior_threshold=0.09, posterior_alpha=0.3)
    tree = Tree.from_paths([[0], [1], [0, 0], [1, 0]])  # two depth-2 paths
    view = TreeView.of_static(tree.buffers(), 1)
    logits = torch.full((1, 5, V), -9.0)
    logits[0, 0, [2, 3]] = torch.tensor([2.0, 1.6])  # root: p(2) > p(3), both above the threshold
    logits[0, 1, 4], logits[0, 2, 5] = 3.0, 3.0  # below either child, the next token is likely
    logits[0, 3, [1, 0]] = logits[0, 4, [1, 0]] = torch.tensor([2.0, 1.9])  # after either leaf: tokens 1 and 0 both
    # well above the threshold (a typical sample would often be 0), 1 the argmax
    tokens = torch.tensor([[0, 2, 3, 4, 5]])  # node 1 = 2, node 2 = 3, node 3 = 4 (below 2), node 4 = 5 (below 3)
    for seed in range(20):
        paths, bonus = accept_typical(tokens, logits, view, s, torch.Generator().manual_seed(seed))
        assert paths == [[0, 1, 3]]  # both paths reach depth 2; the one through the likelier token 2 wins
        assert bonus.item() == 1
    low = logits.clone()
    low[0, 1, 4], low[0, 1, 0] = -9.0, 6.0  # after node 1 the base now wants token 0: node 3 is rejected, so only
    # the path through node 2 is complete (an accepted depth beats likelihood)
    assert accept_typical(tokens, low, view, s)[0] == [[0, 2, 4]]


def test_typical_mode_starts_every_step_with_the_base_argmax():
    """Medusa decodes the first token of every step greedily: the token after the prompt is the argmax at T > 0
    too (a near-uniform base, where a typical sample would almost never be it)."""
    base = tiny_llama(seed=5)
    dec = SpeculativeDecoder(base, make_drafter(noisy_heads(base), default_tree(3, 10)))
    first = plain_greedy(base, [1, 2, 3], 1)[0]
    s = Sampling(temperature=1.0, typical=True)
    for seed in range(3):
        res = dec.generate([[1, 2, 3]], max_new_tokens=4, sampling=s, generator=torch.Generator().manual_seed(seed))
        assert res.tokens[0][0] == first


def test_typical_epsilon_and_alpha_default_as_medusa_and_are_checked():
    """epsilon 0.09 and alpha sqrt(epsilon) (0.3) by default; alpha follows epsilon unless set; bad values name the
    option; the CLI flags reach the rule."""
    from draftlab.cli import build_parser
    from draftlab.cli.args import sampling_from_args
    from draftlab.decode.acceptance import typical_threshold

    assert (Sampling(typical=True).posterior_threshold, Sampling(typical=True).typical_alpha) == (0.09, 0.3)
    assert Sampling(typical=True, posterior_threshold=0.04).typical_alpha == pytest.approx(0.2)
    assert Sampling(typical=True, posterior_threshold=0.04, posterior_alpha=0.5).typical_alpha == 0.5
    flat = torch.full((4,), 0.25)  # H = log 4 (nearly): alpha * exp(-H) = alpha / 4
    assert typical_threshold(flat, Sampling(posterior_threshold=0.5, posterior_alpha=0.4)).item() == \
        pytest.approx(0.1, rel=1e-3)
    with pytest.raises(ValueError, match="posterior_threshold.* 0.09"):
        Sampling(typical=True, posterior_threshold=0.0)
    with pytest.raises(ValueError, match="posterior_alpha"):
        Sampling(typical=True, posterior_alpha=-1.0)
    # (top_p 0 cut every token: NaN probabilities, a cryptic multinomial error, or token V-1 drawn on the device)
    with pytest.raises(ValueError, match=r"top_p = 0.0: .* in \(0, 1\]"):
        Sampling(temperature=0.7, top_p=0.0)
    with pytest.raises(ValueError, match="top_k = -1"):
        Sampling(temperature=0.7, top_k=-1)
    parser = build_parser()
    a = parser.parse_args(["generate", "x", "--prompt", "p", "--typical", "--temperature", "0.7",
                           "--typical-epsilon", "0.16"])
    s = sampling_from_args(a)
    assert (s.typical, s.temperature, s.posterior_threshold) == (True, 0.7, 0.16)
    assert s.typical_alpha == pytest.approx(0.4)
    a = parser.parse_args(["generate", "x", "--prompt", "p", "--typical-alpha", "0.2"])
    with pytest.raises(ValueError, match="add --typical"):
        sampling_from_args(a)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--prompt", "p", "--typical", "--typical-epsilon", "1.5"])


def test_inverse_cdf_draws_follow_q_and_never_pick_a_zero_probability_token():
    """draw(q, u): the drafters' in-graph sampler. Uniform edges (0, and just below 1) land on tokens with mass,
    and 200k draws match q (a max deviation far above it fails: q reversed)."""
    q = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]])  # dyadic: the edges are exact in any precision
    edges = torch.tensor([[[0.0, 0.5 - 1e-7, 0.5, 0.75, 1 - 1e-7]]], dtype=torch.float64)
    assert draw(q[None], edges).tolist() == [[[1, 1, 3, 4, 4]]]
    u = torch.rand(1, 200_000, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(draw(q, u)[0], minlength=6).double() / u.numel()
    assert (freq - q[0]).abs().max() < 0.005
    assert (freq - q[0].flip(0)).abs().max() > 0.1



def test_draws_keep_tokens_whose_mass_is_below_float32s_resolution():
    """10,000 tokens of mass 1e-8 each after one of 1 - 1e-4: torch.multinomial on CPU never draws them (it drew 0
    of 1e6 here), and a float32 CDF gives them widths of 0 or 6e-8. `sample` (every sampling role's draws) gives the
    tail its mass, and draw sends a float64 uniform at the middle of each tail token's interval to that token."""
    K = 10_000
    q = torch.full((K + 1,), 1e-8, dtype=torch.float64)
    q[0] = 1 - 1e-4
    hits = int((sample(q.float(), 1_000_000, torch.Generator().manual_seed(0)) > 0).sum())
    assert 60 < hits < 140  # 100 expected, Poisson sd 10
    cdf = q.cumsum(-1)
    mid = ((cdf[:-1] + cdf[1:]) / 2 / cdf[-1])[None, :]
    assert draw(q[None], mid)[0].tolist() == list(range(1, K + 1))

def sliding_base(kind: str):
    """A tiny base whose layers attend over a sliding window of 12 tokens: every layer (Mistral's) or every other
    one (Gemma 3's and gpt-oss's: one mask per layer type; gpt-oss in float32, its experts' kernel having no
    float64); or (Llama 4's) in chunks of 12 tokens on three layers of four."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, Llama4ForCausalLM,
                              Llama4TextConfig, MistralConfig, MistralForCausalLM)

    torch.manual_seed(0)
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, max_position_embeddings=512, sliding_window=12, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    if kind == "mistral":
        base = MistralForCausalLM(MistralConfig(**kw)).to(torch.float64)
    elif kind == "llama4":
        kw.pop("sliding_window")
        base = Llama4ForCausalLM(Llama4TextConfig(head_dim=8, intermediate_size_mlp=64, attention_chunk_size=12,
                                                  num_local_experts=2, moe_layers=[], **kw)).to(torch.float64)
    elif kind == "gemma3":
        base = Gemma3ForCausalLM(Gemma3TextConfig(head_dim=8, sliding_window_pattern=2, **kw)).to(torch.float64)
    else:
        base = GptOssForCausalLM(GptOssConfig(head_dim=8, num_local_experts=4, num_experts_per_tok=2, **kw))
    base = base.eval()
    base.generation_config.eos_token_id = None
    return base


@pytest.mark.parametrize("path", ["eager", "static", pytest.param("traced", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["mistral", "gemma3", "gpt-oss", "llama4"])
def test_sliding_window_bases_decode_exactly_past_their_windows(kind, path, monkeypatch):
    """A base with sliding-window layers (or chunked ones: Llama 4): draftlab's caches keep every layer's whole text
    and its masks apply each layer type's window or chunk (decode.cache.span_masks), so runs several windows long
    give the base's own greedy tokens (transformers' generate, with its own caches), with an SSM drafting and
    without, batch of uneven prompts longer than the window, EOS mid-run. The SSM is the base itself, so its drafts
    are all accepted only if its own masks slide too, the chained step's included. Without the windows the tokens
    differ."""
    from draftlab.decode import cache as cache_mod
    from draftlab.decode.decoder import NoDraft
    from draftlab.drafters.ssm import SSMDrafter

    base = sliding_base(kind)
    limit = ("chunk" if kind == "llama4" else "window", 12)
    assert {l for _, l in cache_mod.layer_spans(base)} == ({limit} if kind == "mistral" else {None, limit})
    # Both prompts longer than the window, the second left-padded; the run goes about four windows past them.
    prompts = [[5, 9, 2, 7, 5, 9, 4, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [3, 8, 21, 6, 30, 31, 7, 40, 41, 42,
                                                                               9, 10, 43, 44]]
    want = [plain_greedy(base, p, 40) for p in prompts]
    eos = want[1][25]
    cut = [w[: w.index(eos) + 1] if eos in w else w for w in want]
    opts = {"eager": {}, "static": {"static": True}, "traced": {"compile": "eager"}}[path]
    for drafter in (NoDraft(), SSMDrafter(base, Tree.chain(3))):
        dec = SpeculativeDecoder(base, drafter, **opts)
        res = dec.generate(prompts, max_new_tokens=40)
        assert res.tokens == want, (kind, path, type(drafter).__name__)
        # (An SSM's own earlier tree levels count as near: in chunks of 12 a tree crossing into the next chunk then
        # drafts otherwise than its model would, which costs acceptance, never exactness.)
        assert res.accept_length > ((3.0 if kind == "llama4" else 3.5) if drafter.max_nodes > 1 else 0.99)
        assert dec.generate(prompts, max_new_tokens=40, eos_token_id=eos).tokens == cut
    monkeypatch.setattr(cache_mod, "layer_spans", lambda model: None)
    assert SpeculativeDecoder(base, NoDraft(), **opts).generate(prompts, max_new_tokens=40).tokens != want


@pytest.mark.parametrize("layers", ["mixed", "sliding-only", "gpt-oss"])
def test_draft_layers_take_the_bases_rotary_table(layers):
    """Gemma 3 has a rotary table per layer type (a local one for its sliding layers): the draft layers that read
    the base's rotary embedding (Hydra++'s prefix layer, EAGLE-3's, DFlash's) take its full-attention layers' table
    (they attend over the whole text), or the only one a base of sliding layers alone has. gpt-oss's table covers
    half a head (both halves rotate by the same angles): EAGLE-3's and DFlash's Llama layers get it repeated. Hydra++
    and EAGLE-3 decode the base's greedy tokens past its window, eager and static; the exported configs of EAGLE-3
    and DFlash declare the table's theta, so the engines' reading of the files rotates as the draft does, and
    `draftlab check`'s RoPE check agrees."""
    from draftlab.drafters import build_draft
    from draftlab.drafters.base import flat_rope, own_rotary, rope_table
    from draftlab.interop.check import check_rope

    base = sliding_base("gpt-oss" if layers == "gpt-oss" else "gemma3")
    if layers == "sliding-only":  # two layers, both sliding: no full-attention table
        from transformers import Gemma3ForCausalLM

        config = base.config
        config.num_hidden_layers, config.layer_types = 2, ["sliding_attention"] * 2
        torch.manual_seed(0)
        base = Gemma3ForCausalLM(config).to(torch.float64).eval()
        base.generation_config.eos_token_id = None
    table = rope_table(base)
    assert table == {"mixed": "full_attention", "sliding-only": "sliding_attention", "gpt-oss": None}[layers]
    theta = flat_rope(base.config.rope_parameters, table)["rope_theta"]
    prompts = [[5, 9, 2, 7, 5, 9, 4, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [3, 8]]
    want = [plain_greedy(base, p, 30) for p in prompts]
    x, pos = torch.randn(1, 4, 8, dtype=base.dtype), torch.arange(40)[None]
    for spec in ({"type": "hydra", "num_heads": 2, "num_layers": 1, "prefix_attention": True},
                 {"type": "eagle3", "eagle": {}}, {"type": "dflash", "dflash": {"num_layers": 1, "block_size": 4}}):
        torch.manual_seed(0)
        module = build_draft(spec, base).to(base.dtype).eval()
        if spec["type"] != "dflash":
            for static in (False, True):
                drafter = make_drafter(module, Tree.from_paths([[0], [1], [0, 0]]) if spec["type"] == "hydra" else None)
                got = SpeculativeDecoder(base, drafter, static=static).generate(prompts, max_new_tokens=30)
                assert got.tokens == want, (layers, spec["type"], static)
        if spec["type"] != "hydra":
            cfg = module.engine_config()
            assert cfg["rope_theta"] == theta and check_rope(cfg, base.config.to_dict(), spec["type"], ["vllm"]).ok
            cos, sin = own_rotary(cfg)(x, pos)
            assert torch.allclose(cos.double(), module.rope(x, pos)[0].double(), atol=1e-6)
            assert torch.allclose(sin.double(), module.rope(x, pos)[1].double(), atol=1e-6)


def test_the_prefill_keeps_the_layers_the_drafter_reads_and_the_last_logits(monkeypatch):
    """A prefill kept every layer's states and every position's logits: at a 70B base's batch 8 x 4,096 tokens about
    43 GB and 8 GB where EAGLE-3 reads 3 layers and the decoder the last logits (review). Both caches keep the
    layers asked for (the same values) and the last position's logits; the decoder asks for its drafter's."""
    from draftlab.decode.cache import SlotCache, StaticSlotCache

    m = tiny_llama(seed=0, layers=4)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = m(input_ids=ids, output_hidden_states=True)
    for cache in (SlotCache(m), StaticSlotCache(m, 2, 64)):
        out, _ = cache.prefill(ids, torch.ones_like(ids, dtype=torch.bool), hidden=(1, 3, -1), last=True)
        assert out.logits.shape == (2, 1, 64) and torch.allclose(out.logits[:, -1], ref.logits[:, -1], atol=1e-6)
        assert [h is None for h in out.hidden_states] == [True, False, True, False, False]
        assert all(torch.allclose(out.hidden_states[l], ref.hidden_states[l], atol=1e-6) for l in (1, 3, -1))
    seen = []
    prefill = SlotCache.prefill
    monkeypatch.setattr(SlotCache, "prefill", lambda self, *a, **kw: seen.append(r := prefill(self, *a, **kw)) or r)
    base = tiny_llama(seed=0)
    drafter = make_drafter(noisy_heads(base, num_heads=2), Tree.chain(2))  # reads the last layer's states
    res = SpeculativeDecoder(base, drafter).generate([[5, 9, 2, 7]], max_new_tokens=8)
    assert res.tokens[0] == plain_greedy(base, [5, 9, 2, 7], 8)
    out = seen[0][0]
    assert out.logits.shape[1] == 1 and sum(h is not None for h in out.hidden_states) == 1
