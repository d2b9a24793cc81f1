"""The engine: one loop that decodes for every caller (generate, chat, serve, the harness, RL rollouts, the
tasks' reports, ImageGPT's completions), over a fixed set of cache slots with continuous batching.

    engine = Engine(model, params, slots=8)
    engine.run([Request(ids, Sampling(temperature=0.8, max_new_tokens=32), samples=4), ...])  # request.tokens
    engine = Engine.open("runs/sft").start()          # a thread of its own, for a server
    for token in engine.stream(ids, Sampling(max_new_tokens=32)): ...   # ids as they are written

A request joins the running rows between decode calls and leaves them when it stops (a stop id, a stop string,
its token budget), each row with its own sampling. The requests admitted in one cycle are prefilled together,
all but each one's last token: one row per prompt (a prompt's `samples` share its row), the rows padded to a
power of two R (at most S), every row in the chunks of the longest rounded up to a multiple of 16 (powers of
two, largest first), padded with id 0. Each row then gets its own length as its position, so the padding's keys
sit past it, hidden by the causal mask until decoding overwrites them; one scatter copies each row into its
`samples` slots. The last prompt token is the rows' first decode input. A model with a sliding window keeps a
ring cache, where padding would overwrite the ring's valid keys, so its requests are prefilled one by one at
batch 1 in their own chunks. A decode call runs `steps` cached steps on the device before the host looks. So
the programs are a fixed set: for each row count R (the powers of two below S, and S) an empty cache, a prefill
per chunk length and a copy; one decode call. No prompt length or request count compiles a new one (`programs`
counts them, `warm` compiles them).

Rows are independent: a request's tokens are a function of its prompt, sampling and key alone, whatever
else is in flight (up to float rounding of the chunk lengths it was prefilled in; a mixture of experts with
`capacity` dispatch drops by chunk length, so its prefill depends on its companions' lengths). A draw's key is
fold_in(fold_in(request key, sample), position).

Glossary of shapes: S slots, R prefilled rows, L a chunk's length, T steps of one decode call, C cache
positions, V vocab, M stop ids of a row.
"""

import contextlib
import dataclasses
import functools
import queue
import sys
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from transformer import parallel, rundir
from transformer.data.text import chat_templates
from transformer.inference import decoding, sampling
from transformer.models import common

