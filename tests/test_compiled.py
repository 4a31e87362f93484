"""The static-shape decode path (static KV cache, trees padded to the drafter's node budget, torch.compile) gives
the eager path's tokens for every drafter kind; its cache keeps, compacts and defragments as the eager one does.

The compiled runs here use torch.compile's "eager" backend (dynamo's graph capture without code generation, a
few seconds): what they check is that the static path traces and gives the same tokens. The inductor backend,
which generates code (about 40 s per shape on 2 CPU cores), is checked in one slow test."""

import copy

import pytest
import torch

from conftest import tiny_llama
from draftlab.decode.cache import SlotCache, StaticSlotCache, attention_window, keep_on_device
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.tree import DynamicTree, Tree, TreeView
from draftlab.drafters import build_draft, make_drafter
from draftlab.drafters.ensemble import EnsembleDrafter
from draftlab.drafters.retrieval import LookupDrafter
from draftlab.drafters.ssm import SSMDrafter


def peaked(layers=2, seed=4, dtype=torch.float64):
    base = tiny_llama(vocab=32, layers=layers, seed=seed, dtype=dtype)
    with torch.no_grad():
        base.lm_head.weight.mul_(4)  # wide top-2 margins, and drafts close to it accepted several tokens deep
    return base


def near(base, noise=0.2, seed=1):
    lm = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return lm.eval()


def drafter(kind: str, base):
    torch.manual_seed(0)
    if kind in ("medusa", "hydra", "hydra++"):
        head = {"type": "hydra" if kind == "hydra++" else kind, "num_heads": 3, "num_layers": 1,
                "prefix_attention": kind == "hydra++"}
        heads = build_draft(head, base).to(base.dtype).eval()
        if getattr(heads, "prefix_layer", None) is not None:  # it starts as the identity: give it weights that change the heads' h
            with torch.no_grad():
                for p in heads.prefix_layer.parameters():
                    p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype))
        return make_drafter(heads, Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))
    if kind == "ssm":
        return SSMDrafter(near(base), Tree.expansion([2, 2, 1]))
    if kind == "eagle3":
        return make_drafter(build_draft({"type": "eagle3", "eagle": {}}, base).to(base.dtype).eval(),
                            DynamicTree(3, 2, 6))
    if kind == "ensemble":
        return EnsembleDrafter([SSMDrafter(near(base), Tree.expansion([1, 2])), SSMDrafter(near(base, 0.4, 2),
                                Tree.chain(3)), LookupDrafter(num_tokens=2)], mode="merge", node_budget=8)
    if kind == "dflash":
        from draftlab.drafters.dflash import DFlashDrafter

        module = build_draft({"type": "dflash", "dflash": {"num_layers": 1, "block_size": 4}}, base).to(base.dtype)
        return DFlashDrafter(module.eval(), Tree.from_paths([[0], [1], [0, 0], [0, 0, 0]]))
    if kind == "ensemble-grouped":  # three SSMs of one shape and tree: one grouped model
        return EnsembleDrafter([SSMDrafter(near(base, 0.2, s), Tree.expansion([1, 2])) for s in (1, 2, 3)]
                               + [LookupDrafter(num_tokens=2)], mode="merge", node_budget=8)
    return LookupDrafter(num_tokens=3)


KINDS = ["medusa", "hydra", "hydra++", "ssm", "eagle3", "ensemble", "ensemble-grouped", "lookup"]


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow)  # 9-13 s each (CI's slow run has them)
                                  if k in ("ensemble", "ensemble-grouped", "ssm") else k for k in KINDS])
def test_static_and_compiled_decoding_give_the_eager_tokens(kind):
    """... and every compiled call traces as whole graphs: a graph break would run Python between its pieces on every
    call (a DFlash call once read Tree.depth, a max() dynamo cannot trace, inside its graph)."""
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()
    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]  # uneven, left-padded
    eager = SpeculativeDecoder(base, drafter(kind, base)).generate(prompts, max_new_tokens=21)
    eos = eager.tokens[0][9]  # a token the first row emits mid-run (often mid-tree): EOS ends rows there
    ref = SpeculativeDecoder(base, drafter(kind, base)).generate(prompts, max_new_tokens=21, eos_token_id=eos)
    assert eager.accept_length > 1.0 or kind in ("medusa", "hydra", "hydra++", "eagle3")  # untrained heads
    for opts in ({"static": True}, {"compile": "eager"}):
        dec = SpeculativeDecoder(base, drafter(kind, base), **opts)
        for e, r in ((None, eager), (eos, ref)):
            got = dec.generate(prompts, max_new_tokens=21, eos_token_id=e)
            assert got.tokens == r.tokens, (kind, opts, e)
            assert got.steps == r.steps
    assert not counters["graph_break"], (kind, list(counters["graph_break"]))


@pytest.mark.parametrize("kind", ["hydra++", "eagle3"])
def test_drafter_states_after_each_commit_are_the_same_on_the_static_path(kind, monkeypatch):
    """Hydra++'s prefix layer and EAGLE-3's layer on the static path (commits padded to one width, the padding
    left as holes, run in the next proposal's call, or in the verification's call: the chained step) give the
    drafter the same state after every commit as the eager path, as its next proposal reads it: finer than tokens."""
    from draftlab.drafters.eagle import Eagle3Drafter
    from draftlab.drafters.heads.drafter import HeadsDrafter

    cls, attr = (HeadsDrafter, "hidden") if kind == "hydra++" else (Eagle3Drafter, "out")
    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    seen = []

    def recording(method):
        def record(self, *args):
            out = method(self, *args)
            seen[-1].append(getattr(self, attr).clone())
            return out
        return record
    monkeypatch.setattr(cls, "propose", recording(cls.propose))
    monkeypatch.setattr(cls, "chained", recording(cls.chained))
    runs = ({}, {"static": True}, {"compile": "eager", "chained": False}, {"compile": "eager"})
    for opts in runs:
        seen.append([])
        res = SpeculativeDecoder(base, drafter(kind, base), **opts).generate(prompts, max_new_tokens=21)
    assert res.chained_steps == res.steps  # the last run's steps all drafted in the verification's call
    assert len({len(s) for s in seen}) == 1 and len(seen[0]) > 3
    for states in zip(*seen):
        assert all(torch.allclose(states[0], s, atol=1e-9) for s in states[1:])


@pytest.mark.parametrize("kind", ["ssm", "ensemble-grouped"])
def test_ssm_logits_at_every_level_are_the_same_on_the_static_path(kind):
    """The SSM's tree levels as one call on the static path (masks built from the cache's committed slots and
    length) give the logits of the eager path's forward per level: finer than tokens, which a near-tie-free draft
    would keep even with a wrong mask."""
    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    seen = []
    for opts in ({}, {"static": True}):
        d = drafter(kind, base)
        lm = d.groups[0].drafter.lm if kind == "ensemble-grouped" else d.lm
        seen.append([])
        hook = lm.register_forward_hook(lambda m, i, out: seen[-1].append(out.logits.clone()))
        SpeculativeDecoder(base, d, **opts).generate(prompts, max_new_tokens=21)
        hook.remove()
    assert len(seen[0]) == len(seen[1]) > 3 * 3  # the prefill, then per step a feed and the levels
    full = 0
    for a, b in zip(seen[0][1:], seen[1][1:]):  # (the prefills differ at the padding)
        # Feeds are one width on the static path (left-padded), the tokens pending on the eager one: their last
        # position (the root) is what the drafter reads. Levels have one shape on both paths.
        if a.shape == b.shape:
            full += 1
            assert torch.allclose(a, b, atol=1e-9)
        assert torch.allclose(a[:, -1], b[:, -1], atol=1e-9)
    assert full > len(seen[0]) // 3


