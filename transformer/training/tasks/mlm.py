"""Masked language modelling (BERT pretraining), with optional next-sentence prediction.

Glossary of shapes: B batch, L seq_len, V vocab. The text is the LM task's token stream
(config.data.source, split by document). A sequence is [CLS] window [SEP], or with
`model.nsp` [CLS] A [SEP] B [SEP] (type ids 0 then 1) where B follows A half of the time
and is a random window otherwise. MASK_RATE of the non-special tokens are selected; of
those 80% become [MASK], 10% a random non-special token and 10% stay; the loss is the
cross entropy at the selected positions only. A batch (a pure function of (seed, step)):
tokens, targets, type_ids [B, L] int32, valid, selected [B, L] bool (+ nsp [B]: 0 = B is next).

eval/unigram_loss is the cross entropy of the training split's unigram distribution on the
same masked eval tokens: the score of a model that ignores the context.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer.data.text import lm_streams, tokenizers
from transformer.layers import cross_entropy, matmul
from transformer.training import losses, tasks
from transformer.training.tasks import text_data

MASK_RATE = 0.15
EVAL_STREAM = 1  # the third seed word of eval batches (train batches use 0)


def mask_draws(rng: np.random.Generator, shape: tuple[int, int], random_ids: np.ndarray) -> dict:
    """The random numbers of BERT's masking for every position of a [B, L] batch."""
    return {"select": rng.random(shape), "action": rng.random(shape), "replacement": rng.choice(random_ids, shape)}


