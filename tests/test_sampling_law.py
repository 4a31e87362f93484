"""Speculative sampling keeps the base's law over whole continuations, not just the first two tokens.

Each test draws hundreds of K-token continuations in one `generate` call (rows of two prompts of different
lengths are independent samples), with trees deep enough that several tokens are accepted per step, and checks every
position against the base's conditional law there (tests/law.py). Tokens accepted at depth >= 2 and tokens
committed in the steps after a sampled commit are all covered, and rows that stop at EOS while others go on.
Each test also checks that multi-token accepts did happen, and that the same samples fail against a wrong law.
Two tests inject a bug the old first-two-tokens tests cannot see (a rule wrong only below depth 1; a KV-cache
compaction wrong only after a side branch is accepted) and check that it is caught.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_llama
from law import ALPHA, StepLog, conditional_laws, law_statistic, pad_samples, rank_labels, ratio_labels
from draftlab.decode import cache as cache_mod
from draftlab.decode import decoder as decoder_mod
from draftlab.decode.acceptance import Sampling, residual, warp
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.tree import DynamicTree, Tree
from draftlab.drafters import build_draft, make_drafter
from draftlab.drafters.ensemble import EnsembleDrafter
from draftlab.drafters.retrieval import LookupDrafter
from draftlab.drafters.ssm import SSMDrafter

V = 8  # a small vocabulary: few cells, each with many samples
PROMPTS = ([1, 5], [7, 3, 2, 6])  # two lengths: rows are left-padded and their caches hold holes


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread while these tests run: their tensors are tiny, and idle threads spinning on a busy
    machine made them several times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def peaked_base(layers: int = 2, seed: int = 4):
    """A tiny Llama with a sharpened lm_head, so that drafts close to it are accepted several tokens deep."""
    base = tiny_llama(vocab=V, layers=layers, seed=seed)
    with torch.no_grad():
        base.lm_head.weight.mul_(6)
    return base


def near_copy(base, noise: float, seed: int, favour: tuple = (), by: float = 1.5):
    """The base with every weight perturbed (noise x the weight's std) and the logits of the `favour` tokens raised
    by `by`: a drafter close to the base whose law still differs from it, in a consistent direction."""
    lm = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
        if favour:
            head = torch.nn.Linear(lm.config.hidden_size, V, bias=True).to(lm.lm_head.weight.dtype)
            head.weight.copy_(lm.lm_head.weight)
            head.bias.zero_()
            head.bias[list(favour)] = by
            lm.lm_head = head
    return lm.eval()


def prompts(n: int) -> list[list[int]]:
    """n rows alternating between the two prompts."""
    return [list(PROMPTS[i % 2]) for i in range(n)]


def sample(dec, n: int, k: int, s: Sampling, seed: int = 0, eos: int | None = None):
    """k-token continuations of prompts(n) from one generate call (independent rows): ids [n, k] (-1 past a row
    that stopped at eos), Result, StepLog."""
    log = StepLog()
    res = dec.generate(prompts(n), max_new_tokens=k, sampling=s, generator=torch.Generator().manual_seed(seed),
                       on_tokens=log, eos_token_id=eos)
    assert all(len(t) == k for t in res.tokens if eos not in t)
    return pad_samples(res.tokens), res, log


def assert_deep_accepts(res, log, min_length: float = 1.5, min_share: float = 0.15):
    """Multi-token accepts happened: a mean commit well above one token, and a share of the steps accepted two or
    more drafted tokens (max_new_tokens cuts the last step of each row, so both are underestimates)."""
    steps = len(log.lengths) - len(res.tokens)  # each row's first call is the prefill's token
    assert res.accept_length > min_length, res.accept_length
    assert log.accepted_at_depth(2) >= min_share * steps, (log.accepted_at_depth(2), steps)


def law_checks(x, p, q=None) -> dict:
    """The checks every test asserts: cells (position, token) (the issue's statistic); cells = the token's rank
    under p, summed over positions (tokens too likely or too unlikely at every position); with a drafter's law
    q, cells = the rank of q / p, summed over positions (a pull towards the drafter's tokens)."""
    checks = {"token": law_statistic(x, p), "p-rank": law_statistic(x, p, rank_labels(p), per_position=False)}
    if q is not None:
        checks["q/p-rank"] = law_statistic(x, p, ratio_labels(q, p), per_position=False)
    return checks


def assert_fits(checks: dict):
    """Every check passes."""
    assert all(c.ok for c in checks.values()), {k: str(c) for k, c in checks.items()}


def assert_rejects(check):
    """A negative control: the statistic itself (not only an impossible token) rejects the wrong law."""
    assert check.p_value < ALPHA, str(check)


# --- a small LM drafting a branching tree ----------------------------------------------------------------------

S_SSM = Sampling(temperature=0.8, top_p=0.9)
SSM_TREE = Tree.expansion([1, 3, 1])  # a chain with three sampled siblings at depth 2 and a third level


def ssm_setup():
    base = peaked_base()
    return base, near_copy(base, 0.3, seed=1, favour=(3, 7))


def ssm_run(n: int, k: int, seed: int = 0, tree: Tree = SSM_TREE, eos: int | None = None, **decoder_options):
    base, lm = ssm_setup()
    x, res, log = sample(SpeculativeDecoder(base, SSMDrafter(lm, tree), **decoder_options), n, k, S_SSM, seed, eos)
    laws = [conditional_laws(m, prompts(n), x, S_SSM) for m in (base, lm)]
    return x, res, log, base, lm, *laws


def test_ssm_tree_sampling_keeps_the_law_over_several_steps():
    x, res, log, base, lm, p, q = ssm_run(600, 8)
    assert_deep_accepts(res, log)
    assert_fits(law_checks(x, p, q))
    # Power: the same samples against the drafter's law, and against the base at another temperature.
    assert_rejects(law_statistic(x, q))
    assert_rejects(law_statistic(x, conditional_laws(base, prompts(600), x, Sampling(1.2, top_p=0.9))))


def test_the_compiled_static_path_keeps_the_law():
    """The same check through the static-shape path (static cache, padded trees, torch.compile's graph capture)."""
    x, res, log, base, lm, p, q = ssm_run(600, 8, compile="eager")
    assert_deep_accepts(res, log)
    assert_fits(law_checks(x, p, q))


def test_rows_that_stop_at_eos_leave_the_others_their_law():
    """With an EOS token the drafter favours (often accepted in the middle of a path, the rest of the path dropped),
    rows end at different steps; every token up to each row's end keeps the base's law."""
    eos = 7
    x, res, log, base, lm, p, q = ssm_run(600, 10, eos=eos)
    ended = sum(t[-1] == eos for t in res.tokens)
    assert 0.3 * 600 < ended < 0.9 * 600 and all(eos not in t[:-1] for t in res.tokens), ended
    assert_deep_accepts(res, log)
    assert_fits(law_checks(x, p, q))
    assert_rejects(law_statistic(x, conditional_laws(base, prompts(600), x, Sampling(1.2, top_p=0.9))))


def accept_with_a_deep_bug(tokens, logits, view, s, generator=None, q=None, q_index=None):
    """accept_sampling with one bug below depth 1: when every child of an accepted non-root node is rejected, the
    bonus is drawn from p itself instead of from what the rejections left of p. The first two tokens keep their law."""
    B = tokens.shape[0]
    paths, bonus = [], torch.empty(B, dtype=torch.long, device=tokens.device)
    qi = q_index if q_index is not None else None
    for b in range(B):
        children = view.children(b)
        node, path = 0, [0]
        while True:
            p = warp(logits[b, node], s)
            full = p.clone()
            nxt = None
            for c in children[node]:
                x, j = int(tokens[b, c]), (qi[b][c] if qi is not None else -1)
                u = torch.rand((), generator=generator)
                qd = q[b, j].float() if j >= 0 else None
                if p[x] > 0 and (u < p[x] if j < 0 else u * qd[x] < p[x]):
                    nxt = c
                    break
                if j < 0:
                    p[x] = 0.0
                else:
                    p = residual(p, qd)
                if p.sum() <= 0:
                    break
                p = p / p.sum()
            if nxt is None:
                bonus[b] = torch.multinomial(p if node == 0 else full, 1, generator=generator)[0]
                break
            node = nxt
            path.append(node)
        paths.append(path)
    return paths, bonus


def test_a_rule_wrong_only_below_depth_one_is_caught(monkeypatch):
    """The bug leaves the first two tokens' law intact, so a first-two-tokens test passes; the whole-continuation
    check (cells by q / p rank) fails."""
    monkeypatch.setattr(decoder_mod, "accept_sampling", accept_with_a_deep_bug)
    x, res, log, base, lm, p, q = ssm_run(600, 8)
    assert_fits(law_checks(x[:, :2], p[:, :2], q[:, :2]))
    assert_rejects(law_checks(x, p, q)["q/p-rank"])


def test_a_kv_cache_compaction_wrong_after_a_side_branch_is_caught(monkeypatch):
    """A cache that keeps the first tentative slots instead of the accepted path's (wrong only when a branch other
    than the first one is accepted): later tokens follow the base's law after the wrong text, and some of them
    are tokens top-p forbids after the right one."""
    keep = cache_mod.SlotCache.keep
    monkeypatch.setattr(cache_mod.SlotCache, "keep",
                        lambda self, start, idx, ok, in_place=False: keep(self, start, idx, ok, True))
    x, res, log, base, lm, p, q = ssm_run(300, 8, tree=Tree.expansion([3, 1]))
    checks = law_checks(x, p, q)
    assert not checks["token"].ok and checks["token"].impossible > 0, str(checks["token"])


# --- a merged ensemble: two sampled SSMs with different laws and a deterministic lookup --------------------------

S_ENS = Sampling(temperature=1.0, top_p=0.95)


def ensemble_run(n: int, k: int, seed: int = 0, mode: str = "merge", grouped: bool = False, scheduler=None,
                 **decoder_options):
    """grouped: both SSMs draft one tree and run as one grouped model (else their trees differ: one by one)."""
    base = peaked_base()
    a, b = near_copy(base, 0.3, seed=1, favour=(3, 7)), near_copy(base, 0.5, seed=2, favour=(0, 4), by=1.0)
    members = [SSMDrafter(a, Tree.expansion([1, 2, 1])), SSMDrafter(b, Tree.expansion([1, 2, 1] if grouped else [2, 1])),
               LookupDrafter(num_tokens=2)]
    drafter = EnsembleDrafter(members, mode=mode, length=3, batch_members=grouped, scheduler=scheduler)
    assert len(drafter.groups) == grouped
    x, res, log = sample(SpeculativeDecoder(base, drafter, **decoder_options), n, k, S_ENS, seed)
    p = conditional_laws(base, prompts(n), x, S_ENS)
    qa, qb = (conditional_laws(m, prompts(n), x, S_ENS) for m in (a, b))
    return x, res, log, base, p, qa, qb


@pytest.mark.parametrize("static", [False, True], ids=["host-merge", "tensor-merge"])
def test_ensemble_merge_sampling_keeps_the_law_over_several_steps(static):
    """Siblings drawn by different members keep their own q; a lookup member adds deterministic siblings. Eager, the
    host's merge (tree_merge.merge_row); on the static path, its tensor form (merge_trees: q rows by offset)."""
    x, res, log, base, p, qa, qb = ensemble_run(600, 8, static=static)
    assert_deep_accepts(res, log)
    assert_fits(law_checks(x, p, (qa + qb) / 2))
    assert_rejects(law_statistic(x, qb))
    assert_rejects(law_statistic(x, conditional_laws(base, prompts(600), x, Sampling(0.7, top_p=0.95))))


@pytest.mark.parametrize("mode,compile", [("merge", None), ("vote", None),
                                          pytest.param("merge", "eager", marks=pytest.mark.slow)])
def test_grouped_ensemble_sampling_keeps_the_law_over_several_steps(mode, compile):
    """The two SSMs draft as one grouped model (one generator, their rows side by side): each row's draws keep its
    own member's q; also through the static path's one drafting call (compile: traced by dynamo)."""
    x, res, log, base, p, qa, qb = ensemble_run(600, 8, mode=mode, grouped=True, compile=compile)
    assert_deep_accepts(res, log, *((1.1, 0.01) if mode == "vote" else ()))
    assert_fits(law_checks(x, p, (qa + qb) / 2))
    if mode == "merge":
        assert_rejects(law_statistic(x, qb))


@pytest.mark.parametrize("compile", [None, pytest.param("eager", marks=pytest.mark.slow)])  # traced: 22 s
def test_cost_scheduled_ensemble_sampling_keeps_the_law_over_several_steps(compile):
    """The cost policy's steps (its counts from a fixed pattern, members in gain order): all three members, the best
    one alone (its own tree and q verified; on the static path chaining into its next step), two, switching between
    them while the members that sat out follow the text."""
    from test_ensemble import CountScheduler

    sched = CountScheduler([3, 1, 1, 2, 1, 1, 1, 3])
    x, res, log, base, p, qa, qb = ensemble_run(600, 8, scheduler=sched, compile=compile)
    assert {sum(on) for on in sched.history} == {1, 2, 3}
    if compile:
        assert res.chained_steps > 0
    assert_deep_accepts(res, log)
    assert_fits(law_checks(x, p, (qa + qb) / 2))
    assert_rejects(law_statistic(x, conditional_laws(base, prompts(600), x, Sampling(0.7, top_p=0.95))))


def test_grouped_ensemble_with_swapped_q_rows_breaks_the_law(monkeypatch):
    """A negative control: a group that hands each member the other member's q rows (a slicing mistake)."""
    propose_group = EnsembleDrafter._propose_group

    def swapped(self, g, root):
        propose_group(self, g, root)
        a, b = (self.props[m] for m in g.members)
        if a is not None and b is not None:
            a.q, b.q = b.q, a.q
    monkeypatch.setattr(EnsembleDrafter, "_propose_group", swapped)
    x, res, log, base, p, qa, qb = ensemble_run(600, 8, grouped=True)
    assert not all(c.ok for c in law_checks(x, p, (qa + qb) / 2).values())


@pytest.mark.parametrize("static", [False, True], ids=["host-vote", "tensor-vote"])
def test_ensemble_vote_sampling_keeps_the_law_over_several_steps(static):
    """Minions' vote: one chain chosen by the members' weighted vote, verified as deterministic drafts (eager: the
    host's vote_row; static: vote_chains)."""
    x, res, log, base, p, qa, qb = ensemble_run(600, 8, mode="vote", static=static)
    assert_deep_accepts(res, log, 1.1, 0.01)  # deterministic drafts are accepted with probability p(x) only
    assert_fits(law_checks(x, p, (qa + qb) / 2))
    assert_rejects(law_statistic(x, conditional_laws(base, prompts(600), x, Sampling(0.7, top_p=0.95))))


# --- EAGLE-3 over dynamic trees ----------------------------------------------------------------------------------

S_EAGLE = Sampling(temperature=0.7, top_k=5)


@pytest.fixture(scope="module")
def eagle_pair():
    """A 3-layer base and an EAGLE-3 drafter trained briefly on its samples (untrained, it rarely gets past depth 1)."""
    from draftlab.base import base_states
    from draftlab.config import LossSection

    base = peaked_base(layers=3)
    torch.manual_seed(8)
    d = build_draft({"type": "eagle3", "eagle": {}}, base).to(torch.float64).train()
    torch.manual_seed(0)
    with torch.no_grad():
        ids = base.generate(torch.tensor([PROMPTS[0]] * 32), attention_mask=torch.ones(32, 2, dtype=torch.long),
                            do_sample=True, max_new_tokens=14, temperature=1.0, top_k=0, top_p=1.0)
        states = base_states(base, ids, torch.ones_like(ids), d.base_layers)
    opt = torch.optim.Adam([w for w in d.parameters() if w.requires_grad], lr=1e-2)
    ones = torch.ones_like(ids)
    for _ in range(30):
        loss = d.objective(states, ids, ones, ones, base.lm_head.weight, LossSection())["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return base, d.eval()


def test_eagle3_dynamic_tree_sampling_keeps_the_law_over_several_steps(eagle_pair):
    base, d = eagle_pair
    x, res, log = sample(SpeculativeDecoder(base, make_drafter(d, DynamicTree(3, 3, 10))), 600, 8, S_EAGLE)
    assert_deep_accepts(res, log)
    p = conditional_laws(base, prompts(600), x, S_EAGLE)
    assert_fits(law_checks(x, p))
    assert_rejects(law_statistic(x, conditional_laws(base, prompts(600), x, Sampling(1.2, top_k=5))))


# --- Medusa and Hydra heads over a static tree -------------------------------------------------------------------

S_HEADS = Sampling(temperature=0.6, top_p=0.95, top_k=5)
HEADS_TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 1, 0],
                              [1, 0, 0]])


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_heads_tree_sampling_keeps_the_law_over_several_steps(kind):
    base = peaked_base()
    torch.manual_seed(0)
    heads = build_draft({"type": kind, "num_heads": 3, "num_layers": 1}, base).to(torch.float64).eval()
    with torch.no_grad():
        for w in heads.parameters():
            w.add_(0.05 * torch.randn_like(w))
    x, res, log = sample(SpeculativeDecoder(base, make_drafter(heads, HEADS_TREE)), 600, 8, S_HEADS)
    # Untrained heads (head k reads h_t, initialised to predict like the base's next token) reach depth 2 less often.
    assert_deep_accepts(res, log, min_share=0.1)
    p = conditional_laws(base, prompts(600), x, S_HEADS)
    assert_fits(law_checks(x, p))
    assert_rejects(law_statistic(x, conditional_laws(base, prompts(600), x, Sampling(1.2, top_k=5))))


@pytest.mark.parametrize("kind,compile", [("ssm", None), ("dflash", None)] + [  # the static path: slow set
    pytest.param(k, "eager", marks=pytest.mark.slow) for k in ("ssm", "dflash")])
def test_sampled_siblings_are_independent_draws_from_the_q_they_hand_in(kind, compile):
    """The rule accepts a sampled sibling by p / q after the others' rejection, which keeps the law only if siblings
    are independent draws from q. A drafter whose siblings shared one uniform (copies of one draw, still handed in as
    i.i.d.) passed the law tests of the default run, which met it in too few steps (found by review). Here each row's
    first proposal: the pairs of the root's first two children against q x q (their q), over 3000 rows."""
    from test_decoder import chi_square

    base, lm = ssm_setup()
    s, n = Sampling(temperature=1.0), 3000
    if kind == "ssm":
        drafter = SSMDrafter(lm, Tree.expansion([3]))
    else:
        from test_dflash import dflash

        drafter = make_drafter(dflash(base, seed=3, block_size=3, scale=0.3), Tree.from_paths([[0], [1], [2]]))
    first, propose = [], drafter.propose

    def recording(root):
        prop = propose(root)
        if not first:
            first.append(prop)
        return prop

    drafter.propose = recording  # (the first proposal, after the prefill, on either path)
    SpeculativeDecoder(base, drafter, compile=compile).generate(
        prompts(n), max_new_tokens=2, sampling=s, generator=torch.Generator().manual_seed(0))
    prop = first[0]
    a, b = 1, 2  # (the root's first two children in both trees)
    q = prop.q[torch.arange(n), prop.q_index[:, a]].double()  # [n, V]: the law both were drawn from
    assert torch.equal(prop.q_index[:, a], prop.q_index[:, b])
    V = q.shape[-1]
    counts = torch.bincount(prop.tokens[:, a] * V + prop.tokens[:, b], minlength=V * V).double()
    stat, df = chi_square(counts, (q[:, :, None] * q[:, None, :]).mean(0).flatten())
    assert df >= 8 and stat < df + 4 * (2 * df) ** 0.5, (stat, df)  # (shared uniforms: a statistic over 15,000)


@pytest.mark.slow
def test_the_fused_chained_sampled_step_keeps_the_law_through_inductor_on_a_cpu(monkeypatch):
    """tests/test_gpu_law.py's check of the fused and chained sampled step (the compiled acceptance inside the verify
    call) with inductor's code on this CPU: the default run's compiled tests trace with dynamo's eager backend, and
    the GPU test is skipped without a GPU."""
    import test_gpu_law

    monkeypatch.setattr(test_gpu_law, "DEVICE", "cpu")
    monkeypatch.setenv("DRAFTLAB_COMPILE_BACKEND", "inductor")
    test_gpu_law.test_sampled_steps_keep_the_law_on_the_gpu(fused=True)


# --- more samples, longer continuations --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ssm", "merge", "vote"])
def test_more_samples_over_more_steps(mode):
    """The same checks with 3000 samples of 12 tokens (5x the samples, more steps covered); also Minions' vote
    (one chain chosen by the members' weighted vote, verified as deterministic drafts)."""
    if mode == "ssm":
        x, res, log, base, lm, p, q = ssm_run(3000, 12, seed=1)
    else:
        x, res, log, base, p, qa, qb = ensemble_run(3000, 12, seed=1, mode=mode)
        q = (qa + qb) / 2
    # The vote's chain is verified token by token as deterministic drafts (accepted with probability p(x)), so it
    # accepts far less than a merge whose sampled drafts keep their q.
    assert_deep_accepts(res, log, *((1.1, 0.01) if mode == "vote" else ()))
    assert_fits(law_checks(x, p, q))
