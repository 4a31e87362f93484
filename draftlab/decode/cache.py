"""A stock Hugging Face causal LM decoding trees over its own KV cache: the base when it verifies, a
small drafter LM when it drafts.

Rows of a batch commit different numbers of tokens per step, so every row keeps its own set of
valid cache slots (`valid` [B, L]); slots a row did not fill are holes it never attends to. Tree
tokens are appended as tentative slots with a 4D mask (each sees the row's valid slots and its own
ancestors) and explicit positions; `keep` then moves the accepted ones into place and crops the rest.
"""

from __future__ import annotations

import functools

import torch


class UnsupportedBaseError(ValueError):
    """The architecture cannot run tree verification (4D masks / croppable KV cache)."""


def cache_layers(cache):
    """(keys, values) tensors of each layer of a DynamicCache, as a list of layer objects."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(l, "keys") for l in layers):
        raise UnsupportedBaseError("the KV cache of this model is not a per-layer key/value cache "
                                   "(DynamicCache); tree decoding needs one")
    return layers


def compact_cache(cache, start: int, keep: torch.Tensor) -> None:
    """Move slots start+keep[b] to start.. for each row b, then crop to start + keep.shape[1]. keep [B, M]."""
    m = keep.shape[1]
    for layer in cache_layers(cache):
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [B, kv_heads, L, d]
            idx = (start + keep)[:, None, :, None].expand(t.shape[0], t.shape[1], m, t.shape[3])
            # Gather first (the source and destination slots overlap), write in place, crop as a view:
            # no copy of the committed prefix.
            t[:, :, start:start + m] = t.gather(2, idx)
            setattr(layer, name, t[:, :, :start + m])


def causal_allowed(valid: torch.Tensor) -> torch.Tensor:
    """valid [B, S] -> allowed [B, S, S]: causal over valid positions; every position attends to itself
    (so no softmax row is empty)."""
    S = valid.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=valid.device).tril()
    return (causal[None] & valid[:, None, :].bool()) | torch.eye(S, dtype=torch.bool, device=valid.device)[None]


def reserved_mask(allowed: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, window: int, dtype: torch.dtype,
                  pos: torch.Tensor | None = None, spans: tuple | None = None):
    """The additive attention mask [B, 1, N, window] of N entries a caller's own forward writes into a static cache
    whose slots from n (a tensor: the committed ones before them) it reserved (StaticSlotCache.reserve): each entry
    sees the committed valid slots (slots [B, >= window]) and the reserved ones allowed [B or 1, N, T] marks. Where
    the model has sliding-window or chunked layers (spans: layer_spans), pos [B, N] are the entries' positions and
    the masks are span_masks'. Tensor operations only, so one compiled graph serves every step."""
    T = allowed.shape[-1]
    rel = torch.arange(window, device=slots.device) - n  # slot -> its index among the reserved ones
    tent = allowed[..., rel.clamp(0, T - 1)] & ((rel >= 0) & (rel < T))  # [B or 1, N, window]
    seen = slots[:, None, :window] | tent
    far = None
    if spans:
        far = behind(slots[:, :window], pos)
        if T == allowed.shape[-2]:  # a block whose reserved slots are its own entries (a feed): their positions
            far = torch.where(tent, apart(pos)[..., rel.clamp(0, T - 1)], far)
    return span_masks(seen, far, pos, spans, dtype)


