import json
import subprocess
import sys

import pytest

from conftest import REPO
from draftlab.cli import main

COMMANDS = ["validate", "train", "import-llama2c", "import-medusa", "export", "quickstart", "generate", "distill-data",
            "search-tree", "recipes"]


def test_every_command_has_help(capsys):
    for cmd in [None] + COMMANDS:
        with pytest.raises(SystemExit) as e:
            main(([cmd] if cmd else []) + ["--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "usage: draftlab" in out


def test_console_entry_point_runs():
    p = subprocess.run([sys.executable, "-m", "draftlab.cli", "--help"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0 and all(c in p.stdout for c in COMMANDS)


def test_validate_prints_resolved_recipe_and_errors_exit_2(capsys, tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("base: {name_or_path: m}\ndata: {path: d.jsonl}\noutput_dir: o\n")
    assert main(["validate", str(r), "train.lr=0.5"]) == 0
    assert "lr: 0.5" in capsys.readouterr().out
    assert main(["validate", str(r), "train.lrr=0.5"]) == 2
    assert "did you mean `train.lr`?" in capsys.readouterr().err
    # A shipped recipe's name, as `recipes list` prints it: copied first (it pointed to a recipes/ folder that an
    # installed draftlab does not have where the user runs; walk-through)
    for given in ("stories260k-medusa", "stories260k-medusa.yaml"):
        assert main(["validate", str(tmp_path / given)]) == 2
        err = capsys.readouterr().err
        assert ("stories260k-medusa is a shipped recipe: `draftlab recipes copy stories260k-medusa` copies it to "
                "./stories260k-medusa.yaml, then `draftlab validate stories260k-medusa.yaml`") in err
    # Overrides after an option are overrides too (they were "unrecognized arguments"; walk-through)
    assert main(["validate", str(r), "train.lr=0.5", "--json", "train.seed=7"]) == 0
    t = json.loads(capsys.readouterr().out)["train"]
    assert (t["lr"], t["seed"]) == (0.5, 7)
    with pytest.raises(SystemExit):
        main(["validate", str(r), "--json", "--nope"])
    assert "unrecognized arguments: --nope" in capsys.readouterr().err
    assert main(["validate", str(r), "train.lrr=0.5"]) == 2
    assert "did you mean `train.lr`?" in capsys.readouterr().err
    # A valid recipe whose files are not here says so (found by a new user's walkthrough: exit 0 and silence, then
    # `train` stopped on them); d.jsonl is a file name, and `m` could be a hub id.
    assert main(["validate", str(r)]) == 0
    err = capsys.readouterr().err
    assert "note: not here (paths are relative to where you run draftlab): data.path = d.jsonl" in err
    assert "base.name_or_path" not in err
    # ... and so does an SSM draft model's directory (validate said nothing of it; walk-through)
    assert main(["validate", str(r), "head.type=ssm", "head.ssm.name_or_path=./small-lm"]) == 0
    assert "head.ssm.name_or_path = ./small-lm (your own)" in capsys.readouterr().err
    assert main(["validate", str(r), "head.type=ssm", "head.ssm.name_or_path=runs/small"]) == 0
    assert "head.ssm.name_or_path = runs/small (your own)" in capsys.readouterr().err  # (no recipe command makes it)
    # The settings a head type does not read are dumped at their defaults; a note says so (EAGLE-3 showed
    # loss.distill_weight: 0.0 and always distils; walk-through)
    assert main(["validate", str(r), "head.type=eagle3"]) == 0
    err = capsys.readouterr().err
    assert ("note: head.type eagle3 does not read head.num_heads, head.num_layers, loss.distill_weight, "
            "loss.head_decay (left at their defaults)") in err
    # (m is no directory here, nor in the hub cache: the checks against the base wait for train, and say so)
    assert "note: the base's config is not readable here (m: not in the hub cache (validate reads no network))" in err
    # The accept settings whose defaults follow the strategy stay unset (null) in the dump; the note resolves them.
    assert ("note: unset, so under distributed.strategy ddp: train.accept_prompts = 8, "
            "train.measure_accept_every = 4") in err
    assert main(["validate", str(r), "train.accept_prompts=3", "distributed.strategy=fsdp"]) == 0
    assert "under distributed.strategy fsdp: train.measure_accept_every = 0\n" in capsys.readouterr().err


def test_validate_checks_the_recipe_against_the_bases_config(tiny_base_dir, tmp_path, capsys):
    """Settings that train refused only after loading the base's weights (walk-through: validate passed them) are
    refused by validate from the base's config, the draft built on a meta-device copy of the base."""
    r = tmp_path / "r.yaml"
    r.write_text(f"base: {{name_or_path: {tiny_base_dir}}}\ndata: {{path: d.jsonl}}\noutput_dir: o\n")
    # (the tiny base: 2 layers, 32 wide, 4 attention heads, 2 key-value heads)
    refused = {("head.type=ssm", "head.ssm.hidden_size=63"): "hidden_size 63 must divide by num_attention_heads",
               ("head.type=ssm", "head.ssm.num_layers=3", "head.ssm.init=truncate"):
                   "head.ssm.init=truncate: the SSM has 3 layers, the base only 2",
               ("head.type=dflash", "head.dflash.layers=[1,3]"): "head.dflash.layers [1, 3]: DFlash reads the "
                                                                 "outputs of this base's 2 decoder layers",
               ("head.type=eagle3", "head.eagle.layers=[0,1,2]"): "head.eagle.layers [0, 1, 2]: EAGLE-3 reads three",
               ("lora.target_modules=[qproj]",): "lora.target_modules ['qproj']: no module of the base has that name "
                                                 "(its layers: embed_tokens, q_proj, k_proj",
               ("head.type=ssm", "ensemble.members=2",
                "ensemble.architectures=[{},{hidden_size: 10, num_attention_heads: 4}]"):
                   "ensemble member 2: head.ssm: hidden_size 10 must divide"}
    for overrides, said in refused.items():
        assert main(["validate", str(r), *overrides]) == 2, overrides
        out, err = capsys.readouterr()
        assert said in err and "1 problem" in err and out == "", overrides
    # What train would take with a warning is a note.
    assert main(["validate", str(r), "lora.target_modules=[q_proj,qproj]"]) == 0
    assert "the adapter goes on the others only" in capsys.readouterr().err
    assert main(["validate", str(r), "head.type=dflash"]) == 0
    assert "note: DFlash on this 2-layer base reads layers [1, 1, 1, 1, 1], which repeat" in capsys.readouterr().err
    for fine in (["head.type=ssm", "head.ssm.hidden_size=16"], ["head.type=eagle3"], ["head.type=hydra"], []):
        assert main(["validate", str(r), *fine]) == 0, fine
        assert "problem" not in capsys.readouterr().err
    # data.max_len past the base's context (512 positions; the default max_len is 2048) is said, here and at train
    # with the examples that pass it (a 512-position base under the default trained past it in silence)
    assert main(["validate", str(r)]) == 0
    assert "note: data.max_len 2048 is above the base's context (512 tokens): examples longer than that would train " \
        "past it; set data.max_len: 512" in capsys.readouterr().err
    assert main(["validate", str(r), "data.max_len=512"]) == 0
    assert "above the base's context" not in capsys.readouterr().err
    from transformers import AutoConfig

    from draftlab.config import load_recipe
    from draftlab.data import Examples
    from draftlab.train.loop import over_context

    config, recipe = AutoConfig.from_pretrained(tiny_base_dir), load_recipe(str(r), [])
    ex = Examples.of([([1] * n, [1] * n) for n in (10, 513, 600)])
    assert over_context(recipe, config, ex, ex[:1]).startswith("2 examples are longer than the base's context (512 "
                                                               "tokens; data.max_len is 2048)")
    assert over_context(recipe, config, ex[:1]) is None
    config.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}  # (NTK scaling: no limit)
    assert over_context(recipe, config, ex) is None
    # A Gemma-2 base's config alone (no weights): the engines' EAGLE-3 targets; its soft cap is one train takes.
    from transformers import Gemma2Config

    gemma = tmp_path / "gemma2"
    Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, architectures=["Gemma2ForCausalLM"]).save_pretrained(gemma)
    assert main(["validate", str(r), f"base.name_or_path={gemma}", "head.type=eagle3"]) == 0
    assert "note: vLLM 0.34.0 and SGLang 0.5.23 do not capture EAGLE-3's layers from a Gemma2ForCausalLM target" in \
        capsys.readouterr().err
    # A base whose config lacks what a kind reads (GPT-2: no intermediate_size) is a note, as train would stop
    # there, not validate's traceback (review); a directory without a config.json is said to be so.
    from transformers import GPT2Config

    GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64).save_pretrained(tmp_path / "gpt2")
    assert main(["validate", str(r), f"base.name_or_path={tmp_path / 'gpt2'}", "head.type=ssm"]) == 0
    assert "note: the ssm draft could not be built on this base's shape (AttributeError:" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["validate", str(r), f"base.name_or_path={tmp_path / 'empty'}"]) == 0
    assert f"({tmp_path / 'empty'}: its config.json cannot be read (" in capsys.readouterr().err


def test_generate_json_compare(tiny_base_dir, tmp_path, capsys):
    from draftlab.base import load_base
    from draftlab.interop.export import save_export
    from draftlab.drafters import build_draft

    base, _ = load_base(str(tiny_base_dir), "float32")
    draft = build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base)
    save_export(draft, base, tmp_path / "exp", str(tiny_base_dir))
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once upon", "--max-new-tokens", "12",
                 "--compare", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("text", "new_tokens", "steps", "accept_length", "tokens_per_s", "baseline_tokens_per_s", "speedup"):
        assert key in rep
    assert rep["identical_to_baseline"] is True and rep["new_tokens"] == 12
    assert rep["new_tokens"] == 1 + round(rep["steps"] * rep["accept_length"])  # the prefill's token, then the steps'
    assert rep["speedup"] == pytest.approx(rep["tokens_per_s"] / rep["baseline_tokens_per_s"], rel=1e-2)
    # Typical acceptance at temperature 0 is greedy's rule, exact as documented: compared like greedy (walk-through).
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once upon", "--max-new-tokens", "12", "--typical",
                 "--compare", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["identical_to_baseline"] is True
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "x", "--tree", "chain", "--temperature", "0.7",
                 "--top-p", "0.9", "--json"]) == 0
    assert main(["generate", str(tmp_path), "--prompt", "x", "--json"]) == 2
    assert "not a draftlab export" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    # --stream prints one text: with two prompts the rows' tokens interleaved in one stream (walk-through)
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "a", "--prompt", "b", "--stream"]) == 2
    assert "--stream prints one text as it is committed: give one --prompt (got 2)" in capsys.readouterr().err
    # Past the base's positions it writes noise, and generate said nothing of it (walk-through)
    from draftlab.serve import generate as serve_generate

    with pytest.MonkeyPatch.context() as m, pytest.warns(UserWarning, match="--max-new-tokens 12 pass the base's 10"):
        m.setattr(serve_generate, "base_context", lambda base: 10)
        assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once upon", "--max-new-tokens", "12"]) == 0
    from draftlab.drafters.base import base_context

    assert base_context(load_base(str(tiny_base_dir), "float32")[0]) == 512
    # A speedup over compiled plain decoding above the accept length is the baseline's noise, and is said to be (one
    # run printed 8.40x on a shared machine; walk-through); with several prompts the rows' lengths differ, so no
    # such bound holds and nothing is said.
    from draftlab.cli import generate as cli_generate

    real = cli_generate.run_generate
    fake = lambda *a, **k: {**real(*a, **k), "speedup_vs_compiled_plain": 8.4, "compiled_plain_tokens_per_s": 1.0}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cli_generate, "run_generate", fake)
        for prompts, said in ((["--prompt", "Once upon"], True), (["--prompt", "a", "--prompt", "b"], False)):
            assert main(["generate", str(tmp_path / "exp"), *prompts, "--max-new-tokens", "12", "--compare"]) == 0
            err = capsys.readouterr().err
            assert ("note: a speedup of 8.40x over compiled plain decoding, above the accept length" in err) == said
            assert "speedup 8.40x over compiled plain decoding" in err


