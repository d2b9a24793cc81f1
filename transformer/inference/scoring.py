"""A language-model run scored on token requests: the log-likelihood of a continuation given a context
(and whether it is the greedy choice at every position), the rolling log-likelihood of a document longer
than the context, and greedy generation up to an end-of-text id or a token limit.

    scorer = scoring.Scorer.from_run("runs/gpt-tiny")
    scorer.loglikelihood([(context_ids, continuation_ids), ...])  # [(sum of log p, greedy?), ...]
    scorer.loglikelihood_rolling([document_ids, ...])              # [sum of log p, ...]
    scorer.generate([context_ids, ...], max_new_tokens=32)         # [new ids, before the end of text]

A causal run (GPT, every imported decoder) scores a continuation after its context in one sequence; an
encoder-decoder (BART, T5) scores it as the target given the context as source. Requests are sorted by
length, cut into batches of `batch_size` rows and padded to a length bucket (powers of two from 16 up to
the model's max_len), so a whole suite compiles one program per bucket used, not one per request
(`programs` counts them). Each program runs over the run's mesh (rows split over its batch axes, params
placed by its rules) and takes the log-softmax in float32. A causal run generates through the engine
(`engine.py`: the cache, `batch_size` slots); on several processes each decodes a share (`hosts.py`).

Multi-host: process 0 calls these methods; every other process calls `serve()`, which runs each batch
process 0 sends (its header and arrays broadcast) until process 0 calls `close()`.

Glossary of shapes: B rows of a program, L length bucket (S a source's, T a target's), V vocab.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from transformer import parallel, rundir, sharding
from transformer.data.text import store_encoding, tokenizers
from transformer.inference import decoding, hosts, sampling

KINDS = {"prompt": "causal", "input": "seq2seq"}  # a family record's `generation` -> how it scores
OPS = ("stop", "loglikelihood", "generate")
MIN_BUCKET = 16


def language_model_kind(run: rundir.RunDir) -> str:
    """'causal' or 'seq2seq' for a run whose model scores text; a ValueError in one line otherwise."""
    family, head = run.family, run.config.model.get("head", "lm")
    if family.generation not in KINDS:
        raise ValueError(f"{run.path} holds a {family.name} model, not a language model: the harness scores "
                         "gpt and encdec runs")
    if head != "lm":
        raise ValueError(f"{run.path} holds a {family.name} model with head={head!r}, not a language model's lm head")
    return KINDS[family.generation]


def bucket(length: int, max_len: int) -> int:
    """The padded length of a batch whose longest row is `length`: a power of two, at most max_len."""
    return min(max_len, max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length()))


def rolling_pairs(ids: list[int], prefix_id: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """A document's disjoint (context, continuation) windows, lm-eval's (`get_rolling_token_windows` with
    context_len 1, then `make_disjoint_window`): every token predicted once, with up to max_len before it."""
    if not ids:
        return []
    first = min(max_len, len(ids))
    pairs, done = [([prefix_id], ids[:first])], first
    while done < len(ids):
        n = min(len(ids) - done, max_len)
        end = done + n
        context = ids[end - max_len - 1:end - 1]
        pairs.append((context[:len(context) - (n - 1)], ids[end - n:end]))
        done = end
    return pairs


@functools.partial(jax.jit, static_argnames=("model",))
def _log_probs(model, params, tokens):
    """tokens [1, L] -> log-probabilities [1, L, V] of each next token (float32)."""
    return jax.nn.log_softmax(model.apply({"params": params}, tokens).astype(jnp.float32), axis=-1)


def token_logprobs(model, params, ids: list[int], top: int = 0) -> tuple[list[float], list[dict[int, float]]]:
    """(log p(ids[t] | ids[:t]) for t >= 1, the `top` most likely ids at each of those places), the row padded
    to a power of two (a few shapes compile): what a server's `logprobs` answer."""
    length = min(model.max_len, 1 << max(len(ids) - 1, 1).bit_length())
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(ids)] = ids
    logp = np.asarray(_log_probs(model, params, jnp.asarray(tokens))[0, :len(ids) - 1])  # [T - 1, V]
    chosen = logp[np.arange(len(ids) - 1), ids[1:]].tolist()
    tops = []
    if top:
        best = np.argsort(-logp, axis=-1)[:, :top]
        tops = [{int(i): float(row[i]) for i in b} for row, b in zip(logp, best)]
    return chosen, tops


