"""Language modelling: next-token prediction on the windows of the run's token stores.

Glossary of shapes: B batch (this process's rows), L seq_len, V vocab. A batch is
{'tokens': int32 [B, L + 1]} (inputs tokens[:, :-1], targets tokens[:, 1:]) and, with
`config.data.document_mask`, 'segments' and 'positions' int32 [B, L]: the documents packed
into each window attend only to themselves and count their positions from 0. Eval reports
the loss over every source's eval windows and, for a mixture, each source's
(`eval/NAME/loss`). Past L = 1024 it also reports the loss by the target's position in the
window (`eval/loss_by_position/0-1K`, `1K-2K`, `2K-4K`, ... doubling, the last bucket ending
at L), so that a long-context run shows whether the far context is used. With ring attention
over a context axis of N > 1 devices the step puts each window's inputs and targets in the
zigzag order (`layers/attention/ring.py`) before the model sees them: the model is told each token's
place, and the loss, a sum over tokens, does not change.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer import models
from transformer.data.text import lm_streams
from transformer.inference import engine, sampling
from transformer.layers import cross_entropy
from transformer.layers.attention import ring
from transformer.training import losses, tasks
from transformer.training.tasks import text_data


def check(config) -> None:
    tasks.check_lengths(config, "seq_len")
    lm_streams.check_source(config)
    if text_data.built(config, stores=True):
        text_data.check_size(config)
    if config.mesh.get("context", 1) > 1:  # -1 is known only once the devices are (after a multi-host start)
        load_balance_order(config, config.mesh.context)
    if config.train.sample_tokens and models.family(config.model.family).generation != "prompt":
        raise ValueError(f"config.train.sample_tokens={config.train.sample_tokens}: {config.model.family} models "
                         "do not generate; set it to 0")


def from_data(config) -> list[str]:
    """A token store's tokenizer and ids, else a byte tokenizer's on the text (`text_data`)."""
    return text_data.stream_from_data(config, "byte")


FIRST_BUCKET = 1024


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
    """The [lo, hi) target positions eval reports the loss of: [0, 1024), [1024, 2048),
    [2048, 4096), ..., the last ending at seq_len; none at seq_len <= 1024."""
    if seq_len <= FIRST_BUCKET:
        return []
    edges = [0, FIRST_BUCKET]
    while edges[-1] < seq_len:
        edges.append(min(2 * edges[-1], seq_len))
    return list(itertools.pairwise(edges))


def position_name(position: int) -> str:
    """'0', '1K', '32K' for multiples of 1024, else the number ('3000')."""
    return f"{position // 1024}K" if position and position % 1024 == 0 else str(position)


def load_balance_order(config, parts: int) -> np.ndarray | None:
    """The zigzag order (`ring.zigzag`) where ring attention splits the sequence over a context axis of
    `parts` > 1 devices, so that each gets as much causal work; None otherwise."""
    if config.model.get("attention") != "ring" or parts == 1:
        return None
    if config.data.seq_len % (2 * parts):
        raise ValueError(f"config.data.seq_len={config.data.seq_len} must be a multiple of 2 x config.mesh.context "
                         f"= {2 * parts}: ring attention gives each device two of 2 x {parts} chunks (zigzag)")
    return ring.zigzag(config.data.seq_len, parts)


class LMTask:
    item_name = "tokens"

    def __init__(self, config, workdir: str, rows: np.ndarray, start_step: int):
        self.config, d = config, config.data
        opened = lm_streams.open_stores(config, workdir)
        lm_streams.check_stores(opened, config)
        self.tokenizer = lm_streams.run_tokenizer(opened, workdir)
        schedule = lm_streams.weight_schedule(workdir, opened, start_step, jax.process_index() == 0)
        held = lm_streams.held_out(opened, config, d.batch_size * (d.seq_len + 1), jax.process_index() == 0)
        self.streams = lm_streams.Streams(opened, schedule, d.seq_len + 1, d.seq_len, d.batch_size, config.train.seed,
                                          rows, held)
        self.items_per_step = d.batch_size * d.seq_len
        self.eval, self.eval_names, self.bytes_per_token = [], [], {}
        for name, split in lm_streams.eval_splits(opened, config, self.streams) if d.eval_batches else []:
            count = min(d.eval_batches, len(split) // (d.seq_len + 1) // d.batch_size)
            if count < 1:
                raise ValueError(f"the eval split of {name} has {len(split)} tokens, too few for one batch of "
                                 f"{d.batch_size} windows of {d.seq_len + 1}: tokenize {name} again with a larger "
                                 "--eval_fraction, or lower config.data.seq_len or config.data.batch_size")
            windows = self.streams.eval_windows(split, count * d.batch_size).reshape(count, d.batch_size, -1)
            self.eval += [self._inputs(w[rows]) for w in windows]
            self.eval_names += [name] * count
            self.bytes_per_token[name] = split.text_bytes / max(len(split), 1)

        self.prompt = config.train.sample_prompt or data_prompt(opened, self.tokenizer)

    def _inputs(self, tokens: np.ndarray) -> dict:
        batch = {"tokens": tokens}
        if self.config.data.document_mask:
            batch["segments"], batch["positions"] = lm_streams.layout(tokens[:, :-1], self.streams.end_of_document)
        return batch

    def init_inputs(self):
        return (jnp.zeros((1, self.config.data.seq_len), jnp.int32),)

    def train_batch(self, step: int) -> dict:
        return self._inputs(self.streams.windows(step))

    def eval_batches(self) -> list[dict]:
        return self.eval

    def _token_losses(self, model, params, batch, log_z: bool = False, **kwargs) -> tuple[object, np.ndarray | None]:
        """(the cross entropy of each target [B, L] (with `log_z`, the pair with each position's log Z), the
        order [L] they come in: None = the row's), in the zigzag order where ring attention splits them
        over the context axis of the mesh the step is traced on. A model that takes `targets` computes the
        head and the loss together (GPT: holding the logits of at most `model.loss_block` positions of each
        row at once); any other gives logits."""
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        packing = {k: batch[k] for k in ("segments", "positions") if k in batch}
        order = load_balance_order(self.config, ring.context_size())
        if order is not None:
            inputs, targets = inputs[:, order], targets[:, order]
            packing = {k: v[:, order] for k, v in packing.items()} | {"order": order}
        if models.computes_loss(model):  # the model computes its loss (GPT)
            return model.apply({"params": params}, inputs, **packing, targets=targets, log_z=log_z, **kwargs), order
        logits = model.apply({"params": params}, inputs, **packing, **kwargs)
        return cross_entropy.token_losses(logits, targets, log_z=log_z), order

    def loss(self, model, params, batch, rng):
        z = losses.z_loss_weight(self.config)
        out, _ = self._token_losses(model, params, batch, z > 0, deterministic=False, rngs={"dropout": rng})
        token_losses, log_z = out if z else (out, None)
        terms = {"cross_entropy": losses.mean(losses.weighted_sum(token_losses))}
        if z:
            terms["z_loss"] = z * losses.mean(losses.z_loss(log_z))
        return losses.total(terms)

    def loss_weights(self, batch) -> dict:
        return losses.term_weights({"cross_entropy": batch["tokens"][:, 1:].size}, self.config)

    def eval_outputs(self, model, params, batch) -> dict:
        """Loss sum and count; past L = 1024 also per position bucket ([buckets] arrays).

        The buckets are of the target's index in the window (0..L-1), with `document_mask` too,
        not of its position in its document.
        """
        token_losses, order = self._token_losses(model, params, batch)
        loss_sum, count = losses.weighted_sum(token_losses)
        outputs = {"loss_sum": loss_sum, "count": count}
        buckets = position_buckets(self.config.data.seq_len)
        if buckets:
            per_position = token_losses.sum(axis=0)
            if order is not None:
                per_position = per_position[np.argsort(order)]
            outputs["bucket_loss_sum"] = jnp.stack([per_position[lo:hi].sum() for lo, hi in buckets])
            outputs["bucket_count"] = jnp.asarray([token_losses.shape[0] * (hi - lo) for lo, hi in buckets],
                                                  jnp.float32)
        return outputs

    def eval_metrics(self, outputs: list[dict]) -> dict:
        sums = {}
        for name, o in zip(self.eval_names, outputs):
            total = sums.setdefault(name, [0.0, 0.0])
            total[0] += float(o["loss_sum"])
            total[1] += float(o["count"])
        loss = sum(s for s, _ in sums.values()) / sum(c for _, c in sums.values())
        nats_per_byte = sum(s for s, _ in sums.values()) / sum(c * self.bytes_per_token[n]
                                                              for n, (_, c) in sums.items())
        metrics = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)),
                   "eval/bits_per_byte": nats_per_byte / math.log(2)}
        if len(sums) > 1:
            metrics.update({f"eval/{name}/loss": s / c for name, (s, c) in sums.items()})
        return metrics | self._loss_by_position(outputs)

    def _loss_by_position(self, outputs: list[dict]) -> dict:
        buckets = position_buckets(self.config.data.seq_len)
        if not buckets:
            return {}
        sums = np.sum([o["bucket_loss_sum"] for o in outputs], axis=0, dtype=np.float64)
        counts = np.sum([o["bucket_count"] for o in outputs], axis=0, dtype=np.float64)
        return {f"eval/loss_by_position/{position_name(lo)}-{position_name(hi)}": float(s / c)
                for (lo, hi), s, c in zip(buckets, sums, counts)}

    def report(self, model, params, step: int) -> list[str]:
        c = self.config.train
        if not c.sample_tokens:
            return []
        stop = () if self.streams.end_of_document is None else (self.streams.end_of_document,)
        text = engine.complete(model, params, self.tokenizer, self.prompt, sampling.Sampling(
            temperature=0.8, top_k=40, seed=step, max_new_tokens=c.sample_tokens, stop_ids=stop))[0]
        whence = "" if c.sample_prompt else " (from an eval document's start; config.train.sample_prompt sets it)"
        return [f"--- sample at step {step}{whence}:", f"{self.prompt}{text}", "---"]


PROMPT_TOKENS = 16  # of a document's start, the per-eval sample's prompt where config.train.sample_prompt is ''


def data_prompt(opened: list, tokenizer) -> str:
    """The per-eval sample's default prompt: the first line of the first eval document (else train
    document) of the run's stores, at most PROMPT_TOKENS tokens of it ('' where the stores hold none)."""
    for split in ("eval", "train"):
        for _, st, _ in opened:
            if split not in st.index["splits"] or not len(st.split(split)):
                continue
            data = st.split(split)
            ids = data.read(0, min(len(data), PROMPT_TOKENS))
            ends = np.flatnonzero(ids == st.end_of_document)
            text = tokenizer.decode(ids[:ends[0] if len(ends) else len(ids)].tolist()).rstrip("\ufffd")
            line = text.split("\n", 1)[0]
            if text.strip():
                return line if line.strip() else text
    return ""


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> LMTask:
    return LMTask(config, workdir, rows, start_step)