def test_a_half_precision_difference_from_plain_greedy_is_explained(tiny_base_dir, tmp_path, capsys, monkeypatch):
    """In bfloat16 a tree's forward rounds otherwise than a one-token step, and near-ties part the two greedy paths:
    `identical to plain greedy: False` said nothing more (a walk-through's Qwen3 on a CPU); it names why and the fix."""
    import draftlab.cli.generate as cli_generate
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, _ = load_base(str(tiny_base_dir), "float32")
    save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "exp",
                str(tiny_base_dir))
    real = cli_generate.run_generate
    monkeypatch.setattr(cli_generate, "run_generate", lambda *a, **k: {**real(*a, **k), "identical_to_baseline": False})
    for dtype, said in (("bfloat16", True), ("float32", False)):
        assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--max-new-tokens", "4", "--compare",
                     "--dtype", dtype]) == 0
        err = capsys.readouterr().err
        assert "identical to plain greedy: False" in err
        assert ("(in bfloat16 a forward over a tree rounds otherwise" in err and "`--dtype float32`" in err) == said


def test_compare_gives_hf_generate_the_same_batch(tiny_base_dir, tmp_path, monkeypatch):
    """--compare with several prompts times HF generate on the batch draftlab decodes, in one left-padded call, not
    one prompt a call (walk-through: a tree that drafts nothing read 2.89x on four prompts, batching's gain); the
    padded rows give each prompt's own greedy tokens."""
    from draftlab.base import load_base
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.serve.generate import encode_prompt, plain_generate, run_generate

    base, tok = load_base(str(tiny_base_dir), "float32")
    prompts = ["Once upon a time there was", "Lily", "The dog ran to the big park and"]
    calls = []
    real = base.generate
    monkeypatch.setattr(base, "generate", lambda ids, **kw: calls.append(ids.shape[0]) or real(ids, **kw))
    rep = run_generate(SpeculativeDecoder(base, NoDraft()), tok, prompts, max_new_tokens=10, compare=True)
    assert calls == [3, 3] and rep["identical_to_baseline"] is True  # (a warm-up, then the timed call)
    ids = [encode_prompt(tok, p, False) for p in prompts]
    assert len({len(i) for i in ids}) == 3
    calls.clear()
    alone = plain_generate(base, ids, 10, Sampling(), tok.eos_token_id)[0]
    assert calls == [1, 1, 1] and alone == plain_generate(base, ids, 10, Sampling(), tok.eos_token_id, batched=True)[0]


