"""slurm/train.sbatch: the launch line it builds for every node, its preemption path, and (where a Slurm
cluster is up, see slurm/local_cluster.sh) a real submission that trains, is preempted and resumes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from test_train import recipe
from draftlab.config import dump_recipe

SCRIPT = REPO / "slurm" / "train.sbatch"


def fake_tools(tmp_path: Path, accelerate_body: str) -> dict:
    """srun runs its command once per node with SLURM_NODEID set; scontrol answers hostnames and logs requeue;
    the `python` given to the script records `accelerate launch` calls (and runs accelerate_body) and
    passes everything else to the real interpreter."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "calls.log"
    (bin_ / "srun").write_text("""#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
for ((n = 0; n < ${SLURM_NNODES:-1}; n++)); do SLURM_NODEID=$n "$@" & done
wait
""")
    (bin_ / "scontrol").write_text(f"""#!/bin/bash
# A large allocation: enough hostnames that a reader which stops after the first line would break the pipe.
if [ "$1" = show ] && [ "$2" = hostnames ]; then echo node01; echo node02; exec seq -f 'node%05g' 3 200000; fi
echo "scontrol $*" >> {log}
""")
    (bin_ / "python").write_text(f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = accelerate.commands.launch ]; then
    echo "node=$SLURM_NODEID $*" >> {log}
    {accelerate_body}
    exit 0
