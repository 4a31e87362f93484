"""Pipelined drafting/verification (drafter in its own process, an intermediate result pool): the tokens of plain
greedy decoding, and the drafter pauses while the pool holds a verifier batch."""

import pytest
import torch

from test_decoder import plain_greedy


@pytest.fixture(scope="module")
def ssm_export(stories_dir, tmp_path_factory):
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    ssm = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base)
    return str(save_export(ssm, base, tmp_path_factory.mktemp("pipe") / "ssm", str(stories_dir), tokenizer=tok)), base


def test_pipelined_stream_equals_plain_greedy_and_respects_the_pool(ssm_export):
    from draftlab.decode.pipeline import DraftPipeline

    export, base = ssm_export
    g = torch.Generator().manual_seed(0)
    # 11 requests of different lengths in groups of 3: four groups, the last one short, rows ending at EOS-free
    # different steps; three groups in flight so the drafter has to wait for the pool to drain.
    prompts = [[1] + torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (11,), generator=g)]
    with DraftPipeline(base, export, tree="expansion:2,1,1") as pipe:
        limited = pipe.run(prompts, batch_size=3, in_flight=3, max_new_tokens=20)
        unlimited = pipe.run(prompts, batch_size=3, in_flight=3, max_new_tokens=20, pool_limit=None)
    for p, got in zip(prompts, limited.tokens):
        assert got == plain_greedy(base, p, 20)
    assert unlimited.tokens == limited.tokens
    assert limited.accept_length > 1 and limited.steps > 0
    # Minions' rule: the drafter starts a draft only while the pool holds fewer than batch_size (3) requests, so
    # it never holds more than 3 + 2; without the rule all three groups' drafts pile up.
    assert limited.drafter["paused"] > 0 and limited.drafter["pool_max"] <= 5
    assert unlimited.drafter["paused"] == 0 and unlimited.drafter["pool_max"] == 9


def test_drafters_that_read_the_base_are_refused(stories_dir, tmp_path):
    from draftlab.base import load_base
    from draftlab.decode.pipeline import DraftPipeline, PipelineError
    from draftlab.drafters import build_draft
    from draftlab.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    exp = save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "m",
                      str(stories_dir), tokenizer=tok)
    with pytest.raises(PipelineError, match="reads the base's hidden states"):
        DraftPipeline(base, str(exp))
