"""Direct preference optimization on pairs of a chosen and a rejected response (the dpo task).

Glossary of shapes: B batch (this process's rows), L seq_len, W = L + 1. A batch is {'chosen', 'rejected':
int32 [B, W], 'chosen_weights', 'rejected_weights': float32 [B, L] (1 on a response's targets),
'ref_chosen', 'ref_rejected': float32 [B] (the reference's log-probabilities of each response), 'pairs':
float32 [B] (1, 0 on an eval batch's padding rows)} (`data.text.preferences`).

The reference is the starting point, config.init_from, frozen: its log-probabilities of every pair are
computed once when the task is built (one jitted pass over the pairs, TRL's precompute_ref_log_probs),
cached in the workdir (`REFERENCE`, so a resumed run reads them), and its weights let go; a batch carries
them, so the step is the loop's pure step. Under LoRA this is the base with the adapters off, never held
beside the trained model. config.dpo.loss (the `LOSSES`), with s = log pi(y | x) summed over the response
and d = (s_chosen - ref_chosen) - (s_rejected - ref_rejected):

  sigmoid  -log sigmoid(beta d)                                        (DPO, Rafailov et al. 2023)
  ipo      (d' - 1 / (2 beta))^2, d' the log-ratios each divided by its response's tokens (IPO, as TRL)
  simpo    -log sigmoid(beta (s_c / n_c - s_r / n_r) - gamma)          (SimPO: no reference, n tokens)

The policy's forward runs without dropout (config.dpo.disable_dropout, TRL's DPOConfig.disable_dropout, both
True by default: the policy's first step then scores as the reference does); the reference's always does.

The implicit rewards are beta (s - ref) (simpo: beta s / n); train and eval report rewards/chosen,
rewards/rejected, rewards/margins and rewards/accuracies (the share of pairs whose chosen reward is the
larger), as TRL names them.
"""

import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from transformer import models, rundir
from transformer.data.text import conversations, order, preferences
from transformer.inference import engine, sampling
from transformer.layers import cross_entropy
from transformer.training import losses, tasks
from transformer.training.tasks import sft

LOSSES = ("sigmoid", "ipo", "simpo")
REFERENCE = "reference_logps.npz"
SHOWN_ANSWERS = 2


def check(config) -> None:
    tasks.check_post_training(config, "tunes a trained run, its reference", "prompt/chosen/rejected")
    if config.dpo.loss not in LOSSES:
        raise ValueError(f"config.dpo.loss={config.dpo.loss!r}: choose one of {', '.join(LOSSES)}")
    if config.dpo.beta <= 0:
        raise ValueError(f"config.dpo.beta={config.dpo.beta} must be positive")
    if config.model.get("attention") == "ring":
        raise ValueError("config.model.attention='ring': the dpo task keeps each pair's rows whole; choose another")


def from_data(config) -> list[str]:
    """Fills config.model.vocab_size (0: the starting run's); says which chat format renders conversations."""
    start = rundir.open(config.init_from)
    pretrained = start.config.model.vocab_size
    if config.model.vocab_size == 0:
        config.model.vocab_size = pretrained
    elif config.model.vocab_size != pretrained:
        raise ValueError(f"config.model.vocab_size={config.model.vocab_size} differs from config.init_from's "
                         f"{pretrained}: set it to 0")
    chat = start.chat_format()
    return [f"chat: {config.init_from}'s chat template renders conversations" if chat else
            f"chat: {config.init_from} has no chat template: plain-text pairs only",
            f"from the data: model.vocab_size={config.model.vocab_size} (config.init_from's)"]


