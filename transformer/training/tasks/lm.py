"""Language modelling: next-token prediction on a token stream.

Glossary of shapes: B batch, L seq_len, V vocab. A batch is {'tokens': int32 [B, L + 1]};
inputs are tokens[:, :-1] and targets tokens[:, 1:].
"""

import math

import jax
import jax.numpy as jnp

from transformer import generate, models
from transformer.data import lm, tokenizers
from transformer.training import losses, tasks


def check(config) -> None:
    tasks.check_lengths(config, "seq_len")
    if config.train.sample_tokens and models.family(config.model.family).generation != "prompt":
        raise ValueError(f"config.train.sample_tokens={config.train.sample_tokens}: {config.model.family} models "
                         "do not generate; set it to 0")


class LMTask:
    item_name = "tokens"

    def __init__(self, config, workdir: str):
        self.config = config
        texts = lambda: iter(lm.split_documents(config.data)["train"])
        self.tokenizer = tokenizers.build_tokenizer(config.data, workdir, texts, config.model.vocab_size)
        self.data = lm.LMData(config.data, self.tokenizer, workdir, seed=config.train.seed,
                              process_index=jax.process_index(), process_count=jax.process_count())
        self.items_per_step = config.data.batch_size * config.data.seq_len

    def init_inputs(self):
        return (jnp.zeros((1, self.config.data.seq_len), jnp.int32),)

    def train_batch(self, step: int) -> dict:
        return {"tokens": self.data.train_batch(step)}

    def eval_batches(self) -> list[dict]:
        return [{"tokens": b} for b in self.data.eval_batches()]

    def loss(self, model, params, batch, rng):
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, tokens[:, :-1], deterministic=False, rngs={"dropout": rng})
        loss = losses.mean(losses.cross_entropy(logits, tokens[:, 1:]))
        return loss, {"loss": loss}

    def loss_weights(self, batch) -> dict:
        return {"loss": batch["tokens"][:, 1:].size}

    def eval_outputs(self, model, params, batch) -> dict:
        tokens = batch["tokens"]
        loss_sum, count = losses.cross_entropy(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])
        return {"loss_sum": loss_sum, "count": count}

    def eval_metrics(self, outputs: list[dict]) -> dict:
        loss = sum(float(o["loss_sum"]) for o in outputs) / sum(float(o["count"]) for o in outputs)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)),
                "eval/bits_per_byte": loss / self.data.bytes_per_token / math.log(2)}

    def report(self, model, params, step: int) -> list[str]:
        c = self.config.train
        if not c.sample_tokens:
            return []
        text = generate.complete(model, params, self.tokenizer, c.sample_prompt, c.sample_tokens,
                                 seed=step, temperature=0.8, top_k=40)[0]
        return [f"--- sample at step {step}:", f"{c.sample_prompt}{text}", "---"]


def build(config, workdir: str) -> LMTask:
    return LMTask(config, workdir)