def behind(slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """How many positions each committed valid slot (slots [B, S]) lies behind each of N queries at positions pos
    [B, N]: [B, N, S] int32 (the size of a float32 mask), 0 at the other slots. A valid slot's position is the number
    of valid slots before it (a row's positions count its own tokens, and its valid slots stay in text order through
    keep and defragment)."""
    far = pos.to(torch.int32)[:, :, None] - (slots.cumsum(-1, dtype=torch.int32) - 1)[:, None, :]
    return far.masked_fill_(~slots[:, None, :], 0)


def apart(pos: torch.Tensor) -> torch.Tensor:
    """How many positions each of N tokens at positions pos [B, N] lies behind each of them: [B, N, N] int32."""
    pos = pos.to(torch.int32)
    return pos[:, :, None] - pos[:, None, :]


def distances(committed: torch.Tensor, pos: torch.Tensor, T: int, width: int | None = None) -> torch.Tensor:
    """span_masks' distances [B, N, width] over a cache's slots: the committed ones (committed [B, L], valid or not:
    behind), then T tentative ones of which the last N are the queries at positions pos [B, N] (apart; the earlier
    ones are their ancestors, counted as near), then unwritten ones up to width (default L + T)."""
    (B, N), L = pos.shape, committed.shape[1]
    zeros = lambda n: torch.zeros(B, N, n, dtype=torch.int32, device=pos.device)  # noqa: E731
    return torch.cat([behind(committed, pos), zeros(T - N), apart(pos), zeros((width or L + T) - L - T)], dim=2)


def span_masks(seen: torch.Tensor, far: torch.Tensor | None, pos: torch.Tensor | None, spans: tuple | None,
               dtype: torch.dtype):
    """The additive attention mask [B, 1, N, S] of seen [B, N, S] (what each of N queries, at positions pos [B, N],
    may attend to). Where some of the model's layers attend over a sliding window or in chunks (spans: layer_spans),
    such a layer attends only to the slots less than its window behind the query (far [B, N, S], see behind), or to
    those of the query's chunk (no further behind than the query's offset in its chunk): one mask where every layer
    attends alike (Mistral), else a dict of one per layer type (Gemma 3, gpt-oss, Llama 4: transformers' models with
    layer types take one)."""
    def additive(ok):
        return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, torch.finfo(dtype).min)[:, None]

    def within(limit):
        if limit is None:
            return seen
        kind, size = limit
        if kind == "window":
            return seen & (far < size)
        return seen & (far <= (pos.to(torch.int32) % size)[:, :, None])  # a chunk: from its first position on
    if not spans:
        return additive(seen)
    masks = {limit: additive(within(limit)) for limit in {limit for _, limit in spans}}
    return next(iter(masks.values())) if len(masks) == 1 else {kind: masks[limit] for kind, limit in spans}


def mark_valid(slots: torch.Tensor, ok: torch.Tensor, n: torch.Tensor) -> None:
    """In place: the reserved slots n .. n + T - 1 (n a tensor) become valid where ok [B, T] is (the caller committed
    them; StaticSlotCache.commit_reserved then counts them). Tensor operations only."""
    T = ok.shape[1]
    rel = torch.arange(slots.shape[1], device=slots.device) - n
    slots |= ok.gather(1, rel.clamp(0, T - 1)[None].expand(ok.shape[0], -1)) & ((rel >= 0) & (rel < T))


def _layer_windows(model) -> list[tuple[str, int | None]]:
    """(layer type, sliding window or attention chunk or None) of each of the model's layers that keeps a cache."""
    config = model.config.get_text_config(decoder=True)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(config)
    except (ImportError, AttributeError):  # a transformers without per-layer configs: the model-wide fields
        window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
        types = types or ["sliding_attention" if window else "full_attention"]  # (Mistral's have no layer types)
        return [(t, window if t == "sliding_attention" else None) for t in types]
    return [(t, k.get("sliding_window")) for t, k in zip(types, kwargs) if t != "dummy"]


def layer_spans(model) -> tuple | None:
    """How far back each of the model's layer types attends, where some layers attend over a sliding window or in
    chunks: ((layer type, None for the whole text, ("window", w) or ("chunk", c)), ...); None where every layer
    attends to the whole text. draftlab's caches keep every layer's whole text (full_layers) and its masks apply the
    windows and chunks (span_masks), so a run may be as long as the model allows."""
    spans = {t: (None if not w else ("chunk", w) if t == "chunked_attention" else ("window", w))
             for t, w in _layer_windows(model)}
    return tuple(sorted(spans.items())) if any(spans.values()) else None