def sequence_logps(model, params, tokens, weights, **kwargs) -> tuple[jax.Array, jax.Array]:
    """(log pi of each row's weighted targets summed [R], their count [R]) for rows tokens [R, W]."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if models.computes_loss(model):
        token_losses = model.apply({"params": params}, inputs, targets=targets, **kwargs)
    else:
        token_losses = cross_entropy.token_losses(model.apply({"params": params}, inputs, **kwargs), targets)
    weights = weights.astype(jnp.float32)
    return -(token_losses * weights).sum(-1), weights.sum(-1)


def preference_loss(chosen, rejected, ref_chosen, ref_rejected, n_chosen, n_rejected, beta: float,
                    kind: str = "sigmoid", gamma: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss [B], chosen reward [B], rejected reward [B]) of each pair from its summed log-probabilities."""
    if kind == "simpo":
        c, r = chosen / jnp.maximum(n_chosen, 1.0), rejected / jnp.maximum(n_rejected, 1.0)
        return -jax.nn.log_sigmoid(beta * (c - r) - gamma), beta * c, beta * r
    c, r = chosen - ref_chosen, rejected - ref_rejected
    if kind == "sigmoid":
        loss = -jax.nn.log_sigmoid(beta * (c - r))
    else:
        loss = (c / jnp.maximum(n_chosen, 1.0) - r / jnp.maximum(n_rejected, 1.0) - 1 / (2 * beta)) ** 2
    return loss, beta * c, beta * r


