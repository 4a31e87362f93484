import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import launch_train, tiny_llama
from draftlab.config import build_recipe, dump_recipe
from draftlab.interop.export import ExportError, load_export, read_meta
from draftlab.train import RunDirError, train
from draftlab.train.loop import rank_seed


MEDUSA = {"head": {"num_heads": 3, "num_layers": 1}}
# A 1-layer, half-width SSM built from the base's config, distilled with reverse KL mixed with CE.
SSM = {"head": {"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}},
       "loss": {"distill_weight": 0.7, "divergence": "rkl"}}
# EAGLE-3-style: three base layers, a 40-token draft vocabulary, the training-time test unrolled 3 steps.
EAGLE3 = {"head": {"type": "eagle3", "eagle": {"draft_vocab_size": 40, "ttt_steps": 3}}}
# Medusa-2: the heads with a LoRA adapter on the base (q/v projections), one heads-only warm-up step.
MEDUSA2 = {**MEDUSA, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"], "heads_warmup_steps": 1}}
# DFlash-style: one draft layer drafting blocks of 4 at 8 random anchors per sequence.
DFLASH = {"head": {"type": "dflash", "dflash": {"num_layers": 1, "block_size": 4, "num_anchors": 8}}}
KINDS = {"medusa": MEDUSA, "ssm": SSM, "eagle3": EAGLE3, "medusa2": MEDUSA2, "dflash": DFLASH}


def recipe(base_dir, data, out, kind="medusa", **train):
    t = {"lr": 1e-2, "warmup_steps": 1, "batch_size": 2, "max_steps": 4, "save_every_steps": 2,
         "eval_every_steps": 2, "log_every_steps": 1, **train}
    return build_recipe({"base": {"name_or_path": str(base_dir), "dtype": "float32"}, **KINDS[kind],
                         "data": {"path": str(data), "max_len": 64, "eval_size": 4},
                         "train": t, "output_dir": str(out)})


def weights(out: Path) -> dict:
    """The exported draft's tensors (heads: draft.safetensors; an SSM: its HF model.safetensors), and a Medusa-2
    export's adapter tensors (prefixed adapter.)."""
    heads = out / "export" / "draft.safetensors"
    w = load_file(heads if heads.is_file() else out / "export" / "model.safetensors")
    adapter = out / "export" / "adapter" / "adapter_model.safetensors"
    if adapter.is_file():
        w.update({f"adapter.{k}": v for k, v in load_file(adapter).items()})
    return w


@pytest.mark.parametrize("kind", ["medusa", "ssm", "eagle3", "medusa2", "dflash"])
def test_resume_equals_straight_run(tiny_base_dir, data_file, tmp_path, kind):
    # The accept figures' decoding (EAGLE-3 measures it at every evaluation) kept short: tests/test_train_accept.py
    # checks those figures; here they only have to be the same on both runs.
    short = {"accept_prompts": 2, "accept_max_new_tokens": 16}
    straight = train(recipe(tiny_base_dir, data_file, tmp_path / "a", kind, **short))
    assert straight["finished"] and straight["step"] == 4
    first = train(recipe(tiny_base_dir, data_file, tmp_path / "b", kind, **short), stop_after_steps=2)
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert not first["finished"] and state["rank_streams"] is True  # (a resume keeps each rank's restored stream)
    assert not (tmp_path / "b" / "export").exists()
    resumed = train(recipe(tiny_base_dir, data_file, tmp_path / "b", kind, **short))
    assert resumed["finished"]
    wa, wb = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    # The draft actually moved away from its initialisation.
    fresh = train(recipe(tiny_base_dir, data_file, tmp_path / "c", kind, max_steps=1, lr=1e-9, **short))
    w0 = weights(tmp_path / "c")
    assert fresh["finished"] and any((wa[k] - w0[k]).abs().max() > 1e-4 for k in wa)


def test_metrics_config_and_eval_are_written(tiny_base_dir, data_file, tmp_path):
    out = tmp_path / "run"
    summary = train(recipe(tiny_base_dir, data_file, out))
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["event"] == "start" and lines[0]["train_examples"] == 20
    train_lines = [l for l in lines if "loss" in l]
    assert [l["step"] for l in train_lines] == [1, 2, 3, 4]
    evals = [l for l in lines if l.get("event") == "eval"]
    assert len(evals) == 2 and len(evals[0]["top1"]) == 3 and all(t1 <= tk <= 1 for t1, tk in zip(evals[-1]["top1"], evals[-1]["topk"]))
    assert (out / "config.yaml").read_text() == dump_recipe(recipe(tiny_base_dir, data_file, out))
    assert summary["eval"]["top1"] == evals[-1]["top1"]
    # keep_checkpoints=2 by default: steps 2 and 4 remain
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_tokens_per_s_leaves_evaluations_out(tiny_base_dir, data_file, tmp_path, monkeypatch):
    """The first log record after an evaluation counted the evaluation's time in tokens_per_s (walk-through: 3178,
    then 119.8 right after an eval, then 3048). A clock that jumps 1000 s in each evaluation must not show."""
    import time
    from types import SimpleNamespace

    import draftlab.train.loop as loop

    jump = [0.0]
    clock = SimpleNamespace(perf_counter=lambda: time.perf_counter() + jump[0], time=time.time)
    real = loop.evaluate_run

    def slow_eval(run, step):
        jump[0] += 1000.0
        return real(run, step)
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(loop, "evaluate_run", slow_eval)
    out = tmp_path / "run"
    train(recipe(tiny_base_dir, data_file, out, log_every_steps=1))
    rates = [json.loads(l).get("tokens_per_s") for l in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r for r in rates if r is not None]
    assert len(rates) == 4 and jump[0] == 2000.0 and min(rates) > 1.0, rates  # (a step is at most 128 tokens)


def test_run_dir_refuses_a_different_recipe(tiny_base_dir, data_file, tmp_path):
    out = tmp_path / "run"
    train(recipe(tiny_base_dir, data_file, out, max_steps=2))
    with pytest.raises(RunDirError, match=r"train.lr: 0.01 -> 0.5.*--overwrite"):
        train(recipe(tiny_base_dir, data_file, out, max_steps=2, lr=0.5))
    # Extending max_steps is a resume, not a different run.
    assert train(recipe(tiny_base_dir, data_file, out, max_steps=3))["step"] == 3
    assert train(recipe(tiny_base_dir, data_file, out, lr=0.5, max_steps=2), overwrite=True)["step"] == 2


def test_only_the_first_process_wipes_an_overwritten_run(tiny_base_dir, data_file, tmp_path, monkeypatch):
    """--overwrite wiped the run directory in every process, before the process group exists: a late process
    could delete the config and metrics the first had written since (found by review). RANK 0 alone wipes."""
    from draftlab.train.run_dir import prepare_run_dir

    out = tmp_path / "run"
    r = recipe(tiny_base_dir, data_file, out, max_steps=2)
    train(r)
    monkeypatch.setenv("RANK", "1")
    prepare_run_dir(r, overwrite=True)
    assert (out / "config.yaml").is_file() and (out / "checkpoints" / "step_2").is_dir()
    monkeypatch.setenv("RANK", "0")
    prepare_run_dir(r, overwrite=True)
    assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()


def test_a_run_saved_with_a_setting_its_head_type_never_read_resumes(tiny_base_dir, data_file, tmp_path):
    """A config.yaml written before unread settings were refused (an EAGLE-3 run with head.num_heads: 3) failed
    validation when read back, so the run could not resume without --overwrite; the unread setting is dropped."""
    import yaml

    from draftlab.config import build_recipe
    from draftlab.train.run_dir import RunDirError, prepare_run_dir, write_run_config

    out = tmp_path / "run"
    r = recipe(tiny_base_dir, data_file, out)
    r = build_recipe({**r.model_dump(mode="json"), "head": {"type": "eagle3"}})
    write_run_config(out, r)
    (out / "export").mkdir()  # (a run that trained)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    saved["head"]["num_heads"], saved["loss"]["distill_weight"] = 3, 0.5
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    assert prepare_run_dir(r, overwrite=False) == out
    saved["train"]["lr"] = 0.5  # (a setting it reads still makes another run)
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(RunDirError, match="different recipe .*train.lr"):
        prepare_run_dir(r, overwrite=False)


def test_export_round_trip_and_base_mismatch(tiny_base_dir, data_file, tmp_path):
    from draftlab.base import load_base

    out = tmp_path / "run"
    train(recipe(tiny_base_dir, data_file, out, max_steps=1))
    meta = read_meta(out / "export")
    assert meta["format_version"] == 1 and meta["head"]["num_heads"] == 3
    assert meta["base"]["hidden_size"] == 32 and meta["base"]["dtype"] == "float32"
    base, _ = load_base(str(tiny_base_dir), "float32")
    draft, _ = load_export(out / "export", base=base)
    sd = weights(out)
    for k, v in draft.state_dict().items():
        torch.testing.assert_close(v, sd[k])
    other = tiny_llama(vocab=base.config.vocab_size, hidden=48, dtype=torch.float32)
    with pytest.raises(ExportError, match=r"hidden_size: export has 32, base has 48"):
        load_export(out / "export", base=other)
    with pytest.raises(ExportError, match="not a draftlab export"):
        read_meta(tmp_path)
    with pytest.raises(ExportError, match=r"did you mean .*/export \(the run's export\)"):  # the run directory
        read_meta(out)


def test_tensorboard_and_wandb_offline_trackers(tiny_base_dir, data_file, tmp_path):
    trackers = ["tensorboard"]
    try:
        import wandb  # noqa: F401
        trackers.append("wandb")
    except ImportError:
        pass
    out = tmp_path / "run"
    r = build_recipe({**recipe(tiny_base_dir, data_file, out, max_steps=2).model_dump(mode="json"),
                      "log": {"trackers": trackers}})
    os.environ["WANDB_DIR"] = str(tmp_path)
    train(r)
    assert list((out / "logs").rglob("events.out.tfevents*"))
    if "wandb" in trackers:
        assert list(tmp_path.rglob("offline-run-*"))


@pytest.mark.slow  # two-process launches; CI runs the slow tests
@pytest.mark.parametrize("kind", ["medusa", "ssm", "eagle3", "medusa2", "dflash"])
def test_two_process_accelerate_launch(tiny_base_dir, data_file, tmp_path, kind):
    out = tmp_path / "ddp"
    cfg = tmp_path / "r.yaml"
    trackers = ["tensorboard"] + (["wandb"] if importlib.util.find_spec("wandb") else [])
    cfg.write_text(dump_recipe(build_recipe({**recipe(tiny_base_dir, data_file, out, kind, max_steps=2).model_dump(mode="json"),
                                             "log": {"trackers": trackers}})))
    site = tmp_path / "site"  # each worker writes the seed of its torch generator as it exits
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, os\n"
        "def _seed():\n"
        "    import torch\n"
        "    f = os.path.join(os.environ['SEED_DIR'], 'seed' + os.environ['RANK'])\n"
        "    open(f, 'w').write(str(torch.initial_seed()))\n"
        "if 'LOCAL_RANK' in os.environ:\n"
        "    atexit.register(_seed)\n")
    p = launch_train(cfg, processes=2, json_out=True, timeout=300, env={
        "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "SEED_DIR": str(tmp_path),
        "PYTHONPATH": f"{site}{os.pathsep}{Path(__file__).parents[1]}"})
    assert p.returncode == 0, p.stderr[-3000:]
    # Dropout and DFlash's anchors draw from each rank's own stream (they drew the same on every rank).
    seeds = {r: int((tmp_path / f"seed{r}").read_text()) for r in (0, 1)}
    assert seeds[0] == 0 and seeds[1] == rank_seed(0, 1) != 0
    start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert start["processes"] == 2
    assert weights(out)
    # Trackers log from the main process only: tensorboard files from one process id, one wandb run.
    events = list((out / "logs").rglob("events.out.tfevents*"))  # events.out.tfevents.TIME.HOST.PID.N
    assert events and len({e.name.split(".")[-2] for e in events}) == 1
    if "wandb" in trackers:
        assert len(list(tmp_path.rglob("offline-run-*"))) == 1


@pytest.mark.slow  # two two-process launches
def test_two_nodes_keep_a_hidden_state_cache_each(tiny_base_dir, data_file, tmp_path):
    """Across nodes every node's first process makes the cache its node reads (found by review: only global rank 0
    made it, so a node-local cache_dir was missing on the other nodes, and on a shared file system the nodes would
    share one memory map, which machines do not keep coherent). Two nodes are played by two processes whose host
    names differ; the weights are those of the same run on one node."""
    r = recipe(tiny_base_dir, data_file, tmp_path / "x", max_steps=None, epochs=2, eval_every_steps=1000,
               save_every_steps=1000, cache_hidden=True)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, socket\n"
                                           "socket.gethostname = lambda: 'host' + os.environ.get('RANK', '0')\n")
    runs = {}
    for name, env in (("one", {}), ("two", {"PYTHONPATH": f"{site}{os.pathsep}{Path(__file__).parents[1]}"})):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(dump_recipe(build_recipe({**r.model_dump(mode="json"), "output_dir": str(tmp_path / name)})))
        p = launch_train(cfg, processes=2, env=env)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        runs[name] = tmp_path / name
    assert (runs["one"] / "hidden_cache" / "meta.json").is_file()
    assert not (runs["two"] / "hidden_cache" / "meta.json").exists()
    for node in ("node0", "node1"):
        assert (runs["two"] / "hidden_cache" / node / "meta.json").is_file()
    wa, wb = weights(runs["one"]), weights(runs["two"])
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["medusa", "eagle3", "dflash"])  # eagle3 / dflash cache their layers and the final state
def test_hidden_state_cache_skips_the_base_in_later_epochs(tiny_base_dir, data_file, tmp_path, monkeypatch, kind):
    import draftlab.train.loop as train_mod

    calls = {"n": 0}
    real = train_mod.base_features

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)
    monkeypatch.setattr(train_mod, "base_features", counting)
    # 24 training examples (no held-out split), batch 2 -> 12 micro-batches per epoch; 3 epochs.
    r = recipe(tiny_base_dir, data_file, tmp_path / "c", kind, max_steps=None, epochs=3, eval_every_steps=1000,
               save_every_steps=1000, cache_hidden=True)
    r = build_recipe({**r.model_dump(mode="json"), "data": {**r.data.model_dump(), "eval_size": 0}})
    train(r)
    assert calls["n"] == 12  # only the first epoch ran the base
    calls["n"] = 0
    train(build_recipe({**r.model_dump(mode="json"), "output_dir": str(tmp_path / "p"),
                                "train": {**r.train.model_dump(), "cache_hidden": False}}))
    assert calls["n"] == 36
    wa, wb = weights(tmp_path / "c"), weights(tmp_path / "p")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    meta = json.loads((tmp_path / "c" / "hidden_cache" / "meta.json").read_text())
    width = 32 * {"eagle3": 4, "dflash": 2}.get(kind, 1)  # H = 32; eagle3: three layers and the final state
    assert (tmp_path / "c" / "hidden_cache" / "hidden.bin").stat().st_size == meta["tokens"] * width * 4  # fp32