@pytest.mark.slow  # 30-35 s on a 2-core CI machine; test_the_chained_step_gives_the_split_calls_tokens[ssm] runs by default
def test_the_ssms_cache_after_each_chained_step_is_the_split_steps(monkeypatch):
    """The chained step's SSM commit (the accepted internal slots kept on the device, the accepted leaf and the root
    fed, the next tree drafted, all in the verification's call) leaves the SSM's cache as commit + propose do: the
    same committed length, valid slots, positions and keys for every row still decoding, after every step (a row
    that ended may differ: the chained commit reads liveness from before the step's emission). The SSM's cache
    starts with room for 16 tokens past the prompt, so steps without room for the chained call's worst case go the
    split way, which defragments and grows the cache as the split path does."""
    import draftlab.decode.cache as cache_module
    import draftlab.drafters.ssm as ssm_module
    from draftlab.decode.acceptance import Sampling

    slot_cache = cache_module.slot_cache
    monkeypatch.setattr(cache_module, "static_slots", lambda n: n)
    monkeypatch.setattr(ssm_module, "slot_cache", lambda lm, B, n, *a, **k: slot_cache(lm, B, n - 240, *a, **k))
    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]

    def snapshot(d):
        c, live = d.target, torch.tensor(d.live)
        slots = c.slots[live, : c.n + c.tentative]
        keys = c.cache.layers[0].keys[live][:, :, : c.n + c.tentative] * slots[:, None, :, None]  # (holes: any value)
        return c.n, c.tentative, slots.clone(), c.next_pos[live].clone(), keys.clone()

    for sampling in (None, Sampling(temperature=0.7, typical=True)):
        seen, sizes = [], []
        for chained in (False, True):
            d, seen = drafter("ssm", base), seen + [[]]
            for name in ("propose", "chained"):
                def record(*args, method=getattr(d, name), out=seen[-1]):
                    prop = method(*args)
                    out.append((snapshot(d), prop.tokens[torch.tensor(d.live)].clone()))
                    return prop
                setattr(d, name, record)
            res = SpeculativeDecoder(base, d, compile="eager", chained=chained).generate(
                prompts, max_new_tokens=21, sampling=sampling, generator=torch.Generator().manual_seed(1))
            assert (0 < res.chained_steps <= res.steps - 2) if chained else res.chained_steps == 0
            sizes.append(d.target.max_len)
        assert len(seen[0]) == len(seen[1]) > 3 and sizes[0] == sizes[1] > 9 + 16  # it grew
        for (state, tokens), (state1, tokens1) in zip(*seen):
            assert state[:2] == state1[:2] and torch.equal(tokens, tokens1)
            assert torch.equal(state[2], state1[2]) and torch.equal(state[3], state1[3])
            assert torch.allclose(state[4], state1[4], atol=1e-9)


def test_sampled_acceptance_on_the_static_path_is_the_device_rule_in_the_acceptance_graph(monkeypatch):
    """On the static path speculative sampling decides in the acceptance graph (decode.decoder.decide, compiled where
    the path is), never through the host-side accept_sampling, and draws what the eager path draws: same tokens for
    one seed (a tree the drafter never pads, so both draw blocks of one width)."""
    import draftlab.decode.decoder as decoder_module
    from draftlab.decode.acceptance import Sampling

    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3]]
    s = Sampling(temperature=0.9, top_p=0.95)
    run = lambda **kw: SpeculativeDecoder(base, drafter("hydra++", base), **kw).generate(  # noqa: E731
        prompts, max_new_tokens=21, sampling=s, generator=torch.Generator().manual_seed(5)).tokens
    eager = run()

    def host_rule(*args, **kwargs):
        raise AssertionError("the static path decided on the host")
    monkeypatch.setattr(decoder_module, "accept_sampling", host_rule)
    assert run(static=True) == run(compile="eager") == eager


@pytest.mark.parametrize("kind", ["ssm", pytest.param("ensemble-grouped", marks=pytest.mark.slow)])  # 8 s
def test_sampled_ssm_drafts_are_the_eager_loops_on_the_static_path(kind):
    """Sampled SSM children are drawn inside the static path's one drafting call (compiled: the chained step's, for a
    lone SSM), from uniforms the drafter's own generator gave before it in the eager loop's order: the same tree
    tokens and q at every step for every row still decoding, so the same output, as the eager loop (also traced by
    dynamo)."""
    from draftlab.decode.acceptance import Sampling

    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    runs = []
    for opts in ({}, {"static": True}, {"compile": "eager"}):
        d = drafter(kind, base)
        ssm = d.groups[0].drafter if kind == "ensemble-grouped" else d
        props = []
        for name in ("propose", "chained"):
            def record(arg, method=getattr(ssm, name), props=props, ssm=ssm):
                p = method(arg)
                live = torch.tensor(ssm.live)
                props.append((p.tokens[live].clone(), p.q[live].clone()))
                return p
            setattr(ssm, name, record)
        out = SpeculativeDecoder(base, d, **opts).generate(prompts, max_new_tokens=21,
                                                           sampling=Sampling(temperature=1.0, top_k=8),
                                                           generator=torch.Generator().manual_seed(3))
        runs.append((out.tokens, props))
    tokens, props = runs[0]
    assert len(props) > 3
    for other, other_props in runs[1:]:
        assert other == tokens and len(other_props) == len(props)
        for (t, q), (t0, q0) in zip(other_props, props):
            assert torch.equal(t, t0) and torch.allclose(q, q0, atol=1e-7)


@pytest.mark.slow  # traces one graph per chain length (about 15 s)
def test_trees_that_change_between_steps_decode_exactly_on_the_compiled_path():
    """Minions' adaptive speculation length changes the members' chains between steps: every length is a call of
    its own signature on the compiled path (never an earlier tree's graph), greedy exact."""
    from draftlab.drafters.ensemble import AdaptiveLength

    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    ref = SpeculativeDecoder(base, drafter("ssm", base)).generate(prompts, max_new_tokens=24).tokens
    adaptive = AdaptiveLength(s=1, s_min=1, s_max=3, decision_threshold=2)
    d = EnsembleDrafter([SSMDrafter(near(base, 0.2, s), Tree.chain(1)) for s in (1, 2)], mode="vote", adaptive=adaptive)
    assert d.groups  # the two members draft as one grouped model
    assert SpeculativeDecoder(base, d, compile="eager").generate(prompts, max_new_tokens=24).tokens == ref
    assert len(set(adaptive.history)) >= 3


def test_the_smallest_attention_window_is_the_devices_and_a_window_never_passes_the_buffer():
    """128 slots on a CPU, 256 elsewhere, doubling to hold what a forward can see, at most the whole buffer."""
    assert [attention_window(n, 1024) for n in (1, 128, 129, 300, 600)] == [128, 128, 256, 512, 1024]
    assert [attention_window(n, 1024, "cuda") for n in (1, 256, 257)] == [256, 256, 512]
    assert attention_window(200, 192) == 192 and attention_window(10, 64, "cuda") == 64


