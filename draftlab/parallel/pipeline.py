"""Pipelined drafting and verification of a request stream (Minions' pipeline), lossless.

Two processes: the verifier (this one: the base) and a drafter worker (a small draft model: SSMs, SSM ensembles,
lookup; on a GPU node it sits on its own GPU). Requests are decoded in groups of `batch_size` (the verifier's
batch); `in_flight` groups are open at once, so while the base verifies one group's drafts the drafter drafts
another's. A group's drafts wait in the intermediate result pool until the verifier takes them; the drafter
pauses while the pool holds at least `batch_size` requests and resumes when the verifier takes a group (so
drafted-but-unverified requests, and the KV memory they pin, stay bounded). When a group ends, the next
`batch_size` requests of the stream open a new one.

The groups' drafters learn online as one: a vote ensemble's weights, schedule and adaptive length are shared
by every group, and the adaptive length follows the verifier's time per verified token (Minions' t_LLM; the
`metric: verify` ensemble option, set here unless the caller sets another).

Each step of a group is exactly a step of the plain decoder (draftlab.decode.decoder.Verifier + the same
Drafter), so greedy output equals plain greedy decoding and sampling keeps the target distribution.

Deviation from Minions: there the verifier batches whichever drafted requests are in the pool; here a batch is a
fixed group whose KV cache the verifier keeps as one batched cache (per-request caches would have to be
re-batched every step), so the pool is counted in requests but taken a group at a time.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import queue
import time
from dataclasses import dataclass, field

import torch

from ..decode.acceptance import Sampling
from ..decode.decoder import Verifier, eos_set, sync_device


class PipelineError(RuntimeError):
    """The drafter cannot run apart from the base, or the drafter worker failed."""


def move(obj, device):
    """Tensors inside (nested dataclasses / dicts / lists of) obj moved to device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: move(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (torch.Tensor, dict)):
        return type(obj)(move(v, device) for v in obj)
    return obj


def pack_proposal(prop, sent: set):
    """A proposal for the wire: a static tree's view (the same every step of a group) travels once per group and
    batch shape; later steps name it by key."""
    view = prop.view
    if view.static is None:
        return move(prop, "cpu"), None
    key = (id(view.static), tuple(view.parents.shape))
    light = dataclasses.replace(prop, view=None, tokens=prop.tokens.cpu(), q=move(prop.q, "cpu"),
                                q_index=move(prop.q_index, "cpu"))
    if key in sent:
        return light, key
    sent.add(key)
    return (light, move(view, "cpu")), key


def unpack_proposal(packed, key, views: dict, device):
    if key is None:
        return move(packed, device)
    if isinstance(packed, tuple):
        packed, views[key] = packed[0], move(packed[1], device)
    return dataclasses.replace(move(packed, device), view=views[key])


def _send(q, msg) -> None:
    q.put(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))  # plain bytes: no shared-memory handles per tensor


def _recv(q):
    return pickle.loads(q.get())


