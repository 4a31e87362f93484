"""DSI as processes: one drafter and several target servers with preemption; tokens equal plain greedy for good
and bad drafters and every lookahead (the timings against `draftlab simulate` are benchmarks/dsi.py's)."""

import random

import pytest

from draftlab.base import load_base
from draftlab.decode.acceptance import Sampling
from draftlab.serve.generate import plain_generate
from draftlab.parallel.dsi import DSI, si_generate


def oracle(prompt, ref, a, V, seed):
    """Drafts the target's greedy token with probability a (independently per draft), else a wrong one."""
    rng = random.Random(seed)

    def draft_next(tokens):
        i = len(tokens) - len(prompt)
        right = ref[i] if i < len(ref) else 0
        on_path = tokens[len(prompt):] == ref[:i]
        return right if on_path and rng.random() < a else (right + 1 + rng.randrange(V - 1)) % V
    return draft_next


@pytest.fixture(scope="module")
def setup(tiny_base_dir):
    model, tok = load_base(str(tiny_base_dir), "float32")
    model.generation_config.eos_token_id = None
    prompt = [tok.bos_token_id] + tok("Once upon a time").input_ids
    ref = plain_generate(model, [prompt], 48, Sampling(), None)[0][0]
    return model, prompt, ref, model.config.vocab_size


@pytest.fixture(scope="module")
def dsi(tiny_base_dir):
    """Three target servers, shared by the default run's greedy cases (a pool starts in a few seconds; generate
    calls are independent)."""
    with DSI(str(tiny_base_dir), sp=3) as pool:
        yield pool


def test_dsi_tokens_equal_plain_greedy(dsi, setup):
    model, prompt, ref, V = setup
    for a, k in ((0.0, 1), (0.6, 2), (1.0, 3), (0.9, 5)):
        out = dsi.generate(prompt, 48, oracle(prompt, ref, a, V, seed=1), lookahead=k)
        assert out["tokens"] == ref, (a, k)
        if a == 0.0:  # nothing accepted: every token is decided by a task of its own, and more are preempted
            assert out["tasks"] >= 48 and out["tasks"] - out["preemptions"] >= 48
        # A stretch's deciding task verified n drafts of the m * lookahead (m + 1 tasks sent), committing
        # n + 1 <= (m + 1) * lookahead tokens.
        assert 48 <= out["tasks"] * k
    assert si_generate(model, prompt, 48, oracle(prompt, ref, 0.7, V, seed=2), lookahead=3)["tokens"] == ref


@pytest.fixture(scope="module")
def slow_target_dsi(tiny_base_dir):
    """Servers whose forwards last at least 50 ms: an instant drafter has all its drafts long before the first reply
    (with instant servers a reply to the task at 0 drafts could win that race on a busy machine and end the stretch
    after one token)."""
    with DSI(str(tiny_base_dir), sp=3, target_latency_s=0.05) as pool:
        yield pool


