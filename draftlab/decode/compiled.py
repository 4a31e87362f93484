"""Compiled calls for the static-shape decode path.

`Compiled` wraps a function (a base's forward, a drafter's step, the acceptance rule) in `torch.compile` with fixed
shapes: inductor's C++ wrapper on a CPU (see cpp_wrapper), "reduce-overhead" (CUDA graphs) on a GPU for model
forwards. The static KV cache (draftlab.decode.cache.StaticSlotCache) and trees padded to the drafter's node budget
make every call of a run the same shapes, so each compiles once. A function that does not compile falls back to
eager, saying why in one line (stderr); the tokens are the same either way. Where the failure comes past a graph
break, the part before it may have run compiled (a KV cache written), and running the function again would repeat
it: that call raises instead, saying to decode without compiling.

Guards. Before every call of a compiled function, dynamo evaluates its guards: about a thousand checks for a Hugging
Face model (every parameter, the cache object, config attributes), which on a CPU cost 0.2-0.35 ms, a fifth of a
whole forward of the 260K-parameter test base. Once a call's signature (the shapes, strides, dtypes and devices of
every tensor it is given, which of them are one and the same tensor, the values and types of its other arguments,
the objects it is given (a model, with its training flag and its weights' dtype and device; a KV cache with its
length; a drafter with the shapes of the tensors it holds) by a token no later object gets, the global state: grad
mode, autocast and the rest of what dynamo's global state guard compares) has run once with its guards, later calls
of that signature skip guard evaluation (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`): dynamo then only
runs the guards that tell its compiled variants apart. That is sound when everything a compiled graph depends on is
in the signature, which is what the signature is built to hold for draftlab's calls. It does not watch what a graph
reads besides its arguments' tensors: globals, closures, Python attributes of the objects it is given (a drafter's
numbers, a submodule's training flag switched alone), a setting such as decode.gqa.ON changed after a first call. A
call given an object no token can key (one that cannot be weakly referenced: a list deep in the arguments, an object
with __slots__) keeps its guards. So does code past a graph break, which dynamo may have compiled for a tensor's
value (`.item()`): a function whose compiling met a graph break keeps its guards on every call, and says so once on
stderr. DRAFTLAB_COMPILE_GUARDS=1 keeps full guard evaluation on every call (the reference, for debugging), and
tests check both give the eager tokens.

Direct calls (a CPU). Even with guards skipped, each call goes through dynamo's frame hook: it looks the code
object's compiled variants up by the guards that tell them apart, sets the stance twice and enters and leaves the
compiled region: 0.12-0.19 ms per call on a 2-core CPU, about a sixth of a plain compiled step of the test base. On
a signature's guarded first call draftlab notes the variant dynamo ran (the front of the code object's cache, where
dynamo puts the variant a call runs, chosen by every guard, the backend's among them); on its second call it checks
that variant's guards on the arguments, once, and from then on calls the variant's code (dynamo's transformed
bytecode: the compiled graph's call and everything dynamo replays around it) as a plain function, without the hook.
A function with a graph break keeps the hook and its guards (above). Not on a GPU (not measured there);
DRAFTLAB_COMPILE_DIRECT=0 keeps the hook everywhere.

What a signature recorded stops holding when dynamo forgets its variants: `torch._dynamo.reset()` (and
torch.compiler.reset) empties every code object's cache, so every Compiled forgets its signatures then (the call
is counted; a Hydra decoder's chained step ran for Hydra++ after a reset, its 2 outputs where 3 were read). Past
dynamo's recompile limit a code object runs only the variants it has, and calls of new shapes run eagerly: the
signature's guarded call then ran no variant of its own, so a variant is recorded only when its guards pass on the
call's arguments (a model's forward, whose variants are not read, keeps its guards from then on), and the function's
`failed` says calls run eagerly (the tokens stay the eager path's).

Outputs under CUDA graphs. A graphed call's outputs live in the CUDA graphs' shared memory pool, which the next
graphed call (of any function) writes over: torch raises "accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run" where one is read later, e.g. when a step's bonus token is the next step's input.
A call whose outputs must outlive the next call (`keep_outputs`: the fused and chained verify steps, whose outputs
are the next step's inputs; a verify forward, whose states a drafter's graphed step reads on the split path; a
drafter's step, whose outputs it reads in the next step) returns clones of them. DRAFTLAB_EMULATE_GRAPH_OUTPUTS=1
emulates that lifetime on any device: each graphed call first overwrites the outputs of the graphed call before it
(NaN, a negative index, flipped booleans), so that a read of an overwritten output raises or changes the tokens on a CPU too (a read whose wrong value changes nothing,
such as positions on a small test base, goes unseen there; a GPU raises on every such read).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import os
import re
import sys
import threading
import time
import types
import weakref

import torch

from . import fuse, gqa
from .switches import env_flag

_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # functions' Compiled (models keep their own)
_RESETS = [0]  # torch._dynamo.reset calls in this process (_count_resets)
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
_NO_TENSORS = frozenset(_PLAIN) | {dict}  # attribute types _held passes over (it does not walk dicts)


class Fixed(tuple):
    """A tuple of tensors or plain values (directly or in plain tuples) whose members are never replaced and whose
    tensors keep their shapes: its signature in compiled calls (_signature) is computed once and kept on it. A static
    cache's device_state is one, for as long as its buffers stay the same tensors; an SSM's tree paths are one."""


def _signature(x, depth: int = 0, ids: list | None = None):
    """What a compiled graph of fixed shapes depends on in x, hashable: tensors by shape, strides, dtype and device
    (their values are the graph's inputs); plain values (with their type, but ints and strs) and dataclasses by value;
    containers item by item; an object whose class sets `signature_holds` (a drafter) by its token (_token) and the
    shapes of the tensors it holds (_held); other objects (a KV cache, a module) by type and token, a KV cache with
    its length and attention window (StaticSlotCache grows its buffers in place and attends over a window of them).
    ids: a list that gets the id of every tensor walked, in order (see _aliases)."""
    # Every call of a compiled function computes this (tens of tensors for a verify step): plain attribute reads,
    # list comprehensions rather than generators (a third faster on a CPU).
    if isinstance(x, torch.Tensor):
        if ids is not None:
            ids.append(id(x))
        return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    if isinstance(x, _PLAIN):  # with its type, but for an int or a str: 1 == 1.0 == True, which dynamo tells apart
        return x if type(x) is int or type(x) is str else (type(x), x)
    if type(x) is Fixed:  # computed once (its class docstring), from depth 0 wherever it is met
        kept = x.__dict__
        if "signature" not in kept:
            inner: list = []
            kept["signature"] = tuple([_signature(v, 0, inner) for v in x])
            kept["ids"] = inner
        if ids is not None:
            ids += kept["ids"]
        return kept["signature"]
    if type(x) is slice:  # by value (a slice cannot be weakly referenced, so _token could not key it)
        return (slice, _signature(x.start), _signature(x.stop), _signature(x.step))
    if depth > 2:
        return (type(x).__name__, _token(x))
    if isinstance(x, (list, tuple)):  # (a list and a tuple apart: a graph can branch on the type)
        items = tuple([_signature(v, depth + 1, ids) for v in x])
        return items if type(x) is tuple else (type(x), items)
    if isinstance(x, dict):
        return tuple([(k, _signature(v, depth + 1, ids)) for k, v in x.items()])
    if isinstance(x, torch.nn.Module):
        return (type(x).__name__, _token(x), *_module_state(x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # settings (decode.acceptance.Sampling): by value
        kept = getattr(x, "__dict__", None)
        if kept is not None and "_signature" in kept:
            return kept["_signature"]
        values = [getattr(x, f.name) for f in dataclasses.fields(x)]
        sig = (type(x).__name__, *(_signature(v, depth + 1, ids) for v in values))
        if kept is not None and type(x).__dataclass_params__.frozen and all(isinstance(v, _PLAIN) for v in values):
            kept["_signature"] = sig  # frozen, of plain values: kept on it (fields, eq and hash ignore it)
        return sig
    if getattr(x, "signature_holds", False):  # a drafter given to a compiled call: its buffers' shapes too (_held)
        return (type(x).__name__, _held(x, ids))
    return (type(x).__name__, _token(x), getattr(x, "max_cache_len", None), getattr(x, "window", None))


_TOKENS: dict = {}  # id -> (a weak reference to the object, its token): see _token
_NEXT_TOKEN = itertools.count(1)
# `unkeyed`: set by _token when it met an object it cannot key (one that cannot be weakly referenced: a list or dict
# deep in the arguments, an object with __slots__); the call that computed the signature then keeps its guards
# (Compiled._call). Per thread: two threads' calls computing signatures at once do not clear each other's.
_UNKEYED = threading.local()


def _token(x) -> int:
    """A number for object x that no other object of this process gets, unlike id(x), which a new object can take once
    x is freed (a new model or KV cache at a freed one's address would otherwise match the freed one's signatures and
    run its graphs). An object that cannot be weakly referenced has none: id(x) stands in, and _UNKEYED says so (for
    the thread computing a signature)."""
    seen = _TOKENS.get(id(x))
    if seen is not None and seen[0]() is x:
        return seen[1]
    try:
        key = id(x)
        ref = weakref.ref(x, lambda _, key=key: _TOKENS.pop(key, None))
    except TypeError:
        _UNKEYED.unkeyed = True
        return id(x)
    token = next(_NEXT_TOKEN)
    _TOKENS[key] = (ref, token)
    return token


_PARAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module -> a weak reference to its first parameter


def _module_state(m: torch.nn.Module) -> tuple:
    """What a module's compiled graphs depend on besides its tensors' values: its training flag and its weights' dtype
    and device, read from its first parameter (`.to()`, `.half()`, `.train()` change the whole module in place, and a
    graph compiled for float32 weights or eval mode must not run after). Submodules switched one by one and Python
    attributes changed after a first call are not seen."""
    ref = _PARAMS.get(m)
    p = ref() if ref is not None else None
    if p is None:
        p = next(m.parameters(), None)
        if p is None:
            return (m.training,)
        _PARAMS[m] = weakref.ref(p)
    return (m.training, p.dtype, p.device)


def _held(obj, ids: list | None = None):
    """The shapes of the tensors an object holds (directly, or in a list / tuple: a drafter's KV buffers), which
    its compiled methods read; its Python numbers are left out: a graph that read one would recompile on every
    change, which tests rule out (see tests/test_compiled.py). ids: as _signature's."""
    # Every call of a chained step computes this (a drafter holds a few dozen attributes): the types that hold no
    # tensors are passed over first, and a list without tensors adds no entry.
    out = []
    for k, v in vars(obj).items():
        if type(v) in _NO_TENSORS:
            continue
        if isinstance(v, torch.Tensor):
            out.append((k, _signature(v, 0, ids)))
        elif isinstance(v, (list, tuple)):
            v = [t for t in v if isinstance(t, torch.Tensor)] or [t for p in v if isinstance(p, (list, tuple))
                                                                   for t in p if isinstance(t, torch.Tensor)]
            if v:
                out.append((k, tuple([_signature(t, 0, ids) for t in v])))
    return (_token(obj), tuple(out))


def _aliases(ids: list) -> tuple:
    """Which of a call's tensors (their ids in the order the signature walked them) are one and the same tensor: for
    each, the position of its first occurrence. Dynamo compiles a tensor given twice as one input of its graph and
    guards on it (`a is b`); a signature without it would run that graph for two different tensors of the same
    shapes once guards are skipped. () where every tensor is a different one."""
    if len(set(ids)) == len(ids):  # (nearly every call: a third of the time of the mapping below)
        return ()
    first = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))  # (the earliest position wins)
    return tuple(map(first.__getitem__, ids))


