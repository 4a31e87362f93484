"""Pipelined drafting/verification (drafter in its own process, an intermediate result pool): the tokens of plain
greedy decoding, and the drafter pauses while the pool holds a verifier batch."""

import pytest
import torch

from test_decoder import plain_greedy


@pytest.fixture(scope="module")
def ssm_export(stories_dir, tmp_path_factory):
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    ssm = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base)
    return str(save_export(ssm, base, tmp_path_factory.mktemp("pipe") / "ssm", str(stories_dir), tokenizer=tok)), base


def test_pipelined_stream_equals_plain_greedy_and_respects_the_pool(ssm_export):
    from draftlab.parallel.pipeline import DraftPipeline

    export, base = ssm_export
    g = torch.Generator().manual_seed(0)
    # 11 requests of different lengths in groups of 3: four groups, the last one short, rows ending at EOS-free
    # different steps; three groups in flight so the drafter has to wait for the pool to drain.
    prompts = [[1] + torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (11,), generator=g)]
    with DraftPipeline(base, export, tree="expansion:2,1,1") as pipe:
        limited = pipe.run(prompts, batch_size=3, in_flight=3, max_new_tokens=20)
        unlimited = pipe.run(prompts, batch_size=3, in_flight=3, max_new_tokens=20, pool_limit=None)
        # Groups whose rows all end with their first token are finished at prefill: no draft, no verification.
        first = pipe.run(prompts, batch_size=3, in_flight=3, max_new_tokens=1)
        for bad in (0, -1, "all"):  # (0: the drafter would never draft, and the run would wait for its timeout)
            with pytest.raises(ValueError, match="pool_limit"):
                pipe.run(prompts, batch_size=3, pool_limit=bad)
    for p, got in zip(prompts, limited.tokens):
        assert got == plain_greedy(base, p, 20)
    assert unlimited.tokens == limited.tokens
    assert first.tokens == [t[:1] for t in limited.tokens] and first.steps == 0 and first.drafter["drafts"] == 0
    assert limited.accept_length > 1
    # Each step of a group is a step of the plain decoder on that group's batch, with the same drafter and tree.
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.serve.generate import resolve_tree
    from draftlab.drafters import make_drafter
    from draftlab.interop.export import load_export

    draft, meta = load_export(export, base=None)
    dec = SpeculativeDecoder(base, make_drafter(draft, resolve_tree("expansion:2,1,1", meta)))
    plain_steps = sum(dec.generate(prompts[i:i + 3], max_new_tokens=20).steps for i in range(0, len(prompts), 3))
    assert limited.steps == unlimited.steps == plain_steps
    # Minions' rule: the drafter starts a draft only while the pool holds fewer than batch_size (3) requests, so
    # it never holds more than 3 + 2; without the rule all three groups' drafts pile up.
    assert limited.drafter["paused"] > 0 and limited.drafter["pool_max"] <= 5
    assert unlimited.drafter["paused"] == 0 and unlimited.drafter["pool_max"] == 9


@pytest.mark.slow  # two pipelines, each a spawned worker (about 25 s on 2 cores); CI runs the slow tests
def test_compiled_pipeline_gives_the_eager_pipelines_tokens_and_steps(ssm_export):
    """compile= puts both processes on the static-shape path (the verifier's trees padded to the drafter's
    max_nodes, the SSM on its static cache), traced here with the eager backend: same tokens, same steps."""
    from draftlab.parallel.pipeline import DraftPipeline

    export, base = ssm_export
    prompts = [[1, 5, 7, 9], [1, 3], [1, 2, 3, 4, 5, 6, 7], [1, 40], [1, 8, 8]]
    runs = []
    for compile in (False, "eager"):
        with DraftPipeline(base, export, tree="expansion:2,1,1", compile=compile) as pipe:
            runs.append(pipe.run(prompts, batch_size=2, in_flight=2, max_new_tokens=16))
    eager, compiled = runs
    assert compiled.tokens == eager.tokens == [plain_greedy(base, p, 16) for p in prompts]
    assert compiled.steps == eager.steps and compiled.committed == eager.committed
    from draftlab.decode.decoder import fused_step
    assert compiled.drafter["decode_path"] == {"static": True, "compile": "eager"} and eager.drafter["decode_path"] is None
    assert fused_step("eager", "cpu").calls  # the verifier's steps went through the compiled (fused) verify step