def test_a_recipe_s_chat_template_trains_exports_and_serves(tiny_base_dir, data_file, tmp_path):
    """base.chat_template (Vicuna ships no template: it trained with draftlab's User:/Assistant: fallback, while
    it is served in FastChat's format): training renders with it, the export keeps it, and draftlab serves with it;
    `check` names the file an engine is to be given."""
    from draftlab.base import VICUNA_CHAT_TEMPLATE, load_tokenizer
    from draftlab.data import tokenize_chat
    from draftlab.interop.check import check_export
    from draftlab.serve.generate import load_decoder

    r = recipe(tiny_base_dir, data_file, tmp_path / "r", max_steps=1)
    vic = build_recipe({**r.model_dump(mode="json"), "base": {**r.base.model_dump(), "chat_template": "vicuna"},
                        "data": {**r.data.model_dump(), "max_len": 256}})  # (the system line: ~150 byte tokens)
    summary = train(vic)
    export = Path(summary["export"])
    assert (export / "chat_template.jinja").read_text() == VICUNA_CHAT_TEMPLATE
    _, tok, _ = load_decoder(str(export), device="cpu")
    assert tok.chat_template == VICUNA_CHAT_TEMPLATE
    assert load_tokenizer(str(tiny_base_dir)).chat_template != VICUNA_CHAT_TEMPLATE  # (the base's own differs)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    ids, mask = tokenize_chat(msgs, tok, 512)
    assert tok.decode([t for t, m in zip(ids, mask) if m]).strip() == "Hello there" + tok.eos_token
    assert "USER: Hi ASSISTANT:" in tok.decode(ids)
    report = check_export(str(export), engine="vllm")
    line = next(c for c in report["checks"] if c["name"] == "tokenizer")
    # The served tokenizer is compared as the export says to serve it, with that file as its template (named)
    assert line["ok"] is True and "chat_template.jinja, which the engine must be given" in line["message"], line
    with pytest.raises(ValueError, match="base.chat_template='vicunaa': not a built-in template"):
        train(build_recipe({**vic.model_dump(mode="json"), "output_dir": str(tmp_path / "bad"),
                            "base": {**vic.base.model_dump(), "chat_template": "vicunaa"}}))
    assert not (tmp_path / "bad").exists()