def test_dsi_ends_off_the_lookahead_grid(slow_target_dsi, setup):
    """Token counts that are not a multiple of the lookahead: the drafter drafts only the n - 1 tokens the text has
    a use for (the target's token after them is the n-th) and the last task verifies them all, off the grid."""
    model, prompt, ref, V = setup
    for n, k in ((7, 4), (13, 5), (48, 7)):
        out = slow_target_dsi.generate(prompt, n, oracle(prompt, ref, 1.0, V, seed=4), lookahead=k)
        assert out["tokens"] == ref[:n], (n, k)
        # One stretch: tasks at 0, k, 2k, ... drafts and at n - 1, none preempted.
        assert out["drafts"] == n - 1 and out["tasks"] == -(-(n - 1) // k) + 1, (n, k, out)
        assert out["preemptions"] == 0


@pytest.mark.parametrize("path", ["eager", "static"])
def test_cached_greedy_equals_recomputing_the_whole_sequence(setup, path):
    """The servers' KV cache keeps the longest common prefix of consecutive tasks: extending, branching behind
    the last sequence and going back to an earlier one all give the full recomputation's tokens, on the eager path
    and on the static-shape one (--compile: chunks of a fixed width, here 3, so some tasks take several)."""
    import torch

    from draftlab.parallel.dsi import greedy_model

    model, prompt, ref, V = setup
    c = greedy_model(model, 3, "eager" if path == "static" else None)
    rng = random.Random(0)
    seq, total = prompt + ref[:10], 0
    for _ in range(25):
        cut = rng.randint(1, len(seq))  # a prefix of what the cache holds, then new tokens
        prefix = seq[:cut] + [rng.randrange(V) for _ in range(rng.randint(0, 3))]
        drafts = [rng.randrange(V) for _ in range(rng.randint(0, 4))]
        with torch.no_grad():
            want = model(input_ids=torch.tensor([prefix + drafts])).logits[0, len(prefix) - 1:].argmax(-1).tolist()
        assert c.next_tokens(prefix, drafts) == want
        seq = prefix + drafts
        total += len(seq)
    assert c.computed < total  # it reused its cache
    # A task extending the last one runs only its new tokens; one repeating it, only the last prefix token (whose
    # logits it needs).
    before = c.computed
    c.next_tokens(seq + [5, 6], [7, 8, 9])
    assert c.computed - before == 2 + 3
    c.next_tokens(seq + [5, 6], [7, 8, 9])
    assert c.computed - before == 2 + 3 + 4


@pytest.mark.parametrize("path", ["eager", "static"])
def test_cached_greedy_on_a_sliding_window_base(path):
    """The same on a base whose layers attend over a 12-token window (Gemma 3's shape) with sequences several windows
    long: the cache keeps every layer's whole text, so tasks that branch behind the window are cropped and recomputed
    exactly (a transformers sliding layer keeps one window and cannot be cropped behind it)."""
    import torch

    from draftlab.parallel.dsi import greedy_model
    from test_decoder import sliding_base

    model = sliding_base("gemma3")
    c = greedy_model(model, 3, "eager" if path == "static" else None)
    rng = random.Random(0)
    seq = [rng.randrange(3, 64) for _ in range(30)]
    for _ in range(8):
        prefix = seq[: rng.randint(len(seq) - 20, len(seq))] + [rng.randrange(3, 64) for _ in range(rng.randint(0, 3))]
        drafts = [rng.randrange(3, 64) for _ in range(rng.randint(0, 4))]
        with torch.no_grad():
            want = model(input_ids=torch.tensor([prefix + drafts])).logits[0, len(prefix) - 1:].argmax(-1).tolist()
        assert c.next_tokens(prefix, drafts) == want
        seq = prefix + drafts + [rng.randrange(3, 64) for _ in range(4)]


@pytest.mark.slow  # three server pools through the CLI (about 20 s)
def test_dsi_command_with_an_ssm_export(stories_dir, tmp_path, capsys):
    import json

    from draftlab.cli import main
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    exp = save_export(build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base), base,
                      tmp_path / "ssm", str(stories_dir), tokenizer=tok)
    rc = main(["dsi", str(exp), "--prompt", "Once upon a time", "--sp", "2", "--max-new-tokens", "24", "--compare",
               "--target-latency-ms", "20", "--draft-latency-ms", "4", "--json"])
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and rep["identical_to_greedy"] is True and rep["emulated"] and rep["compiled"] is None
    assert rep["lookahead"] == 3  # ceil(20 / (2 * 4)): the smallest with which no task waits for a server
    run = rep["runs"][0]
    assert len(run["tokens"]) == 24 and len(run["tokens"]) <= run["tasks"] * rep["lookahead"]
    # With the drafter's acceptance rate the lookahead is the one of least expected latency (waits included).
    from draftlab.parallel.simulate import best_dsi_lookahead

    assert main(["dsi", str(exp), "--prompt", "Once upon a time", "--sp", "2", "--max-new-tokens", "24",
                 "--target-latency-ms", "20", "--draft-latency-ms", "4", "--acceptance", "0.3", "--json"]) == 0
    rep2 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep2["lookahead_rule"] == "expected" and rep2["lookahead"] == best_dsi_lookahead(0.3, 0.004, 0.02, 2, 24) == 2
    assert rep2["runs"][0]["tokens"] == rep["runs"][0]["tokens"]  # greedy: the lookahead changes the time only
    heads = save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "m",
                        str(stories_dir), tokenizer=tok)
    assert main(["dsi", str(heads), "--prompt", "x"]) == 2
    assert "cannot draft ahead of verification" in capsys.readouterr().err
    from draftlab.drafters import EnsembleDraft, LookupDraft  # (said to hold heads needing hidden states: walk-through)

    ens = save_export(EnsembleDraft([LookupDraft(), LookupDraft()], ["a", "b"]), base, tmp_path / "e",
                      str(stories_dir), tokenizer=tok)
    assert main(["dsi", str(ens), "--prompt", "x"]) == 2
    assert "holds an ensemble, whose drafting chooses among its members" in capsys.readouterr().err
    # Sampling (its law is tested in test_dsi_sampling_is_the_targets_distribution): the text differs from greedy's.
    assert main(["dsi", str(exp), "--prompt", "Once upon a time", "--sp", "2", "--max-new-tokens", "24",
                 "--temperature", "1.0", "--json"]) == 0
    sampled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]["tokens"]
    assert len(sampled) == 24 and sampled != rep["runs"][0]["tokens"]