@pytest.mark.parametrize("window_min", [256, 4])
def test_the_static_cache_follows_the_dynamic_one_through_keeps_and_a_defragmentation(window_min, monkeypatch):
    """Random trees and accepted paths, rows keeping different counts (holes): the static cache's logits equal
    the dynamic cache's at every step, also after its buffers filled and the rows' slots were moved together.
    window_min 4: the forwards attend over 16, then 32 of the 32 slots as the text grows, 8 after the defragmentation
    (256: all 32). A third cache keeps with keep_on_device (tensor operations only, as the compiled acceptance graph
    runs it): it ends every step in the same state as the one that keeps on the host, also after plain steps (one
    node), where it moves nothing."""
    monkeypatch.setattr("draftlab.decode.cache.WINDOW_MIN", window_min)
    base = tiny_llama(vocab=32, seed=2)
    B, L = 3, 5
    ids = torch.randint(0, 32, (B, L), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, :2] = False
    dyn, st, dev = SlotCache(base), StaticSlotCache(base, B, 32), StaticSlotCache(base, B, 32)
    with torch.no_grad():
        a, _ = dyn.prefill(ids, valid)
        b, _ = st.prefill(ids, valid)
        dev.prefill(ids, valid)
        assert torch.allclose(a.logits[valid], b.logits[valid], atol=1e-10)
        defragmented, windows = False, set()
        for step in range(14):
            tree = Tree.expansion([2, 1]) if step % 3 else Tree.from_paths([])  # a plain step (one node) too
            view = TreeView.of_static(tree.buffers(), B)
            tokens = torch.randint(0, 32, (B, tree.size), generator=torch.Generator().manual_seed(step))
            n_before = st.length
            a = dyn.forward(tokens, view.ancestors, view.depth).logits
            b = st.forward(tokens, view.ancestors, view.depth).logits
            assert torch.allclose(dev.forward(tokens, view.ancestors, view.depth).logits, b, atol=1e-10), step
            windows.add(st.window)
            defragmented |= st.length < n_before
            assert torch.allclose(a, b, atol=1e-10), step
            paths = [[0, 2, 4] if b == step % B and tree.size > 1 else [0] for b in range(B)]  # a side branch
            M = max(len(p) for p in paths)
            keep = torch.tensor([p + [0] * (M - len(p)) for p in paths])
            kv = torch.tensor([[True] * len(p) + [False] * (M - len(p)) for p in paths])
            start = dyn.length
            dyn.keep(start, keep, kv)
            st.keep(st.length, keep, kv)
            assert torch.equal(dyn.next_pos, st.next_pos)
            N = tree.size
            full = torch.cat([keep, torch.zeros(B, N - M, dtype=torch.long)], 1)
            full_valid = torch.cat([kv, torch.zeros(B, N - M, dtype=torch.bool)], 1)
            dev.kept(M, keep_on_device(*dev.device_state(), dev.slots, full, full_valid, kv.sum(-1), dev.next_pos))
            assert torch.equal(dev.next_pos, st.next_pos) and dev.length == st.length
            assert torch.equal(dev.slots, st.slots) and int(dev.cache.layers[0].cumulative_length) == st.length
            held = st.valid[:, None, :, None]  # holes are never attended to: what they hold may differ
            for x, y in zip(dev.device_state()[0], st.device_state()[0]):
                assert torch.equal(x[:, :, :st.length] * held, y[:, :, :st.length] * held)
        assert defragmented  # 5 + 9 steps x 3 slots + 5 x 1 do not fit in 32 without moving the holes out
        assert windows == ({32} if window_min == 256 else {8, 16, 32})


def test_a_bucketed_prefill_gives_the_eager_one_and_the_same_later_steps():
    """On a CPU with a compiled forward, a prefill that may bucket pads the prompt on the right with holes to
    prefill_width (one shape per width) and cuts the output back to the prompt's positions; the next forward writes
    over the padding. Its logits and hidden states, the cache's length, and the next steps' logits equal an eager
    prefill's (the "eager" backend: traced, no code generated). A cache without room for the padding prefills
    eagerly at the prompt's width rather than grow."""
    from draftlab.decode.cache import prefill_width
    from draftlab.decode.compiled import compiled_forward

    assert [prefill_width(n) for n in (1, 16, 17, 100, 256, 257, 700)] == [16, 16, 32, 128, 256, 512, 768]
    base = tiny_llama(vocab=32, seed=5)
    forward = compiled_forward(base, "eager")
    B, L = 2, 5
    ids = torch.randint(0, 32, (B, L), generator=torch.Generator().manual_seed(2))
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[0, :2] = False
    view = TreeView.of_static(Tree.expansion([2, 1]).buffers(), B)
    for size, padded in ((256, True), (8, False)):  # 8 slots: no room for the 16 of prefill_width(5)
        plain, bucketed = StaticSlotCache(base, B, size), StaticSlotCache(base, B, size, forward)
        with torch.no_grad():
            a, pos_a = plain.prefill(ids, valid, hidden=True, bucket=True)  # no compiled forward: eager, unpadded
            calls = forward.calls
            b, pos_b = bucketed.prefill(ids, valid, hidden=True, bucket=True)
            assert (forward.calls > calls) == padded and plain.length == bucketed.length == L
            assert torch.equal(pos_a, pos_b) and torch.equal(plain.valid, bucketed.valid)
            assert b.logits.shape == a.logits.shape and torch.allclose(a.logits[valid], b.logits[valid], atol=1e-10)
            assert all(torch.allclose(x[valid], y[valid], atol=1e-10) for x, y in zip(a.hidden_states, b.hidden_states))
            for step in range(2 if padded else 1):
                tokens = torch.randint(0, 32, (B, 5), generator=torch.Generator().manual_seed(20 + step))
                x = plain.forward(tokens, view.ancestors, view.depth).logits
                y = bucketed.forward(tokens, view.ancestors, view.depth).logits
                assert torch.allclose(x, y, atol=1e-10), (size, step)
                keep, kv = torch.tensor([[0, 1], [0, 2]]), torch.ones(B, 2, dtype=torch.bool)
                plain.keep(plain.length, keep, kv)
                bucketed.keep(bucketed.length, keep, kv)


def test_the_static_cache_grows_when_its_run_is_longer_than_it_was_sized_for(monkeypatch):
    """A drafter sizes its own cache from the prompt alone; past that the buffers double, contents kept (and the
    attention window follows the text: 8 slots first, then 16, 32)."""
    monkeypatch.setattr("draftlab.decode.cache.WINDOW_MIN", 8)
    base = tiny_llama(vocab=32, seed=3)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, 6, dtype=torch.bool)
    dyn, st = SlotCache(base), StaticSlotCache(base, 2, 8)
    with torch.no_grad():
        dyn.prefill(ids, valid)
        st.prefill(ids, valid)
        view = TreeView.of_static(Tree.chain(3).buffers(), 2)
        for step in range(4):
            tokens = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(10 + step))
            a = dyn.forward(tokens, view.ancestors, view.depth).logits
            b = st.forward(tokens, view.ancestors, view.depth).logits
            assert torch.allclose(a, b, atol=1e-10), step
            keep, kv = torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.ones(2, 3, dtype=torch.bool)
            dyn.keep(dyn.length, keep, kv, in_place=True)
            st.keep(st.length, keep, kv, in_place=True)
    assert st.max_len >= 6 + 4 * 3 and st.cache.layers[0].keys.shape[2] == st.max_len


@pytest.mark.parametrize("kind", ["ssm", "hydra++"])
def test_later_runs_reuse_the_static_caches_and_give_the_eager_tokens(kind):
    """A decoder's next run empties and reuses its last static cache (and the drafter its own, also after an eager
    decoder ran the same drafter in between), so CUDA graphs recorded against their buffers stay valid; a batch of
    another size gets caches of its own. An eager run leaves no tensor in the drafter that would change its compiled
    calls' signature (decode.compiled._held) for the static runs after it."""
    from draftlab.decode.compiled import _held

    base = peaked()
    d = drafter(kind, base)
    dec = SpeculativeDecoder(base, d, static=True)
    own = (lambda: d.target) if kind == "ssm" else (lambda: d.static)  # the drafter's own static cache
    dec.generate([[1, 5, 7, 9, 5, 7]], max_new_tokens=30)  # a long first run: later ones reuse what it wrote over
    first, first_own, held = dec._cache, own(), _held(d)
    eager = SpeculativeDecoder(base, drafter(kind, base))
    same_drafter_eager = SpeculativeDecoder(base, d)
    for prompts in ([[1, 3]], [[1, 8, 8, 3, 6]]):
        got = dec.generate(prompts, max_new_tokens=21).tokens
        assert dec._cache is first and own() is first_own and _held(d) == held
        want = eager.generate(prompts, max_new_tokens=21).tokens
        assert got == want and same_drafter_eager.generate(prompts, max_new_tokens=21).tokens == want
    two = [[1, 3], [1, 2, 3, 4]]
    assert dec.generate(two, max_new_tokens=21).tokens == eager.generate(two, max_new_tokens=21).tokens
    assert dec._cache is not first and dec._cache.batch == 2


