"""The serving engine: one thread runs the model; requests from any thread wait on it, and those asking
the same prompt length and sampling are decoded together as one batch.

    engine = Engine.open("runs/sft", max_batch=8); engine.start()
    for token in engine.generate(ids, max_tokens=32, temperature=0.0): ...   # ids as they are written
    engine.score(ids, top=5)   # each token's log-probability given those before, and the top 5 there

Glossary of shapes: B requests decoded together, P prompt length, T tokens scored, V vocab.
"""

import dataclasses
import functools
import queue
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from transformer import rundir
from transformer.data.text import chat_templates
from transformer.inference import chat as chat_lib
from transformer.inference import decoding

DONE = object()


@dataclasses.dataclass
class Job:
    ids: list[int]
    max_tokens: int
    sampling: tuple  # (temperature, top_k, top_p)
    seed: int
    stop: tuple[int, ...]
    out: Callable  # called with each new token id, then DONE (or an exception)
    cancelled: bool = False

    @property
    def group(self) -> tuple:
        return len(self.ids), self.sampling


@functools.partial(jax.jit, static_argnames=("model",))
def _log_probs(model, params, tokens):
    """tokens [1, T] -> log-probabilities [1, T, V] of each next token (float32)."""
    return jax.nn.log_softmax(model.apply({"params": params}, tokens).astype(jnp.float32), axis=-1)


class Engine:
    def __init__(self, model, params, tokenizer, chat: chat_templates.ChatFormat | None, stop_ids: tuple[int, ...],
                 max_batch: int = 8):
        self.model, self.params, self.tokenizer, self.chat = model, params, tokenizer, chat
        self.max_batch, self.stop_ids = max_batch, stop_ids
        self.jobs: queue.Queue = queue.Queue()
        self.batches = 0  # decoding batches run (a test and the benchmark read it)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="engine")

    @classmethod
    def open(cls, workdir: str, step: int | None = None, max_batch: int = 8) -> "Engine":
        run = rundir.open(workdir)
        return cls(run.model(), run.restore_params(step), run.tokenizer(), run.chat_format(), run.stop_ids(), max_batch)

    def start(self) -> "Engine":
        self._thread.start()
        return self

    @property
    def context(self) -> int:
        return self.model.max_len

    def text_ids(self, text: str) -> list[int]:
        """A prompt's ids, no special token parsed out of the text."""
        try:
            return list(chat_templates.plain_encode(self.tokenizer, text)[0])
        except ValueError:
            return self.tokenizer.encode(text).tolist()

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if token < self.tokenizer.vocab_size else ""

    def submit(self, job_or_call) -> None:
        self.jobs.put(job_or_call)

    def generate(self, ids: list[int], max_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> Iterator[int]:
        """The new ids, as they are written, the stop id that ends them included (a blocking iterator, for
        threads other than the engine's)."""
        out: queue.Queue = queue.Queue()
        job = Job(ids, max_tokens, (temperature, top_k, top_p), seed, self.stop_ids, out.put)
        self.submit(job)
        try:
            while (item := out.get()) is not DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            job.cancelled = True  # a reader that stops early (a stop string) frees its row

    def score(self, ids: list[int], top: int = 0) -> tuple[list[float], list[dict[int, float]]]:
        """(log p(ids[t] | ids[:t]) for t >= 1, the `top` most likely ids at each of those places)."""
        out: queue.Queue = queue.Queue()

        def call():
            try:
                out.put(self._score(ids, top))
            except Exception as e:  # noqa: BLE001 (raised in the waiting request's thread)
                out.put(e)
        self.submit(call)
        result = out.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def _score(self, ids: list[int], top: int):
        length = min(self.model.max_len, 1 << max(len(ids) - 1, 1).bit_length())  # a few shapes compile
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :len(ids)] = ids
        logp = np.asarray(_log_probs(self.model, self.params, jnp.asarray(tokens))[0, :len(ids) - 1])  # [T - 1, V]
        chosen = logp[np.arange(len(ids) - 1), ids[1:]].tolist()
        tops = []
        if top:
            best = np.argsort(-logp, axis=-1)[:, :top]
            tops = [{int(i): float(row[i]) for i in b} for row, b in zip(logp, best)]
        return chosen, tops

    def _serve(self) -> None:
        while True:
            first = self.jobs.get()
            pending = [first]
            while len(pending) < 4 * self.max_batch:
                try:
                    pending.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            jobs = [item for item in pending if isinstance(item, Job)]
            for item in pending:
                if not isinstance(item, Job):
                    item()
            groups: dict[tuple, list[Job]] = {}
            for job in jobs:
                groups.setdefault(job.group, []).append(job)
            for group in groups.values():
                for at in range(0, len(group), self.max_batch):
                    self._decode(group[at:at + self.max_batch])

    def _decode(self, jobs: list[Job]) -> None:
        try:
            self._decode_batch(jobs)
        except Exception as e:  # noqa: BLE001 (each waiting request hears of it; the engine goes on)
            for job in jobs:
                job.out(e)
        for job in jobs:
            job.out(DONE)

    def _decode_batch(self, jobs: list[Job]) -> None:
        self.batches += 1
        b, p = len(jobs), len(jobs[0].ids)
        steps = max(job.max_tokens for job in jobs)
        model = decoding.sized_cache(self.model, p + steps)
        temperature, top_k, top_p = jobs[0].sampling
        cache = decoding.init_cache(model, b)
        logits, cache = chat_lib._feed(model, self.params, cache, jnp.asarray([job.ids for job in jobs], jnp.int32))
        rng = jax.random.key(jobs[0].seed)
        written = np.zeros(b, np.int64)
        done = np.zeros(b, bool)
        for i in range(steps):
            tokens = np.asarray(chat_lib._sample(logits, jax.random.fold_in(rng, i), temperature=temperature,
                                                 top_k=top_k, top_p=top_p))
            for r, job in enumerate(jobs):
                done[r] |= job.cancelled
                if done[r]:
                    continue
                job.out(int(tokens[r]))
                if int(tokens[r]) in job.stop:
                    done[r] = True
                    continue
                written[r] += 1
                done[r] = written[r] >= job.max_tokens
            if done.all():
                break
            logits, cache = chat_lib._feed(model, self.params, cache, jnp.asarray(tokens[:, None]))