def test_pipeline_groups_share_one_vote_and_adaptive_length(ssm_export, stories_dir, tmp_path):
    """Minions: the vote weights and the speculation length are learned over every verified batch of the stream,
    whichever group it belongs to, and the length follows the verifier's time."""
    from draftlab.parallel.pipeline import DraftPipeline
    from draftlab.drafters import EnsembleDraft, build_draft
    from draftlab.interop.export import save_export

    _, base = ssm_export
    members = [build_draft({"type": "ssm", "ssm": {"num_layers": n, "init": "truncate"}}, base) for n in (1, 2)]
    exp = save_export(EnsembleDraft(members, ["one", "two"], {"mode": "vote", "length": 3, "adaptive": True}),
                      base, tmp_path / "vote", str(stories_dir))
    prompts = [[1, 5 + i, 40 + 3 * i] for i in range(6)]
    with DraftPipeline(base, str(exp)) as pipe:
        res = pipe.run(prompts, batch_size=2, in_flight=3, max_new_tokens=12)
    for p, got in zip(prompts, res.tokens):
        assert got == plain_greedy(base, p, 12)
    state = res.drafter["state"]
    # every group's steps, not one group's (a group's last step ends it: no commit reaches the drafter), for the
    # vote weights and the adaptive length alike
    assert state["verified_batches"] == state["length_records"] == res.steps - 3
    assert state["length_metric"] == "verify"


def test_drafters_that_read_the_base_are_refused(stories_dir, tmp_path):
    from draftlab.base import load_base
    from draftlab.parallel.pipeline import DraftPipeline, PipelineError
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    exp = save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "m",
                      str(stories_dir), tokenizer=tok)
    with pytest.raises(PipelineError, match="reads the base's hidden states"):
        DraftPipeline(base, str(exp))


def small_vocab_ssm_export(d, vocab: int = 16, context_free: bool = False):
    """A saved tiny base with a small, peaked vocabulary (so a law test has power with few samples) and an SSM
    export of it whose law is close to, but not, the base's: (export path, base). context_free: every embedding
    row equal, so the base's law (and the drafter's) is the same after every prefix; a draft drawn with the same
    uniform as the token before it then repeats that token, which makes shared random streams plain to see."""
    from conftest import tiny_llama
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export
    from draftlab.cli.quickstart import build_tokenizer

    target = tiny_llama(vocab=vocab, seed=4, dtype=torch.float32)
    with torch.no_grad():
        target.lm_head.weight.mul_(6)
        if context_free:
            target.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[3:4].expand(vocab, -1))  # not the zero pad row
    tok = build_tokenizer(["a b c"], d / "base")  # loaded beside the weights; prompts are given as ids
    target.save_pretrained(d / "base")
    base, _ = load_base(str(d / "base"), "float32")
    ssm = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base)
    return str(save_export(ssm, base, d / "ssm", str(d / "base"), tokenizer=tok)), base


def pair_labels(samples, V: int):
    """law_statistic labels [N, K, V]: cell (previous token, token), so the test sees the joint law of neighbours,
    which per-position token counts of a context-free base cannot (label 0..V-1 at the first position)."""
    x = torch.as_tensor(samples, dtype=torch.long)
    prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1] + 1], 1)  # [N, K]; 0 marks the first position
    return prev[..., None] * V + torch.arange(V)


def check_neighbours(base, prompts, samples, sampling):
    """check_law with cells (previous token, token)."""
    from law import conditional_laws, law_statistic

    probs = conditional_laws(base, prompts, samples, sampling)
    return law_statistic(samples, probs, pair_labels(samples, probs.shape[-1]))