def mask_tokens(ids: np.ndarray, draws: dict, special_ids: np.ndarray, mask_id: int) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking of ids [B, L] by `draws` (`mask_draws`, for these rows): (masked ids, selected positions)."""
    selected = ~np.isin(ids, special_ids) & (draws["select"] < MASK_RATE)
    action = draws["action"]
    masked = np.where(selected & (action < 0.8), mask_id, ids)
    masked = np.where(selected & (action >= 0.8) & (action < 0.9), draws["replacement"], masked)
    return masked.astype(np.int32), selected


def check(config) -> None:
    tasks.check_lengths(config, "seq_len")
    lm_streams.check_source(config)
    tasks.check_specials(config, "[CLS]", "[SEP]", "[MASK]")
    if text_data.built(config, stores=True):
        text_data.check_size(config)


def from_data(config) -> list[str]:
    """A token store's tokenizer and ids, else a wordpiece tokenizer's trained on the text (`text_data`)."""
    return text_data.stream_from_data(config, "wordpiece")


class MLMTask:
    item_name = "tokens"

    def __init__(self, config, workdir: str, rows: np.ndarray, start_step: int):
        self.config, self.nsp, self.rows = config, config.model.nsp, np.asarray(rows)
        opened = lm_streams.open_stores(config, workdir)
        lm_streams.check_stores(opened, config)
        self.tokenizer = lm_streams.run_tokenizer(opened, workdir)
        self.cls, self.sep, self.mask = (tokenizers.require_special(self.tokenizer, n)
                                         for n in ("[CLS]", "[SEP]", "[MASK]"))
        specials = [self.tokenizer.special_id(n) for n in tokenizers.SPECIALS]
        self.special_ids = np.array(sorted(i for i in specials if i is not None))
        self.random_ids = np.setdiff1d(np.arange(self.tokenizer.vocab_size), self.special_ids)
        length = config.data.seq_len
        self.a_len = (length - 3) // 2 if self.nsp else length - 2
        self.b_len = length - 3 - self.a_len if self.nsp else 0
        width = self.a_len + self.b_len  # A (and B, where it follows A) read as one window
        schedule = lm_streams.weight_schedule(workdir, opened, start_step, jax.process_index() == 0)
        held = lm_streams.held_out(opened, config, max(2 * length, width * config.data.batch_size),
                                   jax.process_index() == 0)
        self.streams = lm_streams.Streams(opened, schedule, width, width, config.data.batch_size, config.train.seed,
                                          rows, held)
        self.items_per_step = config.data.batch_size * length
        evals = lm_streams.eval_splits(opened, config, self.streams)
        if not evals or len(evals[0][1]) < 2 * length:
            raise ValueError("the eval split has fewer than 2 x config.data.seq_len tokens: use more data or a "
                             "smaller seq_len")
        split, batch = evals[0][1], config.data.batch_size
        windows = self.streams.eval_windows(split, config.data.eval_batches * batch)
        eval_global = [self._frame(windows[i * batch:(i + 1) * batch], split, (config.train.seed, i, EVAL_STREAM),
                                   np.arange(batch)) for i in range(config.data.eval_batches)]
        self.unigram_loss = self._unigram_loss(eval_global, self.streams.sources[0].train)
        self._eval = [{k: v[self.rows] for k, v in b.items()} for b in eval_global]

    def _frame(self, windows: np.ndarray, split, seed: tuple, rows: np.ndarray) -> dict:
        """[CLS] A [SEP] (B [SEP]) of windows [R, A (+ B)] of global rows `rows`, masked by BERT's rule.

        Each row draws its own random numbers from (*seed, row): a row is the same however many
        processes share the batch, and a process draws only its own rows'. A random B is read
        from `split`.
        """
        length, n = self.config.data.seq_len, len(rows)
        rngs = [np.random.default_rng([*seed, int(r)]) for r in rows]
        column = lambda token: np.full((n, 1), token, np.int32)
        if not self.nsp:
            ids = np.concatenate([column(self.cls), windows, column(self.sep)], axis=1)
            type_ids, extra = np.zeros_like(ids), {}
        else:
            is_next = np.array([rng.random() < 0.5 for rng in rngs])
            other = np.stack([split.read(start, start + self.b_len).astype(np.int32) for start in
                              (int(rng.integers(0, len(split) - self.b_len)) for rng in rngs)])
            b = np.where(is_next[:, None], windows[:, self.a_len:], other)
            ids = np.concatenate([column(self.cls), windows[:, :self.a_len], column(self.sep), b, column(self.sep)],
                                 axis=1)
            type_ids = (np.arange(length) >= self.a_len + 2).astype(np.int32)[None].repeat(n, 0)
            extra = {"nsp": (~is_next).astype(np.int32)}
        draws = [mask_draws(rng, (1, length), self.random_ids) for rng in rngs]
        draws = {k: np.concatenate([d[k] for d in draws]) for k in draws[0]}
        masked, selected = mask_tokens(ids, draws, self.special_ids, self.mask)
        batch = {"tokens": masked, "targets": ids, "type_ids": type_ids, "valid": np.ones_like(selected),
                 "selected": selected, **extra}
        if self.config.data.document_mask:
            batch["segments"], batch["positions"] = lm_streams.layout(ids, self.streams.end_of_document)
        return batch

    def _unigram_loss(self, batches: list[dict], train) -> float:
        """Cross entropy of the (add-one) unigram distribution of the train split's first 2^24 tokens
        on the selected eval targets."""
        sample = train.read(0, min(len(train), 1 << 24))
        counts = np.bincount(sample, minlength=self.tokenizer.vocab_size)[: self.tokenizer.vocab_size] + 1.0
        log_p = np.log(counts / counts.sum())
        targets = np.concatenate([b["targets"][b["selected"]] for b in batches]) if batches else np.zeros(0, int)
        return float(-log_p[targets].mean()) if len(targets) else float("nan")

    def init_inputs(self):
        shape = (1, self.config.data.seq_len)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.ones(shape, bool)

    def train_batch(self, step: int) -> dict:
        split = self.streams.sources[0].train if self.nsp else None
        return self._frame(self.streams.windows(step), split, (self.config.train.seed, step, 0), self.rows)

    def eval_batches(self) -> list[dict]:
        return self._eval

    def _outputs(self, model, params, batch, **kwargs) -> dict:
        packing = {k: batch[k] for k in ("segments", "positions") if k in batch}
        return model.apply({"params": params}, batch["tokens"], batch["type_ids"], batch["valid"], **packing,
                           **kwargs)

    def loss(self, model, params, batch, rng):
        out = self._outputs(model, params, batch, deterministic=False, rngs={"dropout": rng})
        logits, selected, z = out["mlm_logits"], batch["selected"], losses.z_loss_weight(self.config)
        terms = {"mlm_loss": losses.mean(losses.cross_entropy(
            logits, batch["targets"], selected, fused_backward=matmul.low_precision(self.config.model.dtype)))}
        if self.nsp:
            terms["nsp_loss"] = losses.mean(losses.cross_entropy(out["nsp_logits"], batch["nsp"]))
        if z:
            terms["z_loss"] = z * losses.mean(losses.z_loss(cross_entropy.log_partition(logits), selected))
        return losses.total(terms)

    def loss_weights(self, batch) -> dict:
        """The masked-token loss (and the z-loss) averages over the masked positions, next-sentence over the rows."""
        nsp = {"nsp_loss": batch["nsp"].size} if self.nsp else {}
        return losses.term_weights({"mlm_loss": batch["selected"].sum(), **nsp}, self.config)

    def eval_outputs(self, model, params, batch) -> dict:
        out = self._outputs(model, params, batch)
        loss_sum, count = losses.cross_entropy(out["mlm_logits"], batch["targets"], batch["selected"])
        correct = (jnp.argmax(out["mlm_logits"], -1) == batch["targets"]) * batch["selected"].astype(jnp.float32)
        sums = {"loss_sum": loss_sum, "correct": correct.sum(), "count": count}
        if self.nsp:
            sums["nsp_correct"] = (jnp.argmax(out["nsp_logits"], -1) == batch["nsp"]).sum()
            sums["nsp_count"] = jnp.array(batch["nsp"].size, jnp.float32)
        return sums

    def eval_metrics(self, outputs: list[dict]) -> dict:
        total = lambda key: sum(float(o[key]) for o in outputs)
        count = max(total("count"), 1.0)
        loss = total("loss_sum") / count
        metrics = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)),
                   "eval/mlm_accuracy": total("correct") / count, "eval/unigram_loss": self.unigram_loss}
        if self.nsp:
            metrics["eval/nsp_accuracy"] = total("nsp_correct") / max(total("nsp_count"), 1.0)
        return metrics

    def report(self, model, params, step: int) -> list[str]:
        return []


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> MLMTask:
    return MLMTask(config, workdir, rows, start_step)