@pytest.mark.slow  # every server, the drafter and SI / non-SI trace their forwards (dynamo, a few seconds each)
def test_dsi_command_on_the_compiled_path_gives_the_greedy_tokens(stories_dir, tmp_path, capsys, monkeypatch):
    """`dsi --compile`: servers, drafter and SI / non-SI on the static-shape compiled path (dynamo's graph capture
    here), warmed up before anything is timed; the lookahead comes from the compiled path's measured forward times,
    and the tokens are HF generate's."""
    import json

    from draftlab.cli import main
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    monkeypatch.setenv("DRAFTLAB_COMPILE_BACKEND", "eager")
    base, tok = load_base(str(stories_dir), "float32")
    exp = save_export(build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base), base,
                      tmp_path / "ssm", str(stories_dir), tokenizer=tok)
    assert main(["dsi", str(exp), "--prompt", "Once upon a time", "--prompt", "The dog", "--sp", "2",
                 "--max-new-tokens", "20", "--compare", "--compile", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["compiled"] == "eager" and rep["identical_to_greedy"] is True and not rep["emulated"]
    assert rep["t_target_ms"] > 0 and rep["t_draft_ms"] > 0 and [len(r["tokens"]) for r in rep["runs"]] == [20, 20]


@pytest.mark.slow  # 1500 multi-process generations, about a minute
def test_dsi_sampling_is_the_targets_distribution(tmp_path):
    """Sampled DSI: the joint law of the first two tokens equals the target's (chi-square), with a drafter whose
    own law is far from it (the same check against the drafter's law fails)."""
    import torch

    from conftest import tiny_llama
    from draftlab.decode.acceptance import warp
    from draftlab.cli.quickstart import build_tokenizer
    from test_decoder import _joint_first_two, chi_square

    s = Sampling(temperature=0.8, top_p=0.95)
    target = tiny_llama(vocab=16, seed=4, dtype=torch.float32)
    drafter = tiny_llama(vocab=16, seed=9, dtype=torch.float32)
    with torch.no_grad():
        target.lm_head.weight.mul_(6)  # peaked laws give the test power with few samples
        drafter.lm_head.weight.mul_(4)
    build_tokenizer(["a b c"], tmp_path)  # the servers load a tokenizer beside the weights; it is never used
    target.save_pretrained(tmp_path)
    prompt = [1, 5]
    g = torch.Generator().manual_seed(3)

    def draft_next(tokens):
        with torch.no_grad():
            q = warp(drafter(torch.tensor([tokens])).logits[0, -1], s)
        return int(torch.multinomial(q, 1, generator=g)), q
    counts = torch.zeros(16, 16)
    with DSI(str(tmp_path), sp=2, sampling=s) as dsi:
        for i in range(1500):
            toks = dsi.generate(prompt, 2, draft_next, lookahead=1 + i % 2, seed=i)["tokens"]
            counts[toks[0], toks[1]] += 1
    stat, df = chi_square(counts, _joint_first_two(target, prompt, s))
    assert df >= 5 and stat < df + 4 * (2 * df) ** 0.5, (stat, df)
    wrong, df2 = chi_square(counts, _joint_first_two(drafter, prompt, s))
    assert wrong > df2 + 4 * (2 * df2) ** 0.5


def test_dsi_stops_at_eos_like_hf_generate(dsi, setup):
    """DSI ends the text at EOS (kept) as HF generate does, and at a stop match; SI likewise."""
    model, prompt, ref, V = setup
    eos = ref[5]  # pretend the 6th greedy token is the end of turn
    want = plain_generate(model, [prompt], 48, Sampling(), eos)[0][0]
    assert want == ref[:ref.index(eos) + 1]
    for a, k in ((0.0, 1), (1.0, 4)):
        assert dsi.generate(prompt, 48, oracle(prompt, ref, a, V, seed=1), k, eos_token_id=eos)["tokens"] == want
    cut = dsi.generate(prompt, 48, oracle(prompt, ref, 1.0, V, seed=1), 4, stop=lambda _, t: 3 if len(t) >= 3 else None)
    assert cut["tokens"] == ref[:3]
    assert si_generate(model, prompt, 48, oracle(prompt, ref, 0.7, V, seed=2), 3, eos_token_id=eos)["tokens"] == want


@pytest.mark.slow  # multi-process: two server processes started twice (about 20 s)
def test_dsi_reused_after_an_interrupted_run_takes_no_stale_result(tiny_base_dir, setup):
    """A run interrupted with tasks in flight (the drafter raised) leaves results behind; the next run on the same
    servers must not take them for its own tasks."""
    model, prompt, ref, V = setup
    other = [prompt[0]] + [(t + 7) % V for t in prompt[1:]]  # another text: its tasks' answers differ
    other_ref = plain_generate(model, [other], 48, Sampling(), None)[0][0]

    def failing(after):
        calls = {"n": 0}
        good = oracle(other, other_ref, 1.0, V, seed=0)

        def draft_next(tokens):
            calls["n"] += 1
            if calls["n"] > after:
                raise KeyboardInterrupt
            return good(tokens)
        return draft_next
    with DSI(str(tiny_base_dir), sp=3, target_latency_s=0.02) as dsi:
        for after in (2, 5, 9):
            with pytest.raises(KeyboardInterrupt):
                dsi.generate(other, 48, failing(after), lookahead=1)
            assert dsi.generate(prompt, 48, oracle(prompt, ref, 0.8, V, seed=after), lookahead=2)["tokens"] == ref


def _alive(procs):
    return [p for p in procs if p.is_alive()]


@pytest.mark.slow  # multi-process: two pools of server processes (about 24 s)
def test_dsi_server_errors_reach_the_caller_and_the_pool_is_closed(tiny_base_dir, setup):
    """A server that raises (a token outside the vocabulary) or is killed: DSIError with the server's traceback or
    its death, no hang, and no server process left running."""
    import os
    import signal

    from draftlab.parallel.dsi import DSIError

    model, prompt, ref, V = setup
    dsi = DSI(str(tiny_base_dir), sp=2)
    with pytest.raises(DSIError, match="(?s)target server.*Traceback.*Error"):
        dsi.generate(prompt + [V + 1000], 8, oracle(prompt, ref, 0.0, V, seed=0), lookahead=1)
    assert not _alive(dsi.procs)

    dsi = DSI(str(tiny_base_dir), sp=2, target_latency_s=0.05)
    victim = dsi.procs[0]

    def kill_then_draft(tokens, draft=oracle(prompt, ref, 0.5, V, seed=0)):
        if victim.is_alive():
            os.kill(victim.pid, signal.SIGKILL)
        return draft(tokens)
    with pytest.raises(DSIError, match="died"):
        dsi.generate(prompt, 48, kill_then_draft, lookahead=1)
    assert not _alive(dsi.procs)
    with pytest.raises(DSIError, match="pool is closed"):  # (not a ValueError from a closed queue)
        dsi.generate(prompt, 8, oracle(prompt, ref, 0.0, V, seed=0), lookahead=1)


def test_dsi_failed_start_leaks_no_server(tmp_path):
    """Servers that cannot load the base report why, and none stays behind."""
    import multiprocessing as mp

    from draftlab.parallel.dsi import DSIError

    servers = lambda: {p.pid for p in mp.active_children() if p.name.startswith("dsi-server")}  # noqa: E731
    before = servers()  # another test's shared pool may be running in this worker
    with pytest.raises(DSIError, match="(?s)target server.*Traceback"):
        DSI(str(tmp_path / "no-such-model"), sp=2)
    assert servers() <= before


@pytest.fixture(scope="module")
def emulated_pool(tiny_base_dir):
    """Two target servers whose forwards last 60 ms (the runtime-vs-simulator cases share them)."""
    with DSI(str(tiny_base_dir), sp=2, target_latency_s=0.06) as dsi:
        yield dsi


# How the text ends: the stretches before the last (accepted drafts each; a stretch commits them and the target's
# token), the last stretch's accepted drafts and how many of its tokens the text takes (max_new_tokens is the sum).
_BEFORE = [8, 5, 2, 0, 3]  # 23 tokens
_ENDS = {
    "last-accepts-0": (_BEFORE, 0, 1),  # a target-only task ends the text
    "last-accepts-1": (_BEFORE, 1, 2),  # 1 draft: off the lookahead-4 grid
    "last-accepts-3": (_BEFORE, 3, 4),
    # The last stretch would accept 8 drafts; the text takes 6 of its tokens: 5 drafts, off the lookahead-4 grid,
    # and at lookahead 4 the task verifying them waits 10 ms for a server.
    "cut-mid-stretch": (_BEFORE, 8, 6),
    "one-stretch-10-tokens": ([], 47, 10),  # everything accepted; 10 is no multiple of 4
}


# Slow: multi-process and compared against wall-clock arrivals; beside another test worker on 2 cores (-n auto) one
# case counted 0 server waits where the simulator has 1 (2026-11-25, a clean-clone default run). CI runs the slow
# tests one at a time.
@pytest.mark.slow
@pytest.mark.parametrize("end", list(_ENDS))
def test_dsi_runtime_follows_the_simulator_on_the_same_inputs(emulated_pool, setup, end):
    """The process runtime and `draftlab simulate`'s event simulator on the same stretches (accepted drafts per
    stretch replayed), emulated latencies: with too few servers for the lookahead tasks wait while the drafter goes
    on drafting (it never blocks on the pool); with enough servers no task on the lookahead grid waits. The
    runtime's counts (tasks sent, tasks that waited for a server, tasks preempted) are the simulator's, and so is
    its time on the emulated clock (no wall time is compared: that holds the runtime's overheads and the machine's
    load), however the text ends: both draft only the tokens the text has a use for and send a stretch's last task
    once those drafts exist."""
    import math

    from draftlab.parallel.simulate import min_lookahead, simulate_dsi

    model, prompt, ref, V = setup
    tt, td = 0.06, 0.01
    before, last, tail = _ENDS[end]
    stretches = before + [last]
    n = sum(j + 1 for j in before) + tail
    # What each stretch accepts in the text: the last has a use for tail - 1 drafts.
    accepted = before + [min(last, tail - 1)]

    def replay(accepts):
        """Drafts the target's token for the first accepts[i] drafts of stretch i, then wrong ones."""
        it, st = iter(accepts), {"prev": None, "start": 0, "j": 0}

        def draft_next(tokens):
            if tokens != st["prev"]:  # not the continuation of the last draft: a new stretch starts here
                st["start"], st["j"] = len(tokens), next(it)
            i = len(tokens) - len(prompt)
            right = ref[i] if i < len(ref) else 0
            d = right if len(tokens) - st["start"] < st["j"] else (right + 1) % V
            st["prev"] = tokens + [d]
            return d
        return draft_next

    def simulate(k, t_target):
        return simulate_dsi(n + 1, 0.0, k, td, t_target, 2, random.Random(0), t_prefill=0.0, accepts=stretches)

    def counts(r):
        return r["tasks"], r["waits"], r["preempted"]

    for k in (1, min_lookahead(td, tt, 2) + 1):
        sim = simulate(k, tt)
        # A task due exactly when a server frees or a decision comes is a tie the emulated clock resolves but the
        # runtime's measured counts race on; the cases have none (their counts stand when t_target moves a little).
        assert counts(simulate(k, tt * 0.999)) == counts(sim) == counts(simulate(k, tt * 1.001)), (k, sim)
        got = emulated_pool.generate(prompt, n, replay(stretches), k, draft_latency_s=td)
        assert got["tokens"] == ref[:n]
        assert got["tasks"] == got["emulated_tasks"] == sim["tasks"], (k, got, sim)
        # A stretch's deciding task is the first to verify all its accepted drafts (task m verifies m * k drafts,
        # the last one all the text has a use for); every task sent after it is preempted.
        deciding = sum(math.ceil(j / k) + 1 for j in accepted)  # tasks up to each stretch's deciding one
        assert got["preemptions"] == sim["preempted"] == sim["tasks"] - deciding, (k, got, sim)
        assert got["server_waits"] == got["emulated_waits"] == sim["waits"], (k, got, sim)
        assert got["emulated_wait_s"] == pytest.approx(sim["waited"], abs=1e-9), (k, got, sim)
        assert got["emulated_s"] == pytest.approx(sim["time"], abs=1e-9), (k, got, sim)
        if k == 1:  # tasks due every 10 ms, each holding a server 60 ms: most wait, and the drafter drafts on
            assert sim["waits"] > 5
        else:  # no task on the grid waits; a stretch's last task, off the grid, may wait for a server
            assert sim["waits"] <= 1


@pytest.mark.slow  # multi-process; test_run_dsi_draws_each_role_from_its_own_stream stays in the default run
@pytest.mark.parametrize("n", [150, 1200])
def test_run_dsi_sampling_keeps_the_base_law(tmp_path, n):
    """Sampled DSI through `draftlab dsi`'s own entry point and drafting (run_dsi: its SSM drafter and random
    streams), one prompt per run as a user's first prompt, on one server pool: every token of 4-token continuations
    (several stretches, depth >= 2 decided in one task) follows the base's law. A context-free base makes a drafter
    stream that repeats the verifier's draws plain to see."""
    from test_pipeline import check_neighbours, small_vocab_ssm_export

    from draftlab.parallel.dsi import run_dsi

    export, base = small_vocab_ssm_export(tmp_path, context_free=True)
    s = Sampling(temperature=0.9)
    samples = []
    with DSI(str(tmp_path / "base"), sp=2, sampling=s) as pool:
        for seed in range(n):
            rep = run_dsi(export, [[1, 5]], 2, max_new_tokens=4, lookahead=2, sampling=s, seed=seed, eos=False,
                          pool=pool)
            samples.append(rep["runs"][0]["tokens"])
    law = check_neighbours(base, [[1, 5]] * n, samples, s)
    assert law.ok, str(law)


def test_run_dsi_draws_each_role_from_its_own_stream(tmp_path, monkeypatch):
    """The drafter's stream and every prompt's verifier stream are distinct by construction (seeded alike, a
    drafter's first draw would reuse the verifier's uniform), for any user seed."""
    import draftlab.decode.streams as streams
    from test_pipeline import small_vocab_ssm_export

    from draftlab.parallel.dsi import run_dsi

    made = []
    real = streams.role_generator
    monkeypatch.setattr(streams, "role_generator",
                        lambda seed, role, device="cpu": made.append(streams.role_seed(seed, role)) or real(seed, role, device))
    export, _ = small_vocab_ssm_export(tmp_path)
    s = Sampling(temperature=1.0)
    with DSI(str(tmp_path / "base"), sp=1, sampling=s) as pool:
        run_dsi(export, [[1, 5], [1, 6], [1, 7]], 1, max_new_tokens=3, lookahead=1, sampling=s, seed=0, pool=pool)
    assert len(made) == 4 and len(set(made)) == 4  # one drafter stream, three verifier streams
    assert streams.role_seed(0, "drafter") != streams.role_seed(0, "verifier")


def test_dsi_rejection_with_no_residual_mass_does_not_crash():
    """A q lying over p everywhere (mass over 1 through rounding): a rejection leaves max(p - q, 0) empty, which
    made torch.multinomial raise; the token then comes from p."""
    import torch

    from draftlab.parallel.dsi import _decide_sampled

    p = torch.softmax(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)), -1)  # [n + 1, V], n = 1
    q = p[0] * 1.5
    gen = torch.Generator().manual_seed(1)
    draws = 600
    rejected = []  # the token put in the draft's place after each rejection
    for _ in range(draws):
        decided, _ = _decide_sampled(p, 1, [3], [q], 0, gen)
        # Accepted: the draft and a token from p after it; rejected: one token in its place.
        if len(decided) == 1:
            rejected.append(decided[0])
        else:
            assert decided[0] == 3
    # The draft is accepted with probability p(3) / q(3) = 2/3 (binomial, within 4 standard deviations) ...
    sd = (draws * 2 / 9) ** 0.5
    assert abs(len(rejected) - draws / 3) < 4 * sd, len(rejected)
    # ... and a rejection's token comes from p (chi-square over the 8 tokens, df = 7).
    counts = torch.bincount(torch.tensor(rejected), minlength=8).double()
    want = p[0].double() * len(rejected)
    stat = float(((counts - want) ** 2 / want).sum())
    assert stat < 7 + 4 * 14 ** 0.5, (stat, counts.tolist(), want.tolist())