@pytest.mark.slow  # 600 pipelined runs; the greedy and failure-path pipeline tests stay in the default run
def test_pipelined_sampling_keeps_the_base_law(tmp_path):
    """Sampling through the pipeline (drafter and verifier in two processes, each with its own random stream):
    every token of 4-token continuations, depth-2 accepts and later steps included, follows the base's law. With
    the two streams seeded alike the first draft would follow the sampled root."""
    from law import check_law

    from draftlab.decode.acceptance import Sampling
    from draftlab.parallel.pipeline import DraftPipeline

    s = Sampling(temperature=0.8, top_p=0.95)
    prompts = [[1, 5]] * 600
    for context_free, tree in ((False, "expansion:2,1,1"), (True, "chain:3")):
        export, base = small_vocab_ssm_export(tmp_path / str(context_free), context_free=context_free)
        with DraftPipeline(base, export, tree=tree, seed=0) as pipe:
            res = pipe.run(prompts, batch_size=300, in_flight=2, max_new_tokens=4, sampling=s)
        assert res.accept_length > 1.5  # drafts are accepted, at depth 2 too
        law = (check_neighbours if context_free else check_law)(base, prompts, res.tokens, s)
        assert law.ok, (context_free, str(law))


def test_a_worker_blocked_on_a_large_proposal_stops_when_asked(ssm_export, monkeypatch):
    """A sampled run that ends mid-way (Ctrl-C, a failure) leaves the worker writing proposals (their q's: here
    about 330 KB each) into a pipe nobody reads; it read close()'s stop only once that write ended, so close()
    waited out its timeout and terminated it. close() now reads and drops what the worker still sends: the
    worker ends by itself (exit code 0), not by SIGTERM."""
    from draftlab.parallel import pipeline as P

    export, base = ssm_export
    pipe = P.DraftPipeline(base, export, tree="expansion:4,3,2")

    def failing_verify(self, prop, draft_s=0.0):
        raise RuntimeError("verifier failed")
    monkeypatch.setattr(P.Verifier, "verify", failing_verify)
    with pytest.raises(RuntimeError, match="verifier failed"):
        pipe.run([[1, 50 + i, 7] for i in range(48)], batch_size=16, in_flight=3, max_new_tokens=16,
                 sampling=P.Sampling(temperature=1.0))
    pipe.close()
    assert pipe.worker.exitcode == 0


def test_pipeline_reused_after_an_interrupted_run(ssm_export, monkeypatch):
    """A run that fails mid-way leaves proposals in flight; the next run on the same worker takes none of them
    (run ids), and a proposal whose root is not its rows' current root is refused."""
    from draftlab.parallel import pipeline as P

    export, base = ssm_export
    prompts = [[1, 50 + i, 7] for i in range(6)]
    want = [plain_greedy(base, p, 12) for p in prompts]
    real_verify = P.Verifier.verify
    with P.DraftPipeline(base, export, tree="expansion:2,1,1") as pipe:
        calls = {"n": 0}

        def failing_verify(self, prop, draft_s=0.0):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("verifier failed")
            return real_verify(self, prop, draft_s)
        monkeypatch.setattr(P.Verifier, "verify", failing_verify)
        with pytest.raises(RuntimeError, match="verifier failed"):
            pipe.run(prompts[::-1], batch_size=2, in_flight=3, max_new_tokens=12)
        monkeypatch.setattr(P.Verifier, "verify", real_verify)
        assert pipe.run(prompts, batch_size=2, in_flight=3, max_new_tokens=12).tokens == want

        real_receive = P.DraftPipeline._receive

        def wrong_root(self, run=None):
            msg, waited = real_receive(self, run)
            if msg[0] == "proposal":
                packed = msg[3][0] if isinstance(msg[3], tuple) else msg[3]
                packed.tokens[:, 0] += 1
            return msg, waited
        monkeypatch.setattr(P.DraftPipeline, "_receive", wrong_root)
        with pytest.raises(P.PipelineError, match="current root"):
            pipe.run(prompts, batch_size=2, max_new_tokens=12)


def test_pipeline_worker_failure_reaches_the_caller(ssm_export, tmp_path):
    """The drafter worker's own failure (a tree it cannot build) arrives with its traceback; nothing stays behind."""
    from draftlab.parallel.pipeline import DraftPipeline, PipelineError

    export, base = ssm_export
    with pytest.raises(PipelineError, match="(?s)pipeline drafter.*Traceback"):
        DraftPipeline(base, export, tree="no-such-tree:1")
    import multiprocessing as mp
    assert not [p for p in mp.active_children() if p.name == "pipeline-drafter"]