def test_error_paths_found_by_the_review(tiny_base_dir, tmp_path, capsys):
    """What a new user hits first: a damaged export, a base path that does not exist, nonsensical lengths."""
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, _ = load_base(str(tiny_base_dir), "float32")
    save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "e",
                str(tiny_base_dir))
    (tmp_path / "e" / "draft.safetensors").write_bytes(b"\0" * 16)
    assert main(["generate", str(tmp_path / "e"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "draft.safetensors: damaged or truncated" in err and "Export again" in err and "Traceback" not in err
    save_export(build_draft({"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}}, base), base,
                tmp_path / "s", str(tiny_base_dir))
    weights = tmp_path / "s" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])  # (an SSM's file: safetensors' own error, a traceback before)
    assert main(["generate", str(tmp_path / "s"), "--prompt", "x"]) == 2
    assert "the SSM's Hugging Face files do not load" in (err := capsys.readouterr().err) and "Traceback" not in err
    assert main(["generate", str(tmp_path / "e"), "--prompt", "x", "--base", str(tmp_path / "nope")]) == 2
    assert "no such directory (from " in (err := capsys.readouterr().err) and "a hub id looks like org/name" in err
    # A bare name (a hub id, or a directory not here) offline, not in the cache: said so, not "check your internet
    # connection" after retries (walk-through)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        m.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        import huggingface_hub.constants as hub

        m.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
        m.chdir(tmp_path)
        assert main(["generate", str(tmp_path / "e"), "--prompt", "x", "--base", "nobase"]) == 2
    err = capsys.readouterr().err
    assert "--base='nobase': no such directory here" in err or "name_or_path='nobase': no such directory here" in err
    assert "as a hub id it is not in the hub cache" in err and "HF_HUB_OFFLINE is set" in err
    with pytest.raises(SystemExit) as e:
        main(["generate", str(tmp_path / "e"), "--prompt", "x", "--max-new-tokens", "0"])
    assert e.value.code == 2 and "0 is not >= 1" in capsys.readouterr().err


def test_a_device_this_machine_lacks_and_a_dynamic_tree_on_heads_are_named(tiny_base_dir, tmp_path, capsys):
    """--device cuda:3 on a machine without CUDA ended in torch's assertion, and --tree dynamic:... on a heads
    export in an AttributeError (found by a new user's walkthrough): both are named with what to do instead."""
    import torch

    from draftlab.base import load_base
    from draftlab.cli import main
    from draftlab.drafters import build_draft, make_drafter
    from draftlab.decode.tree import DynamicTree, TreeError
    from draftlab.interop.export import save_export

    base, _ = load_base(str(tiny_base_dir), "float32")
    save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "exp",
                str(tiny_base_dir))
    if not torch.cuda.is_available():
        assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--device", "cuda:3"]) == 2
        assert "--device cuda:3: this machine has no CUDA device" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--device", "gpu"]) == 2
    assert "--device 'gpu': not a device name; use cpu, cuda, cuda:N or mps" in capsys.readouterr().err
    with pytest.raises(TreeError, match="dynamic trees are built by eagle3 drafters"):
        make_drafter(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), DynamicTree(3, 8, 25))
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--tree", "dynamic:3,8,25"]) == 2
    assert "dynamic trees are built by eagle3 drafters" in capsys.readouterr().err
    # A rank past the vocabulary, ensemble options on another kind, and lookup given a tree or a bad length are one
    # line each, exit 2 (walk-through: torch's index error, a TypeError, silence, and int()'s message).
    vocab = base.get_output_embeddings().weight.shape[0]
    long = "{paths: [" + ", ".join(["[0]", "[1]"] + [f"[0, {i}]" for i in range(60)]) + "]}"  # (past 255 chars:
    assert len(long) > 255  # a file-name check raised ENAMETOOLONG, a traceback: review)
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--max-new-tokens", "4", "--tree", long]) == 0
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--tree", f"[[0], [{vocab}]]"]) == 2
    assert f"rank {vocab} asks for the draft's token of that rank, but it ranks {vocab}" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--ensemble-mode", "vote", "--length",
                 "3"]) == 2
    assert "--ensemble-mode, --length: options of ensemble exports; a medusa export takes none" in \
        capsys.readouterr().err
    assert main(["generate", "lookup", "--base", str(tiny_base_dir), "--prompt", "Once", "--tree", "chain:2"]) == 2
    assert "--tree chain:2: prompt lookup drafts one continuation" in capsys.readouterr().err
    assert main(["generate", "lookup:abc", "--base", str(tiny_base_dir), "--prompt", "Once"]) == 2
    assert "lookup:N takes the tokens per continuation, a positive integer" in capsys.readouterr().err
    # Flags that cannot apply together, or at all, were taken in silence (walk-through).
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--stream", "--json"]) == 2
    assert "--stream prints the text as it is committed, --json one object at the end" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["generate", str(tmp_path / "exp"), "--prompt", "Once", "--temperature", "-1"])
    assert e.value.code == 2 and "-1.0 is not >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # (DSI emulated negative latencies and printed them)
        main(["dsi", str(tmp_path / "exp"), "--prompt", "Once", "--target-latency-ms", "-5"])
    assert e.value.code == 2 and "-5.0 is not >= 0" in capsys.readouterr().err
    data = tmp_path / "d.txt"
    data.write_text("Once upon a time.\nThe dog ran.\n")
    assert main(["search-tree", str(tmp_path / "exp"), "--data", str(data), "--out", str(tmp_path / "t.json"),
                 "--schedule-by", "timed"]) == 2
    assert "--schedule-by timed: settings of a schedule; add --batch-sizes" in capsys.readouterr().err


