"""Speculative sampling keeps the base's law on a GPU through the compiled path: its acceptance in a graph of its own
(the split calls) and inside the fused and chained verify call under CUDA graphs, which a GPU runs for sampled steps
by default since this test passed on an H200 (2026-11-30; decode.decoder.fused_default).
The check of tests/test_sampling_law.py (an SSM drafting a tree with sampled siblings, several steps, depth >= 2),
in float32 on the GPU, with the GPU's own random streams. Skipped without CUDA; benchmarks/gpu_check.sh runs it.
DRAFTLAB_GPU_LAW_DEVICE=cpu runs it on a CPU (a smoke test of the test itself)."""

from __future__ import annotations

import os

import pytest
import torch

from law import StepLog, conditional_laws, pad_samples
from test_sampling_law import S_SSM, SSM_TREE, assert_deep_accepts, assert_fits, law_checks, prompts, ssm_setup
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.drafters.ssm import SSMDrafter

DEVICE = os.environ.get("DRAFTLAB_GPU_LAW_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused-chained"])
def test_sampled_steps_keep_the_law_on_the_gpu(fused):
    base, lm = (m.to(DEVICE, torch.float32) for m in ssm_setup())
    dec = SpeculativeDecoder(base, SSMDrafter(lm, SSM_TREE), compile=True, fused=fused, chained=fused)
    n, log = 600, StepLog()
    res = dec.generate(prompts(n), max_new_tokens=8, sampling=S_SSM, on_tokens=log,
                       generator=torch.Generator(DEVICE).manual_seed(0))
    assert dec.compile_failed is None
    assert (res.chained_steps > 0) == fused
    x = pad_samples(res.tokens)
    assert_deep_accepts(res, log)
    assert_fits(law_checks(x, *(conditional_laws(m, prompts(n), x, S_SSM) for m in (base, lm))))


@pytest.mark.parametrize("mode", ["merge", "vote"])
def test_the_ensembles_merge_on_the_gpu_gives_the_eager_tokens(mode):
    """The ensemble's merge and vote as compiled tensor calls on the GPU (weights in and owners out without a stream
    sync, read after the step's host copy): greedy tokens and steps as the eager path's host rules give them."""
    from conftest import tiny_llama
    from draftlab.decode.tree import Tree
    from draftlab.drafters.ensemble import EnsembleDrafter
    from draftlab.drafters.retrieval import LookupDrafter

    def drafter():
        trees = [Tree.chain(3), Tree.chain(3)] if mode == "vote" else [Tree.expansion([2, 1]), Tree.chain(3)]
        members = [SSMDrafter(tiny_llama(seed=s).to(DEVICE), t) for s, t in zip((0, 7), trees)]
        return EnsembleDrafter(members + [LookupDrafter(num_tokens=3)], mode=mode, node_budget=6, length=3)
    base = tiny_llama(seed=0).to(DEVICE)
    prompts = [[1, 5, 7, 9, 1, 5, 7], [3, 4, 3, 4, 3], [2, 9]]
    eager = SpeculativeDecoder(base, drafter()).generate(prompts, max_new_tokens=20)
    dec = SpeculativeDecoder(base, drafter(), compile=True)
    got = dec.generate(prompts, max_new_tokens=20)
    assert dec.compile_failed is None
    assert got.tokens == eager.tokens and got.steps == eager.steps and eager.accept_length > 1.2