DONE = object()
MAX_STOP_IDS = 8  # the stop ids one row checks on the device
STEPS = 8  # decode steps a call runs on the device before the host looks (the default)


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and how to continue it, `samples` times; `tokens[g]` and `logps[g]` (each drawn token's
    log-probability under what it was drawn from) fill as the engine writes."""
    ids: list[int]
    sampling: sampling.Sampling
    samples: int = 1
    key: jax.Array | None = None  # default: key(sampling.seed)
    out: Callable | None = None  # called (sample, token) for each new token, then (sample, DONE)
    cancelled: bool = False
    tokens: list = dataclasses.field(default_factory=list)
    logps: list = dataclasses.field(default_factory=list)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)


class Engine:
    """A causal model's `slots` rows of key/value cache (`context` positions each) and the loop over them."""

    def __init__(self, model, params, slots: int = 8, context: int = 0, steps: int = STEPS, tokenizer=None,
                 chat: chat_templates.ChatFormat | None = None, stop_ids: tuple[int, ...] = (), mesh=None):
        """With `mesh`, the slots are split over its batch axes (a multiple of their size), the cache's heads over
        its tensor axis; the params stay where they are given (replicated, or in a run's layout)."""
        sized = model.clone(cache_length=min(model.max_len, context or model.max_len))
        self.model, self.params = common.decoding_form(sized, params)  # a scanned stack's layers apart
        self.scanned, self.slots, self.steps = self.params is not params, slots, steps
        self.tokenizer, self.chat, self.stop_ids = tokenizer, chat, tuple(stop_ids)
        self.empty = decoding.init_cache(self.model, 1)
        names = {decoding.leaf_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(self.empty)}
        self.packed = names <= decoding.PACKABLE  # else a ring cache (a window): prefilled one request at a time
        self.cache, self.mesh = decoding.empty_rows(self.empty, slots), mesh
        if mesh is not None:
            if slots % parallel.batch_divisor(mesh):
                raise ValueError(f"{slots} slots over {parallel.batch_divisor(mesh)} data-parallel devices: give a "
                                 "multiple of them")
            self.cache = jax.device_put(self.cache, parallel.cache_sharding(mesh, self.cache))
        self.rows = slot_rows(slots)
        self.owner: list = [None] * slots  # (request, sample) of each busy slot
        self.pending: list[Request] = []
        self.jobs: queue.Queue = queue.Queue()
        self.batches = 0  # decode calls run
        self._thread = threading.Thread(target=self._serve, daemon=True, name="engine")

    @classmethod
    def open(cls, workdir: str, step: int | None = None, max_batch: int = 8, devices=None) -> "Engine":
        """The engine of a run on `devices` (default: this process's), its chat format's end-of-turn ids stopping
        a row, else its end-of-document id. On several devices the slots (max_batch rounded up to a multiple of
        them) are split over them, the params in the layout `decoding.decoding_layout` picks, said in one line."""
        run = rundir.open(workdir)
        devices = jax.local_devices() if devices is None else devices
        mesh, said = decoding.decoding_layout(run, devices) if len(devices) > 1 else (None, "")
        rows = 1 if mesh is None else parallel.batch_divisor(mesh)
        slots = -(-max_batch // rows) * rows
        if said:
            print(f"engine: {slots} slots over {len(devices)} devices; {said}", file=sys.stderr)
        return cls(run.model(), run.restore_params(step, mesh), slots, tokenizer=run.tokenizer(),
                   chat=run.chat_format(), stop_ids=run.stop_ids(), mesh=mesh)

    @property
    def context(self) -> int:
        return self.model.cache_length

    @property
    def programs(self) -> int:
        """The programs compiled so far (by every engine of this process)."""
        return sum(f._cache_size() for f in (decoding.empty_rows, decoding.prefill_rows, decoding.place_rows,
                                              decoding.decode_slots, folded_keys))

    @property
    def row_counts(self) -> list[int]:
        """The row counts R a prefill runs at: the powers of two below S and S (1 alone for a ring cache)."""
        if not self.packed:
            return [1]
        return [1 << b for b in range((self.slots - 1).bit_length())] + [self.slots]

    def warm(self) -> "Engine":
        """Compiles every program a request may need: its samples' keys, for each row count an empty cache, a
        prefill per chunk length and the copy; the decode call."""
        nowhere = jnp.full(self.slots, self.slots, jnp.int32)
        for n in [1 << b for b in range((self.slots - 1).bit_length() + 1)]:
            sample_keys(jax.random.key(0), n)
        for n in self.row_counts:
            for b in range(max(self.context - 1, 1).bit_length()):
                rows = decoding.prefill_rows(self.model, self.params, decoding.empty_rows(self.empty, n),
                                             jnp.zeros((n, 1 << b), jnp.int32))
            self.cache = decoding.place_rows(self.cache, rows, jnp.zeros(n, jnp.int32), nowhere,
                                             jnp.zeros(self.slots, jnp.int32))
        self.cache, *_ = self._decode()
        self.rows["done"][:] = True
        return self

    # ---- asking

    def check(self, request: Request) -> None:
        """A request the engine can answer, else a ValueError in one line."""
        s, n = request.sampling, len(request.ids)
        if not n:
            raise ValueError("the prompt encodes to no tokens; give a non-empty prompt")
        if n + s.max_new_tokens - 1 > self.context:  # the last new token is drawn, never fed
            raise ValueError(f"a prompt of {n} tokens plus max_new_tokens={s.max_new_tokens} exceeds the "
                             f"context of {self.context}: shorten the prompt or ask for fewer tokens")
        if not 1 <= request.samples <= self.slots:
            raise ValueError(f"{request.samples} samples of one prompt: give 1 to {self.slots} (the slots)")
        if len(set(s.stop_ids)) > MAX_STOP_IDS:
            raise ValueError(f"{len(s.stop_ids)} stop ids: give at most {MAX_STOP_IDS}")

    def run(self, requests: list[Request], params=None) -> list[Request]:
        """Decodes `requests` to their ends (with `params`, default the engine's); returns them, filled."""
        for request in requests:
            self.check(request)
        if self._thread.is_alive():
            for request in requests:
                self.jobs.put(request)
            for request in requests:
                request.finished.wait()
            return requests
        if params is not None:
            self.params = common.unstack_layers(params, "block") if self.scanned else params
        self.pending += requests
        while self.pending or any(self.owner):
            self.cycle()
        return requests

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def submit(self, job) -> None:
        """A Request, or a function the engine's thread calls between decode calls."""
        self.jobs.put(job)

    def stream(self, ids: list[int], settings: sampling.Sampling) -> Iterator[int]:
        """The new ids of one sample, as they are written, the stop id that ends them included: from the
        engine's thread where it is started (other rows decode beside it), else decoded here. A reader that
        stops early frees the row."""
        out: queue.Queue = queue.Queue()
        request = Request(list(ids), settings, out=lambda _, token: out.put(token))
        self.check(request)
        threaded = self._thread.is_alive()
        (self.submit if threaded else self.pending.append)(request)
        try:
            while True:
                while not threaded and out.empty():
                    self.cycle()
                if (item := out.get()) is DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.cancelled = True

    def text_ids(self, text: str) -> list[int]:
        """A prompt's ids, no special token parsed out of the text."""
        try:
            return list(chat_templates.plain_encode(self.tokenizer, text)[0])
        except ValueError:
            return self.tokenizer.encode(text).tolist()

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if token < self.tokenizer.vocab_size else ""

    def text(self, ids, drop_stops: bool = True) -> str:
        ids = [i for i in ids if not (drop_stops and i in self.stop_ids)]
        return self.chat.decode(ids) if self.chat else self.tokenizer.decode(ids)

    def call(self, fn: Callable):
        """fn() run on the engine's thread between decode calls (where it is started), its result or its error
        handed back here: what reads the params beside the running rows (the server's scoring)."""
        out: queue.Queue = queue.Queue()

        def job():
            try:
                out.put(fn())
            except Exception as e:  # noqa: BLE001 (raised in the waiting request's thread)
                out.put(e)
        if not self._thread.is_alive():
            return fn()
        self.submit(job)
        result = out.get()
        if isinstance(result, BaseException):
            raise result
        return result

    # ---- the loop

    def _serve(self) -> None:
        while True:
            jobs = [self.jobs.get()] if not (self.pending or any(self.owner)) else []
            while True:
                try:
                    jobs.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            for job in jobs:
                if isinstance(job, Request):
                    self.pending.append(job)
                else:
                    job()
            try:
                self.cycle()
            except Exception as e:  # noqa: BLE001 (each request in flight hears of it; the engine goes on)
                for slot, owner in enumerate(self.owner):
                    if owner:
                        self._emit(owner, e)
                        self._free(slot)

    def cycle(self) -> None:
        """Admits what fits, runs one decode call, hands each row its tokens and frees the rows that end."""
        self._admit()
        if not any(self.owner):
            return
        self.batches += 1
        self.cache, tokens, logps, after = self._decode()
        tokens, logps = np.asarray(tokens), np.asarray(logps)
        for name, value in after.items():
            self.rows[name] = np.array(value)
        for slot, owner in enumerate(self.owner):
            if not owner:
                continue
            request, g = owner
            for token, logp in zip(tokens[slot], logps[slot]):
                if token < 0 or request.cancelled:
                    break
                request.tokens[g].append(int(token))
                request.logps[g].append(float(logp))
                self._emit(owner, int(token))
            if request.cancelled or self.rows["done"][slot] or self._stopped(request, g):
                self._free(slot)

    def _decode(self):
        """One decode call over the slots; on a mesh, traced under it (each device's paged kernel, its rows)."""
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            return decoding.decode_slots(self.model, self.params, self.cache, self.rows, self.steps)

    def _stopped(self, request: Request, g: int) -> bool:
        stops = request.sampling.stop_strings
        return bool(stops) and sampling.cut_at_stops(self.text(request.tokens[g]), stops)[1]

    def _emit(self, owner, item) -> None:
        request, g = owner
        if request.out is not None:
            request.out(g, item)

    def _free(self, slot: int) -> None:
        request, g = self.owner[slot]
        self.owner[slot] = None
        self.rows["done"][slot] = True
        self._emit((request, g), DONE)
        if not any(o and o[0] is request for o in self.owner):
            request.finished.set()

    def _admit(self) -> None:
        """Takes the pending requests that fit in the free slots, in order, and prefills them."""
        free = [s for s in range(self.slots) if self.owner[s] is None]
        admitted = []
        while self.pending and self.pending[0].samples <= len(free):
            request = self.pending.pop(0)
            admitted.append((request, free[:request.samples]))
            free = free[request.samples:]
        for group in [admitted] if self.packed else [[one] for one in admitted]:
            if group:
                self._prefill(group)

    def _prefill(self, group: list) -> None:
        """Prefills the (request, slots) of `group` as the rows of one cache and copies them into their slots."""
        n = min(1 << (len(group) - 1).bit_length(), self.slots)
        plan = decoding.chunks(max(len(request.ids) for request, _ in group) - 1,
                               self.context - 1 if self.packed else None)
        tokens, lengths = np.zeros((n, sum(plan)), np.int32), np.zeros(n, np.int32)
        slot, source = np.full(self.slots, self.slots, np.int32), np.zeros(self.slots, np.int32)
        placed = 0
        for i, (request, slots) in enumerate(group):
            lengths[i] = len(request.ids) - 1
            tokens[i, :lengths[i]] = request.ids[:-1]
            slot[placed:placed + len(slots)], source[placed:placed + len(slots)] = slots, i
            placed += len(slots)
        rows, at = decoding.empty_rows(self.empty, n), 0
        for length in plan:
            rows = decoding.prefill_rows(self.model, self.params, rows, jnp.asarray(tokens[:, at:at + length]))
            at += length
        self.cache = decoding.place_rows(self.cache, rows, jnp.asarray(lengths), jnp.asarray(slot),
                                         jnp.asarray(source))
        for request, slots in group:
            self._start(request, slots)

    def _start(self, request: Request, slots: list[int]) -> None:
        """The rows' state of a request whose cache is in `slots`."""
        s, ids = request.sampling, request.ids
        key = jax.random.key(s.seed) if request.key is None else request.key
        stops = list(dict.fromkeys(s.stop_ids))[:MAX_STOP_IDS]
        request.tokens = [[] for _ in range(request.samples)]
        request.logps = [[] for _ in range(request.samples)]
        for g, slot in enumerate(slots):
            self.owner[slot] = (request, g)
            r = self.rows
            r["token"][slot], r["count"][slot], r["done"][slot], r["budget"][slot] = ids[-1], 0, False, s.max_new_tokens
            r["stops"][slot] = stops + [-1] * (MAX_STOP_IDS - len(stops))
            r["temperature"][slot], r["top_k"][slot], r["top_p"][slot] = s.temperature, s.top_k, s.top_p
        self.rows["key"][slots] = sample_keys(key, len(slots))


def slot_rows(slots: int) -> dict[str, np.ndarray]:
    """The state of `slots` idle rows that a decode call reads (each row's token, count, budget, stop ids,
    sampling and key) and updates."""
    return {"token": np.zeros(slots, np.int32), "count": np.zeros(slots, np.int32), "done": np.ones(slots, bool),
            "budget": np.zeros(slots, np.int32), "stops": np.full((slots, MAX_STOP_IDS), -1, np.int32),
            "temperature": np.zeros(slots, np.float32), "top_k": np.zeros(slots, np.int32),
            "top_p": np.ones(slots, np.float32), "key": np.zeros((slots, 2), np.uint32)}


def sample_keys(key: jax.Array, n: int) -> np.ndarray:
    """The key data [n, 2] of `key` folded with 0..n-1 (sample g's key: fold_in(key, g)), in one call (a
    program per power of two)."""
    return np.asarray(folded_keys(key, 1 << (n - 1).bit_length()))[:n]


@functools.partial(jax.jit, static_argnums=1)
def folded_keys(key: jax.Array, n: int) -> jax.Array:
    return jax.random.key_data(jax.vmap(lambda g: jax.random.fold_in(key, g))(jnp.arange(n)))


def continue_ids(model, params, prompts: list, settings: sampling.Sampling, samples: int = 1, key=None,
                 slots: int = 32, runner: "Engine | None" = None, keys: list | None = None) -> list[Request]:
    """Each prompt (a list of ids) continued `samples` times with its key (`keys`, else fold_in(key, its index)),
    on `runner` or on an engine sized to them (the cache holds the longest prompt plus max_new_tokens, rounded
    up to 64); the requests, filled."""
    if runner is None:
        longest = max(len(p) for p in prompts) + settings.max_new_tokens
        runner = Engine(model, params, slots=max(samples, min(slots, len(prompts) * samples)),
                        context=decoding.sized_cache(model, longest).cache_length)
    if keys is None:
        keys = [None] * len(prompts) if key is None else list(jax.random.wrap_key_data(sample_keys(key, len(prompts))))
    return runner.run([Request(list(p), settings, samples, k) for p, k in zip(prompts, keys)])


def complete(model, params, tokenizer, prompt: str, settings: sampling.Sampling, num_samples: int = 1) -> list[str]:
    """Prompt text -> `num_samples` completions (text only, prompt excluded), each ending before its first stop
    id. Longer than the model's context, the text is written in windows: when the cache is full, decoding
    restarts from the last half-context of tokens."""
    ids = [int(i) for i in tokenizer.encode(prompt)]
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    total, stops = settings.max_new_tokens, settings.stop_ids
    new = [[] for _ in range(num_samples)]
    first = min(len(ids), model.max_len - 1)  # one engine for every window: a window fits where the first does
    runner = Engine(model, params, slots=num_samples, context=decoding.sized_cache(model, first + total).cache_length)
    window = 0
    while True:
        going = [g for g in range(num_samples) if len(new[g]) < total and not set(new[g]) & set(stops)]
        if not going:
            break
        contexts = [ids[-(model.max_len - 1):]] if window == 0 else [
            (ids + new[g])[-(model.max_len // 2):] for g in going]
        n = min(total - len(new[going[0]]), model.max_len - len(contexts[0]))
        asked = dataclasses.replace(settings, max_new_tokens=n)
        key = jax.random.fold_in(jax.random.key(settings.seed), window)
        done = continue_ids(model, params, contexts, asked, num_samples if window == 0 else 1, key, runner=runner)
        rows = done[0].tokens if window == 0 else [r.tokens[0] for r in done]
        for g, row in zip(going, rows):
            new[g] += row
        window += 1
    return [tokenizer.decode(sampling.until_stop(row, stops)) for row in new]


def new_tokens(model, params, prompts: list, settings: sampling.Sampling, samples: int = 1, key=None) -> list:
    """`continue_ids`'s new ids alone: a list per sample, the samples of a prompt together, in order."""
    return [row for request in continue_ids(model, params, prompts, settings, samples, key) for row in request.tokens]