def test_export_to_refuses_a_directory_with_files_unless_forced(tiny_base_dir, tmp_path, capsys):
    """export --to wrote over whatever --out held, silently (found by a new user's walkthrough)."""
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, _ = load_base(str(tiny_base_dir), "float32")
    save_export(build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base), base, tmp_path / "exp",
                str(tiny_base_dir))
    args = ["export", str(tmp_path / "exp"), "--to", "vllm-medusa", "--out", str(tmp_path / "v")]
    assert main(args) == 0
    assert main(args) == 2 and "holds files; export --to writes over them: pass --force" in capsys.readouterr().err
    assert main(args + ["--force"]) == 0
    assert main(args + ["--force", "--eval", str(tmp_path / "nope")]) == 2  # (was a card saying "not measured")
    assert f"--eval {tmp_path / 'nope'}: no summary.json there" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")  # a file: one line, not a FileExistsError traceback (walk-through)
    assert main(args[:-1] + [str(tmp_path / "f"), "--force"]) == 2
    assert f"--out {tmp_path / 'f'} is a file" in capsys.readouterr().err
    # import-medusa into an export wrote its files over the export's, which then said medusa (walk-through).
    imported = ["import-medusa", str(tmp_path / "v"), "--base", str(tiny_base_dir), "--out", str(tmp_path / "exp")]
    before = (tmp_path / "exp" / "draftlab.json").read_text()
    assert main(imported) == 2 and "holds files; import-medusa writes over them" in capsys.readouterr().err
    assert (tmp_path / "exp" / "draftlab.json").read_text() == before
    assert main(imported[:-1] + [str(tmp_path / "imp")]) == 0