def test_a_base_converted_to_another_dtype_between_runs_gets_a_cache_and_graphs_of_that_dtype():
    """`base.to(dtype)` converts the model in place, the same object: the decoder's next run must not reuse the static
    cache of the old dtype (its writes failed: index_copy_ between float64 and float32), nor run graphs compiled for
    the old weights (the signature holds the weights' dtype, decode.compiled._module_state)."""
    from draftlab.decode.decoder import NoDraft

    base = peaked()  # float64
    dec = SpeculativeDecoder(base, NoDraft(), compile="eager")
    prompts = [[1, 5, 7, 9, 5, 7]]
    first = dec.generate(prompts, max_new_tokens=12).tokens
    assert first == SpeculativeDecoder(base, NoDraft()).generate(prompts, max_new_tokens=12).tokens
    old = dec._cache
    base.to(torch.float32)
    got = dec.generate(prompts, max_new_tokens=12).tokens
    assert dec._cache is not old and dec._cache.dtype == torch.float32
    assert got == SpeculativeDecoder(base, NoDraft()).generate(prompts, max_new_tokens=12).tokens


def test_an_ssm_drafter_keeps_a_static_cache_on_the_compiled_path():
    base = peaked()
    d = drafter("ssm", base)
    SpeculativeDecoder(base, d, compile="eager").generate([[1, 5, 7]], max_new_tokens=8)
    assert isinstance(d.target, StaticSlotCache) and d.target.run is not d.lm  # compiled forward
    SpeculativeDecoder(base, d).generate([[1, 5, 7]], max_new_tokens=8)
    assert isinstance(d.target, SlotCache)  # the same drafter on the eager path: the eager cache


@pytest.mark.slow
def test_inductor_compiled_decoding_gives_the_eager_tokens():
    base = peaked(dtype=torch.float32)
    prompts = [[1, 5, 7, 9], [1, 3, 8]]
    ref = SpeculativeDecoder(base, drafter("ssm", base)).generate(prompts, max_new_tokens=24)
    dec = SpeculativeDecoder(base, drafter("ssm", base), compile=True)
    assert dec.generate(prompts, max_new_tokens=24).tokens == ref.tokens
    assert dec.forward.failed is None and dec.compile_s > 0


def test_generate_compile_flag_reports_both_baselines(tiny_base_dir, tmp_path, capsys, monkeypatch):
    """`generate --compile --compare`: the same tokens as plain greedy, and beside HF generate the fair baseline,
    plain decoding on the same compiled path, with the compile time reported."""
    import json

    from draftlab.base import load_base
    from draftlab.cli import main
    from draftlab.decode.compiled import compile_cache_report, machine_kind
    from draftlab.interop.export import save_export

    monkeypatch.setenv("DRAFTLAB_COMPILE_BACKEND", "eager")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # --compile-cache sets it; restored after the test
    before = compile_cache_report()  # the process's counts so far (other tests may have compiled with inductor)
    base, _ = load_base(str(tiny_base_dir), "float32")
    save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "exp",
                str(tiny_base_dir))
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once upon", "--prompt", "A cat",
                 "--max-new-tokens", "12", "--compare", "--compile", "--json", "--compile-cache",
                 str(tmp_path / "cache")]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["compiled"] is True and rep["identical_to_baseline"] is True and rep["compile_failed"] is None
    assert rep["fused_projections"] == 2 * base.config.num_hidden_layers  # q/k/v and gate/up per layer, on a CPU
    # the "eager" backend generates no code: nothing for inductor's cache, which --compile-cache put in a folder
    # for this kind of machine
    assert rep["compile_cache"] == {"dir": str(tmp_path / "cache" / machine_kind()), "hits": before["hits"],
                                    "misses": before["misses"]}
    assert rep["compile_s"] > 0 and rep["compiled_plain_tokens_per_s"] > 0
    assert rep["speedup_vs_compiled_plain"] == pytest.approx(rep["tokens_per_s"] / rep["compiled_plain_tokens_per_s"],
                                                             rel=1e-2)
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once upon", "--max-new-tokens", "8", "--compare",
                 "--compile"]) == 0
    err = capsys.readouterr().err
    # the human-readable line leads with the fair baseline (both compiled), then HF's eager generate
    assert "over compiled plain decoding (" in err and "over HF's eager generate (" in err
    assert err.index("over compiled plain decoding") < err.index("over HF's eager generate")
    assert err.startswith("compiling the decode steps")
    assert "compiled graphs loaded from the on-disk cache" in err
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--compile-cache", str(tmp_path)]) == 2
    assert "--compile-cache DIR keeps the compiled path's cache: add --compile" in capsys.readouterr().err


COMPILE_ONCE = """
import json, sys, torch
from draftlab.decode.compiled import Compiled, compile_cache_report, use_compile_cache
use_compile_cache(sys.argv[1])
torch.manual_seed(0)
layer = torch.nn.Linear(8, 8)
with torch.no_grad():
    c = Compiled(lambda x: torch.relu(layer(x)) * 2)
    out = c(torch.ones(2, 8))
print(json.dumps({**compile_cache_report(), "out": out.tolist(), "failed": c.failed}))
"""


@pytest.mark.slow  # one inductor compile from nothing (about 20 s on a 2-core CPU), then two from the cache
def test_a_second_process_loads_its_compiled_graphs_from_the_compile_cache(tmp_path):
    """use_compile_cache(DIR) (`--compile-cache DIR`): the first process generates and builds its graph and stores it
    in DIR; a second process with the same DIR loads it rather than building it again, with the same result. A built
    kernel an interrupted build left empty is removed and built again, not a reason to decode eagerly from then on."""
    import json
    import os
    import subprocess
    import sys

    def session():
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        out = subprocess.run([sys.executable, "-c", COMPILE_ONCE, str(tmp_path / "cache")], env=env,
                             capture_output=True, text=True, check=True)
        return {**json.loads(out.stdout.strip().splitlines()[-1]), "err": out.stderr}

    first, second = session(), session()
    assert first["dir"] == second["dir"] and first["dir"].startswith(str(tmp_path / "cache"))
    assert (first["hits"], first["misses"]) == (0, 1) and (second["hits"], second["misses"]) == (1, 0)
    assert first["out"] == second["out"] and first["failed"] is None and second["failed"] is None
    built = [p for p in (tmp_path / "cache").rglob("*.main.so")]
    assert built
    for p in built:  # what a build killed half-way leaves
        p.write_bytes(b"")
    third = session()
    assert third["failed"] is None and third["out"] == first["out"]
    assert "unreadable file(s) from the compile cache" in third["err"]
    assert all(p.stat().st_size > 0 for p in built)


@pytest.mark.parametrize("kind", ["eagle3"] + [pytest.param(k, marks=pytest.mark.slow)  # CI's slow run has them
                                                for k in ("medusa", "hydra++", "ssm")])
def test_after_warm_up_no_call_compiles_again_so_skipping_guards_is_sound(kind, monkeypatch):
    """Calls of a signature seen before skip dynamo's guard evaluation (decode.compiled). That is sound only if nothing a
    compiled graph depends on is left out of the signature: with every guard evaluated, decoding new prompts of the
    warmed-up shapes must compile no new graph (a Python number read by a graph, a changed stride, would recompile
    here), and with guards skipped the tokens are the guarded run's."""
    from draftlab.decode.compiled import compiled_graphs

    base = peaked()
    warm = [[1, 5, 7, 9, 5, 7], [1, 3]]
    later = [[[1, 2, 3, 4, 5, 6, 7], [1, 9, 2]], [[1, 4], [1, 8, 8, 3, 6]]]
    d = drafter(kind, base)
    monkeypatch.setenv("DRAFTLAB_COMPILE_GUARDS", "1")
    dec = SpeculativeDecoder(base, d, compile="eager")
    dec.generate(warm, max_new_tokens=21)
    before = compiled_graphs()
    guarded = [dec.generate(p, max_new_tokens=21).tokens for p in later]
    assert compiled_graphs() == before, f"{kind}: a warmed-up call compiled again"
    monkeypatch.delenv("DRAFTLAB_COMPILE_GUARDS")
    assert [dec.generate(p, max_new_tokens=21).tokens for p in later] == guarded
    assert guarded == [SpeculativeDecoder(base, drafter(kind, base)).generate(p, max_new_tokens=21).tokens for p in later]


