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
