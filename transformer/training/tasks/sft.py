"""Supervised fine-tuning on conversations: next-token loss on the assistant's tokens only.

Glossary of shapes: B batch (this process's rows), L seq_len, V vocab. A batch is
{'tokens': int32 [B, L + 1], 'weights': float32 [B, L] (1 where the target is an assistant token or its
end-of-turn marker), 'segments', 'positions': int32 [B, L]} of packed conversations
(`data.text.conversations`): each attends only to itself. The loss is token-weighted over the whole batch
(a sum over assistant targets / their count; TRL's assistant_only_loss, nanochat's chat_sft). The run starts
from config.init_from (a pretrained run or a converted Hugging Face model) and keeps its tokenizer; its chat
format is that run's (chat_template.json: a converted model's own template) or the built-in template, whose
markers grow the vocabulary (`from_data`). Eval reports the loss on the held-out conversations and, with
train.sample_tokens, prints the greedy answers to the first held-out prompts.
"""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from transformer import models, rundir
from transformer.data.text import chat_templates, conversations, order
from transformer.inference import engine, sampling
from transformer.layers import cross_entropy
from transformer.training import losses, tasks

SHOWN_ANSWERS = 2


def check(config) -> None:
    tasks.check_post_training(config, "fine-tunes a trained run", "conversations")
    if config.model.get("attention") == "ring":
        raise ValueError("config.model.attention='ring': the sft task packs conversations unsplit; choose another")


def pretrained_chat(init_from: str) -> chat_templates.ChatFormat:
    """The chat format config.init_from has (its chat_template.json), else the built-in one over its tokenizer."""
    run = rundir.open(init_from)
    return run.chat_format() or chat_templates.built_in(run.tokenizer(framed=False))


def from_data(config) -> list[str]:
    """Fills config.model.vocab_size (0: the pretrained model's, grown to hold the chat markers); says how."""
    chat = pretrained_chat(config.init_from)
    pretrained = rundir.open(config.init_from).config.model.vocab_size
    says = []
    if chat.added:
        ids = sorted(chat.added.values())
        says.append(f"chat: the built-in template; its markers {' '.join(chat.added)} are special tokens "
                    f"{ids[0]}..{ids[-1]} added to the tokenizer and the embeddings")
    else:
        says.append(f"chat: {config.init_from}'s chat template (end of turn: {list(chat.end_ids)})")
    if config.model.vocab_size == 0:
        config.model.vocab_size = max(pretrained, chat.vocab_size)
        says.append(f"from the data: model.vocab_size={config.model.vocab_size} (the pretrained {pretrained})")
    elif config.model.vocab_size < chat.vocab_size:
        raise ValueError(f"config.model.vocab_size={config.model.vocab_size} is smaller than the chat format's "
                         f"{chat.vocab_size} ids; set it to 0 (the data's)")
    return says