fi
exec {sys.executable} "$@"
""")
    for f in bin_.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "DRAFTLAB_PYTHON": str(bin_ / "python"),
            "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]"}


def test_multi_node_launch_line(tiny_base_dir, data_file, tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(recipe(tiny_base_dir, data_file, tmp_path / "run")))
    env = {**fake_tools(tmp_path, ""), "SLURM_NNODES": "2", "DRAFTLAB_PROCS_PER_NODE": "4"}
    p = subprocess.run(["bash", str(SCRIPT), str(cfg), "train.lr=3e-4"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "2 node(s) x 4 process(es); main node01:24242" in p.stdout
    calls = sorted((tmp_path / "calls.log").read_text().splitlines())
    assert len(calls) == 2
    for rank, line in enumerate(calls):
        assert line.startswith(f"node={rank} -m accelerate.commands.launch --multi_gpu")
        assert (f"--num_machines 2 --machine_rank {rank} --num_processes 8 --main_process_ip node01 "
                f"--main_process_port 24242") in line
        assert line.endswith(f"-m draftlab.cli train {cfg} train.lr=3e-4")


def test_bad_recipe_fails_before_launch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("head: {num_heads: 0}\n")
    env = fake_tools(tmp_path, "")
    p = subprocess.run(["bash", str(SCRIPT), str(bad)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "head.num_heads" in p.stderr and not (tmp_path / "calls.log").exists()
    assert "Traceback" not in p.stderr  # (the validation error, then a KeyError of the script's: walk-through)
    p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage: sbatch slurm/train.sbatch" in p.stderr


def test_preemption_signal_stops_the_trainer_and_requeues(tiny_base_dir, data_file, tmp_path):
    out = tmp_path / "run"
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(recipe(tiny_base_dir, data_file, out)))
    # The stand-in trainer runs until the STOP file appears, as draftlab train does.
    env = {**fake_tools(tmp_path, f'while [ ! -f {out}/STOP ]; do sleep 0.1; done; echo saw-stop >> {tmp_path}/calls.log'),
           "SLURM_NNODES": "1"}
    p = subprocess.Popen(["bash", str(SCRIPT), str(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, cwd=tmp_path)
    t0 = time.time()
    while not (tmp_path / "calls.log").exists() and p.poll() is None and time.time() - t0 < 60:
        time.sleep(0.1)
    assert p.poll() is None, p.communicate()[0]  # the job must still be running when the signal comes
    p.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@300` delivers before the time limit
    log, _ = p.communicate(timeout=60)
    assert p.returncode == 0, log
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert "--multi_gpu" not in calls[0] and "--num_processes 1" in calls[0]
    assert calls[1:] == ["saw-stop", "scontrol requeue 4242"]
    assert "requeueing job 4242" in log


# --- a real Slurm cluster (slurm/local_cluster.sh start) ---------------------------------------------------

def slurm_up() -> bool:
    if not shutil.which("sbatch") or not os.environ.get("SLURM_CONF"):
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and any(s.strip() in ("idle", "mix", "alloc") for s in r.stdout.split())


def job_state(job: str) -> str:
    r = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, timeout=30)
    for tok in r.stdout.split():
        if tok.startswith("JobState="):
            return tok.split("=", 1)[1]
    return "UNKNOWN"


@pytest.mark.slow  # a real cluster job, preempted and requeued: CI runs it with the slow tests
@pytest.mark.skipif(not slurm_up(), reason="no Slurm cluster (start one with `bash slurm/local_cluster.sh start`)")
def test_real_slurm_job_is_preempted_requeued_and_finishes(tiny_base_dir, data_file, tmp_path):
    out = tmp_path / "run"
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(recipe(tiny_base_dir, data_file, out, max_steps=400, save_every_steps=50,
                                      eval_every_steps=400, log_every_steps=1)))
    env = {**os.environ, "DRAFTLAB_PROCS_PER_NODE": "2", "DRAFTLAB_PYTHON": sys.executable, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    sub = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2", "--time=10",
                          f"--output={tmp_path}/job-%j.out", str(SCRIPT), str(cfg)],
                         env=env, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        t0 = time.time()
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) > 20):
            assert time.time() - t0 < 300 and job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), job_state(job)
            time.sleep(0.5)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
        while job_state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") or not (out / "export").exists():
            assert time.time() - t0 < 600, job_state(job)
            if job_state(job) in ("FAILED", "CANCELLED", "TIMEOUT"):
                break
            time.sleep(1)
        log = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
        assert job_state(job) == "COMPLETED", log[-3000:]
        events = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        assert any(e.get("event") == "stopped" for e in events), log[-3000:]
        assert "restart 1" in log and "resuming from" in log
        assert (out / "export" / "draft.safetensors").is_file()
        assert [e["processes"] for e in events if e.get("event") == "start"] == [2]
    finally:  # a failed check must not leave the job holding the cluster
        subprocess.run(["scancel", job], capture_output=True, timeout=30)


@pytest.mark.parametrize("newest,requeued", [(600, True), (500, False)])
def test_a_stop_after_an_earlier_finish_requeues_unless_the_export_is_newest(tiny_base_dir, data_file, tmp_path,
                                                                           newest, requeued):
    """A run that finished at step 500 and trains on (train.max_steps raised) keeps its old export meanwhile: a
    preemption then was taken for a finished run and the job was not requeued (found by review). The script asks
    draftlab.train.run_dir whether a checkpoint is newer than the export."""
    out = tmp_path / "run"
    cfg = tmp_path / "r.yaml"
    cfg.write_text(dump_recipe(recipe(tiny_base_dir, data_file, out)))
    (out / "export").mkdir(parents=True)
    (out / "export" / "draftlab.json").write_text(json.dumps({"training": {"steps": 500}}))
    ck = f"{out}/checkpoints/step_{newest}"
    body = (f'while [ ! -f {out}/STOP ]; do sleep 0.1; done; mkdir -p {ck}; echo {{}} > {ck}/trainer_state.json; '
            f'echo saw-stop >> {tmp_path}/calls.log')
    env = {**fake_tools(tmp_path, body), "SLURM_NNODES": "1"}
    p = subprocess.Popen(["bash", str(SCRIPT), str(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, cwd=tmp_path)
    t0 = time.time()
    while not (tmp_path / "calls.log").exists() and p.poll() is None and time.time() - t0 < 60:
        time.sleep(0.1)
    p.send_signal(signal.SIGUSR1)
    log, _ = p.communicate(timeout=60)
    assert p.returncode == 0, log
    assert ("scontrol requeue 4242" in (tmp_path / "calls.log").read_text()) == requeued, log
    assert ("already finished" in log) != requeued


def test_the_finished_question_answers_with_its_exit_status_and_a_line(tmp_path, capsys):
    """python -m draftlab.train.finished OUTPUT_DIR (what the script asks): a missing directory was "not finished"
    in silence, no argument an IndexError, and the module warned on every call (walk-through)."""
    from draftlab.train.finished import main

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert main([str(tmp_path / "typo")]) == 2 and "typo: no such run directory" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 1 and "not finished" in capsys.readouterr().out
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "draftlab.json").write_text(json.dumps({"training": {"steps": 4}}))
    assert main([str(tmp_path)]) == 0 and capsys.readouterr().out == f"{tmp_path}: finished\n"
    p = subprocess.run([sys.executable, "-m", "draftlab.train.finished", str(tmp_path)], capture_output=True,
                       text=True, cwd=REPO)
    assert p.returncode == 0 and p.stderr == "", p.stderr