def test_the_vicuna_template_renders_fastchat_s_format():
    """FastChat's vicuna_v1.1: system, a space, "USER: q ASSISTANT: a</s>" per turn, "ASSISTANT:" to generate."""
    from jinja2 import Template

    from draftlab.base import VICUNA_CHAT_TEMPLATE, VICUNA_SYSTEM

    render = lambda msgs, gen: Template(VICUNA_CHAT_TEMPLATE).render(
        messages=msgs, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "More?"}]
    assert render(msgs, True) == f"<s>{VICUNA_SYSTEM} USER: Hi ASSISTANT: Hello</s>USER: More? ASSISTANT:"
    assert render([{"role": "system", "content": "Be brief."}] + msgs[:1], True) == "<s>Be brief. USER: Hi ASSISTANT:"


def test_tokenized_examples_are_kept_for_resume_and_made_again_when_an_input_changes(tiny_base_dir, data_file,
                                                                                    tmp_path, monkeypatch):
    """Every process of a launch tokenized the whole data set, and so did every resume (minutes for 100k
    conversations). The main process now writes the examples to OUTPUT_DIR/tokenized once; the others and every
    resume read them, unless the data, the data section or the tokenizer changed."""
    import shutil

    import draftlab.train.examples_cache as ec
    from draftlab.base import load_tokenizer
    from draftlab.data import load_examples

    data = tmp_path / "d.jsonl"
    shutil.copy(data_file, data)
    r = recipe(tiny_base_dir, data, tmp_path / "r")
    assert not train(r, stop_after_steps=2)["finished"]
    [f] = (tmp_path / "r" / "tokenized").glob("*.npz")
    tok = load_tokenizer(str(tiny_base_dir))
    assert ec.read_examples(f) == load_examples(r.data, tok, seed=r.train.seed)  # (examples and counts, exactly)
    calls = []
    monkeypatch.setattr(ec, "load_examples", lambda *a, **k: calls.append(1) or load_examples(*a, **k))
    assert train(r)["finished"] and calls == []  # the resume read the file

    class Alone:
        is_main_process = True

        def wait_for_everyone(self):
            pass

    out = tmp_path / "r"
    assert ec.cached_examples(r.data, tok, r.train.seed, out, Alone()) == ec.read_examples(f) and calls == []
    data.write_text(data.read_text() + json.dumps({"conversations": [{"from": "human", "value": "One more?"},
                                                                     {"from": "gpt", "value": "Yes."}]}) + "\n")
    train_ex, _, _ = ec.cached_examples(r.data, tok, r.train.seed, out, Alone())
    assert calls == [1] and len(train_ex) == 21 and [p.name for p in (out / "tokenized").glob("*.npz")] != [f.name]
    tok.chat_template = tok.chat_template.replace("User: ", "Q: ")
    ec.cached_examples(r.data, tok, r.train.seed, out, Alone())
    assert calls == [1, 1] and len(list((out / "tokenized").glob("*.npz"))) == 1  # (the older key's file removed)
    ec.cached_examples(r.data.model_copy(update={"max_len": 32}), tok, r.train.seed, out, Alone())
    assert calls == [1, 1, 1]


