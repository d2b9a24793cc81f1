"""Training from token stores: the order without replacement, mixtures, document packing, the rows
a process builds, and the stores a run records."""

import os
import subprocess
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, SMALL_GPT

from transformer import config as config_lib
from transformer import models, parallel, rundir
from transformer.data.text import lm_streams, order, store_build, token_store
from transformer.training import checks, loop, metrics, shapes, tasks
from transformer.training.tasks import lm as lm_task

JSON_SOURCE = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")


def build_store(path, source=JSON_SOURCE, eval_fraction=0.3) -> token_store.Store:
    settings = {"source": source, "eval_source": None, "text_field": "text", "tokenizer": "byte",
                "tokenizer_path": None, "vocab_size": None, "sample_mb": None, "eval_fraction": eval_fraction,
                "shard_mb": 0.05}
    store_build.build(settings, str(path), workers=1, progress=False)
    return token_store.Store.open(str(path))


@pytest.fixture(scope="module")
def json_store(tmp_path_factory):
    return build_store(tmp_path_factory.mktemp("stores") / "json")


def test_permute_is_a_bijection_keyed_by_its_key():
    for n in (1, 2, 5, 64, 1000, 4097):
        assert sorted(order.permute(np.arange(n), n, (3,))) == list(range(n))
    assert not np.array_equal(order.permute(np.arange(100), 100, (0,)), order.permute(np.arange(100), 100, (1,)))
    g = np.arange(300)
    drawn = order.epochs(g, 100, (7,))
    for epoch in range(3):  # without replacement: every epoch visits each example once
        assert sorted(drawn[epoch * 100:(epoch + 1) * 100]) == list(range(100))
    assert not np.array_equal(drawn[:100], drawn[100:200])
    big = order.epochs(np.array([10**7 * 16 + 3]), 2**31 // 129, (0, 0))  # a late step of a 2^31-token store
    assert 0 <= big[0] < 2**31 // 129


def test_a_mixture_draws_its_shares_without_replacement_and_a_change_counts_from_its_step():
    batch, steps = 16, 1000
    g = np.arange(batch * steps)
    source, local = order.Mixture([(0, [0.8, 0.2])], batch, seed=0)(g)
    shares = np.bincount(source) / len(g)
    assert abs(shares[0] - 0.8) < 0.01 and abs(shares[1] - 0.2) < 0.01
    for s in (0, 1):
        assert len(np.unique(local[source == s])) == np.sum(source == s)
    again = order.Mixture([(0, [0.8, 0.2])], batch, seed=0)(g)
    np.testing.assert_array_equal(again[0], source)
    changed_source, changed_local = order.Mixture([(0, [0.8, 0.2]), (500, [0.5, 0.5])], batch, seed=0)(g)
    np.testing.assert_array_equal(changed_source[:500 * batch], source[:500 * batch])
    assert not np.array_equal(changed_source[500 * batch:], source[500 * batch:])
    assert abs(np.mean(changed_source[500 * batch:] == 1) - 0.5) < 0.01
    for s in (0, 1):  # the change goes on where each source was: nothing read twice
        assert len(np.unique(changed_local[changed_source == s])) == np.sum(changed_source == s)


def test_layout_numbers_documents_and_restarts_positions():
    eod = 9
    tokens = np.array([[1, 2, 9, 3, 4, 5, 9, 6], [9, 1, 1, 1, 1, 1, 1, 1]])
    segments, positions = lm_streams.layout(tokens, eod)
    np.testing.assert_array_equal(segments, [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]])


def streams(opened, rows, seed=0, batch=8, width=33, schedule=None):
    return lm_streams.Streams(opened, schedule or [(0, [w for *_, w in opened])], width, width - 1, batch, seed, rows)