def reference_logps(config, pairs: preferences.Pairs, path: str) -> tuple[np.ndarray, np.ndarray]:
    """(ref_chosen [N], ref_rejected [N]): config.init_from's log-probabilities of each pair's responses,
    read from the cache at `path` where it holds these pairs', else computed in batches and cached there."""
    key = hashlib.sha256(b"".join(a.tobytes() for a in (pairs.chosen, pairs.rejected, pairs.chosen_mask,
                                                         pairs.rejected_mask))
                         + os.path.abspath(config.init_from).encode()).hexdigest()
    if os.path.isfile(path):
        cached = np.load(path)
        if str(cached["key"]) == key:
            return cached["chosen"], cached["rejected"]
    model = models.build(config.model)  # the base: adapters off
    b = config.data.batch_size
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, config.data.seq_len), jnp.int32))
    params = rundir.open(config.init_from).restore_onto(shapes["params"], place=False)
    score = jax.jit(lambda p, t, w: sequence_logps(model, p, t, w)[0])
    out = {}
    for side in ("chosen", "rejected"):
        tokens, weights = getattr(pairs, side), getattr(pairs, f"{side}_mask")[:, 1:]
        index = np.minimum(np.arange(-(-len(pairs) // b) * b), len(pairs) - 1).reshape(-1, b)
        out[side] = np.concatenate([np.asarray(score(params, tokens[i], weights[i])) for i in index])[:len(pairs)]
    del params
    if jax.process_index() == 0:
        np.savez(path, key=key, **out)
        print(f"reference: {config.init_from}'s log-probabilities of {len(pairs):,} pairs, cached in {path}",
              file=sys.stderr)
    return out["chosen"], out["rejected"]


class DPOTask:
    item_name = "pairs"

    def __init__(self, config, workdir: str, rows: np.ndarray, start_step: int):
        self.config, self.rows, d = config, rows, config.data
        start = rundir.open(config.init_from)
        self.chat, tokenizer = start.chat_format(), start.tokenizer(framed=False)
        if jax.process_index() == 0:
            tokenizer.save(workdir)
            if self.chat:
                self.chat.save(workdir)
        width = d.seq_len + 1
        every = preferences.read(d.train_path, width, self.chat, tokenizer)
        if d.eval_path:
            train, held = every, preferences.read(d.eval_path, width, self.chat, tokenizer)
        else:
            out = conversations.split(every.prompts, d.eval_fraction)
            train, held = every.subset(~out), every.subset(out)
        if not len(train):
            raise ValueError(f"{d.train_path}: every pair is held out: lower config.data.eval_fraction")
        if not len(held) and d.eval_batches:
            raise ValueError(f"{d.train_path}: no pair is held out for eval: give config.data.eval_path, or raise "
                             "config.data.eval_fraction")
        self.tokenizer, self.train, self.held = tokenizer, train, held
        self.train_ref = reference_logps(config, train, os.path.join(workdir, REFERENCE))
        self.held_ref = reference_logps(config, held, os.path.join(workdir, f"eval_{REFERENCE}")) if len(held) else None
        self.eval = self._eval_batches()
        self.items_per_step = d.batch_size
        if jax.process_index() == 0:
            print(f"data: {d.train_path}: {len(train):,} preference pairs for training, "
                  f"{conversations.split_said(len(held), len(every), 'pairs', d.eval_path, d.eval_fraction)}; "
                  f"{train.cut + (held.cut if d.eval_path else 0)} responses cut to {width} tokens", file=sys.stderr)

    def _batch(self, pairs, ref, rows) -> dict:
        return {**pairs.batch(rows), "ref_chosen": ref[0][rows].astype(np.float32),
                "ref_rejected": ref[1][rows].astype(np.float32), "pairs": np.ones(len(rows), np.float32)}

    def _eval_batches(self) -> list[dict]:
        b, n = self.config.data.batch_size, len(self.held)
        batches = []
        for i in range(min(self.config.data.eval_batches, -(-n // b)) if n else 0):
            rows = np.arange(i * b, (i + 1) * b)[self.rows]
            batch = self._batch(self.held, self.held_ref, np.minimum(rows, n - 1))
            batch["pairs"][rows >= n] = 0.0  # past the last pair: repeated, not counted
            batches.append(batch)
        return batches

    def init_inputs(self):
        return (jnp.zeros((1, self.config.data.seq_len), jnp.int32),)

    def train_batch(self, step: int) -> dict:
        b = self.config.data.batch_size
        g = step * b + np.arange(b)[self.rows]
        return self._batch(self.train, self.train_ref, order.epochs(g, len(self.train), (self.config.train.seed, 6)))

    def eval_batches(self) -> list[dict]:
        return self.eval

    def _pairs(self, model, params, batch, **kwargs):
        tokens = jnp.concatenate([batch["chosen"], batch["rejected"]])  # [2B, W]
        weights = jnp.concatenate([batch["chosen_weights"], batch["rejected_weights"]])
        logps, counts = sequence_logps(model, params, tokens, weights, **kwargs)
        (c, r), (nc, nr) = jnp.split(logps, 2), jnp.split(counts, 2)
        d = self.config.dpo
        return preference_loss(c, r, batch["ref_chosen"], batch["ref_rejected"], nc, nr, d.beta, d.loss, d.gamma)

    def loss(self, model, params, batch, rng):
        kept = not self.config.dpo.get("disable_dropout", True)  # a run saved before the key: TRL's default
        dropout = {"deterministic": False, "rngs": {"dropout": rng}} if kept else {}
        pair_losses, chosen, rejected = self._pairs(model, params, batch, **dropout)
        loss, metrics = losses.total({"dpo": pair_losses.mean()})
        chosen, rejected = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
        return loss, {**metrics, "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                      "rewards/margins": (chosen - rejected).mean(),
                      "rewards/accuracies": (chosen > rejected).astype(jnp.float32).mean()}

    def loss_weights(self, batch) -> dict:
        return {"loss": float(len(batch["pairs"]))}

    def eval_outputs(self, model, params, batch) -> dict:
        pair_losses, chosen, rejected = self._pairs(model, params, batch)
        w = batch["pairs"]
        return {"count": w.sum(), "loss": (pair_losses * w).sum(), "chosen": (chosen * w).sum(),
                "rejected": (rejected * w).sum(), "accuracies": ((chosen > rejected) * w).sum()}

    def eval_metrics(self, outputs: list[dict]) -> dict:
        total = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        n = max(total.pop("count"), 1.0)
        means = {k: v / n for k, v in total.items()}
        return {"eval/loss": means["loss"], "eval/rewards/chosen": means["chosen"],
                "eval/rewards/rejected": means["rejected"],
                "eval/rewards/margins": means["chosen"] - means["rejected"],
                "eval/rewards/accuracies": means["accuracies"]}

    def report(self, model, params, step: int) -> list[str]:
        n = self.config.train.sample_tokens
        return [f"--- {answer_prompt(p)!r} -> {answer(model, params, self.chat, self.tokenizer, p, n)!r}"
                for p in self.held.prompts[:SHOWN_ANSWERS]] if n else []


def answer_prompt(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def answer(model, params, chat, tokenizer, prompt, max_new_tokens: int) -> str:
    """The greedy response to a pair's prompt: through the chat format for messages, else continued text
    up to the tokenizer's [EOS] (where it has one: plain-text responses end in it)."""
    if isinstance(prompt, str):
        eos = tokenizer.special_id("[EOS]")
        return engine.complete(model, params, tokenizer, prompt, sampling.Sampling(
            max_new_tokens=max_new_tokens, stop_ids=() if eos is None else (eos,)))[0]
    return sft.reply(model, params, chat, prompt, max_new_tokens)


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> DPOTask:
    return DPOTask(config, workdir, rows, start_step)