def test_a_step_s_objective_does_not_depend_on_batch_size_and_accumulation(tiny_base_dir, tmp_path):
    """One optimizer step over the same four conversations, answers of 8 and of 200 characters, as batch 4, as 2 x 2
    accumulated and as 1 x 4: the same gradient and logged loss. Each micro-batch's mean loss divided by
    grad_accum_steps made a token of a short answer weigh many times one of a long answer, so the layout changed the
    objective (found by review: gradient norms 1.047, 1.330 and 1.649 in a run like this one). Ranks take the same
    shares (window_shares, one all-reduce a step; the two-process launch runs it)."""
    from conftest import STORY_TEXT

    data = tmp_path / "uneven.jsonl"
    data.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"Tell me about cat {i}."},
        {"from": "gpt", "value": STORY_TEXT[i * 7: i * 7 + (200 if i % 2 else 8)]}]}) + "\n" for i in range(12)))
    seen = []
    for batch, ga in ((4, 1), (2, 2), (1, 4)):
        out = tmp_path / f"b{batch}x{ga}"
        r = recipe(tiny_base_dir, data, out, batch_size=batch, grad_accum_steps=ga, max_steps=1, max_grad_norm=1e9,
                   warmup_steps=0, eval_every_steps=100, save_every_steps=100)
        train(build_recipe({**r.model_dump(mode="json"), "data": {"path": str(data), "max_len": 128,
                                                                   "eval_size": 0}}))
        rec = next(json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"grad_norm"' in l)
        seen.append((rec["grad_norm"], rec["loss"]))
    for grad_norm, loss in seen[1:]:
        assert grad_norm == pytest.approx(seen[0][0], rel=1e-5) and loss == pytest.approx(seen[0][1], rel=1e-5)


def test_a_step_the_fp16_loss_scaler_skipped_leaves_the_schedule_where_it_was():
    """On an fp16 overflow the optimizer skips its step; the learning-rate schedule (a plain LambdaLR, which
    Accelerate's wrapper would not guard) stepped anyway, so warm-up lost those steps (found by review)."""
    from types import SimpleNamespace

    from draftlab.train.loop import optimizer_step

    stepped = []
    for skipped in (True, False):
        opt = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None, step_was_skipped=skipped)
        run = SimpleNamespace(recipe=SimpleNamespace(train=SimpleNamespace(max_grad_norm=0)), optimizer=opt,
                              scheduler=SimpleNamespace(step=lambda: stepped.append(skipped)))
        optimizer_step(run)
    assert stepped == [False]


