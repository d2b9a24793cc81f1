"""Sequence to sequence: an encoder-decoder trained on (source, target) text pairs.

Glossary of shapes: B batch, S source_len, L target_len, V vocab. A batch is
{'src': int32 [B, S], 'tgt_in': int32 [B, L], 'tgt_out': int32 [B, L]}, padded with
[PAD] = 0: tgt_in = [BOS] y and tgt_out = y [EOS] (y cut to L - 1 tokens); with
`config.data.source_eos` the source ends in [EOS] too (T5's `</s>`).

Pairs come from config.data.train_path / eval_path (TSV `source<TAB>target`); left empty,
the embedded code2doc task (stdlib code -> first docstring line) is built in WORKDIR/data.
Eval scores teacher-forced loss and token accuracy on the eval batches, then decodes them
(greedy, or beam search with config.train.eval_beam_size beams) and scores the texts against
the references (`text_scores`): `eval/bleu`, sacrebleu's corpus BLEU with effective order (the
n-gram orders that no output is long enough to hold are left out, so exact outputs shorter
than four tokens score 100, not 0; with 4-grams present it is the standard BLEU), and
`eval/chrf`, sacrebleu's corpus chrF (character 6-grams, no length threshold); each next to
the same score of copying the source's first words (as many as the mean reference has).
"""

import os

import jax.numpy as jnp
import numpy as np
import sacrebleu

from transformer.data.text import seq2seq_pairs, tokenizers
from transformer.inference import decoding, sampling
from transformer.layers import cross_entropy, matmul
from transformer.training import losses, tasks
from transformer.training.tasks import text_data


def check(config) -> None:
    tasks.check_lengths(config, "source_len", "target_len")
    tasks.check_specials(config, "[BOS]", "[EOS]", "[PAD]")
    text_data.check_size(config)


def from_data(config) -> list[str]:
    """The `data:` line of its pairs: an encoder-decoder's config gives its tokenizer and sizes."""
    d, m = config.data, config.model
    held = (f"{d.train_path} and {d.eval_path or '(no eval_path)'}" if d.train_path else
            "the embedded code2doc task (stdlib functions -> the first line of their docstring)")
    ids = tokenizers.expected_size(d, m.vocab_size) or tokenizers.hf_tokenizer(d.tokenizer_path).vocab_size
    trained = ", trained on both sides" if d.tokenizer in ("bpe", "wordpiece") and not d.tokenizer_path else ""
    return [f"data: {held}: source<TAB>target pairs, tokenized by {d.tokenizer} ({ids:,} ids{trained})"]


def _load_pairs(data_config, workdir: str) -> dict[str, list[tuple[str, str]]]:
    paths = {"train": data_config.train_path, "eval": data_config.eval_path}
    if not paths["train"]:
        data_dir = os.path.join(workdir, "data")
        built = {s: os.path.join(data_dir, f"code2doc_{s}.tsv") for s in ("train", "eval")}
        if not all(os.path.isfile(p) for p in built.values()):
            built = seq2seq_pairs.prepare_code2doc(data_dir)
        paths = built
    if not paths["eval"]:
        raise ValueError("config.data.eval_path is empty: give a TSV of held-out pairs")
    return {split: seq2seq_pairs.read_pairs(os.path.expanduser(p)) for split, p in paths.items()}


