"""A base split over processes (tensor parallel, gloo on CPU) under the tree decoder: the same tokens as one
process, for heads, Hydra++ and SSM drafters, greedy and seeded sampling, eager and compiled."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_cmd
from test_decoder import noisy_heads
from tp_worker import PROMPTS, decode_all


def torchrun(n: int, *args, timeout=600, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", **(env or {})}
    return run_cmd(cmd, timeout, env=env)


@pytest.fixture(scope="module")
def exports(stories_dir, tmp_path_factory):
    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    d = tmp_path_factory.mktemp("tp_exports")
    torch.manual_seed(0)
    hydra = build_draft({"type": "hydra", "num_heads": 3, "num_layers": 1, "prefix_attention": True}, base)
    for p in hydra.parameters():
        p.data += 0.02 * torch.randn_like(p)
    ssm = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, base)
    return [str(save_export(noisy_heads(base, num_heads=3, noise=0.02), base, d / "medusa", str(stories_dir),
                            tokenizer=tok)),
            str(save_export(hydra, base, d / "hydra++", str(stories_dir), tokenizer=tok)),
            str(save_export(ssm, base, d / "ssm", str(stories_dir), default_tree=[[0], [0, 0], [0, 0, 0], [1]],
                            tokenizer=tok))]


@pytest.fixture(scope="module")
def base_reading_exports(stories_dir, tmp_path_factory):
    """Exports whose drafter reads the base through modules TP splits: DFlash's logits go through the base's lm_head,
    and Medusa-2's adapter is merged into the base's attention and MLP weights."""
    from peft import LoraConfig, get_peft_model

    from draftlab.base import load_base
    from draftlab.drafters import build_draft
    from draftlab.interop.export import save_export

    base, tok = load_base(str(stories_dir), "float32")
    d = tmp_path_factory.mktemp("tp_exports_2")
    torch.manual_seed(0)
    dflash = build_draft({"type": "dflash", "dflash": {"block_size": 4, "num_layers": 1}}, base)
    adapted = get_peft_model(load_base(str(stories_dir), "float32")[0],
                             LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return [str(save_export(dflash, base, d / "dflash", str(stories_dir), tokenizer=tok)),
            str(save_export(noisy_heads(base, num_heads=2, noise=0.02), base, d / "medusa2", str(stories_dir),
                            tokenizer=tok, adapter=adapted))]


def single_process(exports) -> dict:
    return decode_all(exports, device="cpu")[0]


@pytest.mark.slow  # multi-process (gloo); CI runs the slow tests
@pytest.mark.parametrize("procs", [2, 4])
def test_tensor_parallel_decoding_gives_the_single_process_tokens(exports, tmp_path, procs):
    out = tmp_path / "tp.json"
    p = torchrun(procs, str(REPO / "tests" / "tp_worker.py"), str(out), *exports)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"tp.json.rank{r}").read_text()) for r in range(procs)]
    ref = single_process(exports)
    for r in ranks:
        # Each rank holds its share of the attention and MLP weights (embeddings and norms stay whole).
        assert r["local_share"] < 1 - 0.5 * (1 - 1 / procs)
        assert r["runs"] == ranks[0]["runs"]
    for key, run in ref.items():
        assert ranks[0]["runs"][key] == run, key
        assert all(len(t) == 24 for t in run["tokens"])


@pytest.mark.slow  # multi-process (gloo)
def test_dflash_and_medusa2_decode_under_tp_as_in_one_process(base_reading_exports, tmp_path):
    """Both failed under --tp (review): DFlash multiplied by the split lm_head's weight, and peft merged whole LoRA
    tensors into split weights. Now each rank merges the adapter into its own shards."""
    out = tmp_path / "tp.json"
    p = torchrun(2, str(REPO / "tests" / "tp_worker.py"), str(out), *base_reading_exports)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"tp.json.rank{r}").read_text()) for r in range(2)]
    assert ranks[0]["runs"] == ranks[1]["runs"] == single_process(base_reading_exports)


@pytest.mark.slow  # multi-process (gloo) and compiling
def test_tensor_parallel_compiled_decoding_gives_the_single_process_tokens(exports, tmp_path):
    """The static-shape path with the base's verify forward compiled, on a base split over two processes: the
    single process's eager tokens, greedy and sampled, on every rank (rank 0's proposals and decisions broadcast as
    on the eager path)."""
    out = tmp_path / "tp.json"
    p = torchrun(2, str(REPO / "tests" / "tp_worker.py"), str(out), *exports, env={"TP_COMPILE": "inductor"})
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"tp.json.rank{r}").read_text()) for r in range(2)]
    ref = single_process(exports)
    for r in ranks:
        assert r["compiled"], r["compile_failed"]
        assert r["runs"] == ref


@pytest.mark.slow  # two torchrun launches of the CLI; the decoding itself is covered by the worker test above
def test_tp_cli_generate_matches_one_process(exports, tmp_path):
    from draftlab.cli import main

    args = ["generate", exports[2], "--prompt", "Once upon a time", "--prompt", "The dog", "--max-new-tokens", "16",
            "--dtype", "float64", "--json"]
    p = torchrun(2, "-m", "draftlab.cli", *args, "--tp", "--compare")
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1  # rank 1 prints nothing
    rep = json.loads(lines[0])
    assert rep["identical_to_baseline"] is True
    one = run_cmd([sys.executable, "-m", "draftlab.cli", *args], 600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert json.loads(one.stdout.splitlines()[-1])["text"] == rep["text"]


@pytest.mark.slow  # a torchrun launch of the CLI
def test_tp_cli_eval_mt_bench_on_the_compiled_path(exports, tmp_path):
    """eval mt-bench --tp --compile: the ranks agree on which turns to decode again after a compile and on which
    differences to explain (collective forwards on the split base, or none), so the run finishes; rank 0 writes a
    summary with both baselines, identical to plain decoding."""
    args = ["eval", "mt-bench", exports[0], "--limit", "2", "--max-new-tokens", "16", "--out", str(tmp_path / "run"),
            "--no-plots", "--json", "--compile"]
    p = torchrun(2, "-m", "draftlab.cli", *args, "--tp", env={"DRAFTLAB_COMPILE_BACKEND": "eager"})
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1  # rank 1 prints nothing
    o = json.loads(lines[0])["overall"]
    assert o["identical_share"] == 1.0 and o["turns"] == 4 and o["compiled_plain_tokens_per_s"] > 0, o


def test_layerwise_device_map_decodes_the_same_tokens(exports):
    """--device-map: layers placed by accelerate's hooks. A CPU machine's only second 'device' is disk offload,
    which runs the same hook path (weights moved in per forward); the last layer offloaded too (Hydra++ builds its
    prefix layer's shape from it)."""
    from draftlab.serve.generate import load_decoder

    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
          **{f"model.layers.{i}": ("disk" if i in (1, 3, 4) else "cpu") for i in range(5)}}
    ref = single_process(exports[1:])
    for exp in exports[1:]:
        decoder, _, _ = load_decoder(exp, dtype="float64", device_map=dm)
        assert decoder.base.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
        got = decoder.generate(PROMPTS, max_new_tokens=24, generator=torch.Generator().manual_seed(7)).tokens
        assert got == ref[f"{exp}|greedy"]["tokens"]