@pytest.mark.parametrize("kind", ["ensemble-grouped"] + [pytest.param(k, marks=pytest.mark.slow) for k in ("ssm", "hydra++")])
def test_a_second_run_of_a_length_compiles_nothing(kind):
    """A run longer than a drafter's first cache guess (the prompt + 256 slots) used to grow the drafter's cache
    mid-run; the next run of that length, reusing the grown cache, met other shapes and compiled again (4 graphs,
    seconds each, in an MT-Bench turn of 1024 tokens). Drafters now size their caches for the run the decoder
    announces (PromptState.room), and an SSM's feed starts each run at its narrowest (a feed a merged tree widened
    used to stay wide for the next run, at other shapes): a second run of the same length compiles nothing, and
    its tokens are the first's."""
    from draftlab.decode.compiled import compiled_graphs

    base = peaked(layers=1)
    dec = SpeculativeDecoder(base, drafter(kind, base), compile="eager")
    prompt = [1] + [5, 7, 9, 11] * 60  # 241 tokens: a first guess of 512 slots, which 300 new tokens outgrow
    run = lambda: dec.generate([prompt], max_new_tokens=300).tokens  # noqa: E731
    first = run()
    before = compiled_graphs()
    assert run() == first and compiled_graphs() == before, f"{kind}: the second run compiled again"


def test_the_fused_verify_step_gives_the_split_calls_tokens(monkeypatch):
    """The compiled path verifies, decides and keeps in one call (decode.decoder.verify_and_keep);
    DRAFTLAB_FUSED_STEP=0 splits it into the verify forward and the acceptance graph. Both give the eager tokens,
    greedy and with typical acceptance (its thresholds are in the graph), with drafters that read the base's states
    from the step (Hydra++, EAGLE-3) too, and the fused call is the one that ran; sampled steps give the split calls'
    tokens for one seed."""
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.decoder import fused_default, fused_step

    base = peaked()
    prompts = [[1, 5, 7, 9], [1, 3]]
    for kind, sampling in (("hydra++", None), ("eagle3", None), ("hydra++", Sampling(temperature=0.7, typical=True))):
        run = lambda **kw: SpeculativeDecoder(base, drafter(kind, base), **kw).generate(  # noqa: E731
            prompts, max_new_tokens=21, sampling=sampling).tokens
        ref = run()
        fused = fused_step("eager", "cpu")
        calls = fused.calls
        assert run(compile="eager", chained=False) == ref, kind  # (the chained step: the next test)
        assert fused.calls > calls
        monkeypatch.setenv("DRAFTLAB_FUSED_STEP", "0")
        calls = fused.calls
        assert fused_step("eager", "cpu") is None
        assert run(compile="eager") == ref, kind  # (no fused step: no chained step either)
        assert fused.calls == calls
        monkeypatch.delenv("DRAFTLAB_FUSED_STEP")
    assert SpeculativeDecoder(base, drafter("hydra++", base), compile="eager", fused=False).step is None
    # Sampled steps run the fused call too, with the split calls' tokens for one seed.
    fused, calls = fused_step("eager", "cpu"), fused.calls
    sampled = lambda **kw: SpeculativeDecoder(base, drafter("hydra++", base), compile="eager", chained=False,  # noqa
                                              **kw).generate(prompts, max_new_tokens=13, sampling=Sampling(
                                                  temperature=0.9), generator=torch.Generator().manual_seed(3)).tokens
    both = sampled()
    assert fused.calls > calls and both == sampled(fused=False)
    # Every device fuses every rule's steps by default (a GPU too, since tests/test_gpu_law.py passed on an H200);
    # DRAFTLAB_FUSED_STEP=0 splits them everywhere.
    assert fused_step("eager", "cuda") is not None and fused_default()
    monkeypatch.setenv("DRAFTLAB_FUSED_STEP", "0")
    assert fused_step("eager", "cuda") is None and not fused_default()


# (Medusa's and EAGLE-3's chained greedy tokens are also checked by the first test of this file, where they chain.)
# The SSM's chained greedy tokens are in the first test too; its sampled chained steps run here in the slow run.
@pytest.mark.parametrize("kind", ["hydra++"] + [pytest.param(k, marks=pytest.mark.slow)  # (7-20 s each)
                                           for k in ("dflash", "ssm", "medusa", "eagle3")])
def test_the_chained_step_gives_the_split_calls_tokens(kind, monkeypatch):
    """Where the verify step is fused, drafters whose commit and next proposal are one tensor-only call run it inside
    the verification's call (decode.decoder.verify_keep_and_draft): one compiled call per step. Chained and split
    calls give the eager tokens (batch of uneven prompts, EOS mid-run, greedy and typical acceptance), every step
    after the first proposal is chained, and chained=False / DRAFTLAB_CHAINED_STEP=0 turn it off; speculative
    sampling too (its acceptance in the same call, from uniforms drawn before it). DFlash's sampled block (drawn from
    a generator outside any call) keeps its own call; an SSM's sampled tree (typical acceptance, sampling) chains,
    its uniforms drawn before the call."""
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.decoder import chained_step

    base = peaked()
    make = lambda: drafter(kind, base)  # noqa: E731
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    typical = Sampling(temperature=0.7, typical=True)
    eager = SpeculativeDecoder(base, make()).generate(prompts, max_new_tokens=21)
    assert eager.accept_length > 1.0  # some steps commit drafted tokens: the chained commit keeps paths
    eos = eager.tokens[0][9]
    sampled = Sampling(temperature=0.9, top_p=0.95)
    for sampling, e in ((None, None), (None, eos), (typical, eos), (sampled, eos)):
        kw = dict(max_new_tokens=21, sampling=sampling, eos_token_id=e)
        gen = lambda: torch.Generator().manual_seed(2)  # noqa: E731
        ref = eager if e is None else SpeculativeDecoder(base, make()).generate(prompts, generator=gen(), **kw)
        chained = SpeculativeDecoder(base, make(), compile="eager").generate(prompts, generator=gen(), **kw)
        split = SpeculativeDecoder(base, make(), compile="eager", chained=False).generate(prompts, generator=gen(),
                                                                                         **kw)
        assert chained.tokens == split.tokens == ref.tokens, (kind, sampling, e)
        assert split.chained_steps == 0
        if kind == "dflash" and sampling is not None:  # its sampled block is drawn outside any call
            assert chained.chained_steps == 0
        else:
            assert chained.chained_steps == chained.steps > (3 if e is None else 1)
    assert SpeculativeDecoder(base, make(), compile="eager", fused=False).chain is None
    assert chained_step("eager", "cuda") is None  # on a GPU: opt-in (chained=True, DRAFTLAB_CHAINED_STEP=1)
    monkeypatch.setenv("DRAFTLAB_CHAINED_STEP", "1")
    assert chained_step("eager", "cuda") is not None
    monkeypatch.setenv("DRAFTLAB_CHAINED_STEP", "0")
    assert chained_step("eager", "cpu") is None
    assert SpeculativeDecoder(base, make(), compile="eager").generate(prompts, max_new_tokens=5).chained_steps == 0


def test_a_chained_calls_signature_holds_the_drafters_buffers():
    """The chained step takes the drafter as an argument; its signature, which decides whether dynamo's guards are
    skipped, holds the shapes of the drafter's tensors (its KV buffers grow), not only its identity."""
    from draftlab.decode.compiled import _signature

    base = peaked()
    d = drafter("eagle3", base)
    SpeculativeDecoder(base, d, static=True).generate([[1, 5, 7]], max_new_tokens=5)
    before = _signature((d,))
    d.k = torch.cat([d.k, d.k], 2)  # a grown buffer
    assert _signature((d,)) != before


