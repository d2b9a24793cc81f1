"""The probes: captured attention weights, the logit lens, embedding analogies, and the CLI on tiny runs."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILES, REPO
from test_bert import STDLIB_FILES, bert_config

from transformer import probe
from transformer.layers.attention import MultiHeadAttention, masks
from transformer.models import bert, encdec, gpt
from transformer.training import loop


def test_captured_weights_times_values_give_the_attention_output_and_causal_maps_are_zero_above_the_diagonal():
    layer = MultiHeadAttention(num_heads=4, head_dim=8, num_kv_heads=2, attention="dense")
    x = jax.random.normal(jax.random.key(0), (2, 7, 32))
    mask = masks.Mask(causal=True)
    params = layer.init(jax.random.key(1), x, mask=mask)["params"]
    seen = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.module.name in ("value", "out") and context.method_name == "__call__":
            seen[context.module.name] = args[0] if context.module.name == "out" else out
        return out

    with nn.intercept_methods(record):
        _, state = layer.apply({"params": params}, x, mask=mask, mutable=["intermediates"])
    weights = state["intermediates"]["attention_weights"][0]  # [B, H, L, S]
    v = jnp.repeat(seen["value"], 2, axis=2)  # [B, S, H, Dh]: each kv head serves two query heads
    np.testing.assert_allclose(jnp.einsum("bhls,bshd->blhd", weights, v), seen["out"], atol=1e-5)
    assert weights.dtype == jnp.float32 and weights.shape == (2, 4, 7, 7)
    assert np.all(np.triu(np.asarray(weights), k=1) == 0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    plain = layer.clone(attention="auto").apply({"params": params}, x, mask=mask)
    np.testing.assert_allclose(layer.apply({"params": params}, x, mask=mask), plain, atol=1e-5)


def test_a_hand_set_previous_token_head_puts_its_rows_on_the_previous_token():
    model = gpt.GPT(vocab_size=16, num_layers=1, d_model=64, num_heads=2, mlp_dim=64, max_len=16, norm="rmsnorm")
    params = jax.tree.map(np.array, nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]))
    params["embed"]["embedding"][:] = 0.0
    params["pos_embed"]["embedding"][:] = np.eye(16, 64)  # position p: unit vector e_p
    query, key = params["block_0"]["self_attn"]["query"], params["block_0"]["self_attn"]["key"]
    query["kernel"][:, 0], key["kernel"][:, 0] = 0.0, 0.0
    for p in range(16):
        key["kernel"][p, 0, p] = 1.0
        if p:
            query["kernel"][p, 0, p - 1] = 10.0  # head 0: position p asks for p - 1
    model, params = probe.probe_form(gpt.FAMILY, model, params)
    tokens = jnp.arange(12)[None] % 16
    weights = probe.attention(model, params, tokens)["block_0/self_attn"]  # [H, L, L]
    assert np.all(weights[0, np.arange(1, 12), np.arange(0, 11)] > 0.99)
    assert np.all(np.triu(weights, k=1) == 0)


def _cut(params: dict, layers: int, total: int) -> dict:
    return {k: v for k, v in params.items() if k not in {f"block_{i}" for i in range(layers, total)}}


@pytest.mark.parametrize("family", [gpt.FAMILY, bert.FAMILY])
def test_the_lens_after_layer_k_is_the_logits_of_the_model_cut_to_k_layers(family):
    sizes = dict(vocab_size=50, num_layers=3, d_model=32, num_heads=4, mlp_dim=64, max_len=16)
    model = family.module(**sizes, scan_layers=True, attention="blockwise")
    tokens = jax.random.randint(jax.random.key(2), (1, 10), 0, 50)
    params = model.init(jax.random.key(3), tokens)["params"]
    probed, unscanned = probe.probe_form(family, model, params)
    lens = probe.logit_lens(probed, unscanned, tokens[0], family.lens_entry)  # [N, L, V]
    assert lens.shape == (3, 10, 50)
    for k in range(1, 4):
        cut = probed.clone(num_layers=k)
        logits = probe.vocabulary_logits(cut.apply({"params": _cut(unscanned, k, 3)}, tokens))[0]
        np.testing.assert_allclose(lens[k - 1], logits, atol=1e-5, err_msg=f"after layer {k}")


def test_analogies_on_a_hand_built_table_return_the_planted_answer_first_and_never_a_b_or_c():
    words = ["king", "man", "woman", "queen", "apple", "crown"]
    table = np.array([[1.0, 1.0, 0.0, 0.1], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0],
                      [0.0, 0.9, 1.0, 0.1], [0.3, -1.0, 0.2, 1.0], [0.5, 1.0, 0.5, 0.0]])
    answers = probe.analogy(table, 0, 1, 2, k=3)
    assert words[answers[0][0]] == "queen"
    assert not {0, 1, 2} & {i for i, _ in answers}
    assert answers[0][1] == pytest.approx(probe.cosine(table, table[0] - table[1] + table[2])[3])
    assert [i for i, _ in probe.nearest(table, table[0], 2, exclude=[0])] == [5, 1]
    assert probe.project(table).shape == (6, 2)


def _probe(kind: str, workdir: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILES}
    return subprocess.Popen([sys.executable, "-m", "transformer.probe", kind, "--workdir", workdir, *args],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """A tiny GPT and a tiny BERT, each trained for a few steps."""
    root = tmp_path_factory.mktemp("runs")
    from conftest import SMALL_GPT

    from transformer import config as config_lib
    loop.train(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), [*SMALL_GPT, "train.steps=2"]),
               str(root / "gpt"))
    corpus = root / "corpus"
    corpus.mkdir()
    for name in STDLIB_FILES:
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), corpus / name.replace("/", "_"))
    loop.train(bert_config("tiny", f"data.source={corpus}/*.py", "data.eval_fraction=0.3", "train.steps=2"),
               str(root / "bert"))
    return str(root / "gpt"), str(root / "bert")


def test_each_probe_writes_its_files_on_tiny_gpt_and_bert_runs(tiny_runs):
    gpt_run, bert_run = tiny_runs
    jobs = {
        ("gpt", "attention"): _probe("attention", gpt_run, "--text", "def f(x):"),
        ("gpt", "embeddings"): _probe("embeddings", gpt_run, "--text", "def", "--analogy", "a,b,c"),
        ("gpt", "lens"): _probe("lens", gpt_run, "--text", "import os"),
        ("gpt", "temperature"): _probe("temperature", gpt_run, "--text", "def "),
        ("bert", "attention"): _probe("attention", bert_run, "--text", "import json"),
        ("bert", "embeddings"): _probe("embeddings", bert_run, "--text", "return", "--words", "def,class,return"),
        ("bert", "lens"): _probe("lens", bert_run, "--text", "import json"),
        ("bert", "temperature"): _probe("temperature", bert_run, "--text", "import [MASK]"),
        ("gpt", "too long"): _probe("lens", gpt_run, "--text", "x" * 40, "--max_tokens", "20"),
    }
    results = {key: job.communicate() + (job.returncode,) for key, job in jobs.items()}
    for (family, kind), (out, err, code) in results.items():
        if kind == "too long":
            assert code == 2 and err.strip().splitlines()[-1] == (
                "error: the text is 40 tokens, more than the limit of 20: shorten it or raise --max_tokens")
            continue
        assert code == 0, (family, kind, err[-2000:])
        paths = [line for line in out.splitlines() if os.path.isfile(line)]
        assert any(p.endswith(".png") for p in paths) and paths[-1].endswith(f"{kind}.json")
        assert all(os.path.getsize(p) > 0 for p in paths), paths
        assert os.path.dirname(paths[-1]).endswith(f"probes/{kind}-2")
        assert json.load(open(paths[-1]))["step"] == 2
    for family in ("gpt", "bert"):  # the neighbours and answers as text: printed, and saved beside the figures
        out = results[(family, "embeddings")][0]
        folder = os.path.dirname(out.splitlines()[-1])
        text, numbers = open(f"{folder}/embeddings.txt").read(), json.load(open(f"{folder}/embeddings.json"))
        assert out.startswith(text) and f"{folder}/embeddings.txt" in out.splitlines()
        ranked = [line.split() for line in text.splitlines() if line.startswith("  ")]
        expected = numbers["nearest"] + numbers.get("analogy", {}).get("answers", [])
        assert [(token, score) for _, token, score in ranked] == [(t, f"{s:.4f}") for t, s in expected]
        assert len(ranked) == 8 * (2 if family == "gpt" else 1)
    assert "a - b + c (a, b and c excluded), by cosine similarity:" in results[("gpt", "embeddings")][0]


def test_an_encoder_decoder_shows_encoder_self_decoder_self_and_cross_attention():
    model = encdec.EncoderDecoder(vocab_size=40, num_layers=2, d_model=32, num_heads=4, mlp_dim=64, max_len=16)
    src, tgt = jnp.arange(1, 8)[None], jnp.arange(1, 5)[None]  # S = 7, L = 4
    params = model.init(jax.random.key(0), src, tgt, src != 0)["params"]
    model, params = probe.probe_form(encdec.FAMILY, model, params)
    maps = probe.attention(model, params, src, tgt, src != 0)
    shapes = {path: w.shape for path, w in maps.items()}
    assert shapes == {**{f"encoder_{i}/self_attn": (4, 7, 7) for i in range(2)},
                      **{f"decoder_{i}/self_attn": (4, 4, 4) for i in range(2)},
                      **{f"decoder_{i}/cross_attn": (4, 4, 7) for i in range(2)}}
    assert all(np.all(np.triu(maps[f"decoder_{i}/self_attn"], k=1) == 0) for i in range(2))


def test_the_rollout_of_identity_maps_is_the_identity_and_of_hand_made_maps_the_hand_computation():
    eye = np.repeat(np.eye(5)[None], 3, axis=0)  # [H, T, T]
    np.testing.assert_allclose(probe.rollout([eye] * 4), np.eye(5), atol=1e-12)
    first = np.array([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]])  # heads average to 1/2 everywhere
    second = np.array([[[1.0, 0.0], [1.0, 0.0]]] * 2)
    # layer 1: 0.5 * [[.5, .5], [.5, .5]] + 0.5 * I = [[.75, .25], [.25, .75]]; layer 2: [[1, 0], [.5, .5]]
    np.testing.assert_allclose(probe.rollout([first, second]), [[0.75, 0.25], [0.5, 0.5]], atol=1e-12)


def test_the_pooled_row_is_cls_or_the_mean_over_queries_and_its_patches_fill_the_grid():
    weights = np.random.default_rng(0).dirichlet(np.ones(5), size=5)  # [T, T], rows sum to 1
    np.testing.assert_allclose(probe.pooled_row(weights, "cls"), weights[0])
    np.testing.assert_allclose(probe.pooled_row(weights, "mean").sum(), 1.0)
    np.testing.assert_array_equal(probe.patch_grid(weights[0], "cls"), weights[0, 1:].reshape(2, 2))
    assert probe.patch_grid(weights[0, :4], "mean").shape == (2, 2)


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    """A tiny ViT that pools by [CLS], trained 2 steps on the digits."""
    from test_vit import SMALL_VIT

    from transformer import config as config_lib
    root = tmp_path_factory.mktemp("vit")
    config = config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"),
                             [*SMALL_VIT, "model.pool=cls", "train.steps=2", "train.eval_every=2"])
    loop.train(config, str(root / "run"))
    return str(root / "run"), config


def test_a_vit_image_is_read_and_normalised_as_the_task_reads_its_data(tiny_vit):
    from transformer.training import tasks
    run, config = tiny_vit
    first, mean, std = probe.data_images(config, run)
    task = tasks.build(config, run, "image_classification", np.arange(8), 0)
    np.testing.assert_array_equal(first, next(iter(task.eval_batches()))["images"][0])
    np.testing.assert_array_equal(mean, task.mean)
    np.testing.assert_array_equal(std, task.std)


def test_the_vit_attention_probe_overlays_cls_rows_that_sum_to_one_and_other_probes_refuse(tiny_vit, tmp_path):
    from PIL import Image
    run, _ = tiny_vit
    picture = tmp_path / "digit.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(picture)
    jobs = {"first eval image": _probe("attention", run, "--out", str(tmp_path / "first")),
            "png": _probe("attention", run, "--image", str(picture), "--out", str(tmp_path / "png")),
            **{kind: _probe(kind, run, "--text", "x") for kind in ("embeddings", "lens", "temperature")}}
    results = {key: job.communicate() + (job.returncode,) for key, job in jobs.items()}
    for key in ("first eval image", "png"):
        out, err, code = results[key]
        assert code == 0, err[-2000:]
        paths = out.split()
        assert {os.path.basename(p) for p in paths} == {"image.png", "block_0-self_attn.png", "layers.png",
                                                        "attention.json"}
        numbers = json.load(open(paths[-1]))
        assert numbers["pool"] == "cls" and len(numbers["tokens"]) == 17
        for row in ("last_layer", "rollout"):  # [CLS]'s weight on itself, then on the 16 patches
            assert len(numbers[row]) == 17 and sum(numbers[row]) == pytest.approx(1.0, abs=1e-4)
        assert ("first eval image" in numbers["image"]) == (key == "first eval image")
    assert "no --image: probing the first eval image" in results["first eval image"][1]
    for kind in ("embeddings", "lens", "temperature"):
        out, err, code = results[kind]
        assert code == 2 and len(err.strip().splitlines()) == 1 and "vit" in err, (kind, err)