def test_a_tp_process_destroys_its_group_before_the_interpreter_ends():
    """init_tp's process group is destroyed at exit (tensor_parallel.release), before the interpreter's teardown: a
    gloo group left to it aborted a rank of the TP CLI ("terminate called without an active exception", SIGABRT) in
    a CI run. A handler registered before init_tp runs after release (atexit runs them last in, first out) and sees
    no group; the process exits 0."""
    code = ("import atexit, torch.distributed as dist\n"
            "atexit.register(lambda: print('group after exit handlers:', dist.is_initialized(), flush=True))\n"
            "from draftlab.decode.tensor_parallel import init_tp\n"
            "init_tp(); print('group:', dist.is_initialized(), flush=True)\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29581", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == "group: True group after exit handlers: False".split()


def test_launch_mistakes_are_named(monkeypatch):
    from draftlab.decode.tensor_parallel import check_launch

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="4 processes .* --tp was not given"):
        check_launch(False)
    check_launch(True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="--tp splits the base over the processes of `torchrun.*Without GPUs, "
                                         "accelerate starts N processes only with --multi_gpu"):
        check_launch(True)


class PassSync:
    """A one-process stand-in for RankSync: every rank's decisions are its own."""

    def root(self, root):
        return root

    def proposal(self, prop):
        return prop

    def decision(self, last, bonus):
        return last, bonus