def full_layers(cache, max_len: int | None = None):
    """The cache with its sliding-window (and chunked-attention) layers replaced by full ones: draftlab's masks
    address every slot of the text, where a sliding layer keeps only its last window of keys; the masks apply the
    window or chunk (span_masks). A sliding layer's cache then grows with the text as a full layer's does. max_len:
    a static cache's length."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

    cache.layers = [StaticLayer(max_cache_len=max_len) if isinstance(l, StaticSlidingWindowLayer)
                    else DynamicLayer() if isinstance(l, DynamicSlidingWindowLayer) else l for l in cache.layers]
    return cache


class SlotCache:
    """A model, its DynamicCache, and per row: which slots are valid and the next position."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = full_layers(DynamicCache(config=model.config))
        self.spans = layer_spans(model)  # its sliding windows or chunks, if it has some: the masks apply them
        self.valid: torch.Tensor | None = None  # [B, L] bool
        self.next_pos: torch.Tensor | None = None  # [B] long

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, hidden=(), bucket: bool = False, last: bool = False):
        """Left-padded prompts [B, L] (valid marks real tokens) -> model output; each row's positions count
        its own tokens only. hidden: the hidden_states indices the caller reads (hidden_states_arg); last: the
        logits of the last position only. (bucket: StaticSlotCache's; the eager path runs every width as it comes.)"""
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=valid.long(), position_ids=pos,
                         **cache_arg(self.model, self.cache), use_cache=True, output_hidden_states=hidden_states_arg(hidden),
                         **last_logits(self.model, last))
        self.valid, self.next_pos = valid.bool(), valid.sum(-1)
        return out, pos

    def forward(self, tokens: torch.Tensor, allowed: torch.Tensor, depth: torch.Tensor, hidden=()):
        """Tentative slots for tokens [B, N]. Node i sees the valid committed slots and, of the tentative slots
        (those already appended since the last keep, then these N), the ones allowed[:, i] [B, N, T] marks.
        Its position is next_pos + depth [B, N]. Returns the model output (hidden: as prefill's)."""
        B, N = tokens.shape
        L = self.valid.shape[1]
        full = torch.cat([self.valid[:, None, :].expand(B, N, L), allowed], dim=2)  # [B, N, L+T]
        pos = self.next_pos[:, None] + depth
        far = distances(self.valid, pos, allowed.shape[2]) if self.spans else None
        return self.model(input_ids=tokens, attention_mask=span_masks(full, far, pos, self.spans, self.dtype),
                          position_ids=pos, **cache_arg(self.model, self.cache), use_cache=True,
                          output_hidden_states=hidden_states_arg(hidden))

    def keep(self, start: int, keep: torch.Tensor, keep_valid: torch.Tensor, in_place: bool = False) -> None:
        """Keep tentative slots start+keep[b] [B, M] (entries with keep_valid False become holes), drop the
        other tentative slots, and advance each row's position by its kept count. in_place: the caller knows
        every row keeps a prefix of its tentative slots in order (chains, root-only accepts), so nothing moves
        and the cache is only cropped."""
        if in_place:
            for layer in cache_layers(self.cache):
                layer.keys, layer.values = layer.keys[:, :, :start + keep.shape[1]], layer.values[:, :, :start + keep.shape[1]]
        else:
            compact_cache(self.cache, start, keep)
        self.valid = torch.cat([self.valid[:, :start], keep_valid], dim=1)
        self.next_pos = self.next_pos + keep_valid.sum(-1)

    def append(self, tokens: torch.Tensor, valid: torch.Tensor, hidden=()):
        """Commit tokens [B, P] (rows left-padded: valid marks real ones) in one forward; returns the output."""
        out = self.forward(tokens, causal_allowed(valid), (valid.long().cumsum(-1) - 1).clamp(min=0), hidden)
        self.valid = torch.cat([self.valid, valid.bool()], dim=1)
        self.next_pos = self.next_pos + valid.sum(-1)
        return out


_CHECKED: dict[int, bool] = {}


@torch.no_grad()
def check_tree_support(model) -> None:
    """Probe once per model that a 4D tree mask and explicit positions give the same logits as plain decoding."""
    from transformers import DynamicCache

    if _CHECKED.get(id(model)):
        return
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    arch = type(model).__name__
    V = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (1, 4), generator=g).to(dev)
    sib = torch.randint(0, V, (1, 2), generator=g).to(dev)
    try:
        ref = model(input_ids=torch.cat([ids, sib[:, 1:]], 1)).logits[0, -1].float()
        cache = full_layers(DynamicCache(config=model.config))  # (as the decoder's: a sliding layer keeps one window)
        model(input_ids=ids, **cache_arg(model, cache), use_cache=True)
        # Two siblings at the same position: the second must not see the first.
        seen = torch.ones(1, 2, 6, dtype=torch.bool, device=dev)
        seen[0, 1, 4] = False
        # (one mask per layer type where the model has sliding windows: that it takes them is probed too)
        mask = span_masks(seen, torch.zeros(1, 2, 6, dtype=torch.int32, device=dev),
                          torch.tensor([[4, 4]], device=dev), layer_spans(model), dtype)
        got = model(input_ids=sib, attention_mask=mask, position_ids=torch.tensor([[4, 4]], device=dev),
                    **cache_arg(model, cache), use_cache=True).logits[0, 1].float()
        cache_layers(cache)
    except UnsupportedBaseError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here means the architecture cannot take the tree
        raise UnsupportedBaseError(f"{arch} cannot run tree decoding: a forward with a 4D attention mask "
                                   f"and explicit position ids failed ({type(e).__name__}: {e}). Use a "
                                   "Llama-family model, or attn_implementation='eager'/'sdpa'.") from None
    tol = 1e-3 if dtype == torch.float32 or dtype == torch.float64 else 5e-2
    err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
    if not err < tol:
        raise UnsupportedBaseError(f"{arch} ignores custom 4D attention masks (tree logits differ from plain "
                                   f"decoding by {err:.3g}); its attention implementation "
                                   f"({model.config._attn_implementation!r}) may build its own mask. Try "
                                   "attn_implementation='eager' or 'sdpa'.")
    _CHECKED[id(model)] = True


