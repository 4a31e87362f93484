"""Python warnings from other libraries that a draftlab user cannot act on are kept out of draftlab's output."""

import warnings

import pytest
import torch

from conftest import tiny_llama
from draftlab.progress import quiet_libraries


def _cache_warnings(model) -> list[str]:
    """The past_key_values warnings of one cached forward, each recorded (none dropped as a repeat)."""
    from transformers import DynamicCache

    with warnings.catch_warnings(record=True) as seen:
        model(input_ids=torch.tensor([[1, 5, 7]]), past_key_values=DynamicCache(), use_cache=True)
    return [str(w.message) for w in seen if "past_key_values" in str(w.message)]


def test_the_cache_argument_deprecation_is_dropped():
    model = tiny_llama()
    with warnings.catch_warnings():  # quiet_libraries' filters are process-wide: undone after the test
        warnings.simplefilter("always")
        if not _cache_warnings(model):
            pytest.skip("this transformers does not deprecate past_key_values")
        quiet_libraries()
        assert _cache_warnings(model) == []


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
    code = ("import warnings; warnings.warn('`past_key_values` is deprecated and will be removed in 5.40.0', "
            "FutureWarning); warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
            "`is_activation_checkpointing`', FutureWarning); warnings.warn('another', FutureWarning)")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "past_key_values" not in err and "is_gradient_checkpointing" not in err and "another" in err
    assert "Invalid -W option" not in err