def test_the_logged_loss_and_top1_are_every_rank_s():
    """The log record's loss and train_top1 were rank 0's alone (found by review: at 64 GPUs, a curve of 1/64 of
    the data). They are now averaged (loss) and summed (top-1 counts) over the ranks."""
    from types import SimpleNamespace

    from draftlab.train.loop import Window

    other = {"loss": torch.tensor([3.0], dtype=torch.float64), "top": torch.tensor([[1.0, 0.0], [4.0, 4.0]])}

    def reduce(t, reduction):  # rank 1's figures beside this rank's
        return (t + other["loss"]) / 2 if reduction == "mean" else t + other["top"]

    acc = SimpleNamespace(device=torch.device("cpu"), num_processes=2, reduce=reduce)
    w = Window()
    w.add(1.0, 10)
    w.add(2.0, 10)
    w.n = 2
    rec = w.record(4, 1.0, 1e-3, {"top1": torch.tensor([3.0, 1.0]), "count": torch.tensor([4.0, 4.0])}, None, acc)
    assert rec["loss"] == 2.25 and rec["train_top1"] == [0.5, 0.125]  # (1.5 + 3) / 2; (3 + 1) / 8, (1 + 0) / 8
    alone = Window()
    alone.add(1.0, 10)
    alone.n = 1
    assert alone.record(1, 0.1, 1e-3, {"top1": torch.tensor([1.0]), "count": torch.tensor([2.0])}, None,
                        SimpleNamespace(device=torch.device("cpu"), num_processes=1))["loss"] == 1.0


