"""Other libraries' output in draftlab's: their bars off where they are debris, their empty warnings dropped, and
the quickstart's counts those of what ran."""

import logging
import re

import pytest
import torch

from draftlab.progress import LIBRARY_BARS_ENV, quiet_libraries


@pytest.fixture
def library_bars(monkeypatch):
    """Library bars on, as in a fresh process; the environment and transformers' switch restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    for var in LIBRARY_BARS_ENV:
        monkeypatch.delenv(var, raising=False)
    hf_logging.enable_progress_bar()
    yield
    (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()


def test_weight_bars_are_off_when_asked_and_in_logs(tiny_base_dir, tmp_path, capsys, library_bars):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    assert "Loading weights" in capsys.readouterr().err  # the bar this is about (captured stderr: not a terminal)
    quiet_libraries()  # stderr is not a terminal here: off, as in a log
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    model.save_pretrained(tmp_path / "saved")
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err and err.strip() == ""


def test_shared_tensor_warning_dropped_and_the_tie_survives_reload(tmp_path, caplog):
    """accelerate drops a tied weight's second name when it saves safetensors and warns; safetensors' load_model,
    which accelerate's load_state uses, restores the tie, so the warning tells a user nothing."""
    from accelerate import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors
    from safetensors.torch import load_model, save_file

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    PartialState()
    quiet_libraries(bars=True)
    model = Tied()
    with caplog.at_level(logging.WARNING):
        state = clean_state_dict_for_safetensors(model.state_dict())
        logging.getLogger("accelerate.utils.other").warning("[RANK 0] another accelerate warning")
    assert len(state) == 1  # the condition of the warning was met
    assert "Removed shared tensor" not in caplog.text and "another accelerate warning" in caplog.text
    save_file(state, tmp_path / "m.safetensors")
    fresh = Tied()
    load_model(fresh, tmp_path / "m.safetensors")
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.head.weight, model.head.weight)


def test_deepspeed_cpu_notice_dropped_only_with_a_cpu_only_torch(caplog, capsys):
    quiet_libraries(bars=True)
    log = logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        propagate, log.propagate = log.propagate, True
        try:
            log.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        finally:
            log.propagate = propagate
    shown = "Setting accelerator to CPU" in caplog.text + capsys.readouterr().out
    assert shown == (torch.version.cuda is not None)


def test_quickstart_decode_counts_what_it_decodes(tiny_base_dir, tmp_path, capsys, monkeypatch):
    """The announced number of prompts is the number decoded, also when fewer files are held out than asked."""
    from test_decoder import noisy_heads

    from draftlab.base import load_base
    from draftlab.interop.export import save_export
    from draftlab.cli.quickstart import decode_held_out

    monkeypatch.setenv("DRAFTLAB_PROGRESS_SECONDS", "3600")  # one progress line, at the end
    base, _ = load_base(str(tiny_base_dir), "float32")
    export = save_export(noisy_heads(base, num_heads=2, noise=0.02), base, tmp_path / "medusa", str(tiny_base_dir))
    docs = ["Once upon a time there was a cat.", "The dog was friendly.", "They were happy friends."]
    capsys.readouterr()
    tot, _, _, _, n = decode_held_out({"medusa": str(export)}, docs, num_prompts=16, max_new_tokens=4)
    out, err = capsys.readouterr()
    assert n == 3 and re.search(r"decoding 3 held-out prompts \(the opening of each held-out file;", out)
    assert re.search(r"^decode: 3/3 prompt \(100%\)", err, re.M)
    assert tot["medusa"]["identical"] and tot["medusa"]["new"] <= 3 * 4  # greedy: plain decoding's tokens, 4 a prompt
