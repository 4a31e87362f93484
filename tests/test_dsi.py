"""DSI as processes: one drafter and several target servers with preemption; tokens equal plain greedy for good
and bad drafters and every lookahead (the timings against `draftlab simulate` are benchmarks/dsi.py's)."""

import random

import pytest

from draftlab.base import load_base
from draftlab.decode.acceptance import Sampling
from draftlab.decode.generate import plain_generate
from draftlab.dsi import DSI, si_generate


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


def test_dsi_tokens_equal_plain_greedy(tiny_base_dir, setup):
    model, prompt, ref, V = setup
    with DSI(str(tiny_base_dir), sp=2) as dsi:
        for a, k in ((0.0, 1), (0.6, 2), (1.0, 3), (0.9, 5)):
            out = dsi.generate(prompt, 48, oracle(prompt, ref, a, V, seed=1), lookahead=k)
            assert out["tokens"] == ref, (a, k)
        assert out["tasks"] > 0
    assert si_generate(model, prompt, 48, oracle(prompt, ref, 0.7, V, seed=2), lookahead=3)["tokens"] == ref


def test_dsi_ends_off_the_lookahead_grid(tiny_base_dir, setup):
    """Token counts that are not a multiple of the lookahead: the last task verifies up to the end."""
    model, prompt, ref, V = setup
    with DSI(str(tiny_base_dir), sp=3) as dsi:
        for n, k in ((7, 4), (13, 5), (48, 7)):
            out = dsi.generate(prompt, n, oracle(prompt, ref, 1.0, V, seed=4), lookahead=k)
            assert out["tokens"] == ref[:n], (n, k)


def test_cached_greedy_equals_recomputing_the_whole_sequence(setup):
    """The servers' KV cache keeps the longest common prefix of consecutive tasks: extending, branching behind
    the last sequence and going back to an earlier one all give the full recomputation's tokens."""
    import torch

    from draftlab.dsi import CachedGreedy

    model, prompt, ref, V = setup
    c = CachedGreedy(model)
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


@pytest.mark.slow  # three server pools through the CLI (about 20 s)
def test_dsi_command_with_an_ssm_export(stories_dir, tmp_path, capsys):
    import json

    from draftlab.cli import main
    from draftlab.drafters import build_draft
    from draftlab.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    exp = save_export(build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base), base,
                      tmp_path / "ssm", str(stories_dir), tokenizer=tok)
    rc = main(["dsi", str(exp), "--prompt", "Once upon a time", "--sp", "2", "--max-new-tokens", "24", "--compare",
               "--target-latency-ms", "20", "--draft-latency-ms", "4", "--json"])
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and rep["identical_to_greedy"] is True and rep["emulated"]
    assert rep["lookahead"] == 3  # ceil(20 / (2 * 4)): the smallest with which no task waits for a server
    assert len(rep["runs"][0]["tokens"]) == 24 and rep["runs"][0]["tasks"] > 0
    heads = save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "m",
                        str(stories_dir), tokenizer=tok)
    assert main(["dsi", str(heads), "--prompt", "x"]) == 2
    assert "cannot draft ahead of verification" in capsys.readouterr().err
    # Sampling (its law is tested in test_dsi_sampling_is_the_targets_distribution): the text differs from greedy's.
    assert main(["dsi", str(exp), "--prompt", "Once upon a time", "--sp", "2", "--max-new-tokens", "24",
                 "--temperature", "1.0", "--json"]) == 0
    sampled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]["tokens"]
    assert len(sampled) == 24 and sampled != rep["runs"][0]["tokens"]


@pytest.mark.slow  # 1500 multi-process generations, about a minute
def test_dsi_sampling_is_the_targets_distribution(tmp_path):
    """Sampled DSI: the joint law of the first two tokens equals the target's (chi-square), with a drafter whose
    own law is far from it (the same check against the drafter's law fails)."""
    import torch

    from conftest import tiny_llama
    from draftlab.decode.acceptance import warp
    from draftlab.quickstart import build_tokenizer
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
