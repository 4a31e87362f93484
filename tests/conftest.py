"""Shared fixtures: tiny seeded Llama bases built in memory (and saved with a tokenizer for path loading)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N workers share the cores, one thread each
    torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"  # the repository's own data (data/README.md); nothing is read from outside the clone
STORIES = DATA / "models" / "stories260K"

STORY_TEXT = (
    "Once upon a time there was a little cat. The cat liked to play in the sun. "
    "One day the cat saw a big dog. The dog was friendly and they played all day. "
    "They were happy friends. The end. "
) * 8


def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None  # compare fixed-length greedy runs
    return model


@pytest.fixture(scope="session", autouse=True)
def own_extension_builds(tmp_path_factory):
    """Ops that DeepSpeed JIT-builds in launched runs go to a folder of this session: a `lock` that a killed build
    left in the user's torch-extensions cache would otherwise make every DeepSpeed run wait forever."""
    old = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("torch_extensions"))
    yield
    if old is None:
        os.environ.pop("TORCH_EXTENSIONS_DIR")
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = old


def run_cmd(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) in a session of its own: on a timeout (or any error) the
    whole process group is killed, so the workers a launcher started never outlive the test."""
    import signal

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
            raise
        finally:
            try:  # a launcher that exited normally may still have left children in its group
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama + BPE tokenizer (with chat template), loadable by path like a hub model."""
    from draftlab.cli.quickstart import build_tokenizer

    d = tmp_path_factory.mktemp("tiny_base")
    tok = build_tokenizer([STORY_TEXT, "User: Assistant: Hello hi what is a cat? It is an animal."], d)
    model = tiny_llama(vocab=len(tok), dtype=torch.float32)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def stories_dir(tmp_path_factory) -> Path:
    """stories260K (data/models/stories260K) imported to a HF directory."""
    from draftlab.interop.llama2c import import_llama2c

    d = tmp_path_factory.mktemp("stories260k")
    return import_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.model", d)


@pytest.fixture
def rng():
    return random.Random(0)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_train(cfg: Path, processes: int = 1, env: dict | None = None, json_out: bool = False,
                 timeout: int = 600, cwd=None) -> subprocess.CompletedProcess:
    """`accelerate launch` of `draftlab train CFG` on this CPU machine (several processes talk over gloo)."""
    # A free port of its own: tests run side by side (pytest -n), and Accelerate's default port is one for all.
    port = ["--main_process_port", str(free_port())] if processes > 1 else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), *port,
           *(["--multi_gpu"] if processes > 1 else []), "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "draftlab.cli", "train", str(cfg), *(["--json"] if json_out else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    return run_cmd(cmd, timeout, env=env, cwd=cwd)


def write_jsonl(path: Path, records: list) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """24 ShareGPT conversations (human question, story-text answer) for tiny training runs."""
    import json

    d = tmp_path_factory.mktemp("data")
    recs = [{"conversations": [{"from": "human", "value": f"Tell me about the cat number {i}."},
                               {"from": "gpt", "value": STORY_TEXT[i * 7: i * 7 + 120]}]} for i in range(24)]
    p = d / "chat.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p