def mark_tree_support(model) -> None:
    """Skip the probe for a model known to compute what probed models compute (several SSMs grouped as one)."""
    _CHECKED[id(model)] = True


def static_slots(n: int) -> int:
    """A static buffer's size for n slots: rounded up to 256, so runs of similar length share compiled shapes."""
    return -(-n // 256) * 256


def slot_cache(model, batch: int, length: int, path: dict | None, reuse=None):
    """The KV cache a model decodes with on the decoder's path: a SlotCache on the eager path (path None or not
    static); on the static-shape path a StaticSlotCache of `length` slots (rounded up to 256, grown if needed)
    whose tree forwards run through the model's compiled forward when path["compile"] names a backend. reuse: the
    caller's cache of its previous run, emptied and returned when it fits (see static_slot_cache)."""
    if not path or not path.get("static"):
        return SlotCache(model)
    forward = None
    if path.get("compile"):
        from .compiled import compiled_forward

        forward = compiled_forward(model, path["compile"])
    return static_slot_cache(model, batch, static_slots(length), forward, reuse)


def static_slot_cache(model, batch: int, size: int, forward=None, reuse=None) -> "StaticSlotCache":
    """A StaticSlotCache of at least `size` slots: `reuse` (the caller's cache of its previous run) emptied, when it
    is one for the same model, forward and batch size with as many slots or more, made for the dtype and device the
    model's weights have now (`.to()` converts a model in place); else a new one. Reusing keeps the buffers (and their
    addresses: CUDA graphs are recorded against them, so a new cache per run would re-record every graph, and past
    torch's limit of 128 re-records the graphs would no longer be used)."""
    weights = next(model.parameters())
    if (isinstance(reuse, StaticSlotCache) and reuse.model is model and reuse.run is (forward or model)
            and reuse.batch == batch and reuse.max_len >= size
            and (reuse.dtype, reuse.device) == (weights.dtype, weights.device)):
        reuse.reset()
        return reuse
    return StaticSlotCache(model, batch, size, forward)


WINDOW_MIN = 128  # the smallest attention window (slots) on a CPU
WINDOW_MIN_GPU = 256  # elsewhere: each window size is one more set of graphs to build; a smaller one is not measured


def attention_window(need: int, max_len: int, device_type: str = "cpu") -> int:
    """The slots a forward attends over when the first `need` slots are all it can see: the smallest power of two
    times the device's smallest window (WINDOW_MIN on a CPU, WINDOW_MIN_GPU elsewhere) that holds them (at most
    max_len). A few window sizes per cache, so a few compiled shapes. On a CPU attention over a small base's window is
    a large part of a step (docs/decoding.md, "Static shapes and compilation"), so the smallest window there is 128."""
    w = WINDOW_MIN if device_type == "cpu" else WINDOW_MIN_GPU
    while w < need:
        w *= 2
    return min(w, max_len)


@functools.cache
def _window_layer():
    """transformers' StaticLayer whose update returns only the first `window` slots (all of them when window is
    None): attention then costs what the text written so far needs, not the whole preallocated buffer. One class
    per process (compiled graphs are guarded on their objects' classes)."""
    from transformers.cache_utils import StaticLayer

    class WindowLayer(StaticLayer):
        window: int | None = None

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            w = self.window
            return (keys, values) if w is None or w >= keys.shape[2] else (keys[:, :, :w], values[:, :, :w])

    return WindowLayer


class StaticSlotCache:
    """SlotCache's contract on preallocated buffers, so every verify forward has one shape.

    The KV cache is transformers' StaticCache of `max_len` slots per row; `valid` [B, max_len] marks the slots
    a row may attend to (committed tokens; the rest are holes or not yet written). A forward over N tree tokens
    writes slots [length, length + N) in place and attends through a [B, 1, N, W] mask over the first W slots (the
    attention window: attention_window of the slots written so far, a power of two times 128 or 256), so its shapes
    depend on (B, N, W) only, never on how far decoding got within a window: one compiled graph (and on a GPU one CUDA
    graph) per window size serves every step. Attending over the window rather than the whole buffer matters where
    attention is a large part of a forward (a small base on a CPU: a 60-token verify over 512 slots spends most of
    its time in attention). `keep` moves the accepted slots into place inside the buffers (a gather and a write of
    at most N slots per layer) and rewinds the write pointer.

    forward: the callable that runs the model's verify forwards (the model itself, or a torch.compile of it);
    the prefill runs the model eagerly, or on a CPU through the compiled forward at a few widths (see prefill).
    """

    def __init__(self, model, batch: int, max_len: int, forward=None):
        from transformers import StaticCache

        self.model, self.max_len = model, max_len
        self.run = forward or model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = full_layers(StaticCache(config=model.config, max_cache_len=max_len), max_len)
        self.spans = layer_spans(model)  # its sliding windows or chunks, if it has some: the masks apply them
        window_layer = _window_layer()
        # Full-attention layers attend over the window. A model with other layer kinds (sliding-window ones are made
        # full above; linear attention and the like) keeps attending over the whole buffer: one mask serves all its
        # layers.
        self.windowed = all(type(l).__name__ == "StaticLayer" for l in self.cache.layers)
        if self.windowed:
            self.cache.layers = [window_layer(max_len) for _ in self.cache.layers]
        self.window = max_len  # the slots the next forward attends over (see _set_window)
        self.slots = static_buffer(torch.zeros(batch, max_len, dtype=torch.bool, device=self.device))  # valid slots
        self.n = 0  # slots committed (holes included); tentative slots start here
        self.tentative = 0  # slots written since the last keep
        self.next_pos: torch.Tensor | None = None
        self._state: tuple | None = None  # device_state, while the buffers stay the same tensors

    @property
    def length(self) -> int:
        return self.n

    @property
    def valid(self) -> torch.Tensor:
        return self.slots[:, : self.n]

    @property
    def batch(self) -> int:
        return self.slots.shape[0]

    def reset(self) -> None:
        """Empty, for another run: no slot is valid and writing starts at slot 0 (the buffers are kept; what they
        hold is never attended to again)."""
        self.slots.zero_()
        self.n, self.tentative, self.next_pos = 0, 0, None
        for layer in self._layers():
            layer.cumulative_length.zero_()

    def _layers(self):
        return [l for l in self.cache.layers if getattr(l, "is_initialized", False)]

    def _check_room(self, n: int) -> None:
        if self.n + self.tentative + n > self.max_len and self.tentative == 0:
            self._defragment()
        if self.n + self.tentative + n > self.max_len:
            self._grow(self.n + self.tentative + n)

    def _grow(self, need: int) -> None:
        """Room for `need` slots: the buffers are reallocated at twice the size (rounded to 256) and copied. A
        caller that sized the cache for its run never gets here; a drafter that cannot know the run's length
        (it sees the prompt only) grows a few times per run, and each new size is one more compiled shape."""
        size = max(2 * self.max_len, static_slots(need))
        for layer in self._layers():
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(*old.shape[:2], size, old.shape[3])
                new[:, :, : self.max_len] = old
                if not torch.compiler.is_compiling():
                    torch._dynamo.mark_static_address(new)
                setattr(layer, name, new)
            layer.max_cache_len = size
        self.cache.max_cache_len = size
        self._state = None
        grown = self.slots.new_zeros(self.slots.shape[0], size - self.max_len)
        self.slots = static_buffer(torch.cat([self.slots, grown], 1))
        self.max_len = size

    def _defragment(self) -> None:
        """Rows of a batch leave holes where another row accepted more; when the buffers fill up, move every
        row's valid slots to its front (positions are explicit, so a slot's place does not matter). After it
        the cache holds at most the longest row's prompt and output."""
        order = torch.sort((~self.slots).to(torch.int8), dim=1, stable=True).indices  # valid slots first
        for layer in self._layers():
            for t in (layer.keys, layer.values):
                t.copy_(t.gather(2, order[:, None, :, None].expand_as(t)))
        counts = self.slots.sum(-1)
        self.n = int(counts.max())
        self.slots.copy_(torch.arange(self.max_len, device=self.device)[None] < counts[:, None])  # in place: its address
        for layer in self._layers():
            layer.cumulative_length.fill_(self.n)

    def _set_window(self, need: int) -> None:
        """Attend over the window holding the first `need` slots in the next forward. The window is an attribute of
        the cache object (StaticCache.window), so a compiled forward's call signature holds it (decode.compiled)."""
        self.window = attention_window(need, self.max_len, self.device.type) if self.windowed else self.max_len
        self.cache.window = self.window
        for layer in self.cache.layers:
            if hasattr(layer, "window"):
                layer.window = self.window

    def _mask(self, allowed: torch.Tensor, pos: torch.Tensor):
        """allowed [B, N, T] over the tentative slots (the T last written, these N, at positions pos [B, N],
        included; `open` set the window that holds them) -> the additive [B, 1, N, window] mask: committed valid
        slots, the allowed tentative ones, nothing else (and within the layers' sliding windows: span_masks)."""
        B, N, T = allowed.shape
        full = torch.zeros(B, N, self.window, dtype=torch.bool, device=self.device)
        full[:, :, : self.n] = self.slots[:, None, : self.n]
        full[:, :, self.n: self.n + T] = allowed
        far = distances(self.slots[:, : self.n], pos, T, self.window) if self.spans else None
        return span_masks(full, far, pos, self.spans, self.dtype)

    def reserve(self, n: int) -> int:
        """Room for n tentative slots written by the caller's own forwards of the model (a drafter's feed and tree
        levels in one compiled call, which builds its masks from `slots`, the committed length and this window): the
        window that holds them, which every such forward attends over."""
        self._check_room(n)
        self._set_window(self.n + self.tentative + n)
        self.tentative += n
        return self.window

    def commit_reserved(self, m: int) -> None:
        """The first m reserved slots were committed by the caller (it set their `slots` and the rows' next_pos)."""
        self.n += m
        self.tentative -= m

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, hidden=(), bucket: bool = False, last: bool = False):
        """The prompt [B, L] (ids, or states [B, L, H]; left-padded, valid marks real tokens) written from slot 0:
        the model's output and the positions (hidden, last: as SlotCache.prefill's; a prefill padded to a width
        keeps every position's logits, which the cut below then drops). bucket: on a CPU with a compiled forward, the prompt goes through it
        padded on the right with holes to prefill_width(L) (one compiled shape per width) where the cache has room
        for that, and the output is cut back to the prompt's L positions; the padding's slots are written over by
        the next forward, so the cache holds what an eager prefill leaves. Else the model runs eagerly at the
        prompt's width: on a GPU a prefill is compute-bound, and each width would record CUDA graphs of its own."""
        L = ids.shape[1]
        compiled = bucket and self.run is not self.model and self.device.type == "cpu"
        W = prefill_width(L) if compiled else L
        if self.n + self.tentative + W > self.max_len:  # no room for the padding (growing would be a new shape for
            compiled, W = False, L  # every later graph): eagerly, at the prompt's width
        if compiled and not all(getattr(l, "is_initialized", True) for l in self.cache.layers):
            # A new cache's layers allocate their buffers at their first write, and a graph traced then would
            # allocate them again at every later run (the cache is reused): one eager token first, then empty.
            first = torch.zeros_like(valid[:, :1], dtype=torch.long)
            self.model(**self.open(ids[:, :1], hidden), attention_mask=self._mask(causal_allowed(valid[:, :1]), first),
                       position_ids=first)
            self.reset()
        if W > L:
            ids = torch.nn.functional.pad(ids, [0, 0] * (ids.dim() - 2) + [0, W - L])
            valid = torch.nn.functional.pad(valid, (0, W - L))
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        out = (self.run if compiled else self.model)(**self.open(ids, hidden),
                                                     attention_mask=self._mask(causal_allowed(valid), pos),
                                                     position_ids=pos, **last_logits(self.model, last and W == L))
        self.slots[:, :W] = valid.bool()
        self.n, self.tentative, self.next_pos = L, 0, valid.sum(-1)
        if W == L:
            return out, pos
        for layer in self._layers():  # the next write goes where the padding was
            layer.cumulative_length.fill_(L)
        return _first(out, L, W), pos[:, :L]

    def forward(self, tokens: torch.Tensor, allowed: torch.Tensor, depth: torch.Tensor, hidden=()):
        inputs = self.open(tokens, hidden)
        pos = self.next_pos[:, None] + depth
        return self.run(**inputs, attention_mask=self._mask(allowed, pos), position_ids=pos)

    def open(self, tokens: torch.Tensor, hidden=()) -> dict:
        """Room for a forward over tokens [B, N] written at the next N slots, counted as tentative, with the window
        that holds them set; the model's keyword arguments for it but its mask and positions. `forward` adds those
        (built eagerly); the decoder's fused verify step (decode.decoder.verify_and_keep) builds them in its graph,
        from the slots, the write pointer and this window (reserved_mask)."""
        N = tokens.shape[1]
        self._check_room(N)
        self.tentative += N
        self._set_window(self.n + self.tentative)
        return dict(**_inputs(tokens), **cache_arg(self.model, self.cache), use_cache=True,
                    output_hidden_states=hidden_states_arg(hidden))

    def keep(self, start: int, keep: torch.Tensor, keep_valid: torch.Tensor, in_place: bool = False) -> None:
        m = keep.shape[1]
        if not in_place:
            for layer in self._layers():
                for t in (layer.keys, layer.values):  # [B, kv_heads, max_len, d]
                    idx = (start + keep)[:, None, :, None].expand(t.shape[0], t.shape[1], m, t.shape[3])
                    t[:, :, start:start + m] = t.gather(2, idx)
        for layer in self._layers():
            layer.cumulative_length.fill_(start + m)
        self.slots[:, start:start + m] = keep_valid
        self.slots[:, start + m:] = False
        self.n, self.tentative = start + m, 0
        self.next_pos = self.next_pos + keep_valid.sum(-1)

    def device_state(self) -> tuple[tuple, tuple]:
        """The tensors keep_on_device updates: every layer's keys and values, and every layer's write pointer. One
        object (decode.compiled.Fixed) for as long as the buffers are the same tensors (until _grow), so a compiled
        call's signature is read from it rather than from 3 x layers tensors each step."""
        state = self._state
        if state is None:
            from .compiled import Fixed

            layers = self._layers()
            state = Fixed((tuple(t for l in layers for t in (l.keys, l.values)),
                           tuple(l.cumulative_length for l in layers)))
            if len(layers) == len(self.cache.layers):  # every layer initialised (by the prefill): its buffers stay
                self._state = state
        return state

    def kept(self, m: int, next_pos: torch.Tensor, tentative: int = 0) -> None:
        """The host's side of keep_on_device: the first m tentative slots are now committed (holes included), the
        rows' next positions are next_pos, and the `tentative` slots written after them stay tentative (a chained
        drafter's commit, feed and next tree in one call: see SSMDrafter.chain)."""
        self.n, self.tentative, self.next_pos = self.n + m, tentative, next_pos

    def rewind(self, n: int) -> None:
        """Forget every slot from n on (the sequence went another way after its first n slots); each row's next
        position counts its valid slots before n."""
        self.slots[:, n:] = False
        self.n, self.tentative = n, 0
        self.next_pos = self.slots[:, :n].sum(-1)
        for layer in self._layers():
            layer.cumulative_length.fill_(n)

    def append(self, tokens: torch.Tensor, valid: torch.Tensor, hidden=()):
        out = self.forward(tokens, causal_allowed(valid), (valid.long().cumsum(-1) - 1).clamp(min=0), hidden)
        self.keep(self.n, torch.arange(tokens.shape[1], device=self.device).expand(tokens.shape[0], -1),
                  valid.bool(), in_place=True)
        return out


