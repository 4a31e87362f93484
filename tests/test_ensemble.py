"""Ensembles: merged trees and majority vote stay exact (greedy) and lossless (sampling); the vote weights, the
adaptive speculation length and the scheduler follow their rules; retrieval drafting."""

import random

import pytest
import torch

from conftest import tiny_llama
from test_decoder import _joint_first_two, _sample_joint, chi_square, plain_greedy
from test_ssm import small_lm
from draftlab.decode.acceptance import Sampling
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.tree import Tree
from draftlab.drafters.ensemble import AdaptiveLength, EnsembleDrafter, Scheduler, VoteWeights, ensemble_parts
from draftlab.drafters.retrieval import Datastore, LookupDrafter
from draftlab.drafters.tree_merge import vote_row
from draftlab.drafters.ssm import SSMDrafter


def members(base, seed, trees):
    out = [SSMDrafter(tiny_llama(seed=seed), trees[0])]  # the base itself: most of its tokens are accepted
    out += [SSMDrafter(small_lm(seed + 20 + i, layers=1 + i % 2), t) for i, t in enumerate(trees[1:])]
    return out + [LookupDrafter(num_tokens=3)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode,budget", [("merge", 64), ("merge", 5), ("vote", 0)])
def test_ensembles_are_exact(seed, mode, budget):
    rng = random.Random(seed)
    base = tiny_llama(seed=seed)
    trees = [Tree.chain(3), Tree.expansion([2, 2]), Tree.chain(2)]
    drafter = EnsembleDrafter(members(base, seed, trees), mode=mode, node_budget=budget, scheduler=Scheduler(warmup=2),
                              adaptive=AdaptiveLength(s=2, decision_threshold=2) if mode == "vote" else None)
    dec = SpeculativeDecoder(base, drafter)
    for B in (1, 3):
        prompts = [[rng.randrange(64) for _ in range(rng.randint(2, 9))] * 2 for _ in range(B)]
        res = dec.generate(prompts, max_new_tokens=20)
        for p, got in zip(prompts, res.tokens):
            assert got == plain_greedy(base, p, 20), (mode, budget, p)
        assert res.accept_length > 1.2 and max(res.tree_sizes) <= drafter.max_nodes
        if budget == 5:  # the members draft up to 3 + 6 + 2 nodes a row: the merged tree is cut to the budget
            assert max(res.tree_sizes) == 1 + 5


@pytest.mark.parametrize("mode,budget", [("merge", 64), ("merge", 5), ("vote", 0)])
class PatternScheduler(Scheduler):
    """Who drafts, by a fixed pattern over the steps."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern = pattern

    def active(self):
        on = self.pattern[self.steps % len(self.pattern)]
        self.history.append(on)
        return on


@pytest.mark.parametrize("mode,budget", [("merge", 64), ("merge", 5), ("vote", 0)])
def test_grouped_members_draft_as_they_do_one_by_one(mode, budget):
    """Three SSMs of one shape and tree run as one grouped model (one forward per depth for all three): the same
    trees, accepts and tokens as drafting one by one, greedy exact, with members of the group paused in some steps
    (a paused member still drafts in the group and follows the text) and the whole group paused in others."""
    rng = random.Random(0)
    base = tiny_llama(seed=0)
    lms = [tiny_llama(seed=0), tiny_llama(seed=30), tiny_llama(seed=31)]  # the base and two random ones
    pattern = [[True] * 4, [True, False, True, True], [False, False, False, True], [False, True, False, True]]

    def make(batch):
        tree = Tree.chain(3) if mode == "vote" else Tree.expansion([2, 2])
        return EnsembleDrafter([SSMDrafter(lm, tree) for lm in lms] + [LookupDrafter(num_tokens=3)], mode=mode,
                               node_budget=budget, scheduler=PatternScheduler(pattern), length=3, batch_members=batch)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(2, 9))] * 2 for _ in range(3)]
    runs = {}
    for batch in (True, False):
        drafter = make(batch)
        assert len(drafter.groups) == batch
        # After every step, the text each member follows in the live rows: tokens in its KV cache, tokens pending
        # and, one by one, the text of the steps it sat out (a paused member is given it and feeds it when it
        # drafts again; in a group it drafts anyway).
        ssms, state, commit = [drafter.groups[0].drafter] if batch else drafter.members[:3], [], drafter.commit

        def spy(step):
            commit(step)
            n = torch.cat([d.target.next_pos for d in ssms]).tolist()
            pending = [p for d in ssms for p in d.pending]
            missed = [0] * len(n) if batch else [sum(len(s[b]) for s in drafter.log[drafter.seen[m]:])
                                                 for m in range(3) for b in range(len(prompts))]
            live = step.live_rows() * 3
            state.append([n[r] + len(pending[r]) + missed[r] for r in range(len(n)) if live[r]])
        drafter.commit = spy
        res = SpeculativeDecoder(base, drafter).generate(prompts, max_new_tokens=24)
        for prompt, got in zip(prompts, res.tokens):
            assert got == plain_greedy(base, prompt, 24), (mode, budget, batch)
        runs[batch] = (res.tokens, res.steps, res.tree_sizes, res.accept_length, state)
    assert runs[True] == runs[False]
    assert runs[True][1] > len(pattern)  # every pattern was drafted with
    assert make(True).describe()["batched_members"] == [["member0", "member1", "member2"]]


def test_members_that_do_not_group_draft_one_by_one(monkeypatch, capsys):
    from draftlab.drafters import ensemble as ens
    from draftlab.drafters.ssm import GroupError, grouped_lm

    def refuse(lms):
        raise GroupError("a test's reason")
    monkeypatch.setattr(ens, "grouped_lm", refuse)
    base = tiny_llama(seed=0)
    drafter = EnsembleDrafter([SSMDrafter(tiny_llama(seed=s), Tree.chain(2)) for s in (0, 5)])
    assert drafter.groups == [] and "member0, member1 draft one by one (a test's reason)" in capsys.readouterr().err
    res = SpeculativeDecoder(base, drafter).generate([[1, 5, 7]], max_new_tokens=12)
    assert res.tokens[0] == plain_greedy(base, [1, 5, 7], 12)
    # Layers without a grouped form are refused, not run wrongly.
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = [GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64)) for _ in range(2)]
    with pytest.raises(GroupError, match="no grouped form"):
        grouped_lm(gpt2)
    with pytest.raises(GroupError, match="differ in architecture or shape"):
        grouped_lm([tiny_llama(seed=0), small_lm(1)])


@pytest.mark.slow  # one sample per call; test_sampling_law checks both modes' law batched in the default run
@pytest.mark.parametrize("mode", ["merge", "vote"])
def test_ensemble_sampling_keeps_the_base_distribution(mode):
    base = tiny_llama(vocab=16, seed=4)
    lms = [small_lm(seed=7, vocab=16), small_lm(seed=8, vocab=16, layers=2)]
    with torch.no_grad():
        base.lm_head.weight.mul_(6)
        for lm in lms:
            lm.lm_head.weight.mul_(4)
    # merge: each member's sampled siblings keep that member's q (two members, two samples per node each).
    drafter = EnsembleDrafter([SSMDrafter(lm, Tree.expansion([2, 1])) for lm in lms], mode=mode, length=2)
    dec = SpeculativeDecoder(base, drafter)
    s = Sampling(temperature=0.8, top_p=0.9)
    stat, df = chi_square(_sample_joint(dec, [1, 5], s, 2000, seed=0), _joint_first_two(base, [1, 5], s))
    assert df >= 5 and stat < df + 4 * (2 * df) ** 0.5, (stat, df)


def test_the_static_merge_sees_one_shape_per_run(monkeypatch):
    """On the static path each member's tree reaches the merge at its member's max_nodes: a lookup member's width
    varies step by step (its matches), and a merge compiled for every width would compile in the middle of decoding."""
    from draftlab.drafters import ensemble as ens

    shapes, merge = set(), ens.merge_trees

    def spy(tokens, *args):
        shapes.add(tuple(t.shape for t in tokens))
        return merge(tokens, *args)
    monkeypatch.setattr(ens, "merge_trees", spy)
    base = tiny_llama(seed=0)
    drafter = EnsembleDrafter([SSMDrafter(tiny_llama(seed=5), Tree.expansion([2, 1])), LookupDrafter(num_tokens=3)])
    prompts = [[1, 5, 7, 9, 1, 5, 7], [3, 4, 3, 4, 3]]
    res = SpeculativeDecoder(base, drafter, static=True).generate(prompts, max_new_tokens=24)
    assert res.tokens == [plain_greedy(base, p, 24) for p in prompts]
    assert res.steps > 4 and shapes == {(torch.Size([2, 5]), torch.Size([2, 1 + 3 * 4]))}


def test_typical_acceptance_with_members_drafting_the_same_token():
    """Typical mode shares equal tokens between members' sampled trees (one node, several owners); its rule uses
    no q, so no q table is built (building one assumed a single owner per node and crashed)."""
    lms = [tiny_llama(vocab=16, seed=4) for _ in range(3)]  # the base and two members equal to it
    with torch.no_grad():
        for lm in lms:
            lm.lm_head.weight.mul_(6)  # peaked, so the members' independent draws are mostly the same token
    base, twins = lms[0], [SSMDrafter(lm, Tree.expansion([2, 1])) for lm in lms[1:]]
    drafter = EnsembleDrafter(twins, mode="merge")
    shared, propose = [], drafter.propose

    def spy(root):
        prop = propose(root)
        shared.append(sum(sum(i >= 0 for i in own) == 2 for own in drafter.owners[0][1:]))
        return prop
    drafter.propose = spy
    s = Sampling(temperature=0.8, typical=True)
    res = SpeculativeDecoder(base, drafter).generate([[1, 5]], max_new_tokens=24, sampling=s,
                                                     generator=torch.Generator().manual_seed(0))
    assert len(res.tokens[0]) == 24
    assert sum(shared) > 0  # the case under test: nodes both members drafted (in 8 steps, for seeds 0-5)
    assert res.accept_length > 1.5  # the twins are the base: their shared drafts are accepted


def test_vote_weights_reward_and_punish():
    v = VoteWeights(reward_factor=2.0, punish_factor=0.5, reward_threshold=0.6, punish_threshold=0.3)
    v.reset(3)
    v.update({0: (4, 4)})  # member 0 won with everything accepted: ratio 1.0 > 0.6
    assert v.weights[0] > v.weights[1] == v.weights[2] and sum(v.weights) == pytest.approx(3)
    v.update({1: (0, 4)})  # member 1 won and nothing was accepted: ratio 0 < 0.3
    assert v.weights[1] < v.weights[2] < v.weights[0]
    before = list(v.weights)
    v.update({2: (2, 4)})  # between the thresholds: no change but renormalisation
    assert v.weights == pytest.approx(before)
    v.update({0: (1, 8), 2: (8, 8)})  # the batch's ratio, not a running mean: member 0 is punished now
    assert v.weights[0] / v.weights[2] == pytest.approx(before[0] / before[2] * 0.5 / 2.0)
    winner = lambda members, weights: vote_row([[7, 3]] * len(members), members, 3, weights)[2]
    assert winner((0, 2), v.weights) == 2 and winner((0, 1), v.weights) == 0  # (equal chains) the heaviest
    assert winner((1, 2), [1.0] * 3) == 1  # at equal weights, the first


def test_vote_weights_have_a_floor_so_a_member_that_turns_best_wins_again_soon():
    """After 5,000 batches won by member 0, member 1 becomes the one whose drafts are accepted. Without a floor its
    weight was 1e-323 and it took about 3,300 batches to win a row again (review); at the floor (1e-3) about 19."""
    v = VoteWeights()
    v.reset(2)
    for _ in range(5000):
        v.update({0: (4, 4)})
    assert min(v.weights) == v.weight_floor == 1e-3
    batches = 0
    while v.weights[1] <= v.weights[0]:  # member 0 wins the rows and is punished; member 1 is rewarded on its own
        v.update({0: (0, 4), 1: (4, 4)})
        batches += 1
    assert batches < 25


def test_ensemble_settings_that_cannot_run_are_refused_when_built():
    """A member that reads the base's states of every step (heads, EAGLE-3, DFlash) cannot sit out a step, which a
    scheduler has members do: it crashed at the first probe after a pause (review); and an adaptive length that
    starts outside [s_min, s_max] verified trees larger than the drafter's max_nodes."""
    from test_decoder import noisy_heads
    from draftlab.drafters import make_drafter

    base = tiny_llama(seed=0)
    heads = make_drafter(noisy_heads(base, seed=0, noise=3.0), Tree.chain(3))
    ssm = SSMDrafter(tiny_llama(seed=0), Tree.chain(3))
    with pytest.raises(ValueError, match="member1 read the base's states .* scheduler=None"):
        EnsembleDrafter([ssm, heads], scheduler=Scheduler())
    drafter = EnsembleDrafter([ssm, heads])  # every member drafts every step: exact
    prompt = [1, 5, 7, 9, 3]
    assert SpeculativeDecoder(base, drafter).generate([prompt], max_new_tokens=40).tokens[0] == \
        plain_greedy(base, prompt, 40)
    with pytest.raises(ValueError, match=r"starts at 16 \(--length\), outside \[s_min, s_max\] = \[1, 12\]"):
        EnsembleDrafter([ssm], mode="vote", length=16, adaptive=AdaptiveLength(s=16))


def test_the_cost_schedule_keeps_step_times_per_batch_size():
    """A step's seconds depend on the batch size: a run at batch 1 after one at batch 32 priced two members by the
    batch-32 steps, and a count priced out was never timed again (review). Each batch size explores its own."""
    sched = Scheduler(policy="cost")
    sched.reset(3, 32)
    sched._timed(2, 0.050)
    sched.k = 2
    sched.reset(3, 1)
    assert sched.seconds == [[], [], [], []] and sched.k == 0
    sched._timed(2, 0.020)
    sched.reset(3, 32)
    assert sched.seconds[2] == [0.050] and sched.by_rows[1][0][2] == [0.020]


def _vote_ensemble(lms, length=3, **kw):
    return EnsembleDrafter([SSMDrafter(lm, Tree.chain(length)) for lm in lms], mode="vote", length=length, **kw)


def test_vote_weights_move_once_per_verified_batch():
    """A batch of 16 rows is one verification: a weight moves by at most one reward or punish factor per step
    (16 updates per step multiplied it by 1.2 ** 16 and locked one member in)."""
    base = tiny_llama(seed=3)
    drafter = _vote_ensemble([tiny_llama(seed=3), small_lm(seed=30)])  # the base itself wins every row
    rng = random.Random(0)
    prompts = [[rng.randrange(64) for _ in range(4)] for _ in range(16)]
    res = SpeculativeDecoder(base, drafter).generate(prompts, max_new_tokens=13)
    w = drafter.vote.weights
    # Every step but the last (no commit after it) rewarded member 0 once; member 1 never won a row.
    assert res.steps >= 3 and w[0] / w[1] == pytest.approx(1.2 ** (res.steps - 1))
    assert drafter.vote.updates == res.steps - 1


def test_one_member_wins_each_vote():
    """Two members drafting the same chain: one wins (the first, at equal weights) and only it is rewarded."""
    base = tiny_llama(seed=3)
    drafter = _vote_ensemble([tiny_llama(seed=3), tiny_llama(seed=3)])
    SpeculativeDecoder(base, drafter).generate([[5, 6, 7]], max_new_tokens=9)
    assert drafter.vote.weights[0] > drafter.vote.weights[1] and drafter.winners == [0]


@pytest.mark.parametrize("rule", ["trend", "regression"])
def test_adaptive_length_finds_the_cheapest_length(rule):
    """Cost per token with its minimum at s = 6 (plus noise): either rule settles around it, from below and above."""
    for start in (2, 12):
        rng = random.Random(0)
        a = AdaptiveLength(s=start, s_min=1, s_max=12, decision_threshold=6, window=18, rule=rule)
        for _ in range(600):
            cost = 1.0 + 0.02 * (a.s - 6) ** 2 + rng.gauss(0, 0.01)
            a.record({"draft": cost, "verify": 0.0}, 1.0)
        late = a.history[-300:]
        assert 5 <= sum(late) / len(late) <= 7 and a.history[0] == start, (rule, start, sum(late) / len(late))
    flat = AdaptiveLength(s=4, decision_threshold=2, s_max=6, rule=rule)
    for _ in range(10):
        flat.record({"verify": 1.0}, 1.0)
    assert flat.history == [4, 4] + [5] * 8  # one exploring step, then no evidence to move on


def test_minions_trend_rule_follows_the_cost_over_time():
    """The trend rule: the first decision explores upwards; cost falling since the last move -> the same way
    again; rising -> back the other way; the cost is the verification time over the verified length (metric
    verify, as in a pipeline)."""
    a = AdaptiveLength(s=4, decision_threshold=2, metric="verify")
    for cost in [2.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.8, 0.8, 0.6, 0.6]:  # per period: 2 -> 1 -> 0.5 -> 0.8 -> 0.6
        a.record({"draft": 5.0, "verify": 3 * cost}, 3.0)  # drafting time does not count under metric verify
    assert a.history == [4, 4, 5, 5, 6, 6, 7, 7, 6, 6] and a.s == 5  # up, up, up, back down, on down
    with pytest.raises(ValueError, match="rule='slope'.*trend, regression"):
        AdaptiveLength(rule="slope")
    with pytest.raises(ValueError, match="metric='wall'"):
        AdaptiveLength(metric="wall")


def test_scheduler_pauses_a_useless_member_and_probes_it():
    base = tiny_llama(seed=0)
    good = SSMDrafter(tiny_llama(seed=0), Tree.chain(3))
    bad = SSMDrafter(small_lm(seed=99), Tree.chain(3))
    sched = Scheduler(warmup=4, probe_every=8, min_share=0.3)
    dec = SpeculativeDecoder(base, EnsembleDrafter([good, bad], mode="merge", scheduler=sched))
    prompts = [[3, 4, 5, 6]]
    res = dec.generate(prompts, max_new_tokens=60)
    assert res.tokens[0] == plain_greedy(base, prompts[0], 60)
    late = sched.history[6:]
    bad_share = sum(on[1] for on in late) / len(late)
    assert all(on[0] for on in late) and bad_share < 0.5 and any(on[1] for on in late)  # paused, but probed


class CountScheduler(Scheduler):
    """The cost policy with the member counts of a fixed pattern instead of measured rates (members in gain order)."""

    def __init__(self, pattern):
        super().__init__(policy="cost", warmup=0)
        self.pattern = pattern

    def _count(self):
        return self.pattern[len(self.history) % len(self.pattern)]


@pytest.mark.parametrize("compile", [None, pytest.param("eager", marks=pytest.mark.slow)])  # traced: slow run
def test_the_cost_schedule_drafts_alone_and_stays_exact(compile, monkeypatch):
    """Under the cost policy a step with one member drafting verifies that member's tree alone (at its width) and,
    on the static path, chains when the next step is that member's too; members that sat out catch up with the text
    (a backlog longer than CATCH_UP in chunks, the feed staying narrow). Greedy stays exact, batch 1 and 3, with EOS
    in the middle of a step."""
    from draftlab.drafters import ssm as ssm_mod

    rng = random.Random(1)
    base = tiny_llama(seed=0)
    caught_up = []
    monkeypatch.setattr(ssm_mod, "CATCH_UP_WIDTH", 16)  # a backlog of 50 tokens: several catch-up forwards
    catch_up = ssm_mod.SSMDrafter.catch_up
    monkeypatch.setattr(ssm_mod.SSMDrafter, "catch_up", lambda self, keep=1: (
        caught_up.append(max(len(p) for p in self.pending)), catch_up(self, keep))[1])
    mem = [SSMDrafter(tiny_llama(seed=0), Tree.chain(3)), SSMDrafter(small_lm(21), Tree.expansion([2, 2])),
           LookupDrafter(num_tokens=3)]
    sched = CountScheduler([3, 1, 1, 1, 2, 1, 1, 3, 3] + [1] * 14)
    drafter = EnsembleDrafter(mem, scheduler=sched)
    assert not drafter.groups  # the cost policy drafts members one by one
    dec = SpeculativeDecoder(base, drafter, compile=compile)
    widths, steps = [], 0
    for B, eos in ((1, None), (3, None), (3, "mid")):
        prompts = [[rng.randrange(64) for _ in range(rng.randint(2, 9))] * 2 for _ in range(B)]
        want = [plain_greedy(base, p, 60) for p in prompts]
        stop = want[0][17] if eos else None
        if stop is not None:
            want = [w[: w.index(stop) + 1] if stop in w else w for w in want]
        res = dec.generate(prompts, max_new_tokens=60, eos_token_id=stop)
        assert res.tokens == want, (B, eos)
        widths += res.tree_sizes
        steps += res.steps
    # One entry per step that ran, and the plan for the step after the last: a run's first step drafts with what the
    # last run planned for it (once dropped at every run's start: a lost probe, a step in the history that never ran)
    assert len(sched.history) == steps + 1
    history = [sum(on) for on in sched.history]
    assert history.count(1) > 20 and all(on[0] for on in sched.history if sum(on) == 1)  # member 0 gains most
    assert 1 + 3 in widths  # member 0's chain alone (the static path pads merged trees to max_nodes, not these)
    if compile:
        assert max(widths) == drafter.max_nodes and res.chained_steps > 0
        # Member 1 sat out up to 14 steps: its backlog went in chunks and its feed stayed narrow.
        assert max(caught_up) > ssm_mod.CATCH_UP and mem[1].feed_width <= 1 + ssm_mod.CATCH_UP


@pytest.mark.parametrize("compile", [None, pytest.param("eager", marks=pytest.mark.slow)])  # traced: slow run
def test_a_member_that_begins_late_takes_the_text_as_its_prompt(compile, monkeypatch):
    """Under the cost policy a member begins when it first drafts in a run; one that reads no base states (an SSM,
    prompt lookup) then takes the prompt and the text committed so far, but each row's last token, as its prompt
    (one prefill), and feeds that token with the next root. That prompt grows only up to the width the run's prompt
    is prefilled at (16 here; a wider prefill would compile late in a run), the rest is fed. Its tree is the one it
    drafts after a begin on the prompt alone and a feed of the whole backlog; greedy stays exact, batch 2 with
    uneven prompts."""
    from draftlab.drafters.ensemble import extended_prompt
    from draftlab.drafters import PromptState

    base, lm = tiny_llama(seed=0), small_lm(21)
    begun = []
    begin = SSMDrafter.begin
    monkeypatch.setattr(SSMDrafter, "begin", lambda self, prompt, *a: (
        begun.append((id(self), prompt.valid.sum(-1).tolist())), begin(self, prompt, *a))[1])
    late = SSMDrafter(lm, Tree.expansion([2, 2]))
    mem = [SSMDrafter(tiny_llama(seed=0), Tree.chain(3)), late]
    drafter = EnsembleDrafter(mem, scheduler=CountScheduler([1] * 5 + [2] + [1] * 6))
    dec = SpeculativeDecoder(base, drafter, compile=compile)
    prompts = [[5, 9, 2, 7, 5, 9], [3, 8, 1]]
    res = dec.generate(prompts, max_new_tokens=40)
    assert res.tokens == [plain_greedy(base, p, 40) for p in prompts]
    first = [n for who, n in begun if who == id(late)][0]
    # Its prompt held the text so far, up to the 16 tokens the prompt's prefill is padded to (the first member,
    # the base itself here, drafted 5 steps of 4 tokens).
    assert first == [16, 16], first
    # The same tree as a begin on the prompt and a feed of the backlog (eager, float64).
    ids = torch.tensor([[5, 9, 2, 7, 5, 9], [0, 0, 0, 3, 8, 1]])
    valid = ids > 0
    prompt = PromptState(ids, valid, (valid.long().cumsum(-1) - 1).clamp(min=0))
    backlog, root = [[4, 4, 6, 1, 2], [7, 2]], torch.tensor([11, 12])
    a, b = SSMDrafter(lm, Tree.expansion([2, 2])), SSMDrafter(lm, Tree.expansion([2, 2]))
    a.begin(prompt, Sampling(), None)
    a.follow(backlog)
    b.begin(extended_prompt(prompt, [t[:-1] for t in backlog]), Sampling(), None)
    b.follow([t[-1:] for t in backlog])
    assert torch.equal(a.propose(root).tokens, b.propose(root).tokens)


def _tree_holds(member, prefix, root, text):
    """The tokens member's tree holds along `text` when it drafts from root after prefix (eager, alone)."""
    from draftlab.drafters import PromptState

    d = SSMDrafter(member.lm, member.tree)
    ids = torch.tensor([prefix])
    d.begin(PromptState(ids, ids >= 0, torch.arange(len(prefix))[None]), Sampling(), None)
    tokens = d.propose(torch.tensor([root])).tokens[0].tolist()
    node = {p: i for i, p in enumerate(member.tree.paths, start=1)}
    path = ()
    for t in text:
        nxt = [path + (r,) for r in range(len(tokens)) if path + (r,) in node and tokens[node[path + (r,)]] == t]
        if not nxt:
            break
        path = nxt[0]
    return len(path)


@pytest.mark.parametrize("compile", [None, pytest.param("eager", marks=pytest.mark.slow)])  # traced: slow run
def test_the_text_ranking_scores_what_each_tree_would_have_held(compile):
    """Under the cost policy with rank_on=text (greedy, SSM members), the members that sat out are scored at a probe
    on the text committed meanwhile: at every step one member drafted alone, what each other member's tree would
    have held, from the ranks of the text's tokens under its logits. Each score equals the tokens that member's
    tree holds when it drafts there alone; the complete rows go to the schedule. Batch 2, uneven prompts, EOS."""
    base = tiny_llama(seed=0)
    noisy = tiny_llama(seed=0)  # the base with a noisy output layer: its trees hold some of the text
    with torch.no_grad():
        noisy.lm_head.weight.add_(torch.randn(noisy.lm_head.weight.shape, generator=torch.Generator().manual_seed(3),
                                              dtype=noisy.lm_head.weight.dtype) * 0.005)
    mem = [SSMDrafter(tiny_llama(seed=0), Tree.chain(3)), SSMDrafter(noisy, Tree.expansion([2, 2])),
           SSMDrafter(small_lm(22, layers=2), Tree.chain(2))]
    sched = CountScheduler([3] + [1] * 5 + [3] + [1] * 5 + [3] + [1] * 20)
    drafter = EnsembleDrafter(mem, scheduler=sched)
    seen, text_rows = [], drafter._text_rows

    def spy():  # what the probe scores, and the rows it gives the schedule
        lone, log, before = dict(drafter.lone), [list(step) for step in drafter.log], len(sched.lengths)
        would = {s: {m: dict(r) for m, r in w.items()} for s, w in drafter.would.items()}
        text_rows()
        seen.append((lone, would, log, sched.lengths[before:]))
    drafter._text_rows = spy
    dec = SpeculativeDecoder(base, drafter, compile=compile)
    prompts = [[40, 37, 11, 26], [33, 43, 40, 7, 41, 3, 61]]
    want = [plain_greedy(base, p, 80) for p in prompts]
    stop = want[1][44]  # row 1 ends there, row 0 goes on to 80 tokens
    assert stop not in want[0] + want[1][:44]
    want[1] = want[1][:45]
    res = dec.generate(prompts, max_new_tokens=80, eos_token_id=stop)
    assert res.tokens == want
    scored = nonzero = 0
    rows = []
    for lone, would, log, added in seen:
        got = []
        for s, (m, held) in lone.items():
            for b, h in enumerate(held):
                if h is None:
                    continue
                text = [t for step in log[:s] for t in step[b]]
                after = [t for step in log[s:] for t in step[b]][1:]
                assert h == len(log[s][b]) - 1
                row = [h if i == m else would.get(s, {}).get(i, {}).get(b) for i in range(3)]
                got += [row] if None not in row else []
                for i, w in enumerate(row):
                    if i != m and w is not None:
                        scored += 1
                        nonzero += w > 0
                        assert w == _tree_holds(mem[i], prompts[b] + text, log[s][b][0], after), (s, b, i)
        assert added == got  # the complete rows went to the schedule
        rows += got
    assert scored > 20 and len(rows) > 10 and nonzero > 8, (scored, len(rows), nonzero)
    # Sampling, or rank_on=probes: no text rows.
    for sampling, rank_on in ((Sampling(temperature=1.0), "text"), (Sampling(), "probes")):
        sched = CountScheduler([3] + [1] * 5 + [3] + [1] * 5)
        sched.rank_on = rank_on
        drafter = EnsembleDrafter(mem, scheduler=sched)
        SpeculativeDecoder(base, drafter).generate(prompts, max_new_tokens=40, sampling=sampling,
                                                    generator=torch.Generator().manual_seed(0))
        assert not drafter.text and not drafter.lone and all(None not in r for r in sched.lengths), rank_on
    with pytest.raises(ValueError, match="rank_on"):
        Scheduler(policy="cost", rank_on="gain")


def test_the_cost_schedule_chooses_the_most_tokens_per_second():
    """The cost policy's choice from what it measured: after the warm-up with every member, each member count is
    timed `explore` steps, then the count with the most expected tokens per second drafts, every member drafting on
    probe steps whose interval doubles while the choice stands, up to where probes cost `probe_share` of the time or
    to `probe_max`. Two rows per step, the accepted tokens each member's tree held: "same": member 0 holds them, 1
    never beyond 0; "second": member 1 holds the most (it drafts alone, whatever the gains passed say);
    "complement": members 0 and 1 each hold them on one of the rows."""
    held = {"same": [(3, 1, 0), (3, 1, 0)], "second": [(1, 3, 0), (1, 3, 0)], "complement": [(3, 1, 0), (0, 3, 0)]}
    slow = {1: 1.0, 2: 1.5, 3: 2.0}  # a probe costs one step more than the lone member's
    # (held rows, step seconds per member count, probe_share, the count chosen, the member alone, the last probe gap,
    # seconds every step spends feeding members text they missed: a probe's count toward its cost)
    for kind, costs, share, want, alone, gap, fed in (
            ("same", slow, 0.02, 1, 0, 16, 0.0),  # probes would cost 2% 50 steps apart: probe_max (16) is the bound
            ("second", slow, 0.02, 1, 1, 16, 0.0),
            ("complement", {1: 1.0, 2: 1.2, 3: 2.0}, 0.02, 2, None, 16, 0.0),
            ("same", slow, 0.125, 1, 0, 8, 0.0),  # 12.5% of the time: a probe every 8 steps
            ("same", slow, 0.125, 1, 0, 16, 1.0),  # feeding a step's time more: twice as far apart
            ("same", {1: 1.0, 2: 1.0, 3: 1.0}, 0.02, 1, 0, 4, 0.0)):  # free probes: as often as probe_every
        sched = Scheduler(policy="cost", warmup=2, explore=2, probe_every=4, probe_max=16, probe_share=share)
        sched.reset(3)
        for step in range(120):
            on = sched.active()
            rows = [[h[m] if on[m] else None for m in range(3)] for h in held[kind]]
            gains = [(2.0 if m == 0 else 1.0) if on[m] else None for m in range(3)]  # misleading on purpose
            sched.update(gains, rows, costs[sum(on)], fed)
        counts = [sum(on) for on in sched.history]
        assert counts[:2] == [3, 3] and sorted(counts[2:6]) == [1, 1, 2, 2], counts[:8]  # warm-up, exploring
        late = counts[40:]
        assert late.count(want) >= (1 - 1.5 / gap) * len(late) and all(c in (want, 3) for c in late), (kind, late)
        if alone is not None:
            assert all(on[alone] for on in sched.history[40:] if sum(on) == 1), kind
        probes = [i for i, c in enumerate(counts) if c == 3 and i >= 6]
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert gaps[-1] == gap and gaps == sorted(gaps), (kind, share, gaps)  # doubling up to the bound
    with pytest.raises(ValueError, match="policy"):
        Scheduler(policy="fastest")
    with pytest.raises(ValueError, match="probe_share"):
        Scheduler(policy="cost", probe_share=0)
    sched = Scheduler(policy="cost", probe_every=8, probe_max=4)  # probe_max bounds the interval whatever probe_every
    sched.reset(3)
    sched.k, sched.seconds = 1, [[], [1.0], [], [5.0]]
    assert sched._probe_cap(3) == 4
    # ... from the first probe on (the interval started at probe_every, 16 steps apart where probe_max was 4)
    sched = Scheduler(policy="cost", warmup=2, explore=2, probe_every=16, probe_max=4)
    sched.reset(3)
    for step in range(80):
        on = sched.active()
        seconds = {1: 1.0, 2: 1.5, 3: 2.0}[sum(on)]
        sched.update([1.0 if o else None for o in on], [[3 if o else None for o in on]], seconds)
    probes = [i for i, on in enumerate(sched.history) if all(on) and i >= 6]
    assert max(b - a for a, b in zip(probes, probes[1:])) <= 4
    # The feeding a probe's bound counts is the probes' own, not the warm-up's (which feeds nothing).
    sched = Scheduler(policy="cost", warmup=3, explore=1, probe_every=2, probe_max=4)
    sched.reset(2)
    for step in range(30):
        on = sched.active()
        sched.update([1.0 if o else None for o in on], [[1 if o else None for o in on]], 1.0, 0.5 if all(on) else 0.0)
    assert sched.fed and all(f == 0.5 for f in sched.fed)
    for name in ("explore", "probe_every", "probe_max", "cost_window", "rank_window"):  # 0 would probe every step,
        with pytest.raises(ValueError, match=name):  # or keep every record for good
            ensemble_parts({"policy": "cost", name: "0"})
    with pytest.raises(ValueError, match="merge"):
        EnsembleDrafter([LookupDrafter(num_tokens=2)], mode="vote", scheduler=Scheduler(policy="cost"))


def test_a_standing_choice_is_reused_as_the_count_would_give_it(monkeypatch):
    """Between a choice and the next choice or probe, the cost policy's steps reuse the standing choice instead of
    reading the records again: the same members drafting at every step as a schedule that reads them every step,
    on records whose choice flips now and then (noisy step seconds, members whose lengths cross)."""
    calls = []
    count = Scheduler._count
    monkeypatch.setattr(Scheduler, "_count", lambda self: calls.append(self) or count(self))
    gen = torch.Generator().manual_seed(0)
    scheds = [Scheduler(policy="cost", warmup=2, explore=2, probe_every=4, probe_max=64) for _ in range(2)]
    for sched in scheds:
        sched.reset(3)
    for step in range(400):
        ons = []
        for i, sched in enumerate(scheds):
            if i:  # the reference: never a standing choice
                sched.steady_until = 0
            ons.append(sched.active())
        assert ons[0] == ons[1], step
        k = sum(ons[0])
        lengths = torch.randint(0, 4, (2, 3), generator=gen).tolist()
        seconds = float(k) ** (0.3 if step % 100 < 50 else 2.0) * (1 + 0.2 * torch.rand(1, generator=gen).item())
        for sched in scheds:
            sched.update([1.0 if o else None for o in ons[0]], [[r[m] if ons[0][m] else None for m in range(3)]
                                                                for r in lengths], seconds, 0.1)
    assert scheds[0].history == scheds[1].history and scheds[0].k == scheds[1].k
    assert {sum(on) for on in scheds[0].history[40:]} >= {1, 3}  # the choice moved, probes came
    assert sum(c is scheds[0] for c in calls) < 0.5 * 400  # the first read its records on a minority of its steps
    # A lone member's step (update_one) leaves the records update leaves.
    for seconds in (0.5, None):
        one, every = (Scheduler(policy="cost", warmup=0) for _ in range(2))
        for sched in (one, every):
            sched.reset(3)
        for step in range(12):
            one.update_one(1, 2.0 + step % 3, seconds)
            every.update([None, 2.0 + step % 3, None], None, seconds)
        assert one == every and one.seconds[1] == ([0.5] * 9 if seconds else []), one


def test_schedule_histories_stay_bounded(monkeypatch):
    """A server decodes for days: the schedules' per-step histories keep their last HISTORY steps (or up to twice
    that), newest last, not one entry per step for ever."""
    from draftlab.drafters import ensemble as ens

    monkeypatch.setattr(ens, "HISTORY", 8)
    sched, adaptive = Scheduler(warmup=0), AdaptiveLength(s=4, decision_threshold=2)
    sched.reset(2)
    for step in range(100):
        on = sched.active()
        sched.update([1.0 if o else None for o in on])
        adaptive.record({"verify": 1e-3}, 2.0)
    assert 8 <= len(sched.history) < 16 and 8 <= len(adaptive.history) < 16
    assert sched.history[-1] == on and adaptive.history[-1] == adaptive.s
    assert sched.steps == adaptive.count == 100  # the counts are not the bounded histories' lengths


def test_the_ensembles_log_keeps_what_a_member_has_not_followed(monkeypatch):
    """The log of committed text drops the steps every member has followed (every LOG_KEEP steps): a member that sits
    out 5 steps in 6 drafts the same trees as with the whole log kept."""
    from draftlab.drafters import ensemble as ens

    base, prompts = tiny_llama(seed=0), [[40, 37, 11, 26], [33, 43, 40, 7, 41, 3, 61]]
    runs = []
    for keep in (10 ** 6, 4):
        monkeypatch.setattr(ens, "LOG_KEEP", keep)
        late = SSMDrafter(small_lm(21), Tree.expansion([2, 2]))
        trees, propose = [], late.propose
        late.propose = lambda root: (lambda p: (trees.append(p.tokens.tolist()), p)[1])(propose(root))
        drafter = EnsembleDrafter([SSMDrafter(tiny_llama(seed=0), Tree.chain(3)), late],
                                  scheduler=CountScheduler([2] + [1] * 5))
        res = SpeculativeDecoder(base, drafter).generate(prompts, max_new_tokens=150)
        assert res.tokens == [plain_greedy(base, p, 150) for p in prompts]
        runs.append((trees, drafter.log0, len(drafter.log)))
    assert len(runs[0][0]) > 3 and runs[0][0] == runs[1][0]
    assert runs[0][1] == 0 and runs[1][1] > 0 and runs[1][2] <= 6 + 4, runs[1][1:]


def test_lookup_drafter_prompt_and_datastore():
    base = tiny_llama(seed=1)
    dec = SpeculativeDecoder(base, LookupDrafter(num_tokens=4))
    res = dec.generate([[7, 8, 3, 7, 8], [9, 9, 9]], max_new_tokens=40)
    assert res.tokens == [plain_greedy(base, [7, 8, 3, 7, 8], 40), plain_greedy(base, [9, 9, 9], 40)]
    # This random base falls into short cycles (row 2: 51 24 45 51 24 45 ...): lookup drafts them from the text.
    assert res.accept_length > 1.6
    store = Datastore.from_sequences([[1, 2, 3, 4, 5, 6]], min_n=2, max_n=3)
    assert store.continuations([0, 2, 3], 2, 4) == [[4, 5]]
    d = LookupDrafter(num_tokens=3, min_ngram=2, datastore=store)
    from draftlab.drafters import PromptState

    ids = torch.tensor([[0, 2]])
    d.begin(PromptState(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(2)[None]), Sampling(), None)
    assert d.propose(torch.tensor([3])).tokens[0].tolist() == [3, 4, 5, 6]


def test_options_given_at_decoding_add_to_the_exports_own():
    """--ensemble-option (drafter options) overrides the export's decode options one by one; it replaced the export's
    whole `options` before, dropping the ones it did not name."""
    from draftlab.drafters import EnsembleDraft, LookupDraft, make_drafter

    module = EnsembleDraft([LookupDraft(), LookupDraft()], ["a", "b"], {"options": {"min_share": "0.3",
                                                                                     "probe_every": "4"}})
    d = make_drafter(module, None, options={"policy": "cost", "probe_every": "32"})
    assert (d.scheduler.min_share, d.scheduler.policy, d.scheduler.probe_every) == (0.3, "cost", 32)
    assert make_drafter(module).scheduler.probe_every == 4


def test_ensemble_options_reach_the_scheduler_vote_and_adaptive_length():
    from draftlab.drafters.ensemble import ensemble_parts

    sched, vote, adaptive = ensemble_parts({"min_share": "0.2", "reward_factor": "1.5", "decision_threshold": "4",
                                            "metric": "verify", "rule": "regression", "policy": "cost",
                                            "cost_window": "64", "window": "12"}, length=6)
    assert sched.min_share == 0.2 and vote.reward_factor == 1.5
    assert sched.policy == "cost" and sched.cost_window == 64 and adaptive.window == 12
    assert adaptive.decision_threshold == 4 and adaptive.metric == "verify" and adaptive.s == 6
    assert adaptive.rule == "regression" and ensemble_parts({})[2].rule == "trend"
    with pytest.raises(ValueError, match="rule='newest'"):
        ensemble_parts({"rule": "newest"})
    with pytest.raises(ValueError, match="policy='fastest'"):
        ensemble_parts({"policy": "fastest"})
    with pytest.raises(ValueError, match="known options are .*punish_threshold"):
        ensemble_parts({"reward": "1"})
    with pytest.raises(ValueError, match="expected a int"):
        ensemble_parts({"window": "many"})


def test_the_flat_datastore_answers_as_the_ngram_index_does(monkeypatch):
    """The datastore keeps flat arrays (hashed n-gram keys sorted with their positions) instead of NgramIndex's dict
    of tuples (about 430 bytes a token); its continuations are the dict's, newest first and cut at `per_key`
    occurrences and at the end of each sequence, on random sequences over a small vocabulary (many repeats) and
    with every key colliding (the tokens tell the n-grams apart)."""
    import draftlab.drafters.retrieval as R
    from draftlab.drafters.retrieval import NgramIndex

    rng = random.Random(0)
    for trial in range(6):
        seqs = [[rng.randrange(4) for _ in range(rng.randint(0, 40))] for _ in range(rng.randint(1, 8))]
        min_n, max_n, per_key = rng.randint(1, 2), rng.randint(2, 4), rng.randint(1, 8)
        ref = NgramIndex.of(seqs, min_n, max_n, per_key)
        if trial == 5:  # every n-gram gets the key of its last token
            monkeypatch.setattr(R, "_P", 0)
        store = Datastore.from_sequences(seqs, min_n, max_n, per_key)
        for _ in range(60):
            context = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            length, limit = rng.randint(1, 6), rng.randint(1, 5)
            assert store.continuations(context, length, limit) == ref.continuations(context, length, limit), trial


def test_a_lookup_export_keeps_its_datastore_as_flat_arrays(tmp_path):
    """The export stores the datastore's tokens end to end with their lengths (safetensors) and reloads them without
    Python lists; an export written before (datastore.json) still loads, and one whose store is missing is refused
    (it loaded as a lookup drafter with no datastore before)."""
    import json

    import numpy as np

    from draftlab.drafters import LookupDraft, make_drafter
    from draftlab.drafters.base import ExportError
    from draftlab.interop.export import load_export, save_export

    seqs, base = [[1, 2, 3, 4, 5, 6], [], [2, 3, 9, 9]], tiny_llama(seed=1)
    save_export(LookupDraft(num_tokens=3, min_ngram=2, datastore=seqs), base, tmp_path / "e", "tiny")
    assert not (tmp_path / "e" / "datastore.json").exists()
    module, _ = load_export(tmp_path / "e")
    tokens, lengths = module.datastore
    assert tokens.dtype == np.int32 and tokens.tolist() == [1, 2, 3, 4, 5, 6, 2, 3, 9, 9]
    assert lengths.tolist() == [6, 0, 4]
    assert make_drafter(module).datastore.continuations([0, 2, 3], 2, 4) == [[9, 9], [4, 5]]
    for given in (tuple(seqs), [tuple(q) for q in seqs], (tokens.astype(np.int64), lengths)):  # other shapes of it
        again = LookupDraft(datastore=given).datastore
        assert again[0].dtype == np.int32 and again[0].tolist() == tokens.tolist() and again[1].tolist() == [6, 0, 4]
    (tmp_path / "e" / "datastore.safetensors").unlink()
    with pytest.raises(ExportError, match="datastore.safetensors is missing"):
        load_export(tmp_path / "e")
    (tmp_path / "e" / "datastore.json").write_text(json.dumps(seqs))
    module, _ = load_export(tmp_path / "e")
    assert make_drafter(module).datastore.continuations([0, 2, 3], 2, 4) == [[9, 9], [4, 5]]
