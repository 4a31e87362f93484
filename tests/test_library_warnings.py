"""Python warnings from other libraries that a draftlab user cannot act on are kept out of draftlab's output."""

import warnings

import pytest
import torch

from conftest import tiny_llama
from draftlab.progress import quiet_libraries


def _cache_warnings(run) -> list[str]:
    """The warnings about the old name of the cache argument that run() gives, each recorded (none dropped as a
    repeat): transformers' FutureWarning for the keyword, and its logged one for the output field."""
    import logging

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    log = logging.getLogger("transformers")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run()
    finally:
        log.removeHandler(handler)
    return [m for m in [str(w.message) for w in seen] + logged if "past_key_values" in m]


def test_old_style_forwards_still_get_the_cache_by_the_old_name():
    """A model written for a transformers before the rename (remote code) takes past_key_values; one whose forward
    names neither (a wrapper passing **kwargs on) too: every transformers up to 5.40 takes that name."""
    from draftlab.decode.cache import cache_arg

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return past_key_values

    class Passing(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return kwargs

    model = tiny_llama()
    assert list(cache_arg(model, "kv")) == ["cache"]
    assert Old()(1, **cache_arg(Old(), "kv")) == "kv"
    assert Passing()(**cache_arg(Passing(), "kv")) == {"past_key_values": "kv"}


def test_draftlabs_cached_forwards_name_the_cache_as_the_model_does():
    """transformers 5.x renamed the cache argument (`past_key_values` -> `cache`) and drops the old name in 5.40,
    after which a decoder layer would take it into its **kwargs and run without its cache. Every cached forward of
    draftlab's passes the model's own name: the eager and static decoders (base, Hydra++'s prefix layer, an SSM, the
    tree-support probe), the accept-length replay, the boost's greedy and DSI's servers."""
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.decode.tree import Tree
    from draftlab.drafters import build_draft, make_drafter
    from draftlab.drafters.ssm import SSMDrafter
    from draftlab.parallel.dsi import CachedGreedy
    from draftlab.train.accept import greedy_continuation
    from draftlab.train.boost import _greedy

    base = tiny_llama()
    if "cache" not in __import__("inspect").signature(type(base).forward).parameters:
        pytest.skip("this transformers has not renamed the cache argument")
    torch.manual_seed(0)
    heads = build_draft({"type": "hydra", "num_heads": 2, "num_layers": 1, "prefix_attention": True}, base)
    drafters = [lambda: make_drafter(heads.to(base.dtype).eval(), Tree.chain(2)),
                lambda: SSMDrafter(tiny_llama(seed=1), Tree.expansion([2, 1]))]
    runs = [lambda: greedy_continuation(base, [1, 5, 7], 4, set()),
            lambda: _greedy(base, torch.tensor([[0, 1, 5], [1, 5, 7]]), torch.tensor([[0, 1, 1], [1, 1, 1]]), 3),
            lambda: CachedGreedy(base).next_tokens([1, 5, 7], [9, 2])]
    runs += [lambda d=d, s=s: SpeculativeDecoder(base, d(), static=s).generate([[1, 5, 7], [1, 2]], max_new_tokens=6)
             for d in drafters for s in (False, True)]
    for run in runs:
        assert _cache_warnings(run) == []


def test_child_processes_drop_it_too(monkeypatch):
    """DSI servers and pipeline drafters are fresh interpreters: the filter reaches them through PYTHONWARNINGS."""
    import subprocess
    import sys

    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")  # a user's own setting is kept
    with warnings.catch_warnings():
        quiet_libraries()
        quiet_libraries()  # idempotent
    specs = __import__("os").environ["PYTHONWARNINGS"].split(",")
    from draftlab.progress import LIBRARY_WARNINGS

    assert specs[0] == "default::DeprecationWarning" and len(specs) == len(set(specs)) == 1 + len(LIBRARY_WARNINGS)
    # (peft's read of transformers' renamed property, Medusa-2 training: walk-through)
    code = ("import warnings; warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
            "`is_activation_checkpointing`', FutureWarning); warnings.warn('another', FutureWarning)")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "is_gradient_checkpointing" not in err and "another" in err
    assert "Invalid -W option" not in err