def static_buffer(t: torch.Tensor) -> torch.Tensor:
    """t, marked as a buffer whose address never changes (as transformers marks its StaticCache's): a CUDA graph that
    writes it in place (the fused verify step keeps the accepted slots' validity in `slots`; EAGLE-3 and DFlash write
    their committed entries into their own buffers) may then be recorded; inductor runs a graph that writes an
    unmarked input in place without CUDA graphs ("skipping cudagraphs due to mutated inputs")."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


def keep_on_device(kv: tuple, cumulative: tuple, slots: torch.Tensor, keep: torch.Tensor, keep_valid: torch.Tensor,
                   length: torch.Tensor, next_pos: torch.Tensor) -> torch.Tensor:
    """StaticSlotCache.keep after a forward over N tentative slots, with tensor operations only, so it runs inside
    the verify step's compiled acceptance graph: keep [B, N] (each row's kept path first; the entries past it, which
    keep_valid [B, N] marks False, become holes) moves tentative slot n + keep[b, i] to n + i in every key and value
    buffer of kv, the N slots' validity becomes keep_valid, and every layer's write pointer (cumulative, which the
    forward advanced to n + N) goes back to n + M, M the longest path of length [B]. Returns the rows' next positions;
    the host then calls StaticSlotCache.kept(M, ...)."""
    N = keep.shape[1]
    n = cumulative[0] - N
    if N > 1:  # one node (plain decoding) is a path of one: its slot stays where it was written, the pointers are right
        return move_kept(kv, cumulative, slots, n, keep, keep_valid, n + length.max(), next_pos)
    slots.index_copy_(1, n + torch.arange(N, device=keep.device), keep_valid)
    return next_pos + keep_valid.sum(-1)


def move_kept(kv: list, cumulative: list, slots: torch.Tensor, n: torch.Tensor, keep: torch.Tensor,
              keep_valid: torch.Tensor, end: torch.Tensor, next_pos: torch.Tensor) -> torch.Tensor:
    """keep_on_device's work for the N tentative slots from n (a tensor) on: slot n + keep[b, i] moves to n + i in
    every buffer of kv, the N slots' validity becomes keep_valid [B, N], and every layer's write pointer goes to `end`
    (the first slot after the kept ones, holes of the shorter rows included). Returns the rows' next positions."""
    N = keep.shape[1]
    at = n + torch.arange(N, device=keep.device)  # the tentative slots
    slots.index_copy_(1, at, keep_valid)
    for t in kv:  # [B, heads, L, d]
        B, H, _, d = t.shape
        t.index_copy_(2, at, t.gather(2, (n + keep)[:, None, :, None].expand(B, H, N, d)))
    for c in cumulative:
        c.copy_(end)
    return next_pos + keep_valid.sum(-1)


