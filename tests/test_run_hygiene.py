"""Kill, stop and resume: a run killed (SIGKILL) or asked to stop (STOP file, SIGTERM) at any point resumes
to the same final weights as a run that was never interrupted; half-written checkpoints never load."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO
from draftlab.interop.export import read_meta
from test_train import recipe, weights
from draftlab.config import dump_recipe
from draftlab.train import train
from draftlab.train.run_dir import latest_checkpoint

STEPS = 60


def launch(cfg, tmp_path, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "draftlab.cli", "train", str(cfg), *overrides], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(out, step, proc, timeout=120):
    """Block until metrics.jsonl shows `step` (the process is then somewhere in the following steps)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        f = out / "metrics.jsonl"
        if f.is_file() and any(json.loads(l).get("step", 0) >= step for l in f.read_text().splitlines()[1:]
                               if l.strip().endswith("}")):
            return
        assert proc.poll() is None, proc.stdout.read()[-2000:]
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached")


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """In-process training here uses the one thread the killed subprocesses use (OMP_NUM_THREADS=1): with another
    count, float reductions run in another order and weights agree only to ~1e-4, not bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def straight_runs(tiny_base_dir, data_file, tmp_path_factory):
    """Uninterrupted runs per draft kind, made on first use."""
    made = {}

    def get(kind="medusa"):
        if kind not in made:
            out = tmp_path_factory.mktemp(f"straight-{kind}") / "run"
            train(recipe(tiny_base_dir, data_file, out, kind, max_steps=STEPS, save_every_steps=1,
                         eval_every_steps=STEPS))
            made[kind] = out
        return made[kind]
    return get


@pytest.fixture(scope="module")
def straight(straight_runs):
    return straight_runs("medusa")


# One kill point in the default run; the later kill point and the SSM run (about 17 s of training) with the slow tests.
@pytest.mark.parametrize("kind,kill_after", [("medusa", 3), pytest.param("medusa", 17, marks=pytest.mark.slow),
                                             pytest.param("ssm", 11, marks=pytest.mark.slow)])
def test_sigkill_at_any_point_resumes_to_the_same_weights(tiny_base_dir, data_file, straight_runs, tmp_path,
                                                          kind, kill_after):
    straight = straight_runs(kind)
    out = tmp_path / "run"
    r = recipe(tiny_base_dir, data_file, out, kind, max_steps=STEPS, save_every_steps=1, eval_every_steps=STEPS)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(r))
    p = launch(cfg, tmp_path)
    wait_for_step(out, kill_after, p)
    p.send_signal(signal.SIGKILL)  # a checkpoint save is likely in flight: one is written every step
    p.wait()
    assert not (out / "export").exists()
    ck = latest_checkpoint(out)
    assert ck is not None and (ck / "trainer_state.json").is_file()
    summary = train(r)
    assert summary["finished"] and summary["step"] == STEPS
    assert_same_weights(straight, out)
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == sorted(set(steps)), "records after the resumed checkpoint must not be duplicated"


@pytest.mark.parametrize("how", ["sigterm", pytest.param("stop_file", marks=pytest.mark.slow),  # one by default
                                 pytest.param("sigint", marks=pytest.mark.slow)])
def test_stop_request_checkpoints_then_resumes(tiny_base_dir, data_file, straight, tmp_path, how):
    out = tmp_path / "run"
    r = recipe(tiny_base_dir, data_file, out, max_steps=STEPS, save_every_steps=1000, eval_every_steps=STEPS)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(r))
    p = launch(cfg, tmp_path, f"train.max_steps={STEPS}")
    wait_for_step(out, 5, p)
    if how == "stop_file":
        (out / "STOP").touch()
    else:  # (a first Ctrl-C stops as SIGTERM does: it threw the steps since the last checkpoint away; walk-through)
        p.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
    log, _ = p.communicate(timeout=120)
    assert p.returncode == 0, log[-2000:]
    assert "stop requested: checkpoint saved at step" in log
    # The command to resume with, overrides included (docs said the stop message repeats them; only
    # --stop-after-steps's did: review of the docs)
    assert f"resume with `draftlab train {cfg} train.max_steps={STEPS}` (without --overwrite)" in log
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "stopped" and 5 <= last["step"] < STEPS
    assert latest_checkpoint(out).name == f"step_{last['step']}" and not (out / "export").exists()
    summary = train(r)  # the STOP file is cleared at start: the resumed run goes to the end
    assert summary["finished"] and not (out / "STOP").exists()
    assert_same_weights(straight, out)


def test_half_written_checkpoints_are_never_loaded(tiny_base_dir, data_file, tmp_path):
    out = tmp_path / "run"
    train(recipe(tiny_base_dir, data_file, out, max_steps=2, save_every_steps=2), stop_after_steps=2)
    good = latest_checkpoint(out)
    # A crash between trainer_state.json and the rename, and one in the middle of save_state.
    torn = out / "checkpoints" / "step_9.tmp"
    torn.mkdir()
    (torn / "trainer_state.json").write_text('{"step": 9}')
    (out / "checkpoints" / "step_7").mkdir()
    assert latest_checkpoint(out) == good


def test_a_rerun_after_a_kill_before_any_checkpoint_starts_its_records_again(tmp_path):
    """No checkpoint yet: the run starts again from step 0, so the records the killed run logged (and a line it tore)
    are dropped rather than logged twice (found by review: a start record, steps and an eval twice)."""
    from types import SimpleNamespace

    from draftlab.train.run_dir import resume_step

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "event": "start"}\n{"step": 1, "loss": 3.0}\n{"step": 2, "lo')
    acc = SimpleNamespace(is_main_process=True, num_processes=1)
    assert resume_step(acc, tmp_path, 10) == 0
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_checkpoint_of_another_number_of_processes_is_refused(tmp_path):
    """The data each process sees, the steps per epoch and the schedule follow the number of processes: a checkpoint
    saved by 1 process is not resumed by 2 (found by review: it went on, skipping data and changing the schedule)."""
    from types import SimpleNamespace

    from draftlab.train.run_dir import RunDirError, resume_step

    ckpt = tmp_path / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, "total_steps": 20, "processes": 1}))
    acc = SimpleNamespace(is_main_process=True, num_processes=2, load_state=lambda d: None)
    with pytest.raises(RunDirError, match="1 processes"):  # a user's error: the CLI says it in one line, exit 2
        resume_step(acc, tmp_path, 10)
    acc.num_processes = 1
    assert resume_step(acc, tmp_path, 20) == 4


def test_a_multi_process_checkpoint_from_before_per_rank_streams_gives_the_ranks_their_own_on_resume(tmp_path, capsys):
    """Checkpoints saved before each rank drew from its own random stream hold the same generator state on every rank,
    which Accelerate restores: ranks above 0 are reseeded from (seed, rank, step) when they resume one. Checkpoints
    saved since say `rank_streams`, and their restored states are kept."""
    from types import SimpleNamespace

    from draftlab.train.loop import rank_seed
    from draftlab.train.run_dir import resume_step

    ckpt = tmp_path / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    state = ckpt / "trainer_state.json"
    state.write_text(json.dumps({"step": 4, "total_steps": 20, "processes": 2}))
    calls = []
    for rank in (0, 1):
        acc = SimpleNamespace(is_main_process=rank == 0, num_processes=2, process_index=rank, load_state=lambda d: None)
        assert resume_step(acc, tmp_path, 20, reseed=lambda at, r=rank: calls.append((r, at))) == 4
    assert calls == [(1, 4)]
    assert "the processes above the first are given theirs now" in capsys.readouterr().out
    state.write_text(json.dumps({"step": 4, "total_steps": 20, "processes": 2, "rank_streams": True}))
    resume_step(acc, tmp_path, 20, reseed=lambda at: calls.append((1, at)))
    assert calls == [(1, 4)] and "given theirs" not in capsys.readouterr().out
    assert len({rank_seed(0, 1), rank_seed(0, 1, 4), rank_seed(0, 2, 4), rank_seed(0, 1, 5)}) == 4


def test_training_hands_resume_its_rank_s_own_reseeding(tiny_base_dir, data_file, tmp_path, monkeypatch):
    """train_draft gives resume_step the reseeding of its own rank from (train.seed, rank, step)."""
    import draftlab.train.loop as loop

    class Resumed(Exception):
        pass

    handed = []

    def stop_at_resume(accelerator, out_dir, total_steps, reseed=None):
        handed.append(reseed)
        raise Resumed

    monkeypatch.setattr(loop, "resume_step", stop_at_resume)
    with pytest.raises(Resumed):
        train(recipe(tiny_base_dir, data_file, tmp_path / "run", max_steps=2, seed=5))
    handed[0](7)
    assert torch.initial_seed() == loop.rank_seed(5, 0, 7)


def test_the_hidden_cache_is_keyed_by_every_token_the_layers_read_and_the_base(tmp_path):
    """The cached states are another run's when a token in the middle of an example, the layers read, the base's
    revision or its weight files differ (found by review: only the first and last 8 tokens and the base's name were
    keyed, so --overwrite with other layers or edited data reused stale states)."""
    from draftlab.train.hidden_cache import fingerprint

    ex = [{"input_ids": list(range(40))}, {"input_ids": [5] * 30}]
    edited = [{"input_ids": list(range(20)) + [99] + list(range(21, 40))}, ex[1]]
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"x" * 10)
    fp = fingerprint(ex, str(base), torch.float32, (0, 0, 1))
    assert fp == fingerprint(ex, str(base), torch.float32, (0, 0, 1))
    assert fp != fingerprint(edited, str(base), torch.float32, (0, 0, 1))
    assert fp != fingerprint(ex, str(base), torch.float32, (1, 1, 0))
    assert fp != fingerprint(ex, str(base), torch.float32, (0, 0, 1), revision="v2")
    os.utime(base / "model.safetensors", (0, 0))  # a copy made at another time: the same base
    assert fp == fingerprint(ex, str(base), torch.float32, (0, 0, 1))
    (base / "model.safetensors").write_bytes(b"y" * 10)  # other weights of the same size
    assert fp != fingerprint(ex, str(base), torch.float32, (0, 0, 1))


def test_the_hidden_cache_reads_examples_held_as_arrays_as_it_reads_lists(tmp_path):
    """Training's Examples are hashed and measured from their flat arrays (no lists made), with the same fingerprint
    and offsets as their items read as lists; a slice is its own examples."""
    from draftlab.data import Examples
    from draftlab.train.hidden_cache import HiddenCache, fingerprint

    every = Examples.of(([i] * (3 + i), [1] * (3 + i)) for i in range(6))
    for ex in (every, every[2:5], every.take([4, 1])):
        assert fingerprint(ex, "b", torch.float32, (1,)) == fingerprint(list(ex), "b", torch.float32, (1,))
    assert fingerprint(every[2:5], "b", torch.float32) != fingerprint(every[2:4] + every[1:2], "b", torch.float32)
    a = HiddenCache(tmp_path / "a", every[2:5], 4, torch.float32, "b", create=True)
    b = HiddenCache(tmp_path / "b", list(every[2:5]), 4, torch.float32, "b", create=True)
    assert a.lengths == b.lengths == [5, 6, 7] and a.offsets == b.offsets == [0, 5, 11, 18]
    assert (tmp_path / "a" / "meta.json").read_text() == (tmp_path / "b" / "meta.json").read_text()


def test_the_same_command_after_a_run_finished_changes_nothing_unless_its_end_was_not_logged(tiny_base_dir,
                                                                                              data_file, tmp_path):
    """Running a finished run's command again leaves its export and records as they are (found by review: it
    evaluated and exported again and logged a second end record); a run killed after its last checkpoint but before
    its end record logs its end once; a changed train.export or train.grow_tree makes the export again."""
    out = tmp_path / "run"
    r = recipe(tiny_base_dir, data_file, out, max_steps=2)
    first = train(r)
    meta = (out / "export" / "draftlab.json").read_text()
    records = (out / "metrics.jsonl").read_text()
    again = train(r)
    assert again["already_finished"] and again["export"] == first["export"]
    assert again["eval"] == first["eval"] and again["export_step"] == first["export_step"] == 2
    assert (out / "export" / "draftlab.json").read_text() == meta
    assert (out / "metrics.jsonl").read_text() == records
    lines = records.splitlines()
    assert json.loads(lines[-1])["event"] == "end"
    (out / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # killed before the end record
    redone = train(r)
    assert "already_finished" not in redone
    ends = [l for l in (out / "metrics.jsonl").read_text().splitlines() if json.loads(l).get("event") == "end"]
    assert len(ends) == 1
    other = train(recipe(tiny_base_dir, data_file, out, max_steps=2, export="last"))  # export: changed since
    assert "already_finished" not in other
    assert json.loads((out / "export" / "draftlab.json").read_text())["training"]["export"]["chosen"] == "last"
    kept = train(recipe(tiny_base_dir, data_file, out, max_steps=2, export="last", grow_tree=False))  # so is grow_tree
    assert "already_finished" not in kept and "default_tree" not in read_meta(out / "export")["training"]


def test_a_first_ctrl_c_asks_for_a_stop_and_a_second_interrupts(tmp_path, monkeypatch):
    """The training loop's Ctrl-C: the first sets the stop flag (a checkpoint, then the end), the second raises
    KeyboardInterrupt as Python would; closing the request puts the handlers back, and a step that raised closes it
    too (the handlers stayed in place)."""
    from types import SimpleNamespace

    from draftlab.train import loop
    from draftlab.train.distributed import StopRequest

    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest(tmp_path, SimpleNamespace(is_main_process=False, num_processes=1))
    handler = signal.getsignal(signal.SIGINT)
    handler(signal.SIGINT, None)
    assert stop.requested()
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)
    stop.close()
    assert signal.getsignal(signal.SIGINT) is before

    def raises(run, *a):
        run.stopper = StopRequest(tmp_path, SimpleNamespace(is_main_process=False, num_processes=1))
        raise RuntimeError("a step failed")

    monkeypatch.setattr(loop, "run_steps", raises)
    run = SimpleNamespace(stop_dirs=(), accelerator=SimpleNamespace(process_index=0), out_dir=tmp_path,
                          total_steps=1, is_main=False, stats=None, stopper=None)
    for phase in ("check_teacher", "load_models_and_data", "build_optimizer", "open_hidden_cache",
                  "open_accept_estimate"):
        monkeypatch.setattr(loop, phase, lambda *a, **k: None)
    monkeypatch.setattr(loop, "start", lambda *a: (run, None))
    monkeypatch.setattr(loop, "resume_step", lambda *a, **k: 0)
    monkeypatch.setattr(loop, "finished_before", lambda *a: None)
    monkeypatch.setattr(loop, "Metrics", lambda *a: None)
    with pytest.raises(RuntimeError, match="a step failed"):
        loop.train_draft(SimpleNamespace(train=SimpleNamespace(seed=0)))
    assert signal.getsignal(signal.SIGINT) is before