try:  # the stance's own setter: torch.compiler.set_stance's context manager costs ~20-40 us a call on a CPU
    from torch._dynamo.eval_frame import DynamoStance, _set_stance

    _SKIP = DynamoStance("default", skip_guard_eval_unsafe=True)
except ImportError:  # a torch without it (before 2.6): guards are always evaluated
    _set_stance = _SKIP = None


def remove_broken_builds(error: BaseException) -> list[str]:
    """Remove the built kernels in inductor's on-disk cache that a failed compile could not load, and return their
    paths. A build that is interrupted (a search or a job killed while it compiles) can leave an empty or short
    shared library there, which inductor then loads rather than builds again: every later compile of that graph, in
    any process using the cache, fails with an ImportError naming the file. Only files under the cache folder are
    touched; the next compile builds them again."""
    inner = getattr(error, "inner_exception", None) or error.__cause__
    if not isinstance(inner, (ImportError, OSError)):
        return []
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = os.path.realpath(cache_dir()) + os.sep
    broken = [p for p in re.findall(r"(/[^\s:'\"]+\.so)\b", str(inner))
              if os.path.realpath(p).startswith(root) and os.path.isfile(p)]
    for p in broken:
        try:
            os.remove(p)
        except FileNotFoundError:  # another process of the job removed it first
            pass
    return broken