def test_the_buffers_a_drafters_compiled_step_writes_are_marked_static():
    """EAGLE-3 and DFlash write their committed entries into buffers of their own inside a compiled call. Inductor
    records such a call under CUDA graphs only where the inputs it writes are marked static (decode.cache
    .static_buffer): on an H200, EAGLE-3's chained step ran without CUDA graphs ("skipping cudagraphs due to mutated
    inputs (3 instances)") before they were; after a grown buffer too."""
    base = peaked()
    for kind in ("eagle3", "dflash"):
        d = drafter(kind, base)
        SpeculativeDecoder(base, d, static=True).generate([[1, 5, 7]], max_new_tokens=5)
        first = d.valid
        d._room(d.valid.shape[1] + 1, *((d.k, d.v) if kind == "eagle3" else (d.kv,)), d.valid)
        assert d.valid is not first and d.valid.shape[1] > first.shape[1]  # grown
        for bufs in ((d.k, d.v, d.valid) if kind == "eagle3" else (*[t for kv in d.kv for t in kv], d.valid),):
            assert all(getattr(t, "_dynamo_static_input_type", None) for t in bufs), kind


def test_signatures_hold_settings_by_value():
    """A compiled call's signature (decode.compiled) holds a dataclass of settings by its values: the fused verify
    step bakes the sampling settings into its graph, so equal settings in a new object must reuse it, and other
    settings must not skip the guards that tell its variants apart."""
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.compiled import _signature

    assert _signature(Sampling()) == _signature(Sampling())
    assert _signature(Sampling(typical=True)) != _signature(Sampling())
    assert _signature(Sampling(typical=True, posterior_threshold=0.2)) != _signature(Sampling(typical=True))
    s = Sampling(temperature=0.5)
    assert _signature(s) == _signature(s) == _signature(Sampling(temperature=0.5))  # the second read kept on it
    assert s == Sampling(temperature=0.5) and hash(s) == hash(Sampling(temperature=0.5))


def test_a_static_caches_device_state_is_one_object_until_its_buffers_change():
    """The fused step's signature reads the cache's KV buffers from its device_state, a decode.compiled.Fixed that
    holds its signature: one object from step to step, and a new one, with the new shapes, after the buffers grew."""
    from draftlab.decode.compiled import Fixed, _signature

    base = peaked()
    dec = SpeculativeDecoder(base, drafter("hydra++", base), compile="eager")
    dec.generate([[1, 5, 7]], max_new_tokens=5)
    cache = dec._cache
    state = cache.device_state()
    assert type(state) is Fixed and cache.device_state() is state
    sig = _signature(state)
    assert _signature(state) is sig and sig == _signature(tuple(state))  # as a plain tuple's
    cache._grow(cache.max_len + 1)
    grown = cache.device_state()
    assert grown is not state and _signature(grown) != sig and grown[0][0].shape[2] == cache.max_len


def test_direct_calls_run_the_variant_dynamo_picks_and_keep_the_hook_past_a_graph_break(monkeypatch):
    """A seen signature's call runs its compiled variant's code without dynamo's frame hook (decode.compiled): the
    variant is the one dynamo ran for it (two variants of one function, told apart by a plain argument; two backends
    compiling one function, each its own variant), its outputs and in-place writes are the hooked call's, and a
    function with a graph break keeps the hook and its guards on every call."""
    import draftlab.decode.compiled as compiled

    found = []
    real = compiled._variant_code
    monkeypatch.setattr(compiled, "_variant_code", lambda *a: found.append(real(*a)) or found[-1])

    def scaled(x, out, k: int):
        out.copy_(torch.tanh(x) * k)
        return x.sum() * k, [x + k]

    fn = compiled.Compiled(scaled, "eager")
    x, out = torch.randn(3), torch.zeros(3)
    for k in (2, 3, 2, 3, 2, 3):  # two variants; each signature's second call finds its own
        total, (plus,) = fn(x, out, k)
        assert torch.equal(total, x.sum() * k) and torch.equal(plus, x + k) and torch.equal(out, torch.tanh(x) * k)
    assert len(found) == 2 and all(f is not None for f in found)

    def tanh2(x):
        return torch.tanh(x) * 2

    one, other = compiled.Compiled(tanh2, "eager"), compiled.Compiled(tanh2, "aot_eager")
    for _ in range(3):  # turn by turn: the other backend's variant is the front of the cache at each one's call
        assert torch.equal(one(x), tanh2(x)) and torch.equal(other(x), tanh2(x))
    assert len(found) == 4 and found[-1] is not None and found[-2] is not None
    assert found[-1].__code__ is not found[-2].__code__  # each backend runs its own variant

    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    fn = compiled.Compiled(broken, "eager")
    assert [fn(x).tolist() for _ in range(3)] == [(x * 2 + 1).tolist()] * 3
    assert len(found) == 4 and fn.breaks and not fn.skip  # guarded calls, under the hook


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])  # inductor: 20 s
def test_a_tensor_given_twice_and_two_tensors_are_different_signatures(backend):
    """Dynamo compiles a tensor given twice as one input of its graph (and guards on `a is b`). A signature that only
    held shapes ran that graph, once its guards were skipped, for two different tensors of the same shapes: their
    results came out as if the first had been given twice. Which tensors are one and the same is part of the
    signature (decode.compiled._aliases), on both backends and with direct calls or the hook."""
    import draftlab.decode.compiled as compiled

    def f(a, b, i):
        return a * 10 + b.scatter(0, i, a[:1])

    x, y, i = torch.arange(4.0), torch.arange(4.0) + 100, torch.zeros(1, dtype=torch.long)
    fn = compiled.Compiled(f, backend)
    for a, b in ((x, x), (x, x), (x, y), (x, y), (y, y), (x, x)):
        assert torch.equal(fn(a, b, i), f(a, b, i))
    assert compiled._aliases([1, 2, 3]) == () and compiled._aliases([5, 6, 5, 6, 5]) == (0, 1, 0, 1, 0)