def prefill_width(L: int) -> int:
    """The width a compiled prefill pads a prompt of L tokens to: a power of two from 16 up to 256, then a multiple of
    256. A server then sees a few prefill shapes (each compiles once), and a prompt is padded by less than itself up
    to 256 tokens and by less than 256 tokens past it (the padding costs compute, not cache slots)."""
    if L <= 256:
        return max(16, 1 << (L - 1).bit_length())
    return -(-L // 256) * 256


def _first(out, L: int, W: int):
    """A model output over W positions with its per-position tensors cut to their first L (a prefill padded on the
    right); the rest (the cache) as it is."""
    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == W:
            return v[:, :L]
        return tuple(cut(t) for t in v) if isinstance(v, tuple) else v
    return type(out)(**{k: cut(v) for k, v in out.items()})


def hidden_states_arg(hidden) -> bool | list[int]:
    """output_hidden_states for the hidden_states indices a caller reads (a tuple; True: all, a falsy value: none).
    Given the indices, transformers keeps those layers' states only (None in the others' places): with True a prefill
    kept every layer's, 81 tensors [B, L, H] over a 70B base's prompt (43 GB at batch 8 x 4,096 tokens) where
    EAGLE-3 reads 3. A model without the selection reads the list as True."""
    if isinstance(hidden, (tuple, list)):
        return sorted(set(hidden)) if hidden else False
    return bool(hidden)


def last_logits(model, last: bool) -> dict:
    """The model's keyword argument for logits at the last position only (`logits_to_keep`, where its forward has
    it): a prefill whose caller reads the next token only leaves out [B, L, V] logits (8 GB in bfloat16 for a
    128k vocabulary at batch 8 x 4,096 tokens)."""
    return {"logits_to_keep": 1} if last and "logits_to_keep" in _forward_params(model) else {}


def cache_arg(model, cache) -> dict:
    """The model's keyword argument for its KV cache. transformers 5.x renamed `past_key_values` to `cache`: the
    old name warns and goes in 5.40, after which a decoder layer would take it into its **kwargs and run without
    the cache, silently. A model written for an older transformers (remote code, or transformers before the rename)
    takes `past_key_values`, the name to fall back on where the forward names neither."""
    return {cache_name(model): cache}


def cache_name(model) -> str:
    """cache_arg's keyword, for a caller that builds the call inside a compiled function (resolved beforehand)."""
    return "cache" if "cache" in _forward_params(model) else "past_key_values"


def _forward_params(model) -> frozenset:
    """The names model's forward takes (the wrapped model's, for a peft wrapper or a torch.compile'd module)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    forward = type(getattr(inner, "_orig_mod", inner)).forward
    if forward not in _FORWARD_PARAMS:
        import inspect

        _FORWARD_PARAMS[forward] = frozenset(inspect.signature(forward).parameters)
    return _FORWARD_PARAMS[forward]


_FORWARD_PARAMS: dict = {}


def _inputs(x: torch.Tensor) -> dict:
    """Token ids [B, T] as input_ids; states [B, T, H] (a model run over hidden states, e.g. Hydra++'s prefix
    layer) as inputs_embeds."""
    return {"inputs_embeds": x} if x.is_floating_point() else {"input_ids": x}
