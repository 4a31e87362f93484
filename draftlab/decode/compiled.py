"""Compiled verify forwards for the static-shape decode path.

`torch.compile` of the base, shared by every decoder of that model in the process (one compile per model and
shape set): the default mode on CPU, "reduce-overhead" (CUDA graphs) on a GPU. The static KV cache
(draftlab.decode.cache.StaticSlotCache) and trees padded to the drafter's node budget make every verify forward
of a run the same shapes, so it compiles once. A model that does not compile falls back to eager, saying why
in one line (stderr); the tokens are the same either way.
"""

from __future__ import annotations

import sys
import time
import weakref

import torch

_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class CompiledForward:
    """model(**kwargs) through torch.compile, with an eager fallback; `warmup_s` is the time the first calls
    of each new shape spent compiling (reported beside the speed figures, never hidden)."""

    def __init__(self, model, backend: str = "inductor"):
        self.model, self.backend = model, backend
        cuda = next(model.parameters()).device.type == "cuda"
        # inductor: CUDA graphs on a GPU; other backends (aot_eager, eager: tracing without code generation, for
        # tests and debugging) take no mode.
        mode = ("reduce-overhead" if cuda else "default") if backend == "inductor" else None
        self.fn = torch.compile(model, backend=backend, mode=mode, dynamic=False)
        self.failed: str | None = None
        self.warmup_s = 0.0
        self.shapes: set = set()

    def __call__(self, **kwargs):
        if self.failed:
            return self.model(**kwargs)
        key = tuple((k, tuple(v.shape)) for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        t0 = time.perf_counter()
        try:
            out = self.fn(**kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # tracing or code generation failed (not a runtime
            # error of the model such as out-of-memory, which is raised): decode eagerly, as the reference does
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"draftlab: {type(self.model).__name__} does not compile ({self.failed}); decoding eagerly",
                  file=sys.stderr)
            return self.model(**kwargs)
        if key not in self.shapes:
            self.shapes.add(key)
            self.warmup_s += time.perf_counter() - t0
        return out


def compiled_forward(model, backend: str = "inductor") -> CompiledForward:
    """The process's compiled forward of `model` with `backend` (made on first use, then shared)."""
    fns = _COMPILED.setdefault(model, {})
    if backend not in fns:
        fns[backend] = CompiledForward(model, backend)
    return fns[backend]