def _scores(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, L, V], targets [B, L], weights [B, L] -> (sum of the weighted targets' log p [B],
    whether each weighted target is the argmax [B]), in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, L, V]
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, L]
    best = sampling.greedy(logp.reshape(-1, logp.shape[-1])).reshape(targets.shape)  # [B, L]
    used = weights.astype(bool)
    return jnp.where(used, picked, 0.0).sum(1), jnp.all((best == targets) | ~used, axis=1)


@dataclasses.dataclass
class Cuts:
    """How many requests a scorer was given and how many tokens each one cut on the left lost."""

    seen: int = 0
    lost: list[int] = dataclasses.field(default_factory=list)

    def count(self, lengths: list[int], room: int) -> None:
        self.seen += len(lengths)
        self.lost += [n - room for n in lengths if n > room]

    def said(self, max_len: int) -> str:
        return (f"harness: {len(self.lost)} of {self.seen} requests were longer than the model's context of {max_len} "
                f"tokens and lost their first {min(self.lost)}..{max(self.lost)} tokens ({np.mean(self.lost):.0f} on "
                "average): their few-shot examples are cut; fewer of them (--num_fewshot) fit whole")


class Scorer:
    """A run's model, params on its mesh and tokenizer, scoring token requests in fixed shapes; `cuts` counts
    the requests cut on the left to its context."""

    def __init__(self, model, params, tokenizer, mesh, rules, param_shardings, kind: str, batch_size: int = 8,
                 source_eos: bool = False):
        self.source_eos = source_eos  # an encoder-decoder's sources end in [EOS] (T5's data)
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.mesh, self.rules, self.param_shardings, self.kind = mesh, rules, param_shardings, kind
        divisor = parallel.batch_divisor(mesh)
        self.batch_size = -(-max(batch_size, 1) // divisor) * divisor
        self.max_len = model.max_len
        self.stop_id = self._stop_id()
        self._programs, self._local = {}, None  # _local: the params on this process (`hosts`), once needed
        self.cuts = Cuts()

    @classmethod
    def from_run(cls, workdir: str, step: int | None = None, batch_size: int = 8, devices=None,
                 overrides: dict | None = None) -> "Scorer":
        """The scorer of checkpoint `step` (default: the latest) of the run in `workdir`, its config changed
        by `overrides` (how it computes, its mesh: `RunDir.with_overrides`), on `devices` (default: all)."""
        run = rundir.open(workdir).with_overrides(overrides or {})
        kind = language_model_kind(run)
        step = run.checkpoint_step(step)
        mesh = parallel.make_mesh(run.config.mesh, devices)
        shardings = run.param_shardings(mesh)
        return cls(run.model(), run.restore_params(step, mesh), run.tokenizer(), mesh,
                   sharding.rules_of(run.config.mesh), shardings, kind, batch_size,
                   bool(run.config.data.get("source_eos", False)))

    def _stop_id(self) -> int:
        if self.kind == "seq2seq":
            return self.tokenizer.special_id("[EOS]") if self.tokenizer.special_id("[EOS]") is not None else -1
        try:
            return store_encoding.end_of_document_id(self.tokenizer)
        except ValueError:
            return -1

    def source_ids(self, text: str) -> list[int]:
        """An encoder-decoder's source ids of `text`: with the special tokens a Hugging Face tokenizer's own
        post-processor adds (BART's <s> ... </s>), else ending in [EOS] where the run's data did (T5's)."""
        if isinstance(self.tokenizer, tokenizers.HFTokenizer) and self.tokenizer.tokenizer.post_processor is not None:
            return self.tokenizer.tokenizer.encode(text, add_special_tokens=True).ids
        ids = self.tokenizer.encode(text).tolist()
        return ids + [self.stop_id] if self.source_eos and self.stop_id >= 0 else ids

    @property
    def prefix_id(self) -> int:
        """What an empty context is: [BOS] where the tokenizer has one, else the end-of-text id."""
        bos = self.tokenizer.special_id("[BOS]")
        return bos if bos is not None else max(self.stop_id, 0)

    @property
    def programs(self) -> int:
        """How many programs this scorer has compiled (one per operation and shape bucket used)."""
        return len(self._programs)

    # ---- the requests

    def loglikelihood(self, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) pairs -> (the continuation's summed log-probability, whether each
        of its tokens is the argmax), in the requests' order. A causal sequence longer than max_len + 1 is
        cut on the left (lm-eval's `hf` rule); an encoder-decoder keeps the last max_len of each side."""
        requests = [(list(c), list(t)) for c, t in requests]
        if self.kind == "causal":
            self.cuts.count([len(c) + len(t) for c, t in requests], self.max_len + 1)
        else:
            self.cuts.count([max(len(c), len(t)) for c, t in requests], self.max_len)
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
        results = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            arrays, header = self._loglikelihood_batch([requests[i] for i in chunk])
            logp, greedy = self._call(header, arrays)
            for row, i in enumerate(chunk):
                results[i] = (float(logp[row]), bool(greedy[row]))
        return results

    def loglikelihood_rolling(self, documents: list[list[int]]) -> list[float]:
        """Each document's summed log-probability over windows of the context (`rolling_pairs`)."""
        windows = [rolling_pairs(list(ids), self.prefix_id, self.max_len) for ids in documents]
        flat = self.loglikelihood([pair for pairs in windows for pair in pairs])
        sums, at = [], 0
        for pairs in windows:
            sums.append(sum(logp for logp, _ in flat[at:at + len(pairs)]))
            at += len(pairs)
        return sums

    def generate(self, contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of the contexts: up to `max_new_tokens` ids each, ending before the end-of-text
        id. A causal context is cut on the left to leave room for them in max_len."""
        max_new = max(1, min(max_new_tokens, self.max_len - 1))
        self.cuts.count([len(c) for c in contexts], self.max_len - max_new if self.kind == "causal" else self.max_len)
        contexts = [list(c)[-(self.max_len - max_new):] if self.kind == "causal" else list(c)[-self.max_len:]
                    for c in contexts]
        if self.kind == "causal":
            return self._generate_causal(contexts, max_new)
        order = sorted(range(len(contexts)), key=lambda i: -len(contexts[i]))
        results = [None] * len(contexts)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            arrays, header = self._generate_batch([contexts[i] for i in chunk], max_new)
            (tokens,) = self._call(header, arrays)
            for row, i in enumerate(chunk):
                results[i] = sampling.until_stop(tokens[row, :max_new], (self.stop_id,))
        return results

    def _generate_causal(self, contexts: list[list[int]], max_new: int) -> list[list[int]]:
        """Greedy continuations through the engine (`batch_size` slots, the cache); on several processes every
        process decodes its share of them (`_generate_everywhere`)."""
        contexts = [c or [self.prefix_id] for c in contexts]
        if jax.process_count() > 1:
            length = max(len(c) for c in contexts)
            arrays = {"src": self._rows(contexts, length, len(contexts)),
                      "src_valid": self._rows([np.ones(len(c)) for c in contexts], length, len(contexts))}
            (tokens,) = self._call((OPS.index("generate"), len(contexts), length, 0, max_new), arrays)
        else:
            with sharding.sharding_context(self.mesh, self.rules):
                tokens = hosts.continue_ids(self.model, self.params, contexts, self._greedy(max_new),
                                            slots=self.batch_size)[0][:, 0]
        return [sampling.until_stop([int(t) for t in row if t >= 0], self._greedy(max_new).stop_ids) for row in tokens]

    def _greedy(self, max_new: int) -> sampling.Sampling:
        return sampling.Sampling(max_new_tokens=max_new, stop_ids=(self.stop_id,) if self.stop_id >= 0 else ())

    def _generate_everywhere(self, arrays: dict, max_new: int) -> tuple[np.ndarray]:
        """On every process at once: greedy continuations [B, max_new] (-1 past each end) of the contexts of
        `arrays` (src [B, L], src_valid), each process decoding its share with the params gathered (`hosts`)."""
        if self._local is None:
            self._local = hosts.local_params(self.params)
        contexts = [row[valid > 0].tolist() for row, valid in zip(arrays["src"], arrays["src_valid"])]
        return (hosts.continue_ids(self.model, self._local, contexts, self._greedy(max_new),
                                   slots=self.batch_size)[0][:, 0],)

    # ---- batches: arrays [B, ...] int32 and a header (op, B, L1, L2, max_new) every process can rebuild

    def _rows(self, rows: list[np.ndarray], length: int, count: int | None = None) -> np.ndarray:
        out = np.zeros((count or self.batch_size, length), np.int32)
        for r, ids in enumerate(rows):
            out[r, :len(ids)] = ids
        return out

    def _loglikelihood_batch(self, pairs):
        if self.kind == "causal":
            wholes = [(c + t)[-(self.max_len + 1):] for c, t in pairs]
            length = bucket(max(len(w) - 1 for w in wholes), self.max_len)
            weights = [np.arange(len(w) - 1) >= len(w) - 1 - min(len(t), len(w) - 1)
                       for w, (_, t) in zip(wholes, pairs)]
            arrays = {"tokens": self._rows([w[:-1] for w in wholes], length),
                      "targets": self._rows([w[1:] for w in wholes], length),
                      "weights": self._rows(weights, length)}
            return arrays, (OPS.index("loglikelihood"), self.batch_size, length, 0, 0)
        sources = [c[-self.max_len:] for c, _ in pairs]
        targets = [t[-self.max_len:] for _, t in pairs]
        s = bucket(max(len(x) for x in sources), self.max_len)
        t = bucket(max(len(x) for x in targets), self.max_len)
        arrays = {"src": self._rows(sources, s), "src_valid": self._rows([np.ones(len(x)) for x in sources], s),
                  "tgt_in": self._rows([[self.prefix_id] + x[:-1] for x in targets], t),
                  "targets": self._rows(targets, t), "weights": self._rows([np.ones(len(x)) for x in targets], t)}
        return arrays, (OPS.index("loglikelihood"), self.batch_size, s, t, 0)

    def _generate_batch(self, contexts, max_new: int):
        s = bucket(max(len(c) for c in contexts), self.max_len)
        return {"src": self._rows(contexts, s), "src_valid": self._rows([np.ones(len(c)) for c in contexts], s)}, \
            (OPS.index("generate"), self.batch_size, s, 0, max_new)

    def _layout(self, header) -> dict[str, tuple]:
        op, b, l1, l2, _ = header
        if OPS[op] == "loglikelihood":
            names = ("tokens", "targets", "weights") if self.kind == "causal" else ("src", "src_valid")
            layout = {name: (b, l1) for name in names}
            if self.kind == "seq2seq":
                layout.update({name: (b, l2) for name in ("tgt_in", "targets", "weights")})
            return layout
        return {"src": (b, l1), "src_valid": (b, l1)}

    # ---- running a batch on every process

    def _call(self, header: tuple, arrays: dict) -> tuple[np.ndarray, ...]:
        if jax.process_count() > 1:
            multihost_utils.broadcast_one_to_all(np.asarray(header, np.int32))
            arrays = multihost_utils.broadcast_one_to_all(arrays)
        return self._execute(tuple(int(h) for h in header), arrays)

    def serve(self) -> None:
        """On a process other than 0: run every batch process 0 sends, until its `close()`."""
        while True:
            header = tuple(int(h) for h in multihost_utils.broadcast_one_to_all(np.zeros(5, np.int32)))
            if OPS[header[0]] == "stop":
                return
            templates = {name: np.zeros(shape, np.int32) for name, shape in self._layout(header).items()}
            self._execute(header, multihost_utils.broadcast_one_to_all(templates))

    def close(self) -> None:
        """On process 0: releases the processes in `serve()` (nothing to do on one process)."""
        if jax.process_count() > 1 and jax.process_index() == 0:
            multihost_utils.broadcast_one_to_all(np.zeros(5, np.int32))

    def _execute(self, header: tuple, arrays: dict) -> tuple[np.ndarray, ...]:
        if OPS[header[0]] == "generate" and self.kind == "causal":
            return self._generate_everywhere(arrays, header[4])
        placement = parallel.batch_sharding(self.mesh)
        placed = {name: jax.make_array_from_callback(np.shape(x), placement, lambda index, x=x: np.asarray(x)[index])
                  for name, x in arrays.items()}
        outputs = self._program(header)(self.params, placed)
        return tuple(np.asarray(out.addressable_data(0)) for out in outputs)

    def _program(self, header: tuple):
        if header not in self._programs:
            fn = {"loglikelihood": {"causal": self._loglikelihood_causal, "seq2seq": self._loglikelihood_seq2seq},
                  "generate": {"seq2seq": self._generate_seq2seq}}
            body = functools.partial(fn[OPS[header[0]]][self.kind], max_new=header[4])

            def run(params, batch):
                with sharding.sharding_context(self.mesh, self.rules):
                    return body(params, batch)

            placement = (self.param_shardings, parallel.batch_sharding(self.mesh))
            self._programs[header] = jax.jit(run, in_shardings=placement, out_shardings=parallel.replicated(self.mesh))
        return self._programs[header]

    def _loglikelihood_causal(self, params, batch, max_new):
        logits = self.model.apply({"params": params}, batch["tokens"])  # [B, L, V]
        return _scores(logits, batch["targets"], batch["weights"])

    def _loglikelihood_seq2seq(self, params, batch, max_new):
        logits = self.model.apply({"params": params}, batch["src"], batch["tgt_in"], batch["src_valid"].astype(bool))
        return _scores(logits, batch["targets"], batch["weights"])  # logits [B, T, V]

    def _generate_seq2seq(self, params, batch, max_new):
        tokens, _ = decoding.greedy_decode(self.model, params, batch["src"], batch["src_valid"].astype(bool),
                                           max_len=max_new, bos_id=self.prefix_id, eos_id=max(self.stop_id, 0))
        return (tokens,)