class SFTTask:
    item_name = "tokens"

    def __init__(self, config, workdir: str, rows: np.ndarray, start_step: int):
        self.config, self.rows, d = config, rows, config.data
        chat = pretrained_chat(config.init_from)
        if jax.process_index() == 0:
            chat.tokenizer.save(workdir)
            chat.save(workdir)
        self.chat = chat
        every = conversations.read(d.train_path)
        if not any(m.get("role") == "assistant" for c in every for m in c):
            raise ValueError(f'{d.train_path}: no conversation has an assistant turn (a {{"role": "assistant"}} '
                             'message, or a "completion"), and SFT learns only those: add the answers to the file')
        if d.eval_path:
            train, held = every, conversations.read(d.eval_path)
        else:
            out = conversations.split(every, d.eval_fraction)
            train, held = [c for c, o in zip(every, out) if not o], [c for c, o in zip(every, out) if o]
        width = d.seq_len + 1
        encoded = conversations.encode(chat, train, width, d.train_path)
        if not encoded.examples:
            raise ValueError(f"{d.train_path}: no conversation has an assistant token within "
                             f"{width} tokens; raise config.data.seq_len")
        self.train = conversations.pack(encoded.examples, width)
        if not held and d.eval_batches:
            raise ValueError(f"{d.train_path}: no conversation is held out for eval: give config.data.eval_path, "
                             "or raise config.data.eval_fraction")
        held_encoded = conversations.encode(chat, held, width, d.eval_path or d.train_path)
        self.held = held
        self.eval = self._eval_batches(conversations.pack(held_encoded.examples, width))
        self.items_per_step = d.batch_size * d.seq_len
        if jax.process_index() == 0:
            print(f"data: {d.train_path}: {len(train):,} conversations for training, "
                  f"{conversations.split_said(len(held), len(every), 'conversations', d.eval_path, d.eval_fraction)}; "
                  f"{encoded.cut} cut to {width} tokens, {encoded.dropped} dropped (no assistant token left); "
                  f"packed into {len(self.train):,} rows ({self.train.filled:.0%} filled)", file=sys.stderr)

    def _eval_batches(self, packed) -> list[dict]:
        b = self.config.data.batch_size
        count = min(self.config.data.eval_batches, -(-len(packed) // b))
        index = np.arange(count * b)
        batches = []
        for i in range(count):
            rows = index[i * b:(i + 1) * b][self.rows]
            batch = packed.batch(np.minimum(rows, len(packed) - 1))
            batch["weights"][rows >= len(packed)] = 0.0  # past the last row: repeated, not counted
            batches.append(batch)
        return batches

    def init_inputs(self):
        return (jnp.zeros((1, self.config.data.seq_len), jnp.int32),)

    def train_batch(self, step: int) -> dict:
        b = self.config.data.batch_size
        g = step * b + np.arange(b)[self.rows]
        return self.train.batch(order.epochs(g, len(self.train), (self.config.train.seed, 5)))

    def eval_batches(self) -> list[dict]:
        return self.eval

    def _token_losses(self, model, params, batch, **kwargs):
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        packing = {"segments": batch["segments"], "positions": batch["positions"]}
        if models.computes_loss(model):
            return model.apply({"params": params}, inputs, **packing, targets=targets, **kwargs)
        return cross_entropy.token_losses(model.apply({"params": params}, inputs, **packing, **kwargs), targets)

    def loss(self, model, params, batch, rng):
        token_losses = self._token_losses(model, params, batch, deterministic=False, rngs={"dropout": rng})
        return losses.total({"cross_entropy": losses.mean(losses.weighted_sum(token_losses, batch["weights"]))})

    def loss_weights(self, batch) -> dict:
        return losses.term_weights({"cross_entropy": batch["weights"].sum()}, self.config)

    def eval_outputs(self, model, params, batch) -> dict:
        loss_sum, count = losses.weighted_sum(self._token_losses(model, params, batch), batch["weights"])
        return {"loss_sum": loss_sum, "count": count}

    def eval_metrics(self, outputs: list[dict]) -> dict:
        loss = sum(float(o["loss_sum"]) for o in outputs) / max(sum(float(o["count"]) for o in outputs), 1.0)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}

    def report(self, model, params, step: int) -> list[str]:
        n = self.config.train.sample_tokens
        lines = []
        for conversation in self.held[:SHOWN_ANSWERS] if n else []:
            prompt = conversation[:next(i for i, m in enumerate(conversation) if m["role"] == "assistant")]
            answer = reply(model, params, self.chat, prompt, n)
            lines.append(f"--- {prompt[-1]['content']!r} -> {answer!r}")
        return lines


def reply(model, params, chat, messages, max_new_tokens: int) -> str:
    """The greedy answer to `messages`, up to its end of turn."""
    ids = chat.prompt(messages)[-(model.max_len - 1):].tolist()
    settings = sampling.Sampling(max_new_tokens=min(max_new_tokens, model.max_len - len(ids)),
                                 stop_ids=chat.end_ids[:1])
    out = engine.continue_ids(model, params, [ids], settings)[0].tokens[0]
    return chat.decode(sampling.until_stop(out, settings.stop_ids))


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> SFTTask:
    return SFTTask(config, workdir, rows, start_step)
