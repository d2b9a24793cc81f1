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

from transformer.data import lm, tokenizers
from transformer.training import losses, tasks
from transformer.training.tasks import classification

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
    tasks.check_specials(config, "[CLS]", "[SEP]", "[MASK]")


class MLMTask:
    item_name = "tokens"

    def __init__(self, config, workdir: str):
        self.config, self.nsp = config, config.model.nsp
        texts = lambda: iter(lm.split_documents(config.data)["train"])
        self.tokenizer = classification.run_tokenizer(config, workdir, texts)
        self.cls, self.sep, self.mask = (tokenizers.require_special(self.tokenizer, n)
                                         for n in ("[CLS]", "[SEP]", "[MASK]"))
        specials = [self.tokenizer.special_id(n) for n in tokenizers.SPECIALS]
        self.special_ids = np.array(sorted(i for i in specials if i is not None))
        self.random_ids = np.setdiff1d(np.arange(self.tokenizer.vocab_size), self.special_ids)
        tokens = lm.load_tokens(config.data, self.tokenizer, workdir)
        self.train_tokens, self.eval_tokens = tokens["train"], tokens["eval"]
        for split, stream in (("train", self.train_tokens), ("eval", self.eval_tokens)):
            if len(stream) < 2 * config.data.seq_len:
                raise ValueError(f"the {split} split has {len(stream)} tokens, fewer than 2 x "
                                 f"config.data.seq_len: use more data or a smaller seq_len")
        self.global_batch = config.data.batch_size
        local = self.global_batch // jax.process_count()
        self._rows = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
        self.items_per_step = config.data.batch_size * config.data.seq_len
        eval_global = [self._batch(self.eval_tokens, (config.train.seed, i, EVAL_STREAM), slice(None))
                       for i in range(config.data.eval_batches)]
        self.unigram_loss = self._unigram_loss(eval_global)
        self._eval = [{k: v[self._rows] for k, v in b.items()} for b in eval_global]

    def _batch(self, stream: np.ndarray, seed: tuple, rows: slice) -> dict:
        """Rows `rows` of the global batch drawn from `stream` by np.random.default_rng(seed).

        The random numbers are drawn for the whole batch (so a row is the same however many
        processes share it); the windows and masks are built for `rows` only.
        """
        rng, n, length = np.random.default_rng(seed), self.global_batch, self.config.data.seq_len
        window = lambda offsets, size: stream[offsets[:, None] + np.arange(size)].astype(np.int32)
        column = lambda token: np.full((len(range(n)[rows]), 1), token, np.int32)
        if not self.nsp:
            starts = rng.integers(0, len(stream) - length, n)[rows]
            ids = np.concatenate([column(self.cls), window(starts, length - 2), column(self.sep)], axis=1)
            type_ids, extra = np.zeros_like(ids), {}
        else:
            a_len = (length - 3) // 2
            b_len = length - 3 - a_len
            a_start, is_next, other = (rng.integers(0, len(stream) - length, n), rng.random(n) < 0.5,
                                       rng.integers(0, len(stream) - b_len, n))
            a_start, is_next, other = a_start[rows], is_next[rows], other[rows]
            b_start = np.where(is_next, a_start + a_len, other)
            ids = np.concatenate([column(self.cls), window(a_start, a_len), column(self.sep),
                                  window(b_start, b_len), column(self.sep)], axis=1)
            type_ids = (np.arange(length) >= a_len + 2).astype(np.int32)[None].repeat(len(ids), 0)
            extra = {"nsp": (~is_next).astype(np.int32)}
        draws = {k: v[rows] for k, v in mask_draws(rng, (n, length), self.random_ids).items()}
        masked, selected = mask_tokens(ids, draws, self.special_ids, self.mask)
        return {"tokens": masked, "targets": ids, "type_ids": type_ids, "valid": np.ones_like(selected),
                "selected": selected, **extra}

    def _unigram_loss(self, batches: list[dict]) -> float:
        """Cross entropy of the (add-one) train unigram distribution on the selected eval targets."""
        counts = np.bincount(self.train_tokens, minlength=self.tokenizer.vocab_size) + 1.0
        log_p = np.log(counts / counts.sum())
        targets = np.concatenate([b["targets"][b["selected"]] for b in batches]) if batches else np.zeros(0, int)
        return float(-log_p[targets].mean()) if len(targets) else float("nan")

    def init_inputs(self):
        shape = (1, self.config.data.seq_len)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.ones(shape, bool)

    def train_batch(self, step: int) -> dict:
        return self._batch(self.train_tokens, (self.config.train.seed, step, 0), self._rows)

    def eval_batches(self) -> list[dict]:
        return self._eval

    def _outputs(self, model, params, batch, **kwargs) -> dict:
        return model.apply({"params": params}, batch["tokens"], batch["type_ids"], batch["valid"], **kwargs)

    def loss(self, model, params, batch, rng):
        out = self._outputs(model, params, batch, deterministic=False, rngs={"dropout": rng})
        mlm = losses.mean(losses.cross_entropy(out["mlm_logits"], batch["targets"], batch["selected"]))
        if not self.nsp:
            return mlm, {"loss": mlm}
        nsp = losses.mean(losses.cross_entropy(out["nsp_logits"], batch["nsp"]))
        return mlm + nsp, {"loss": mlm + nsp, "mlm_loss": mlm, "nsp_loss": nsp}

    def loss_weights(self, batch) -> dict:
        """The masked-token loss averages over the masked positions, next-sentence over the rows."""
        weights = {"mlm_loss" if self.nsp else "loss": batch["selected"].sum()}
        if self.nsp:
            weights["nsp_loss"] = batch["nsp"].size
        return weights

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


def build(config, workdir: str) -> MLMTask:
    return MLMTask(config, workdir)
