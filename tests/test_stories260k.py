"""The real pretrained base (data/models/stories260K): importer reproduction and decoder exactness."""

import random

import pytest
import torch

from conftest import STORIES
from test_decoder import noisy_heads, plain_greedy, random_tree
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.drafters import make_drafter
from draftlab.decode.search import default_tree
from draftlab.decode.tree import Tree

FIRST_TOKENS = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298]


@pytest.fixture(scope="module")
def stories(stories_dir):
    from draftlab.base import load_base

    return load_base(str(stories_dir), "float32")


def test_importer_reproduces_the_reference_greedy_output(stories):
    model, tok = stories
    out = model.generate(torch.tensor([[1]]), max_new_tokens=60, do_sample=False)[0, 1:].tolist()
    assert out[:10] == FIRST_TOKENS
    text = tok.decode(out, skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little girl named Lily. She loved to play outside "
                           "in the park. One day, she saw a big, red ball.")


def test_a_story_ends_at_bos_as_in_llama2c(stories):
    """llama2.c's run.c stops at BOS, which opens each training story: with EOS alone as the stop, one story ran on
    into the next (walk-through: every distill-data record glued a second story on)."""
    from draftlab.base import stop_token_ids

    model, tok = stories
    assert stop_token_ids(model, tok) == [2, 1]
    out = model.generate(torch.tensor([[1]]), max_new_tokens=400, do_sample=False)[0, 1:].tolist()
    assert out[-1] == 1 and 1 not in out[:-1] and len(out) == 346  # (the first story's 345 tokens, then BOS)
    assert tok.decode(out, skip_special_tokens=True).rstrip().endswith('You are a good friend."')


def test_imported_tokenizer_matches_sentencepiece(stories):
    import sentencepiece as spm

    _, tok = stories
    sp = spm.SentencePieceProcessor(model_file=str(STORIES / "tok512.model"))
    s = "Lily's mom said, \"Be careful!\" 123 émigré"
    assert tok(s, add_special_tokens=False).input_ids == sp.encode(s)
    assert tok(s).input_ids[0] == 1  # BOS, as llama2.c prepends it
    assert "Assistant:" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   add_generation_prompt=True)


def test_importer_rejects_bad_files(tmp_path):
    from draftlab.base import BaseModelError
    from draftlab.interop.llama2c import import_llama2c

    bad = tmp_path / "x.bin"
    bad.write_bytes(b"\x00" * 10)
    with pytest.raises(BaseModelError, match="too small"):
        import_llama2c(bad, STORIES / "tok512.model", tmp_path / "o")
    with pytest.raises(BaseModelError, match="SentencePiece .model"):
        import_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path / "o")


def test_greedy_exactness_on_stories260k(stories):
    model, tok = stories
    rng = random.Random(0)
    heads = noisy_heads(model, num_heads=4, noise=0.02)
    prompts = ["Once upon a time", "The little dog", "Tom and Sue went to the park. They", "One day"]
    for i, tree in enumerate([default_tree(4), Tree.chain(4), random_tree(rng, 4), Tree.from_paths([])]):
        dec = SpeculativeDecoder(model, make_drafter(heads, tree))
        for B in (1, 3):
            batch = [[1] + tok(prompts[(i + j) % 4], add_special_tokens=False).input_ids for j in range(B)]
            res = dec.generate(batch, max_new_tokens=40)
            for p, got in zip(batch, res.tokens):
                assert got == plain_greedy(model, p, 40)