def test_a_reader_that_goes_away_ends_a_command_quietly():
    """`draftlab recipes list --json | head` ended in a BrokenPipeError traceback (walk-through)."""
    p = subprocess.Popen([sys.executable, "-m", "draftlab.cli", "recipes", "list"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=REPO)
    p.stdout.close()  # (before the command has imported, let alone written)
    err = p.stderr.read().decode()
    assert p.wait(60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
    # Another pipe that broke inside a command is an error like any other, not a quiet 141 (review)
    code = ("import sys, draftlab.cli.simulate as s\n"
            "def broken(a): raise BrokenPipeError(32, 'a socket')\n"
            "s.simulate_command = broken\n"
            "from draftlab.cli import main\n"
            "sys.exit(main(['simulate', '--target-ms', '30', '--drafter-ms', '3', '--acceptance', '0.8']))")
    q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert q.returncode == 1 and "BrokenPipeError: [Errno 32] a socket" in q.stderr, q.stderr


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C printed a KeyboardInterrupt traceback (walk-through, `draftlab dsi`); now one line, the shell's 130."""
    import draftlab.cli.simulate as sim

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(sim, "simulate_command", interrupted)
    assert main(["simulate", "--target-ms", "30", "--drafter-ms", "3", "--acceptance", "0.8"]) == 130
    assert capsys.readouterr().err == "draftlab simulate: interrupted\n"
    # A command that resumes says what it kept (distill-data said "interrupted" alone: walk-through).
    import draftlab.train.distill as distill

    monkeypatch.setattr(distill, "distill_data", lambda *a, **k: interrupted(a))
    assert main(["distill-data", "base", "--prompts", "p.jsonl", "--out", "o.jsonl"]) == 130
    assert capsys.readouterr().err == ("draftlab distill-data: interrupted; the records written so far are kept: the "
                                       "same command again answers the rest\n")
    import draftlab.cli.eval as ev  # (with --overwrite the same command would start again: review)

    monkeypatch.setattr(ev, "eval_command", interrupted)
    assert main(["eval", "mt-bench", "exp", "--overwrite"]) == 130
    assert capsys.readouterr().err.endswith("; run it again without --overwrite, which would start again\n")


def test_draftlabs_warnings_read_as_one_line_of_the_command():
    """A CLI user reads draftlab's warnings as `draftlab COMMAND: warning: ...`, not Python's `file.py:61:
    UserWarning:` with the source line (walk-through); other libraries' keep Python's format, and main puts the
    format back when it returns."""
    import warnings

    import draftlab.cli
    from draftlab.cli import say_warnings

    before, ours = warnings.formatwarning, draftlab.cli.__file__
    previous = say_warnings("generate")
    try:
        assert warnings.formatwarning("tree chosen elsewhere", UserWarning, ours, 61) == \
            "draftlab generate: warning: tree chosen elsewhere\n"
        other = warnings.formatwarning("deprecated", FutureWarning, "/x/transformers/utils.py", 3)
        assert "FutureWarning: deprecated" in other and other.startswith("/x/transformers/utils.py:3")
        # another library's warning pointed at draftlab's line (stacklevel), or a folder that is only named draftlab
        assert "FutureWarning" in warnings.formatwarning("deprecated", FutureWarning, ours, 3)
        assert "UserWarning" in warnings.formatwarning("x", UserWarning, "/home/u/draftlab/.venv/lib/x.py", 3)
    finally:
        warnings.formatwarning = previous
    assert main(["simulate", "--target-ms", "30", "--drafter-ms", "3", "--acceptance", "0.8", "--json"]) == 0
    assert warnings.formatwarning is before