def test_a_call_inside_autocast_is_another_signature():
    """The global state (grad mode, autocast, what dynamo's global state guard compares) is part of a signature: a
    graph compiled outside autocast ran inside it, in float32, once its guards were skipped."""
    from draftlab.decode.compiled import Compiled

    fn = Compiled(lambda a, b: a @ b, "eager")
    x = torch.randn(4, 4)
    for on in (False, False, True, True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            assert fn(x, x).dtype == (x @ x).dtype == (torch.bfloat16 if on else torch.float32)
    assert len(fn.states) == 2


def test_signatures_tell_apart_what_dynamos_guards_do():
    """Other things a graph can depend on that a signature of shapes alone missed, each run first one way (so its
    signature is seen), then the other: a float or a bool argument equal to an int (1 == 1.0 == True); a module that
    a freed one's address went to (a new object, by a token that is never reused, not by id); a function with a
    graph break, whose code past it may hang on a tensor's value (.item()), also where the break is in a loop and
    dynamo skips the whole frame: its calls keep their guards."""
    import gc

    import draftlab.decode.compiled as compiled

    def scaled(x, t):
        return x * t

    fn, x = compiled.Compiled(scaled, "eager"), torch.arange(4)
    for t in (1, 1, 1.0, 1.0, True, True, 1):
        assert fn(x, t).dtype == scaled(x, t).dtype, t

    def call(m, x):
        return m(x)

    fn, x = compiled.Compiled(call, "eager"), torch.randn(6)
    m = torch.nn.LeakyReLU(0.1)
    fn(m, x), fn(m, x)
    old, token = id(m), compiled._token(m)
    del m
    gc.collect()
    for _ in range(2000):  # a new module at the freed one's address (CPython reuses it soon)
        m = torch.nn.LeakyReLU(0.5)
        if id(m) == old:
            break
    assert compiled._token(m) != token
    assert torch.equal(fn(m, x), call(m, x))

    def cut(x, i):
        k = int(i.item())  # a graph break; the rest is compiled for this k
        return x[:k].sum() + k

    def looped(x, ks):  # a graph break in a loop: dynamo skips the frame and compiles what it calls, apart
        total = x.sum()
        for i in range(ks.shape[0]):
            total = total + cut(x, ks[i])
        return total

    for f in (cut, looped):
        fn, x = compiled.Compiled(f, "eager"), torch.arange(8.0)
        for v in (2, 2, 2, 5, 3):
            assert torch.equal(fn(x, torch.tensor([v, v]) if f is looped else torch.tensor(v)),
                               f(x, torch.tensor([v, v]) if f is looped else torch.tensor(v))), (f.__name__, v)
        assert fn.breaks and not fn.skip


def test_signatures_hold_a_modules_state_a_sequences_type_and_slices_by_value():
    """More that a graph can depend on (found by review): a module switched to training or to another dtype after its
    compiled forward ran (the compiled function itself, or given to one); a list where a tuple was (a graph can branch
    on the type); a slice (by value: it cannot be weakly referenced, so no token keys it). Each run one way first (its
    signature seen), then the other; before, every second way ran the first way's graph."""
    import draftlab.decode.compiled as compiled

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(10, 4))
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, ids):
            return self.drop(self.w[ids]) * 2

    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        m = Net().eval()
        fn = compiled.Compiled(m, "eager")
        evaluated = [fn(ids) for _ in range(3)][-1]
        m.train()
        assert not torch.equal(fn(ids), evaluated)  # dropout: zeros and values scaled by 2 (never the eval output)
        m.eval()
        key = compiled._module_state(m)
        m.double()
        assert compiled._module_state(m) != key and fn(ids).dtype == torch.float64

    def typed(x, seq):
        return x * (2 if type(seq) is tuple else 3)

    fn, x = compiled.Compiled(typed, "eager"), torch.arange(4.0)
    for seq in ((1,), (1,), (1,), [1], [1]):
        assert torch.equal(fn(x, seq), typed(x, seq)), seq

    assert compiled._signature(slice(0, 2)) == compiled._signature(slice(0, 2)) != compiled._signature(slice(2, 4))


def test_a_call_with_an_object_no_token_keys_keeps_its_guards():
    """An object that cannot be weakly referenced (__slots__) has no token, only its id, which a new object can take
    once it is freed: a call given one keeps dynamo's guards rather than trust a signature."""
    import draftlab.decode.compiled as compiled

    class Scale:
        __slots__ = ("v",)

        def __init__(self, v):
            self.v = v

    def scaled(x, s):
        return x * s.v

    fn, x = compiled.Compiled(scaled, "eager"), torch.ones(3)
    for v in (2.0, 2.0, 3.0, 3.0):
        assert torch.equal(fn(x, Scale(v)), x * v)
    assert not fn.skip  # no signature was trusted


def test_a_compile_failure_after_a_graph_break_raises_rather_than_run_a_part_twice():
    """Where compiling fails past a graph break, the graph before it may have run (written a KV cache, say): running
    the function again eagerly would repeat that part, so the call raises, saying to decode without compiling. A
    failure with nothing run before it still falls back to eager, as before."""
    import draftlab.decode.compiled as compiled

    built = [0]

    def flaky(gm, example_inputs):  # the second graph does not build
        built[0] += 1
        if built[0] == 2:
            raise ValueError("does not build")
        return gm.forward

    def stepped(a):
        a.add_(1)
        torch._dynamo.graph_break()
        return a * 10

    a = torch.zeros(2)
    with pytest.raises(RuntimeError, match="Decode without compiling"):
        compiled.Compiled(stepped, flaky)(a)
    assert a.tolist() == [1.0, 1.0]  # the first part ran once, not again

    def never(gm, example_inputs):
        raise ValueError("does not build")

    def plain(a):
        return a * 10

    fn = compiled.Compiled(plain, never)
    assert fn(torch.ones(2)).tolist() == [10.0, 10.0] and fn.failed


@pytest.mark.parametrize("kind", ["eagle3"] + [pytest.param(k, marks=pytest.mark.slow) for k in ("dflash", "ssm")])
def test_one_drafter_serves_a_chained_and_an_unchained_decoder(kind):
    """A drafter's compiled step sees other tensors one and the same from call to call: EAGLE-3's first proposal after
    a prompt gives one zero tensor as the bonus and the last node, a later step the root as the bonus. After a chained
    decoder's runs (where that first call's signature was seen), an unchained decoder on the same drafter object ran
    the first call's graph for its later steps and failed (an index out of bounds); both give the eager tokens."""
    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3]]
    d = drafter(kind, base)
    ref = SpeculativeDecoder(base, drafter(kind, base)).generate(prompts, max_new_tokens=21).tokens
    for chained in (None, False, None, False):
        got = SpeculativeDecoder(base, d, compile="eager", chained=chained).generate(prompts, max_new_tokens=21)
        assert got.tokens == ref, (kind, chained)


@pytest.mark.parametrize("kind", ["ssm", pytest.param("eagle3", marks=pytest.mark.slow)])  # (5-8 s each)
def test_direct_calls_give_the_hooked_calls_tokens(kind, monkeypatch):
    """Decoding runs its compiled steps without dynamo's hook once their signatures are seen, and gives the tokens
    of the hooked calls (DRAFTLAB_COMPILE_DIRECT=0) and of eager decoding."""
    import draftlab.decode.compiled as compiled

    calls = []
    real = compiled._variant_code

    def counted(*a):
        run = real(*a)
        return None if run is None else (lambda *args, **kw: calls.append(1) or run(*args, **kw))
    monkeypatch.setattr(compiled, "_variant_code", counted)
    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3]]
    dec = SpeculativeDecoder(base, drafter(kind, base), compile="eager")
    direct = [dec.generate(prompts, max_new_tokens=21).tokens for _ in range(2)]
    assert len(calls) > 5, "no compiled step ran without the hook"
    monkeypatch.setenv("DRAFTLAB_COMPILE_DIRECT", "0")
    n = len(calls)
    hooked = dec.generate(prompts, max_new_tokens=21).tokens
    assert len(calls) == n and direct == [hooked, hooked]
    assert hooked == SpeculativeDecoder(base, drafter(kind, base)).generate(prompts, max_new_tokens=21).tokens


@pytest.mark.parametrize("kind", ["hydra++"] + [pytest.param(k, marks=pytest.mark.slow)  # 10-30 s each
                                           for k in ("dflash", "eagle3", "ssm", "ensemble")])
def test_no_output_a_cuda_graph_overwrites_is_read(kind, monkeypatch):
    """Under CUDA graphs a graphed call's outputs are overwritten by the next graphed call (decode.compiled's
    overview); on an H200 the fused step read its last bonus token as the next step's input and raised. With that
    lifetime emulated on this CPU (each graphed call first overwrites the last one's outputs with NaN, negative
    indices and flipped booleans), the compiled path gives the tokens it gives without the emulation (greedy: the
    eager tokens), fused and chained, fused alone and split, greedy and sampled; and the emulation bites: where the
    fused and chained steps do not keep their outputs, decoding fails or gives other tokens."""
    from draftlab.decode import compiled
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.decoder import chained_step, fused_step

    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    monkeypatch.setattr(compiled, "EMULATE_GRAPH_OUTPUTS", emulate := [False])
    run = lambda sampling=None, **kw: SpeculativeDecoder(base, drafter(kind, base), **kw).generate(  # noqa: E731
        prompts, max_new_tokens=17, sampling=sampling, generator=torch.Generator().manual_seed(3)).tokens
    greedy = run()
    for sampling in (None, Sampling(temperature=0.9)):
        for opts in ({}, {"chained": False}, {"fused": False}):
            emulate[0] = False
            ref = run(sampling, compile="eager", **opts)
            assert sampling is not None or ref == greedy
            emulate[0] = True
            assert run(sampling, compile="eager", **opts) == ref, (kind, sampling, opts)
    if kind == "ensemble":  # its next tree's tokens come from the host; the next positions it reads from the last
        return  # call are overwritten too, but wrong positions leave this base's greedy tokens as they are
    for step in (fused_step("eager", "cpu"), chained_step("eager", "cpu")):
        monkeypatch.setattr(step, "keep_outputs", False)
    try:
        wrong = run(compile="eager") != greedy
    except (RuntimeError, IndexError, ValueError):
        wrong = True
    assert wrong


