"""The encoder-decoder family: pinned sizes, cached decoding, beam search, pairs data, training."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu
from conftest import FAST_COMPILES, REPO, write_pairs
from test_gpt import generate_cli

from transformer import config as config_lib
from transformer import models
from transformer.data.text import seq2seq_pairs
from transformer.inference import decoding
from transformer.models import encdec
from transformer.training import checks, loop
from transformer.training import metrics as metrics_lib
from transformer.training.tasks import seq2seq

# Parameter counts per preset. vaswani-base (vocab 37000, shared embeddings, biases, two
# LayerNorms per sub-layer): embedding 37000 * 512 = 18,944,000; an encoder layer is
# attention 4 * (512 * 512 + 512) = 1,050,624 + mlp 2 * 512 * 2048 + 2048 + 512 = 2,099,712
# + 2 norms 2,048 = 3,152,384 (x6 = 18,914,304); a decoder layer adds cross-attention and its
# norm: 4,204,032 (x6 = 25,224,192). Total 63,082,496, about the paper's 65M (whose count
# includes its own vocabulary and rounding). tiny: the same sum at vocab 2048, width 128, 2+2 layers.
PINNED = {
    "tiny": 1_187_840,
    "vaswani-base": 63_082_496,
    "t5-small": 60_506_624,  # google-t5/t5-small
    "t5-base": 222_903_552,  # google-t5/t5-base
    "t5-v1_1-small": 76_961_152,  # google/t5-v1_1-small (its own lm_head)
}


@pytest.mark.parametrize("preset", sorted(encdec.PRESETS))
def test_pinned_parameter_counts(preset):
    assert preset in PINNED, f"preset {preset!r} has no pinned parameter count"
    assert models.count_params(encdec.default_model_config(preset)) == PINNED[preset]


VOCAB, BOS, EOS = 40, 5, 6


def small_model(**overrides):
    cfg = encdec.default_model_config("tiny")
    cfg.update(num_layers=2, num_decoder_layers=2, d_model=32, num_heads=4, mlp_dim=64, max_len=16,
               vocab_size=VOCAB, dropout=0.0)
    cfg.update(overrides)
    return encdec.build(cfg)


def source(batch=2, length=9, pad_from=(9, 6)):
    src = jax.random.randint(jax.random.key(1), (batch, length), 7, VOCAB)
    valid = jnp.arange(length)[None] < jnp.array(pad_from)[:, None]
    return jnp.where(valid, src, 0), valid


def init(model, src, valid, tgt):
    return nn.unbox(model.init(jax.random.key(0), src, tgt, valid)["params"])


T5_LIKE = dict(norm_placement="pre", positions="relative", norm="rmsnorm", use_bias=False, activation="geglu",
               relative_buckets=8, relative_max_distance=12, scale_embeddings=False)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, dict(norm_placement="pre", positions="learned"), T5_LIKE],
                         ids=["post", "pre-learned", "t5"])
def test_cached_decoding_equals_the_full_forward_pass(variant):
    """Step-by-step decoding with the self- and cross-attention cache gives the teacher-forced logits;
    after the first step the decoder reads the source only from its cache."""
    model = small_model(**variant)
    src, valid = source()
    tgt = jax.random.randint(jax.random.key(2), (2, 12), 7, VOCAB)
    params = init(model, src, valid, tgt)
    full = model.apply({"params": params}, src, tgt, valid)
    encoded = model.apply({"params": params}, src, valid, method="encode")
    logits, cache = decoding.decode_step(model, params, None, tgt[:, 0], encoded, valid)
    steps = [logits]
    for t in range(1, 12):
        logits, cache = decoding.decode_step(model, params, cache, tgt[:, t], jnp.zeros_like(encoded), valid)
        steps.append(logits)
    np.testing.assert_allclose(jnp.stack(steps, 1), full, atol=1e-5)


@pytest.mark.slow
def test_relative_position_bias_is_the_same_under_every_attention_implementation_with_its_gradient():
    """T5's bias rides on the mask description: blockwise (blocks of 4) computes the dense logits and the
    bias tables' gradients."""
    src, valid = source(length=10, pad_from=(10, 7))
    tgt = jax.random.randint(jax.random.key(2), (2, 9), 7, VOCAB)
    dense, blockwise = (small_model(**T5_LIKE, attention=a, attention_block=4) for a in ("dense", "blockwise"))
    params = init(dense, src, valid, tgt)
    loss = lambda model: jax.value_and_grad(lambda p: jnp.sum(model.apply({"params": p}, src, tgt, valid) ** 2))(params)
    (a, grads_a), (b, grads_b) = loss(dense), loss(blockwise)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for name in ("src_rel_bias", "tgt_rel_bias"):
        assert np.abs(grads_a[name]).max() > 0
        scale = np.abs(grads_a[name]).max()  # float32 sums of terms this large round at ~1e-6 of it
        np.testing.assert_allclose(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.torch
def test_relative_position_buckets_are_t5s():
    torch = pytest.importorskip("torch")
    from transformers.models.t5.modeling_t5 import T5Attention
    for bidirectional in (True, False):
        for buckets, far in ((8, 12), (32, 128)):
            distances = np.arange(-300, 301)
            theirs = T5Attention._relative_position_bucket(torch.tensor(distances), bidirectional, buckets, far)
            ours = encdec.relative_buckets(jnp.asarray(distances), bidirectional, buckets, far)
            assert np.asarray(ours).tolist() == theirs.tolist()


def test_source_padding_does_not_change_outputs():
    model = small_model()
    src, valid = source(pad_from=(9, 6))
    tgt = jax.random.randint(jax.random.key(2), (2, 5), 7, VOCAB)
    params = init(model, src, valid, tgt)
    longer = jnp.concatenate([src, jnp.full((2, 4), 3)], 1)  # junk ids in 4 more padded slots
    longer_valid = jnp.concatenate([valid, jnp.zeros((2, 4), bool)], 1)
    np.testing.assert_allclose(model.apply({"params": params}, longer, tgt, longer_valid),
                               model.apply({"params": params}, src, tgt, valid), atol=1e-5)
    encoded = model.apply({"params": params}, longer, longer_valid, method="encode")
    np.testing.assert_allclose(encoded[1, :6], model.apply({"params": params}, src, valid, method="encode")[1, :6],
                               atol=1e-5)


def decoders(model, params, src, valid, **kw):
    greedy = decoding.greedy_decode(model, params, src, valid, max_len=10, bos_id=BOS, eos_id=EOS, **kw)
    return greedy, lambda w, **k: decoding.beam_search(model, params, src, valid, max_len=10, bos_id=BOS,
                                                       eos_id=EOS, beam_size=w, **k)


def sequence_score(model, params, src, valid, tokens, alpha):
    """Log-probability of tokens (up to and including [EOS]) / length penalty, by a full forward pass."""
    tgt_in = jnp.concatenate([jnp.full((tokens.shape[0], 1), BOS), tokens[:, :-1]], 1)
    logp = jax.nn.log_softmax(model.apply({"params": params}, src, tgt_in, valid))
    token_logp = jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    ended = jnp.cumsum(tokens == EOS, 1) - (tokens == EOS)
    live = ended == 0
    return (token_logp * live).sum(1) / decoding.length_penalty(live.sum(1), alpha)


@pytest.mark.slow
def test_beam_search_of_width_one_is_greedy_and_wider_beams_score_no_worse():
    model = small_model()
    src, valid = source(batch=3, pad_from=(9, 6, 3))
    params = init(model, src, valid, src)
    params["embed"]["embedding"] = params["embed"]["embedding"] * 8  # peakier, varied distributions
    (tokens, scores), beam = decoders(model, params, src, valid)
    np.testing.assert_allclose(scores, sequence_score(model, params, src, valid, tokens, 0.0), atol=1e-4)
    one_tokens, one_scores = beam(1, alpha=0.0)
    np.testing.assert_array_equal(one_tokens, tokens)
    np.testing.assert_allclose(one_scores, scores, atol=1e-5)
    for alpha in (0.0, 0.6):
        greedy_scores = sequence_score(model, params, src, valid, tokens, alpha)
        wide_tokens, wide_scores = beam(4, alpha=alpha)
        np.testing.assert_allclose(wide_scores, sequence_score(model, params, src, valid, wide_tokens, alpha),
                                   atol=1e-4)
        assert bool((wide_scores >= greedy_scores - 1e-5).all())


def test_inconsistent_model_config_fails_naming_the_key():
    with pytest.raises(ValueError, match="config.model.d_model=30 is not divisible by num_heads=4"):
        small_model(d_model=30)
    with pytest.raises(ValueError, match="config.model.positions='rotary'"):
        small_model(positions="rotary")
    with pytest.raises(ValueError, match="unknown config.model keys for the encdec family: bogus"):
        small_model(bogus=1)


def test_tsv_reader_names_file_and_line(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_text("a b\tc d\n\nonly a source\n")
    with pytest.raises(ValueError, match=rf"{path}:3: expected 'source<TAB>target'"):
        seq2seq_pairs.read_pairs(str(path))
    path.write_text("x\ty\n\nu v\tw\n")
    assert seq2seq_pairs.read_pairs(str(path)) == [("x", "y"), ("u v", "w")]


def test_code2doc_pairs_drop_the_docstring():
    code = 'def add(a, b):\n    """Add two numbers.\n\n    More.\n    """\n    return a + b\n'
    assert seq2seq_pairs.function_pairs(code) == [("def add(a, b): \\n return a + b", "Add two numbers.")]


SMALL = ["model.num_layers=1", "model.num_decoder_layers=1", "model.d_model=32", "model.num_heads=2",
         "model.mlp_dim=64", "model.max_len=16", "model.vocab_size=64", "data.vocab_size=64",
         "data.tokenizer=wordpiece", "data.source_len=12", "data.target_len=12", "data.batch_size=8",
         "data.eval_batches=2", "optim.warmup_steps=2", "train.steps=4", "train.log_every=2", "train.eval_every=2",
         "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("encdec")
    write_pairs(tmp / "train.tsv", 64, 0)
    write_pairs(tmp / "eval.tsv", 16, 1)
    config = config_lib.load(os.path.join(REPO, "configs/encdec.py:tiny"),
                             [*SMALL, f"data.train_path={tmp / 'train.tsv'}", f"data.eval_path={tmp / 'eval.tsv'}"])
    loop.train(config, str(tmp / "run"), devices=jax.devices()[:1])
    return config, tmp / "run"


@pytest.mark.slow
def test_training_writes_seq2seq_metrics_and_a_checkpoint_evaluates_the_same(trained):
    config, workdir = trained
    recs = metrics_lib.read(str(workdir / "metrics.jsonl"))
    evals = [r for r in recs if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    keys = ("eval/loss", "eval/token_accuracy", "eval/bleu", "eval/bleu_copy_baseline", "eval/chrf",
            "eval/chrf_copy_baseline")
    assert all(np.isfinite(evals[-1][k]) for k in keys)
    run = loop.setup(checks.checked(config), str(workdir), devices=jax.devices()[:1])
    again = loop.evaluate(run, run.state.params)
    np.testing.assert_allclose([again[k] for k in keys], [evals[-1][k] for k in keys], rtol=1e-5)


def test_exact_outputs_shorter_than_four_tokens_score_100_and_worse_ones_less():
    references = ["Add two numbers.", "Close it.", "Run"]
    assert seq2seq.text_scores(references, references) == pytest.approx({"bleu": 100.0, "chrf": 100.0})
    worse = seq2seq.text_scores(["Add numbers.", "Close it.", "Stop"], references)
    assert 0 < worse["bleu"] < 100 and 0 < worse["chrf"] < 100
    long = ["the cat sat on the mat today"]  # with 4-grams, effective order is the standard BLEU
    assert seq2seq.text_scores(["the cat sat on a mat today"], long)["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(["the cat sat on a mat today"], [long]).score)


def test_generate_cli_translates_an_input(trained):
    _, workdir = trained
    out = generate_cli(workdir, "--input", "alpha beta gamma delta", "--beam_size", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.splitlines()) == 1


@pytest.mark.parametrize("family,serves", [
    ("bert", "label new texts with python -m transformer.predict --workdir '{0}' --input FILE (a classifier), or "
             "fine-tune from it with --config.init_from='{0}'"),
    ("vit", "label new images with python -m transformer.predict --workdir '{0}' --input FOLDER"),
])
def test_generate_cli_refuses_a_classifier_run_naming_the_commands_for_its_path(tmp_path, family, serves):
    workdir = tmp_path / "my run"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps({"model": {"family": family}}))
    out = generate_cli(workdir, "--input", "x")
    what = "encoders (masked-LM / classifiers)" if family == "bert" else "image classifiers"
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: {family} models are {what}: they do not generate; score this one with python -m "
        f"transformer.evaluate --workdir '{workdir}', " + serves.format(workdir)], out.stderr


def test_byte_tokenizer_is_refused(tmp_path):
    config = config_lib.load(os.path.join(REPO, "configs/encdec.py:tiny"), ["data.tokenizer=byte"])
    with pytest.raises(ValueError, match="config.data.tokenizer='byte'"):
        loop.setup(checks.checked(config), str(tmp_path))


def probe_cli(kind, workdir, *args):
    return subprocess.run([sys.executable, "-m", "transformer.probe", kind, "--workdir", str(workdir), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XLA_FLAGS": FAST_COMPILES})


@pytest.mark.slow
def test_the_probes_read_an_encoder_decoder_run(trained):
    """Attention maps of the greedy output (encoder self, decoder self, cross) and the embeddings;
    the lens, which needs a next-token head over each layer, is refused in one line."""
    _, workdir = trained
    out = probe_cli("attention", workdir, "--input", "alpha beta gamma delta")
    assert out.returncode == 0, out.stderr[-2000:]
    layers = " ".join(json.load(open(out.stdout.split()[-1]))["weights"])
    assert "encoder" in layers and "self_attn" in layers and "cross_attn" in layers, layers
    assert any(p.endswith("cross_attn-layers.png") for p in out.stdout.split()), out.stdout
    assert probe_cli("embeddings", workdir, "--text", "alpha").returncode == 0
    lens = probe_cli("lens", workdir, "--input", "alpha beta")
    assert lens.returncode == 2 and len(lens.stderr.strip().splitlines()) == 1, lens.stderr