def _drafter_worker(export: str, tree, options: dict, device: str, threads: int, inbox, pool,
                    path: dict | None = None) -> None:
    """The drafter process: drafts for any open group of the current run with a root, while the pool is below its
    limit. Every message names its run; a message of another run (left over from an interrupted one) is dropped."""
    from .workers import die_with_parent, error_message

    die_with_parent()
    try:
        from ..drafters import make_drafter
        from ..interop.export import load_export
        from ..serve.generate import resolve_tree
        from ..decode.streams import role_generator

        torch.set_num_threads(threads)
        draft, meta = load_export(export, base=None, device=device)
        if meta["head"]["type"] == "ensemble":  # Minions: the adaptive length follows the verifier's time alone
            options = {**options, "options": {"metric": "verify", **(options.get("options") or {})}}
        probe = make_drafter(draft, resolve_tree(tree, meta), **options)
        if probe.hidden_layers:
            raise PipelineError(f"a {meta['head']['type']} drafter reads the base's hidden states, so it cannot draft "
                                "in a process apart from the base; pipelining is for separate draft models (ssm, "
                                "ensembles of SSMs, lookup)")
        _send(pool, ("ready", probe.max_nodes))
        run, groups, ready, pool_size, limit, stats, sent, gen = None, {}, [], 0, None, {}, set(), None
        while True:
            if ready and (limit is None or pool_size < limit):
                g = ready.pop(0)
                drafter, root, rows = groups[g]
                t0 = time.perf_counter()
                prop = drafter.propose(root)
                sync_device(device)
                draft_s = time.perf_counter() - t0
                stats["draft_s"] += draft_s
                pool_size += rows
                stats["pool_max"] = max(stats["pool_max"], pool_size)
                stats["drafts"] += 1
                _send(pool, ("proposal", run, g, *pack_proposal(prop, sent), draft_s, rows))
                continue
            if ready:
                stats["paused"] += 1  # the pool is full: wait for the verifier to take a group
            t0 = time.perf_counter()
            msg = _recv(inbox)
            if stats:
                stats["idle_s"] += time.perf_counter() - t0
            kind = msg[0]
            if kind == "run":  # a new stream: its pool limit, random stream and fresh counters; old groups dropped
                _, run, limit, seed = msg
                groups, pool_size, ready, sent = {}, 0, [], set()
                gen = role_generator(seed, "drafter", device)
                stats = {"paused": 0, "pool_max": 0, "drafts": 0, "idle_s": 0.0, "draft_s": 0.0, "commit_s": 0.0}
            elif kind == "stop":
                return
            elif msg[1] != run:
                continue
            elif kind == "taken":
                pool_size -= msg[2]
            elif kind == "begin":
                _, _, g, prompt, root, sampling = msg
                drafter = make_drafter(draft, resolve_tree(tree, meta), **options)
                drafter.share_state(probe)  # one vote / schedule / adaptive length learned over all groups
                drafter.decode_path = path  # the static / compiled path when the pipeline compiles
                drafter.begin(move(prompt, device), sampling, gen)
                groups[g] = [drafter, root.to(device), root.shape[0]]
                ready.append(g)
            elif kind == "commit":
                _, _, g, step = msg
                step = move(step, device)
                t1 = time.perf_counter()
                groups[g][0].commit(step)
                stats["commit_s"] += time.perf_counter() - t1
                groups[g][1:] = [step.bonus, int(step.live.sum())]  # the next root; rows still decoding
                ready.append(g)
            elif kind == "end":
                groups.pop(msg[2], None)
            elif kind == "stats":  # with what the drafters learned together (an ensemble's weights and length)
                _send(pool, ("stats", run, {**stats, "state": probe.describe(), "decode_path": path}))
    except BaseException:  # noqa: BLE001 - reported to the verifier, which raises it
        _send(pool, error_message("pipeline drafter"))


@dataclass
class PipelineResult:
    """Tokens per request (stream order) and what the run cost."""

    tokens: list[list[int]]
    wall_s: float = 0.0
    steps: int = 0
    committed: int = 0  # tokens committed over all verification steps
    rows: int = 0  # request-steps verified
    verify_s: float = 0.0  # the verifier's forwards + acceptance
    verifier_wait_s: float = 0.0  # the verifier waiting for drafts (the pipeline's bubble)
    drafter: dict = field(default_factory=dict)  # the drafter's paused / pool_max / drafts / idle_s

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def accept_length(self) -> float:
        return self.committed / self.rows if self.rows else 0.0