@pytest.mark.parametrize("kind", ["eagle3", "dflash"] + [pytest.param(k, marks=pytest.mark.slow) for k in ("ssm",)])
def test_compiled_decoding_fuses_the_base_and_drafter_projections_and_gives_the_eager_tokens(kind):
    """The compiled path fuses the q/k/v and gate/up projections (decode.fuse) of the base and of the drafter's own
    layers (EAGLE-3's and DFlash's call them on the same input, DFlash's k/v also on the context; an SSM is a Llama),
    and gives the eager tokens with them fused and without."""
    from draftlab.decode.fuse import fused, modules_of

    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    eager = SpeculativeDecoder(base, drafter(kind, base)).generate(prompts, max_new_tokens=17).tokens
    for fuse in (True, False):
        b = copy.deepcopy(base)
        d = drafter(kind, b)
        got = SpeculativeDecoder(b, d, compile="eager", fuse=fuse).generate(prompts, max_new_tokens=17).tokens
        assert got == eager, (kind, fuse)
        assert fused(b) == (4 if fuse else 0)
        assert sum(fused(m) for m in modules_of(d)) >= (2 if fuse else 0)


@pytest.mark.slow
def test_the_gpu_benchmark_runs_its_drafters_chained_on_a_tiny_base(tmp_path):
    """benchmarks/gpu_compiled.py, which a lent GPU runs against a deadline, runs here on a tiny float32 base (--tiny):
    its chained methods chain the steps after their first proposals, every method gives HF's greedy tokens, a split
    drafter's own call is timed alone, and a method that --only names but the options do not add is reported as not
    run."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "benchmarks/gpu_compiled.py", "--tiny", "--no-eager", "--fused-step", "--chained",
                    "--no-hf-compile", "--reps", "1", "--name", "smoke", "--out", str(tmp_path), "--only",
                    "plain_compiled_fused", "ssm_compiled_fused_chained", "medusa_compiled_fused_split",
                    "medusa_compiled_fused_chained", "hf_static_compiled"], cwd=root, check=True, capture_output=True,
                   timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    d = json.loads((tmp_path / "smoke.json").read_text())
    assert list(d["methods"]) == ["plain_compiled_fused", "ssm_compiled_fused_chained", "medusa_compiled_fused_split",
                                  "medusa_compiled_fused_chained"]
    assert list(d["draft_alone"]) == ["medusa_compiled_fused_split"] and d["draft_alone"][
        "medusa_compiled_fused_split"]["alone_ms"] > 0  # the split drafting call timed alone
    for name, r in d["methods"].items():
        assert r["identical_to_hf"], name
        if "chained" in name:
            assert r["steps"] - 2 <= r["chained_steps"] <= r["steps"], name
    assert d["errors"]["hf_static_compiled"].startswith("not run")


@pytest.mark.slow  # two decoders compiled twice (about 30 s)
def test_after_a_dynamo_reset_no_call_runs_a_variant_recorded_before_it(monkeypatch):
    """torch._dynamo.reset() empties dynamo's caches; signatures recorded before it, trusted with guards skipped, ran
    whatever variant was left: Hydra's chained step for Hydra++ (2 outputs read as 3: IndexError; review). The
    path a GPU takes (no direct calls): every signature is forgotten at a reset, and both decoders give the eager
    tokens after it."""
    monkeypatch.setenv("DRAFTLAB_COMPILE_DIRECT", "0")
    base = peaked()
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 2, 3]]
    kinds = ("hydra", "hydra++")
    ref = {k: SpeculativeDecoder(base, drafter(k, base)).generate(prompts, max_new_tokens=21).tokens for k in kinds}
    decs = {k: SpeculativeDecoder(base, drafter(k, base), compile="eager") for k in kinds}
    for _ in range(2):
        for k, dec in decs.items():
            res = dec.generate(prompts, max_new_tokens=21)
            assert res.tokens == ref[k] and res.chained_steps > 0, k
        torch._dynamo.reset()


@pytest.mark.slow  # three compiled decoders (about 20 s)
def test_compiled_models_are_freed_and_a_base_that_fails_leaves_others_compiled(capsys):
    """A registry of compiled forwards held every model compiled in the process (its Compiled refers to it); and one
    base that did not compile turned the shared verify steps eager for every later base, reported as theirs. The
    failure says so once, not once per compiled call."""
    import gc
    import weakref

    base = peaked(seed=10)
    SpeculativeDecoder(base, drafter("hydra++", base), compile="eager").generate([[1, 5, 7]], max_new_tokens=8)
    ref = weakref.ref(base)
    del base
    gc.collect()
    assert ref() is None

    broken = [True]

    @torch._dynamo.register_backend
    def fails_first(gm, example_inputs):
        if broken[0]:
            raise NotImplementedError("aten.some_op has no lowering")
        return gm.forward

    prompts = [[1, 5, 7, 9, 5, 7], [1, 3]]
    for seed, fails in ((4, True), (5, False)):
        base = peaked(seed=seed)
        want = SpeculativeDecoder(base, drafter("hydra++", base)).generate(prompts, max_new_tokens=21).tokens
        dec = SpeculativeDecoder(base, drafter("hydra++", base), compile="fails_first")
        assert dec.generate(prompts, max_new_tokens=21).tokens == want
        assert bool(dec.compile_failed) == fails and (dec.chain.failed_for(base) is None) != fails
        broken[0] = False
    err = capsys.readouterr().err
    assert err.count("does not compile") == 1 and err.count("for the same reason") == 1, err


def test_past_dynamos_recompile_limit_the_calls_that_run_eagerly_are_said(capsys):
    """Past the limit a code object runs the variants it has and other calls eagerly: it was reported as a graph
    break ("slower, not wrong", cut mid-word) and `failed` stayed None, so a run of eager steps said it was compiled.
    A call that ran eagerly there records no variant (the front one is another signature's)."""
    from draftlab.decode.compiled import Compiled

    def double(x):
        return x * 2

    c = Compiled(double, "eager", skip_guards=True)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):  # (monkeypatch's undo deletes a config entry)
            for n in (1, 2, 3, 2, 1):
                assert c(torch.ones(n)).tolist() == [2.0] * n
        assert "recompile limit" in c.failed and "recompile limit" in capsys.readouterr().err
        assert len(c.direct or {}) <= 1  # (only the first shape's variant: the others ran eagerly)
    finally:
        torch._dynamo.reset()


def test_a_model_with_a_compiled_forward_copies_and_pickles_without_it():
    """The compiled forward lives on its model (a registry kept every model alive); copy.deepcopy of such a model
    failed inside dynamo's wrapper (a drafter's `copy.deepcopy(base)` after a compiled run: review)."""
    import pickle

    from draftlab.decode.compiled import compiled_forward

    base = tiny_llama(vocab=32, layers=1)
    fwd = compiled_forward(base, "eager")
    assert compiled_forward(base, "eager") is fwd
    for twin in (copy.deepcopy(base), pickle.loads(pickle.dumps(base))):
        assert dict(twin.__dict__["_draftlab_compiled"]) == {}
        assert compiled_forward(twin, "eager") is not fwd
        assert torch.equal(twin.model.embed_tokens.weight, base.model.embed_tokens.weight)