def test_batches_are_windows_of_the_store_a_pure_function_of_the_step_and_rows(json_store):
    opened = [("json", json_store, 1.0)]
    whole = streams(opened, np.arange(8))
    batch = whole.windows(5)
    assert batch.shape == (8, 33) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, streams(opened, np.arange(8)).windows(5))
    assert not np.array_equal(batch, whole.windows(6))
    assert not np.array_equal(batch, streams(opened, np.arange(8), seed=1).windows(5))
    parts = [streams(opened, np.array(rows)).windows(5) for rows in ([0, 3, 6], [1, 2, 4, 5, 7])]
    np.testing.assert_array_equal(parts[0], batch[[0, 3, 6]])
    np.testing.assert_array_equal(parts[1], batch[[1, 2, 4, 5, 7]])
    train = json_store.split("train")
    _, windows = whole.assignment(5)
    for row, w in zip(batch, windows):
        np.testing.assert_array_equal(row, train.read(int(w) * 32, int(w) * 32 + 33))
    per_epoch = whole.sources[0].windows  # one epoch reads every window once
    seen = np.concatenate([whole.assignment(step)[1] for step in range(per_epoch // 8)])
    assert len(np.unique(seen)) == len(seen)


def test_a_run_records_its_stores_and_refuses_others(tmp_path, json_store):
    other = build_store(tmp_path / "other", source=JSON_SOURCE.replace("json", "html"))
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    first = lm_streams.weight_schedule(workdir, [("json", json_store, 1.0)], 0, True)
    assert first == [(0, [1.0])]
    with pytest.raises(ValueError, match="was trained on other token stores"):
        lm_streams.weight_schedule(workdir, [("other", other, 1.0)], 10, True)
    mixed = str(tmp_path / "mixed")
    os.makedirs(mixed)
    lm_streams.weight_schedule(mixed, [("json", json_store, 0.8), ("other", other, 0.2)], 0, True)
    assert lm_streams.weight_schedule(mixed, [("json", json_store, 0.5), ("other", other, 0.5)], 40, True) == [
        (0, [0.8, 0.2]), (40, [0.5, 0.5])]


def test_a_token_sees_nothing_of_another_document_in_its_window():
    model = models.build({**models.family("gpt").model_config("tiny"), "num_layers": 2, "d_model": 32,
                          "num_heads": 4, "mlp_dim": 64, "max_len": 32, "positions": "rotary"})
    eod = 255
    first = np.array([5, 6, 7, eod])
    tokens = np.stack([np.r_[first, np.arange(20, 32)], np.r_[first, np.arange(40, 45), eod, np.arange(50, 56)]])
    segments, positions = lm_streams.layout(tokens, eod)
    params = model.init(jax.random.key(0), jnp.asarray(tokens))["params"]
    logits = model.apply({"params": params}, jnp.asarray(tokens), segments=jnp.asarray(segments),
                         positions=jnp.asarray(positions))
    np.testing.assert_allclose(logits[0, :4], logits[1, :4], atol=1e-6)  # the next document differs, and its length
    alone = model.apply({"params": params}, jnp.asarray(tokens[:1, 4:]))  # the second one alone: same logits
    np.testing.assert_allclose(logits[0, 4:], alone[0], atol=1e-5)
    mixed = model.apply({"params": params}, jnp.asarray(tokens))  # without the mask the first ones would differ
    assert not np.allclose(mixed[0, 4:], alone[0], atol=1e-3)


@pytest.mark.slow
def test_rows_follow_the_devices_in_any_order(small_gpt_config, tmp_path):
    """8 fake devices in a shuffled order train as 1 device does."""
    devices = jax.devices()
    shuffled = [devices[i] for i in np.random.default_rng(0).permutation(len(devices))]
    mesh = parallel.make_mesh(small_gpt_config().mesh, shuffled)
    assert sorted(parallel.process_rows(mesh, 8)) == list(range(8))
    losses = {}
    for name, devs in (("one", devices[:1]), ("shuffled", shuffled)):
        config = small_gpt_config("train.steps=3", "train.eval_every=3", "train.sample_tokens=0")
        loop.train(config, str(tmp_path / name), devices=devs)
        losses[name] = [r["train/loss"] for r in metrics.read(str(tmp_path / name / "metrics.jsonl"))
                        if "train/loss" in r]
    np.testing.assert_allclose(losses["shuffled"], losses["one"], rtol=1e-5)


def test_a_mixture_run_reports_each_store_and_takes_new_weights_from_its_resumed_step(tmp_path, json_store,
                                                                                    small_gpt_config, capsys):
    email = build_store(tmp_path / "email", source=JSON_SOURCE.replace("json", "email"))
    mix = lambda a, b: f"data.source={json_store.path}={a},{email.path}={b}"
    workdir = str(tmp_path / "run")
    loop.train(small_gpt_config(mix(0.8, 0.2), "train.steps=2", "train.eval_every=2", "train.sample_tokens=0"),
               workdir, devices=jax.devices()[:1])
    last = metrics.read(os.path.join(workdir, "metrics.jsonl"))[-1]
    assert {"eval/loss", "eval/json/loss", "eval/email/loss"} <= set(last)
    loop.train(small_gpt_config(mix(0.5, 0.5), "train.steps=4", "train.eval_every=2", "train.sample_tokens=0"),
               workdir, devices=jax.devices()[:1])
    assert "data: weights [0.8, 0.2] -> [0.5, 0.5] from step 2" in capsys.readouterr().err
    assert token_store.read_json(os.path.join(workdir, "data.json"))["schedule"] == [[0, [0.8, 0.2]], [2, [0.5, 0.5]]]


def eval_of(config, workdir):
    """The LM task's eval outputs (one jitted step per batch, as the loop runs them) and metrics."""
    task = tasks.build(config, workdir, "lm", np.arange(config.data.batch_size), 0)
    model = models.build(config.model)
    params = model.init(jax.random.key(0), *task.init_inputs())["params"]
    step = jax.jit(lambda p, b: task.eval_outputs(model, p, b))
    outputs = jax.device_get([step(params, b) for b in task.eval_batches()])
    return outputs, task.eval_metrics(outputs)


def test_long_context_eval_reports_the_loss_by_position_bucket(tmp_path, json_store, small_gpt_config):
    assert lm_task.position_buckets(1024) == []
    assert lm_task.position_buckets(3000) == [(0, 1024), (1024, 2048), (2048, 3000)]
    assert lm_task.position_buckets(65536) == [(0, 1024)] + [(2**k, 2**(k + 1)) for k in range(10, 16)]
    assert [lm_task.position_name(p) for p in (0, 1024, 3000, 65536)] == ["0", "1K", "3000", "64K"]
    source = f"data.source={json_store.path}"
    _, result = eval_of(small_gpt_config(source, "data.seq_len=1536", "model.max_len=1536", "data.batch_size=2"),
                        str(tmp_path / "long"))
    by_position = {k: v for k, v in result.items() if k.startswith("eval/loss_by_position/")}
    assert list(by_position) == ["eval/loss_by_position/0-1K", "eval/loss_by_position/1K-1536"]
    weighted = (by_position["eval/loss_by_position/0-1K"] * 1024 + by_position["eval/loss_by_position/1K-1536"] * 512)
    np.testing.assert_allclose(weighted / 1536, result["eval/loss"], rtol=1e-6)
    outputs, result = eval_of(small_gpt_config(source), str(tmp_path / "short"))
    assert all(set(o) == {"loss_sum", "count"} for o in outputs)
    assert set(result) == {"eval/loss", "eval/perplexity", "eval/bits_per_byte"}


@pytest.mark.slow
def test_a_gpt_on_a_bpe_store_takes_its_tokenizer_and_vocabulary_from_the_store(tmp_path, capsys, json_store):
    store = tmp_path / "bpe"
    made = subprocess.run([sys.executable, "-m", "transformer.data.tokenize", "--source", JSON_SOURCE, "--out",
                           str(store), "--tokenizer", "bpe", "--vocab_size", "300", "--sample_mb", "1",
                           "--eval_fraction", "0.3", "--workers", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    ids = token_store.Store.open(str(store)).vocab_size
    spec = os.path.join(REPO, f"configs/gpt.py:tiny,data.source={store}")
    loop.train(config_lib.load(spec, [*SMALL_GPT, "train.steps=1", "train.eval_every=1"]), str(tmp_path / "run"),
               devices=jax.devices()[:1])
    said = capsys.readouterr().err.splitlines()
    assert said[0].startswith(f"data: {store}: a token store of ") and said[0].endswith(
        f"documents, tokenized by bpe ({ids} ids); documents not masked: a row's documents attend to each other "
        "(config.data.document_mask)")
    assert said[1] == f"from the data: data.tokenizer='bpe', model.vocab_size={ids}"
    saved = rundir.open(str(tmp_path / "run")).config
    assert (saved.data.tokenizer, saved.model.vocab_size) == ("bpe", ids)

    with pytest.raises(ValueError, match=rf"^config.data.source: the stores were tokenized with different tokenizers "
                                         rf"\(bpe: bpe of {ids} ids, json: byte of 256 ids\); a mixture"):
        lm_streams.check_stores([("bpe", token_store.Store.open(str(store)), 0.5), ("json", json_store, 0.5)], saved)
    with pytest.raises(ValueError, match=r"^config.data.tokenizer='byte' but the store .* with 'bpe': leave the key"):
        checks.validate(config_lib.load(spec, ["data.tokenizer=byte"]))
    with pytest.raises(ValueError, match=f"^config.model.vocab_size=100 is smaller than the bpe tokenizer's {ids}"):
        checks.validate(config_lib.load(spec, ["model.vocab_size=100"]))
    masked = shapes.resolve(config_lib.load(spec, ["model.vocab_size=512", "data.document_mask=true"]))
    assert masked[0].endswith("; documents masked: each token attends within its own document") and masked[1:] == [
        f"config.model.vocab_size=512: the bpe tokenizer has {ids} ids; the embedding's other {512 - ids} rows are "
        "never read", "from the data: data.tokenizer='bpe'"]


def test_an_eval_split_too_small_and_a_changed_data_key_name_what_to_do(tmp_path, json_store, small_gpt_config):
    text, workdir = small_gpt_config(f"data.source={JSON_SOURCE}", "data.eval_fraction=0.3"), str(tmp_path / "run")
    eval_of(text, workdir)
    with pytest.raises(ValueError, match=r"^config.data.eval_fraction=0.5 but the run's store .* was tokenized with "
                                         r"0.3: a new --workdir tokenizes the text again$"):
        eval_of(small_gpt_config(f"data.source={JSON_SOURCE}", "data.eval_fraction=0.5"), workdir)
    too_few = (r"holds \d+ train tokens and no eval split of one batch \(1700000 tokens\): too few to hold one out "
               r"and train on as many; use more data, lower config.data.batch_size")
    with pytest.raises(ValueError, match=too_few):
        eval_of(small_gpt_config(f"data.source={JSON_SOURCE}", "data.eval_fraction=0.3", "data.batch_size=100000"),
                workdir)
    with pytest.raises(ValueError, match=too_few):
        eval_of(small_gpt_config(f"data.source={json_store.path}", "data.batch_size=100000"), workdir)


def test_the_stdlib_is_tokenized_once_per_machine_and_linked_into_each_run(tmp_path, monkeypatch, small_gpt_config):
    monkeypatch.setenv("TRANSFORMER_CACHE", str(tmp_path / "cache"))
    config = small_gpt_config()
    built = []
    build = store_build.build
    monkeypatch.setattr(store_build, "build", lambda settings, out, *a, **k: built.append(out) or build(
        settings, out, *a, **k))
    first, second = (lm_streams.open_stores(config, str(tmp_path / name))[0][1] for name in ("a", "b"))
    kept = [out for out in built if out.startswith(str(tmp_path / "cache"))]
    assert len(kept) == 2 and first.index == second.index  # the second launch found the kept store whole
    index = tmp_path / "b" / lm_streams.STORE_DIR / token_store.INDEX
    assert os.stat(index).st_nlink == 3 and os.path.samefile(index, os.path.join(kept[0], token_store.INDEX))