def test_the_synced_verify_keeps_the_slots_a_defragmentation_moved(monkeypatch):
    """The path tensor parallelism takes (decisions through a sync, the cache kept by the host) on the static cache:
    rows that accept different counts leave holes until the buffer fills and its forward's room comes from a
    defragmentation; the accepted slots are then kept where the defragmentation put the committed ones (they were
    kept at the slots before it, and the run failed)."""
    from conftest import tiny_llama
    from draftlab.decode.cache import StaticSlotCache
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.decode.tree import Tree, TreeView
    from draftlab.drafters import Drafter, Proposal
    from test_decoder import plain_greedy

    class Alternating(Drafter):
        """A chain of the true continuation in every other step of each row (the rows out of phase), else wrong."""
        max_nodes = 5

        def begin(self, prompt, sampling, generator):
            self.at, self.step = [0] * prompt.ids.shape[0], 0

        def propose(self, root):
            rows = []
            for b, w in enumerate(want):
                good = (self.step + b) % 2 == 0
                rows.append([int(root[b])] + [w[j] if good and j < len(w) else 63 - j % 5
                                              for j in range(self.at[b] + 1, self.at[b] + 5)])
            self.step += 1
            return Proposal(torch.tensor(rows), TreeView.of_static(Tree.chain(4).buffers(), len(rows)))

        def commit(self, step):
            self.at = [a + len(p) for a, p in zip(self.at, step.paths)]

    moved = []
    defragment = StaticSlotCache._defragment
    monkeypatch.setattr(StaticSlotCache, "_defragment", lambda self: (moved.append(self.n), defragment(self))[1])
    base = tiny_llama(seed=0)
    prompts = [[5, 9, 2, 7, 5, 9, 4, 11, 12], [3, 8]]
    want = [plain_greedy(base, p, 200) for p in prompts]
    for sync in (None, PassSync()):
        res = SpeculativeDecoder(base, Alternating(), static=True, sync=sync).generate(prompts, max_new_tokens=200)
        assert res.tokens == want and res.accept_length > 2
    assert moved  # the runs went through a defragmentation


def test_tp_settings_that_cannot_work_are_refused_and_a_synced_proposal_keeps_its_width(tmp_path):
    """Found by review: a base whose head counts do not divide by the ranks failed in a reshape with advice for
    another model family; an ensemble whose length or members follow its own clock drafted different trees on
    different ranks and failed; the synced proposal lost its static width (`nodes`), padding to the whole budget."""
    from transformers import LlamaConfig

    from conftest import tiny_llama
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.decode.tensor_parallel import RankSync, check_heads_divide
    from draftlab.decode.tree import Tree, TreeView
    from draftlab.drafters import Proposal
    from draftlab.drafters.ensemble import AdaptiveLength, EnsembleDrafter, Scheduler
    from draftlab.drafters.ssm import SSMDrafter

    LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=1).save_pretrained(tmp_path / "mqa")
    with pytest.raises(ValueError, match="4 attention heads and 1 key/value heads.* processes; use --device-map"):
        check_heads_divide(str(tmp_path / "mqa"), 2)  # (it said "use 1 processes", which --tp refuses: walk-through)
    LlamaConfig(hidden_size=32, num_attention_heads=8, num_key_value_heads=4).save_pretrained(tmp_path / "gqa")
    check_heads_divide(str(tmp_path / "gqa"), 4)
    with pytest.raises(ValueError, match="processes; use 2, 4 processes, or --device-map"):
        check_heads_divide(str(tmp_path / "gqa"), 3)

    base = tiny_llama(seed=0)
    ssm = lambda: SSMDrafter(tiny_llama(seed=0), Tree.chain(3))
    for drafter, what in ((EnsembleDrafter([ssm()], mode="vote", adaptive=AdaptiveLength()), "adaptive length"),
                          (EnsembleDrafter([ssm(), ssm()], scheduler=Scheduler(policy="cost")), "cost schedule")):
        with pytest.raises(ValueError, match=f"{what}.* by its own clock"):
            SpeculativeDecoder(base, drafter, sync=PassSync())
    SpeculativeDecoder(base, EnsembleDrafter([ssm(), ssm()], scheduler=Scheduler()), sync=PassSync())

    sync = RankSync()
    sync._bcast = lambda t: t
    prop = Proposal(torch.tensor([[1, 2, 3]]), TreeView.of_static(Tree.chain(2).buffers(), 1))
    prop.nodes = 3
    assert sync.proposal(prop).nodes == 3
