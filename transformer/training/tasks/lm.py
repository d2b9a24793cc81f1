"""Language modelling: next-token prediction on a token stream.

Glossary of shapes: B batch, L seq_len, V vocab. A batch is {'tokens': int32 [B, L + 1]};
inputs are tokens[:, :-1] and targets tokens[:, 1:].
"""

import math

import jax
import jax.numpy as jnp
import optax

from transformer import generate
from transformer.data import lm, tokenizers


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross entropy in float32: logits [..., V], targets [...] -> [...]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


class LMTask:
    item_name = "tokens"

    def __init__(self, config, workdir: str):
        self.config = config
        if config.data.seq_len > config.model.max_len:
            raise ValueError(f"config.data.seq_len={config.data.seq_len} exceeds "
                             f"config.model.max_len={config.model.max_len}")
        texts = lambda: iter(lm.split_documents(config.data)["train"])
        self.tokenizer = tokenizers.build_tokenizer(config.data, workdir, texts)
        if self.tokenizer.vocab_size > config.model.vocab_size:
            raise ValueError(f"the {self.tokenizer.kind} tokenizer has {self.tokenizer.vocab_size} ids but "
                             f"config.model.vocab_size={config.model.vocab_size}; raise it")
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
        loss = cross_entropy(logits, tokens[:, 1:]).mean()
        return loss, {"loss": loss}

    def eval_outputs(self, model, params, batch) -> dict:
        tokens = batch["tokens"]
        losses = cross_entropy(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])
        return {"loss_sum": losses.sum(), "count": jnp.array(losses.size, jnp.float32)}

    def eval_metrics(self, outputs: list[dict]) -> dict:
        loss = sum(float(o["loss_sum"]) for o in outputs) / sum(float(o["count"]) for o in outputs)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)),
                "eval/bits_per_byte": loss / self.data.bytes_per_token / math.log(2)}

    def report(self, model, params, step: int) -> str | None:
        c = self.config.train
        if not c.sample_tokens:
            return None
        text = generate.complete(model, params, self.tokenizer, c.sample_prompt, c.sample_tokens,
                                 seed=step, temperature=0.8, top_k=40)[0]
        return f"--- sample at step {step}:\n{c.sample_prompt}{text}\n---"


def build(config, workdir: str) -> LMTask:
    return LMTask(config, workdir)