def compiled_graphs() -> int:
    """Graphs dynamo compiled so far in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


RETIMES = 3  # at most so many runs again of a timed call that compiled (timed_without_compiling)


def timed_without_compiling(run, agree=lambda compiled: compiled, retimes: int = RETIMES):
    """run() (which waits for its device) timed so that no compiling is in the figure: a run during which dynamo
    compiled a graph (a shape met for the first time) is run again, up to `retimes` more times until one compiles
    nothing. Returns (the last run's result, its seconds, the seconds the first run took beyond it, or None when the
    first compiled nothing). agree: the answer every process goes by to "did it compile" (tensor parallel: rank 0's,
    so all ranks run again or none)."""
    def once():
        graphs, t0 = compiled_graphs(), time.perf_counter()
        out = run()
        return out, time.perf_counter() - t0, agree(compiled_graphs() != graphs)

    out, first, compiled = once()
    if not compiled or retimes <= 0:
        return out, first, None
    for _ in range(retimes):
        out, wall, compiled = once()
        if not compiled:
            break
    return out, wall, max(first - wall, 0.0)


def cpp_wrapper() -> bool:
    """Whether inductor graphs on a CPU call their kernels from generated C++ rather than Python (default yes;
    DRAFTLAB_CPP_WRAPPER=0: no). A verify forward of a small base is a few dozen kernels and matmuls of microseconds
    each, so the Python lines between them are a large part of its time. Not in a tensor-parallel process: graphs
    over sharded weights take a device mesh, which the C++ wrapper cannot pass."""
    if env_flag("DRAFTLAB_CPP_WRAPPER") is False:
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def use_compile_cache(directory) -> str:
    """Keep inductor's on-disk cache under `directory` for the rest of this process and the processes it starts (the
    code generated for each compiled graph, the C++ and Triton kernels built from it, AOTAutograd's traced graphs).
    A later process that compiles the same graphs with the same torch on the same kind of machine loads them from
    there rather than generating and building them again, which is most of a compile's time (docs/decoding.md,
    "Static shapes and compilation"). Torch's default is a per-user folder in the temporary directory, which a
    fresh machine, container or cluster node does not have. Each kind of CPU gets a folder of its own
    (machine_kind): torch keys a graph's entry by the GPU it was built for, but not by the CPU whose vector
    instructions its generated CPU code is written for, so machines of several kinds can share `directory` (a
    cluster's file system) without one loading code written for another. Call it before the first compile.
    Returns the folder in use."""
    path = os.path.join(os.path.abspath(os.path.expanduser(str(directory))), machine_kind())
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # what inductor reads each time it looks for its cache
    return path


def machine_kind() -> str:
    """A folder name for the CPU code this machine builds: its CPU model, a hash of its instruction-set flags (a
    virtual machine's model name can be generic) and torch's version. Not the GPU (torch keys its GPU entries by it,
    and asking for its name would start CUDA in every process of a launch)."""
    import hashlib
    import platform
    import re

    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:  # Linux (elsewhere: the platform's name for the processor)
            info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
        cpu, flags = info.get("model name", cpu), info.get("flags", "")
    except OSError:
        pass
    tag = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9.+]+", "-", f"{cpu}-{tag}-torch-{torch.__version__}").strip("-")


def compile_cache_report() -> dict:
    """Inductor's on-disk cache and how this process's compiles used it so far: `hits`, graphs whose generated code
    was loaded from it; `misses`, graphs generated and built (and then stored there)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    counts = torch._dynamo.utils.counters["inductor"]
    return {"dir": cache_dir(), "hits": counts["fxgraph_cache_hit"], "misses": counts["fxgraph_cache_miss"]}


def guards_skipped() -> bool:
    """Whether calls of a seen signature skip dynamo's guard evaluation (default yes; DRAFTLAB_COMPILE_GUARDS=1: no)."""
    return _SKIP is not None and env_flag("DRAFTLAB_COMPILE_GUARDS") is not True


def direct_calls() -> bool:
    """Whether calls of a seen signature run the compiled variant's code without dynamo's frame hook, where they can
    (a CPU; see the module's overview): yes, unless DRAFTLAB_COMPILE_DIRECT=0."""
    return env_flag("DRAFTLAB_COMPILE_DIRECT") is not False


def _count_resets() -> None:
    """Count the calls of torch._dynamo.reset and reset_code_caches (see the module's overview): a Compiled whose
    count is behind forgets its signatures."""
    import torch._dynamo

    for name in ("reset", "reset_code_caches"):
        fn = getattr(torch._dynamo, name, None)
        if fn is None or getattr(fn, "_draftlab_counted", False):
            continue

        def counted(*args, _fn=fn, **kwargs):
            _RESETS[0] += 1
            return _fn(*args, **kwargs)

        functools.update_wrapper(counted, fn)
        counted._draftlab_counted = True
        setattr(torch._dynamo, name, counted)


def _limit_reached() -> bool:
    """Whether some code object of this process met dynamo's recompile limit (it then runs the variants it has only,
    and other calls eagerly)."""
    return any("recompile limit" in str(k[1]).lower() for k in _graph_breaks())


def _last_variant(fn):
    """(code, guards) of the compiled variant of fn (a function or a bound method) that dynamo ran last: the front of
    its code object's cache, where dynamo puts the variant a call runs. Read right after a guarded call, that is the
    variant chosen by every guard, the backend's among them. None for what is not a Python function."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    func = getattr(fn, "__func__", fn)
    entries = _debug_get_cache_entry_list(func.__code__) if isinstance(func, types.FunctionType) else []
    return (entries[0].code, entries[0].guard_manager) if entries else None


def _graph_breaks() -> dict:
    """The graph breaks dynamo met so far in this process while compiling, by reason: those it compiled around, and
    those that made it skip a frame (a break inside a loop), which it counts apart."""
    counters = torch._dynamo.utils.counters
    return {**{("graph_break", k): v for k, v in counters["graph_break"].items()},
            **{("unimplemented", k): v for k, v in counters["unimplemented"].items()}}


def _function(fn) -> bool:
    """Whether fn is a Python function or a bound method of one (not a module or another callable)."""
    return isinstance(getattr(fn, "__func__", fn), types.FunctionType)


def _resumes(variant) -> bool:
    """Whether a compiled variant (_last_variant) has a graph break: its code calls a resume function."""
    return variant is not None and any(n.startswith("__resume_at") for n in variant[0].co_names)


def _variant_code(fn, variant, args: tuple, kwargs: dict):
    """The code of `variant` (_last_variant) as a callable taking fn's arguments, to call without dynamo's hook; None
    when its guards do not all pass on these arguments (the guarded call ran eagerly, past dynamo's recompile limit).
    (A variant with a graph break never comes here: its function keeps its guards.)"""
    func, owner = getattr(fn, "__func__", fn), getattr(fn, "__self__", None)
    code, guards = variant
    try:
        bound = inspect.signature(func, follow_wrapped=False).bind(*(() if owner is None else (owner,)), *args,
                                                                   **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    if not guards.check(dict(bound.arguments)):  # the frame's locals on entry, which the guards read
        return None
    if code.co_freevars != func.__code__.co_freevars:
        return None
    run = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    run.__kwdefaults__ = func.__kwdefaults__
    return run if owner is None else functools.partial(run, owner)


class Compiled:
    """fn through torch.compile with fixed shapes, an eager fallback, and guard evaluation only on a signature's first
    call (see the module's overview); `warmup_s` is the time the first calls of each new signature spent compiling
    (reported beside the speed figures, never hidden). graphs: CUDA graphs on a GPU (model forwards); keep_outputs:
    under CUDA graphs, return clones of the outputs, which then outlive the next graphed call (see the module's
    overview)."""

    def __init__(self, fn, backend: str = "inductor", device: str = "cpu", graphs: bool = False,
                 skip_guards: bool = True, keep_outputs: bool = False):
        self.model, self.backend = fn, backend  # `model`: what runs when compiling fails (any callable)
        # inductor: CUDA graphs on a GPU when asked; other backends (aot_eager, eager: tracing without code generation,
        # for tests and debugging) take no mode.
        mode = ("reduce-overhead" if device == "cuda" and graphs else "default") if backend == "inductor" else None
        options = None
        if mode == "default" and device == "cpu" and cpp_wrapper():
            mode, options = None, {"cpp_wrapper": True}  # see cpp_wrapper (torch.compile takes a mode or options)
        self.fn = torch.compile(fn, backend=backend, mode=mode, options=options, dynamic=False)
        if device == "cpu":
            gqa.install()  # grouped-query attention without copying keys and values inside compiled calls (decode.gqa)
        # Outputs under CUDA graphs (see the module's overview): emulated, and cloned where they must outlive the next
        # graphed call.
        self.graphs, self.keep_outputs, self.cudagraphs = graphs, keep_outputs, mode == "reduce-overhead"
        # dynamo keeps at most `recompile_limit` (8) variants of one code object, and every model of a class shares
        # its forward's: batch sizes, tree sizes and cache lengths of one server easily pass 8, after which dynamo
        # would run the forward eagerly without a word.
        cfg = torch._dynamo.config
        for name, least in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 1024),
                            ("accumulated_cache_size_limit", 1024)):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), least))
        _count_resets()
        self.resets = _RESETS[0]
        self.failures: dict = {}  # whose calls run eagerly (_whose), and why
        self.limit: str | None = None  # why calls of new shapes run eagerly: dynamo's recompile limit
        self.skip_guards = skip_guards  # False for a function with few guards: its signature would cost more
        self.warmup_s = 0.0
        self.calls = 0  # calls that went through the compiled function
        self.skip: set = set()  # signatures whose guarded first call is done: later calls skip guard evaluation
        self.guarded: set = set()  # signatures that keep their guards (see __call__)
        self.states: list = []  # the global states its calls have met (_global_state)
        self.breaks = False  # whether compiling it met a graph break (then every call keeps its guards)
        self.owner = getattr(fn, "__self__", None)  # a bound method's object: its tensors are part of the signature
        self.module = fn if isinstance(fn, torch.nn.Module) else None  # a module compiled itself: its state too
        # signature -> the variant its guarded call ran (_last_variant), then its code called without dynamo's hook
        # (None: with it; see _variant_code). None where calls keep the hook: a GPU, a module.
        self.direct: dict | None = {} if device == "cpu" and not isinstance(fn, torch.nn.Module) else None

    def _global_state(self) -> int:
        """Which of the global states this function's calls have met is the current one: grad mode, autocast (per
        device, with its dtype), deterministic algorithms and the rest of what dynamo's global state guard compares,
        by that guard itself (0.1 us a check). A graph compiled outside autocast would otherwise run inside it."""
        for i, state in enumerate(self.states):
            if state.check():
                return i
        self.states.append(torch._C._dynamo.guards.GlobalStateGuard())
        return len(self.states) - 1

    def __call__(self, *args, **kwargs):
        was, fuse.ACTIVE[0] = fuse.ACTIVE[0], True  # fused projections run fused inside compiled calls (decode.fuse)
        try:
            return self._outputs(*args, **kwargs)
        finally:
            fuse.ACTIVE[0] = was

    def _outputs(self, *args, **kwargs):
        emulated = self.graphs and EMULATE_GRAPH_OUTPUTS[0]
        if not (emulated or (self.keep_outputs and self.cudagraphs)):
            return self._call(*args, **kwargs)
        if emulated:
            _overwrite_pool()
        out = self._call(*args, **kwargs)
        if emulated:
            _into_pool(out, (args, kwargs))
        if self.keep_outputs:
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
        return out

    @property
    def failed(self) -> str | None:
        """Why calls run eagerly, if some do: compiling failed (for a function shared by decoders, the first model
        it failed for: see failed_for), or dynamo's recompile limit was reached."""
        return next(iter(self.failures.values()), None) or self.limit

    def failed_for(self, model) -> str | None:
        """failed, for the calls whose first argument is `model` (a function shared by decoders, each with its base:
        one base that does not compile leaves the others' calls compiled)."""
        return self.failures.get(_token(model) if isinstance(model, torch.nn.Module) else None) or self.limit

    @staticmethod
    def _whose(args: tuple):
        """Whose failure a call shares: its first argument's, where that is a model (a shared step's base)."""
        return _token(args[0]) if args and isinstance(args[0], torch.nn.Module) else None

    def _call(self, *args, **kwargs):
        if self.failures and self._whose(args) in self.failures:
            return self.model(*args, **kwargs)
        if self.resets != _RESETS[0]:  # dynamo forgot its variants: so does every signature recorded
            self.resets = _RESETS[0]
            self.skip, self.guarded = set(), set()
            if self.direct is not None:
                self.direct = {}
        self.calls += 1
        key = None
        if self.skip_guards and not self.breaks and guards_skipped():
            ids: list = []  # every tensor the signature walks, for _aliases
            _UNKEYED.unkeyed = False
            key = (_signature(args, 0, ids), _signature(kwargs, 0, ids), self._global_state(),
                   None if self.owner is None else _held(self.owner, ids), _aliases(ids),
                   None if self.module is None else _module_state(self.module))
            if _UNKEYED.unkeyed:  # an object no signature can key: this call keeps its guards
                key = None
            if key in self.skip:
                if self.direct is not None and direct_calls():
                    run = self.direct.get(key)
                    if isinstance(run, tuple):  # the signature's second call: its variant's guards checked once
                        run = self.direct[key] = _variant_code(self.model, run, args, kwargs)
                    if run is not None:
                        return run(*args, **kwargs)
                prior = _set_stance(_SKIP)
                try:
                    return self.fn(*args, **kwargs)
                except RuntimeError as e:  # no compiled variant fits, and dynamo says so rather than run a wrong one:
                    # the first call ran eagerly (past dynamo's recompile limit). This signature keeps its guards.
                    if "skip_guard_eval_unsafe" not in str(e):
                        raise
                    self.skip.discard(key)
                    self.guarded.add(key)
                finally:
                    _set_stance(prior)
        graphs, t0 = compiled_graphs(), time.perf_counter()
        record = key is not None and key not in self.guarded  # a signature's first call: recorded below
        breaks = _graph_breaks() if record else None
        for retry in (False, True):
            try:
                out = self.fn(*args, **kwargs)
                break
            except torch._dynamo.exc.TorchDynamoException as e:  # tracing or code generation failed (not a runtime
                # error of the model such as out-of-memory, which is raised): run eagerly, as the reference does,
                # unless the cache held a broken build (remove_broken_builds), which is built again once
                name = getattr(self.model, "__qualname__", type(self.model).__name__)
                if self.breaks or compiled_graphs() != graphs:  # a graph before the failure may have run its part
                    raise RuntimeError(
                        f"draftlab: {name} does not compile ({type(e).__name__}), and the part of it before a graph "
                        "break may already have run compiled (writing to a KV cache, say): running it again eagerly "
                        "or compiling it again would repeat that part. Decode without compiling (no --compile or "
                        "--static; compile=False).") from e
                broken = [] if retry else remove_broken_builds(e)
                if broken:
                    print(f"draftlab: {name}: removed {len(broken)} unreadable file(s) from the compile cache, left by "
                          f"an interrupted build ({broken[0]}); compiling again", file=sys.stderr)
                    continue
                lines = str(e).splitlines()
                why = self.failures[self._whose(args)] = f"{type(e).__name__}: {' '.join(lines[:2])}"
                _say(f"draftlab: {name} does not compile ({why}); decoding eagerly", why)
                return self.model(*args, **kwargs)
        if compiled_graphs() != graphs:  # this call compiled
            self.warmup_s += time.perf_counter() - t0
        now = None if breaks is None else _graph_breaks()
        if now != breaks:
            self.breaks = True  # no signature from now on (see the module's overview)
            name = getattr(self.model, "__qualname__", type(self.model).__name__)
            new = [str(k[1]) for k in now if now[k] != breaks.get(k)]
            if any("recompile limit" in w.lower() for w in new):
                cfg = torch._dynamo.config
                self.limit = ("dynamo's recompile limit: calls of new shapes run eagerly (raise "
                              f"torch._dynamo.config.recompile_limit, now {getattr(cfg, 'recompile_limit', '?')}, "
                              f"or accumulated_recompile_limit, now {getattr(cfg, 'accumulated_recompile_limit', '?')})")
                _say(f"draftlab: {name} reached {self.limit}; the tokens are the same, slower", self.limit)
            else:
                why = "; ".join(new)[:200]
                _say(f"draftlab: {name} has a graph break ({why}); its compiled calls keep dynamo's guards on every "
                     "call (slower, not wrong)", why)
        if record:
            variant = _last_variant(self.model)  # the variant this guarded call ran
            if variant is not None and _limit_reached() and _variant_code(self.model, variant, args, kwargs) is None:
                variant = None  # the front variant is another signature's: this call ran eagerly, past the limit
            if self.breaks or _resumes(variant) or (variant is None and (_function(self.model) or _limit_reached())):
                self.guarded.add(key)  # code past a graph break can hang on values no signature holds (.item())
            else:
                self.skip.add(key)
                if self.direct is not None and direct_calls():
                    self.direct[key] = variant
        return out


_SAID: dict = {}  # reason -> lines said for it (_say)


def _say(line: str, reason: str) -> None:
    """A line on stderr, once per reason in this process; the functions that meet the same reason later are counted
    on one more line at most (a base that does not compile is met by its forward, the verify step and the drafter's
    steps: one line, not four)."""
    n = _SAID[reason] = _SAID.get(reason, 0) + 1
    if n == 1:
        print(line, file=sys.stderr)
    elif n == 2:
        print("draftlab: (and other compiled calls, for the same reason)", file=sys.stderr)


# DRAFTLAB_EMULATE_GRAPH_OUTPUTS (the module's overview): whether it is on (tests set it), and the outputs of the last
# graphed call, which the next overwrites
EMULATE_GRAPH_OUTPUTS = [env_flag("DRAFTLAB_EMULATE_GRAPH_OUTPUTS") is True]
_POOL: list = []


def _storages(x, found: set, depth: int = 0) -> set:
    """The storages (data pointers) of the tensors x holds: in containers, a module's parameters and buffers, an
    object's attributes (a KV cache, a drafter), a few levels down."""
    if isinstance(x, torch.Tensor):
        found.add(x.untyped_storage().data_ptr())
    elif isinstance(x, torch.nn.Module):
        found.update(t.untyped_storage().data_ptr() for t in (*x.parameters(), *x.buffers()))
    elif depth < 4:
        items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else (
            vars(x).values() if hasattr(x, "__dict__") and not isinstance(x, type) else ())
        for v in items:
            _storages(v, found, depth + 1)
    return found


def _into_pool(out, inputs) -> None:
    """Note a graphed call's outputs for _overwrite_pool, less those that alias what it was given (CUDA graphs
    return those as they are, outside their pool)."""
    given = _storages(inputs, set())
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in given:
            _POOL.append(t)


def _overwrite_pool() -> None:
    """Overwrite the last graphed call's outputs, each storage once, as the next call's CUDA graph would."""
    seen = set()
    with torch.inference_mode():
        for t in _POOL:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
            if t.dtype == torch.bool:
                whole.logical_not_()
            elif t.is_floating_point():
                whole.fill_(float("nan"))
            else:
                whole.fill_(torch.iinfo(t.dtype).min // 2 if t.dtype != torch.uint8 else 255)
    _POOL.clear()


def compile_backend(compile: bool | str) -> str | None:
    """The torch.compile backend a `compile` option names: True is inductor (or the one DRAFTLAB_COMPILE_BACKEND
    names, e.g. eager / aot_eager to trace without generating code), a string names one, False / None: no compiling."""
    if compile is True:
        return os.environ.get("DRAFTLAB_COMPILE_BACKEND", "inductor")
    return compile or None


class _OnModel(dict):
    """A model's compiled forwards, by backend, kept on the model: a copy or a pickle of the model gets none (a
    compiled forward is of the model it was made for, and dynamo's wrapper cannot be copied)."""

    def __deepcopy__(self, memo):
        return _OnModel()

    def __reduce__(self):
        return _OnModel, ()


def compiled_forward(model, backend: str = "inductor") -> Compiled:
    """The process's compiled forward of `model` with `backend` (made on first use, then shared). Kept on the model
    itself: a registry holding it would keep every model ever compiled alive (its Compiled refers to it)."""
    fns = model.__dict__.setdefault("_draftlab_compiled", _OnModel())
    if backend not in fns:
        fns[backend] = Compiled(model, backend, next(model.parameters()).device.type, graphs=True, keep_outputs=True)
    return fns[backend]


def compiled_function(fn, backend: str, device: str = "cpu", graphs: bool = False, skip_guards: bool = False,
                      keep_outputs: bool = False) -> Compiled:
    """The process's compiled form of the function fn for `backend` on a device type (made once, then shared).
    graphs, skip_guards, keep_outputs: as Compiled's (a function of a few tensors evaluates its guards faster than
    its signature)."""
    fns = _COMPILED.setdefault(fn, {})
    key = (backend, device, graphs, skip_guards, keep_outputs)
    if key not in fns:
        fns[key] = Compiled(fn, backend, device, graphs=graphs, skip_guards=skip_guards, keep_outputs=keep_outputs)
    return fns[key]


def method_failure(obj) -> str | None:  # (`failed` covers the recompile limit too)
    """Why one of obj's compiled methods (compiled_method) runs eagerly, if one does."""
    return next((c.failed for c in obj.__dict__.get("_compiled", {}).values() if c.failed), None)


def compiled_method(obj, name: str, backend: str) -> Compiled:
    """The compiled form of obj's method `name` with `backend` (made once per object and backend): a drafter's step
    over its own buffers, whose shapes are part of each call's signature. Under CUDA graphs on a GPU (the buffers it
    writes in place marked with decode.cache.static_buffer), its outputs cloned: the drafter reads them after the
    next graphed call."""
    cache = obj.__dict__.setdefault("_compiled", {})
    if (name, backend) not in cache:
        device = next((v.device.type for v in vars(obj).values() if isinstance(v, torch.Tensor)), "cpu")
        cache[(name, backend)] = Compiled(getattr(obj, name), backend, device, graphs=True, keep_outputs=True)
    return cache[(name, backend)]
