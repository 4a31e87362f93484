"""The processes a run trains in: DeepSpeed's plugin, and what ranks agree on (flags, a stop request)."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import Recipe
from .run_dir import RunDirError


class StopRequest:
    """A polite stop: SIGTERM / SIGUSR1 to this process, a first Ctrl-C (SIGINT; a second stops at once, without a
    checkpoint), or a file `STOP` in the run directory.

    Slurm sends a signal before a time limit or preemption; launchers do not always forward it to
    every worker, so the sbatch scripts also touch OUTPUT_DIR/STOP. All ranks agree on the flag
    (one all-reduce per optimizer step) and stop together after a checkpoint.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, out_dir: Path, accelerator, also: tuple[Path, ...] = ()):
        """also: more directories whose STOP file stops the run (an ensemble's, for the stage it trains)."""
        import signal
        import threading

        self.files = [Path(d) / "STOP" for d in (out_dir, *also)]
        self.accelerator, self.flag, self.old = accelerator, False, {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self.old[sig] = signal.signal(sig, self._on_signal)
            self.old[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_signal(self, signum, frame) -> None:
        self.flag = True

    def _on_interrupt(self, signum, frame) -> None:
        """Ctrl-C threw the steps since the last checkpoint away (walk-through): the first stops as a signal does."""
        if self.flag:
            raise KeyboardInterrupt
        self.flag = True
        if self.accelerator.is_main_process:
            print("\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again stops at once, without one)",
                  file=sys.stderr, flush=True)

    def requested(self) -> bool:
        return any_rank(self.flag or any(f.exists() for f in self.files), self.accelerator)

    def close(self) -> None:
        import signal

        for sig, old in self.old.items():
            signal.signal(sig, old)


def local_fraction(model) -> float:
    """Share of the model's parameters this rank holds (1.0 unless FSDP shards them)."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for p in model.parameters():
        total += p.numel()
        held += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return held / max(total, 1)


def any_rank(flag: bool, accelerator) -> bool:
    """True on every rank when flag is true on any (one all-reduce; none in a single process)."""
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor([float(flag)], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


def node_of(accelerator) -> tuple[int, int, bool]:
    """(this process's node, the number of nodes, whether it is its node's first process): nodes told apart by host
    name and the kernel's boot id (containers given one host name on several machines stay apart), numbered in their
    order (one all-gather; none in a single process)."""
    if accelerator.num_processes == 1:
        return 0, 1, True
    import socket

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # (not Linux)
        boot = ""
    me = f"{socket.gethostname()}|{boot}"
    nodes = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(nodes, me)
    return sorted(set(nodes)).index(me), len(set(nodes)), nodes.index(me) == accelerator.process_index


def single_process_group_env() -> None:
    """One process without a launcher: DeepSpeed still wants a process group (of one)."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", str(port))})


@contextmanager
def outside_deepspeed(ds_plugin):
    """Build models whole: with a DeepSpeed plugin in place transformers' from_pretrained / from_config would
    partition them as ZeRO-3 parameters (zero.Init) on creation. The frozen base runs outside DeepSpeed's
    engine; a draft LM must exist whole to be checked and initialised from the base (the engine shards it)."""
    if ds_plugin is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if getattr(ds_plugin, "dschf", None) is not None:
            set_hf_deepspeed_config(ds_plugin.dschf)


def whole_copy(module, build):
    """A copy of a ZeRO-3 module with whole parameters: each rank holds a slice of every partitioned parameter
    (its `.data` is empty), so whatever reads the weights outside the engine's forward (the accept estimate, the
    export) reads this copy. build() makes an unpartitioned module of the same structure; the weights are
    gathered into it (a collective: every rank calls this). Costs one whole draft per rank while it lives."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    copy = build()
    copy.load_state_dict(state)
    return copy


def deepspeed_plugin(recipe: Recipe):
    """Accelerate's DeepSpeed plugin for the heads (ZeRO 2/3, optional CPU offload), or None for DDP."""
    d, t = recipe.distributed, recipe.train
    if d.strategy != "deepspeed":
        return None
    try:
        import deepspeed  # noqa: F401  (only checking that it is installed)
    except ImportError:
        raise RunDirError("distributed.strategy: deepspeed needs DeepSpeed: pip install -e '.[deepspeed]'") from None
    from accelerate.utils import DeepSpeedPlugin

    _warn_stale_build_locks()
    zero: dict = {"stage": d.zero_stage, "overlap_comm": True, "contiguous_gradients": True}
    if d.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if d.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    zero.update(d.zero_extra)
    config = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": t.mixed_precision == "bf16"},
        "fp16": {"enabled": t.mixed_precision == "fp16"},
        # Gradients accumulate in float32 over the micro-batches (DeepSpeed's default is the model's dtype: bf16
        # under mixed precision, which rounds every accumulation; the DDP path accumulates in float32).
        "data_types": {"grad_accum_dtype": "fp32"},
        "steps_per_print": 1 << 30,
    }
    return DeepSpeedPlugin(hf_ds_config=config)


def _warn_stale_build_locks(older_than_s: float = 600.0) -> None:
    """DeepSpeed JIT-builds its ops (on CPU its shared-memory communication op) under torch's extension folder,
    guarded by a `lock` file; a build that was killed leaves the file behind and every later load waits on it
    forever, without a word. Name such a lock so a hang has an explanation."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time()
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:  # ROOT/op/lock, or ROOT/py311_cpu/op/lock
        age = now - lock.stat().st_mtime
        if age > older_than_s:
            print(f"warning: {lock} is {age / 60:.0f} min old; if no other process is building this op, delete it "
                  "(a killed build leaves it, and DeepSpeed then waits on it forever)", file=sys.stderr)