class Seq2SeqTask:
    item_name = "tokens"

    def __init__(self, config, workdir: str, rows: np.ndarray):
        self.config = config
        data = config.data
        self.pairs = _load_pairs(data, workdir)
        texts = lambda: (text for pair in self.pairs["train"] for text in pair)
        self.tokenizer = tokenizers.build_tokenizer(data, workdir, texts, config.model.vocab_size)
        self.bos, self.eos = (tokenizers.require_special(self.tokenizer, n) for n in ("[BOS]", "[EOS]"))
        self.global_batch, self._rows = data.batch_size, rows
        self.train = self._arrays(self.pairs["train"])
        num_eval = min(data.eval_batches, len(self.pairs["eval"]) // self.global_batch)
        if num_eval < 1:
            raise ValueError(f"the eval split has {len(self.pairs['eval'])} pairs, fewer than one batch of "
                             f"config.data.batch_size={self.global_batch}")
        self.eval_pairs = self.pairs["eval"][: num_eval * self.global_batch]
        self.eval = self._arrays(self.eval_pairs)
        self.items_per_step = data.batch_size * (data.source_len + data.target_len)
        self.examples: list[tuple[str, str, str]] = []

    def _arrays(self, pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
        """Padded int32 arrays of every pair: src [N, S], tgt_in [N, L], tgt_out [N, L]."""
        src = [seq2seq_pairs.source_ids(self.tokenizer, s, self.config.data.source_len, self.config.data.source_eos)
               for s, _ in pairs]
        y = [self.tokenizer.encode(t)[: self.config.data.target_len - 1] for _, t in pairs]
        return {"src": seq2seq_pairs.pad_batch(src, self.config.data.source_len),
                "tgt_in": seq2seq_pairs.pad_batch([np.r_[self.bos, ids] for ids in y], self.config.data.target_len),
                "tgt_out": seq2seq_pairs.pad_batch([np.r_[ids, self.eos] for ids in y], self.config.data.target_len)}

    def init_inputs(self):
        d = self.config.data
        return (jnp.zeros((1, d.source_len), jnp.int32), jnp.zeros((1, d.target_len), jnp.int32),
                jnp.ones((1, d.source_len), bool))

    def train_batch(self, step: int) -> dict:
        rng = np.random.default_rng([self.config.train.seed, step])
        index = rng.integers(0, len(self.train["src"]), self.global_batch)[self._rows]
        return {k: v[index] for k, v in self.train.items()}

    def eval_batches(self) -> list[dict]:
        starts = range(0, len(self.eval_pairs), self.global_batch)
        return [{k: v[s: s + self.global_batch][self._rows] for k, v in self.eval.items()} for s in starts]

    def loss(self, model, params, batch, rng):
        src, targets = batch["src"], batch["tgt_out"]
        logits = model.apply({"params": params}, src, batch["tgt_in"], src != 0, deterministic=False,
                             rngs={"dropout": rng})
        z = losses.z_loss_weight(self.config)
        terms = {"cross_entropy": losses.mean(losses.cross_entropy(
            logits, targets, targets != 0, smoothing=self.config.train.label_smoothing,
            fused_backward=matmul.low_precision(self.config.model.dtype)))}
        if z:
            terms["z_loss"] = z * losses.mean(losses.z_loss(cross_entropy.log_partition(logits), targets != 0))
        return losses.total(terms)

    def loss_weights(self, batch) -> dict:
        return losses.term_weights({"cross_entropy": (batch["tgt_out"] != 0).sum()}, self.config)

    def eval_outputs(self, model, params, batch) -> dict:
        src, targets = batch["src"], batch["tgt_out"]
        valid = targets != 0
        logits = model.apply({"params": params}, src, batch["tgt_in"], src != 0)
        loss_sum, count = losses.cross_entropy(logits, targets, valid)
        decoded = self._decode(model, params, src)
        return {"loss_sum": loss_sum, "count": count,
                "correct": ((logits.argmax(-1) == targets) & valid).sum().astype(jnp.float32),
                "decoded": decoded}

    def _decode(self, model, params, src):
        """Eval outputs [B, N]: beam search with config.train.eval_beam_size beams (greedy at 1)."""
        kwargs = dict(max_len=self.config.data.target_len, bos_id=self.bos, eos_id=self.eos)
        beams = self.config.train.eval_beam_size
        if beams > 1:
            return decoding.beam_search(model, params, src, src != 0, beam_size=beams,
                                        alpha=self.config.train.eval_length_penalty, **kwargs)[0]
        return decoding.greedy_decode(model, params, src, src != 0, **kwargs)[0]

    def eval_metrics(self, outputs: list[dict]) -> dict:
        count = sum(float(o["count"]) for o in outputs)
        decoded = np.concatenate([o["decoded"] for o in outputs])
        hyps = [self.tokenizer.decode(sampling.until_stop(row, (self.eos,))) for row in decoded]
        refs = [t for _, t in self.eval_pairs[: len(hyps)]]
        sources = [s for s, _ in self.eval_pairs[: len(hyps)]]
        n_words = max(1, round(np.mean([len(r.split()) for r in refs])))
        copies = [" ".join(s.split()[:n_words]) for s in sources]
        self.examples = list(zip(sources, refs, hyps))[:3]
        return {"eval/loss": sum(float(o["loss_sum"]) for o in outputs) / count,
                "eval/token_accuracy": sum(float(o["correct"]) for o in outputs) / count,
                **{f"eval/{k}": v for k, v in text_scores(hyps, refs).items()},
                **{f"eval/{k}_copy_baseline": v for k, v in text_scores(copies, refs).items()}}

    def report(self, model, params, step: int) -> list[str]:
        if not self.examples:
            return []
        lines = [f"--- outputs at step {step}:"]
        for source, reference, output in self.examples:
            lines += [f"input:     {source[:160]}", f"reference: {reference}", f"output:    {output}"]
        return lines + ["---"]


def text_scores(outputs: list[str], references: list[str]) -> dict[str, float]:
    """{'bleu': corpus BLEU with effective order, 'chrf': corpus chrF} of `outputs` against `references`
    (one each), 0..100 (the module docstring)."""
    return {"bleu": sacrebleu.BLEU(effective_order=True).corpus_score(outputs, [references]).score,
            "chrf": sacrebleu.CHRF().corpus_score(outputs, [references]).score}


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> Seq2SeqTask:
    return Seq2SeqTask(config, workdir, rows)