class DraftPipeline:
    """The base here, the drafter of `export` in a worker process (started once, reused for every stream).

        with DraftPipeline(base, "runs/ssm/export", tree="chain:3") as pipe:
            res = pipe.run(prompts, batch_size=8)

    The worker dies with this process; its failures reach `run` as a PipelineError with the worker's traceback,
    and a dead or silent worker is noticed within a second or `timeout_s`. Each run has its own id, which every
    message carries: nothing left over from an interrupted run is taken for the next run's, and a proposal whose
    root is not its rows' current root is refused."""

    def __init__(self, base, export: str, tree: str | None = None, drafter_options: dict | None = None,
                 drafter_device: str | None = None, drafter_threads: int = 1, seed: int = 0,
                 timeout_s: float = 600.0, compile: bool | str = False):
        """compile: the static-shape compiled path on both sides, as SpeculativeDecoder's `compile` (True: the
        inductor backend or DRAFTLAB_COMPILE_BACKEND; a string names a torch.compile backend): the verifier's
        forwards through the base's compiled forward, trees padded to the drafter's max_nodes, and the drafter's
        own forwards on its static path. The first run compiles; warm up with a short run before timing."""
        self.base, self.timeout_s, self.seed, self.runs = base, timeout_s, seed, 0
        self.free_caches: list = []  # static path: finished groups' caches, for the next groups (static_slot_cache)
        self.device = base.get_output_embeddings().weight.device
        self.forward, path = None, None
        if compile:
            from ..decode.compiled import compile_backend, compiled_forward

            backend = compile_backend(compile)
            self.forward, path = compiled_forward(base, backend), {"static": True, "compile": backend}
        ctx = mp.get_context("spawn")
        self.inbox, self.pool = ctx.Queue(), ctx.Queue()
        self.worker = ctx.Process(target=_drafter_worker, daemon=True, name="pipeline-drafter",
                                  args=(export, tree, drafter_options or {}, drafter_device or str(self.device),
                                        drafter_threads, self.inbox, self.pool, path))
        from .workers import reading_end_only, start_workers

        try:
            start_workers([self.worker])
            reading_end_only(self.pool)
            (_, self.max_nodes), _ = self._receive()  # ("ready", max_nodes): the drafter is loaded
        except BaseException:
            self.close()
            raise

    def _receive(self, run=None):
        """The next message of `run` from the worker (messages of other runs are dropped) and how long it took."""
        from .workers import WorkerError, receive

        t0 = time.perf_counter()
        while True:
            try:
                msg = receive(self.pool, [self.worker], self.timeout_s, "pipeline", loads=pickle.loads)
            except WorkerError as e:
                raise PipelineError(str(e)) from None
            if run is None or msg[1] == run:
                return msg, time.perf_counter() - t0

    @torch.no_grad()
    def run(self, prompts: list[list[int]], batch_size: int = 8, in_flight: int = 2, max_new_tokens: int = 128,
            sampling: Sampling | None = None, eos_token_id=None, pool_limit: int | None | str = "batch",
            seed: int | None = None) -> PipelineResult:
        """Decode a stream of prompts. batch_size: requests the verifier verifies per forward (one group);
        in_flight: groups open at once (2 lets drafting and verification overlap); pool_limit: the drafter pauses
        while the pool holds this many requests ('batch': batch_size, Minions' rule; None: it never pauses);
        seed (default: the pipeline's): the verifier draws from role_generator(seed, "verifier"), the drafter
        from role_generator(seed, "drafter")."""
        from ..decode.streams import role_generator

        if batch_size < 1 or in_flight < 1:
            raise ValueError("batch_size and in_flight must be >= 1")
        if not (pool_limit in ("batch", None) or (isinstance(pool_limit, int) and pool_limit >= 1)):
            raise ValueError(f"pool_limit {pool_limit!r}: 'batch', None or a number of requests >= 1 (with 0 the "
                             "drafter would never draft)")
        sampling, dev = sampling or Sampling(), self.device
        seed = self.seed if seed is None else seed
        gen = role_generator(seed, "verifier", dev)
        eos = eos_set(eos_token_id)
        self.runs += 1
        run = self.runs
        res = PipelineResult(tokens=[[] for _ in prompts])
        open_groups: dict[int, tuple[Verifier, list[int], torch.Tensor]] = {}  # group -> verifier, requests, root
        views: dict = {}  # static tree views by the drafter's key
        cursor = {"prompt": 0, "group": 0}

        def finish(v: Verifier, idx: list[int]) -> None:
            if self.forward:
                self.free_caches.append(v.target)
            for i, toks in zip(idx, v.res.tokens):
                res.tokens[i] = toks
            res.steps += v.res.steps
            res.committed += sum(v.res.committed)
            res.rows += sum(v.res.rows_per_step)

        def open_group() -> None:
            """Prefill the next prompts and hand them to the drafter; a group whose rows all end with their first
            token (EOS, or max_new_tokens 1) is finished here, and the next one opened in its place."""
            while cursor["prompt"] < len(prompts):
                idx = list(range(cursor["prompt"], min(cursor["prompt"] + batch_size, len(prompts))))
                cursor["prompt"] += len(idx)
                v = Verifier(self.base, [prompts[i] for i in idx], max_new_tokens, sampling, eos, generator=gen,
                             static_nodes=self.max_nodes if self.forward else None, forward=self.forward,
                             cache=self.free_caches.pop() if self.free_caches else None)
                prompt, root = v.prefill()
                if v.done:
                    finish(v, idx)
                    continue
                g = cursor["group"]
                open_groups[g] = (v, idx, root.cpu())
                _send(self.inbox, ("begin", run, g, move(prompt, "cpu"), root.cpu(), sampling))
                cursor["group"] += 1
                return

        t_start = time.perf_counter()
        _send(self.inbox, ("run", run, batch_size if pool_limit == "batch" else pool_limit, seed))
        try:
            while cursor["prompt"] < len(prompts) and len(open_groups) < in_flight:
                open_group()
            while open_groups:
                (_, _, g, packed, key, draft_s, rows), waited = self._receive(run)
                res.verifier_wait_s += waited
                _send(self.inbox, ("taken", run, rows))
                v, idx, root = open_groups[g]
                tokens = (packed[0] if isinstance(packed, tuple) else packed).tokens
                live = torch.tensor(v.live_host)
                if not torch.equal(tokens[:, 0][live], root[live]):
                    raise PipelineError(f"a proposal for group {g} does not start at its rows' current root (a stale "
                                        "or misrouted message); refusing to verify it")
                t0 = time.perf_counter()
                step = v.verify(unpack_proposal(packed, key, views, dev), draft_s)
                res.verify_s += time.perf_counter() - t0
                if v.done:
                    _send(self.inbox, ("end", run, g))
                    del open_groups[g]
                    finish(v, idx)
                    open_group()
                else:
                    open_groups[g] = (v, idx, step.bonus.cpu())
                    _send(self.inbox, ("commit", run, g, move(step, "cpu")))
            res.wall_s = time.perf_counter() - t_start
            _send(self.inbox, ("stats", run))
            res.drafter = self._receive(run)[0][2]
        except BaseException:
            if self.worker.is_alive():
                _send(self.inbox, ("run", None, None, seed))  # the worker drops this run's groups
            raise
        return res

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (asked first, then terminated); safe to call twice. Until it exits, what it still sends is
        read and dropped: a worker writing a proposal larger than the pipe holds (a run interrupted with Ctrl-C
        leaves one) reads its stop only once that write ends, and close() waited out its whole timeout for it."""
        from .workers import stop_workers

        if self.worker.is_alive():
            _send(self.inbox, ("stop",))
            deadline = time.perf_counter() + timeout_s
            while self.worker.is_alive() and time.perf_counter() < deadline:
                try:
                    self.pool.get(timeout=0.05)
                except (queue.Empty, EOFError, OSError):
                    pass
        stop_workers([self.worker], timeout_s=0.0, queues=(self.inbox,))  # (waited above: one still alive is ended)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sequential_generate(decoder, prompts: list[list[int]], batch_size: int = 8, max_new_tokens: int = 128,
                        sampling: Sampling | None = None, eos_token_id=None, seed: int = 0) -> PipelineResult:
    """The same stream through the plain decoder, batch after batch in one process (the baseline)."""
    gen = torch.Generator(device=decoder.device).manual_seed(seed)
    res = PipelineResult(tokens=[])
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        r = decoder.generate(prompts[s:s + batch_size], max_new_tokens, sampling, eos_token_id, generator=gen)
        res.tokens += r.tokens
        res.steps += r.steps
        res.committed += sum(r.committed)
        res.rows += sum(r.rows_per_step)
        res.verify_s += r.time_s["verify"] + r.time_s["accept"]
    res.wall_s = time.perf_counter() - t0
    return res