def test_collectives_wait_as_long_as_the_recipe_says(tiny_base_dir, data_file, tmp_path, monkeypatch):
    """The other processes wait in a collective while the main one tokenizes, loads a sharded base or exports;
    NCCL's default (10 minutes) failed such runs. distributed.timeout_minutes sets the process group's timeout."""
    from datetime import timedelta

    import accelerate

    seen = {}

    class Started(Exception):
        pass

    def accelerator(**kw):
        seen.update(kw)
        raise Started

    monkeypatch.setattr(accelerate, "Accelerator", accelerator)
    r = recipe(tiny_base_dir, data_file, tmp_path / "r")
    with pytest.raises(Started):
        train(build_recipe({**r.model_dump(mode="json"), "distributed": {"timeout_minutes": 90}}))
    [init] = [h for h in seen["kwargs_handlers"] if type(h).__name__ == "InitProcessGroupKwargs"]
    assert init.timeout == timedelta(minutes=90)


def test_a_missing_data_file_is_named_without_asking_the_hub(tiny_base_dir, tmp_path):
    """A data.path like runs/x.jsonl that does not exist went to the hub (25 s of retries, then a traceback) when
    the tokenized-examples cache keyed it (found by a new user's walkthrough): it is refused at once by name."""
    from draftlab.data import DataError

    r = recipe(tiny_base_dir, "runs/nowhere-self.jsonl", tmp_path / "r")
    with pytest.raises(DataError, match=r"data.path='runs/nowhere-self.jsonl': no such file or folder"):
        train(r)
    # The run directory it left holds nothing trained: the fixed recipe starts there (it was refused as "a run made
    # with a different recipe").
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"Cat {i}?"},
                                                          {"from": "gpt", "value": "A cat story."}]}) + "\n"
                            for i in range(12)))
    assert train(recipe(tiny_base_dir, data, tmp_path / "r", max_steps=1))["finished"]


def test_train_stop_after_steps_says_where_it_stopped(tiny_base_dir, data_file, tmp_path, capsys):
    """`train --stop-after-steps N` ended with status 0 and no word (walk-through): it says the step, and how to
    resume."""
    from draftlab.cli import main
    from draftlab.config import dump_recipe

    path = tmp_path / "r.yaml"
    path.write_text(dump_recipe(recipe(tiny_base_dir, data_file, tmp_path / "r")))
    assert main(["train", str(path), "train.max_steps=6", "--stop-after-steps", "5"]) == 0
    assert (f"stopped at step 5 of 6 (--stop-after-steps), after a checkpoint; `draftlab train {path} "
            "train.max_steps=6` (without --overwrite) resumes it") in capsys.readouterr().out
    # Resumed as the message said before, the recipe alone, without its override: 5 steps of 4, "finished" at once
    # and exported (walk-through). Refused, naming what to give again.
    assert main(["train", str(path)]) == 2
    assert "step_5 was saved at step 5 of 6, past the 4 steps this recipe trains" in capsys.readouterr().err
    assert main(["train", str(path), "train.max_steps=6"]) == 0
    assert "export written to" in capsys.readouterr().out
