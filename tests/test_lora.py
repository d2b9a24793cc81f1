"""LoRA: only the adapters train and hold optimizer state, the base stays as it was, the adapters shard like
their kernels, and a run with adapters applies as its merged base does."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from transformer import models, rundir
from transformer.layers import lora
from transformer.training import checks, loop


@pytest.mark.slow
def test_adapters_train_alone(tmp_path, corpus, small_gpt_config):
    config = small_gpt_config(f"data.source={corpus}", "lora.rank=4", "lora.targets=attention,mlp",
                              "lora.dropout=0.1", "train.steps=4", "train.sample_tokens=0")
    run = loop.setup(checks.checked(config), str(tmp_path / "run"))
    before = jax.device_get(run.state.params)
    adapters = traverse_util.flatten_dict(before[lora.ADAPTERS], sep="/")
    assert sorted({p.rsplit("/", 1)[0] for p in adapters}) == sorted(
        p for p in traverse_util.flatten_dict(before, sep="/")
        if p.endswith("kernel") and ("attn" in p or "mlp" in p) and not p.startswith(lora.ADAPTERS))
    trainable, total = lora.count(before)
    state_size = sum(x.size for x in jax.tree.leaves(run.state.opt_state))
    assert state_size <= 2 * trainable + 8 < total  # Adam's two moments of the adapters, and counters
    flat = traverse_util.flatten_dict(run.state.params, sep="/")
    kernel = next(p for p in flat if p.endswith("self_attn/query/kernel") and not p.startswith(lora.ADAPTERS))
    assert flat[f"{lora.ADAPTERS}/{kernel}/a"].sharding.spec[0] == flat[kernel].sharding.spec[0]
    loop.train(config, str(tmp_path / "run"))
    after = rundir.open(str(tmp_path / "run")).restore_params()
    flat_before, flat_after = (traverse_util.flatten_dict(p, sep="/") for p in (before, after))
    for name, value in flat_before.items():
        if name.startswith(lora.ADAPTERS + "/") and name.endswith("/b"):
            assert np.abs(flat_after[name]).max() > 0, name
        elif not name.startswith(lora.ADAPTERS + "/"):
            np.testing.assert_array_equal(flat_after[name], value, err_msg=name)


@pytest.mark.parametrize("scan", [True, False])
def test_adapted_equals_its_merged_base(small_gpt_config, scan):
    config = small_gpt_config("lora.rank=2", "lora.targets=attention,mlp", f"model.scan_layers={scan}")
    model = models.build(config.model, config.lora)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    params = {**params, lora.ADAPTERS: jax.tree.map(lambda x: x + 0.05, params[lora.ADAPTERS])}  # B nonzero
    ours = model.apply({"params": params}, tokens)
    base = models.build(config.model)
    merged = base.apply({"params": lora.merged(params, model.lora.scale)}, tokens)
    plain = base.apply({"params": {k: v for k, v in params.items() if k != lora.ADAPTERS}}, tokens)
    np.testing.assert_allclose(ours, merged, atol=1e-5)
    assert np.abs(np.asarray(ours) - np.asarray(plain)).max() > 1e-3


def test_bad_settings_fail_naming_the_key(small_gpt_config):
    config = small_gpt_config("lora.rank=2", "lora.targets=nothing_here")
    with pytest.raises(ValueError, match="lora.targets"):
        models.build(config.model, config.lora).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="unknown config.lora keys"):
        lora.Lora.of({"rank": 2, "drop": 0.1})
    with pytest.raises(ValueError, match="lora.dropout"):
        lora.Lora.of({"rank": 2, "dropout": 1.0})
    config = small_gpt_config("lora.rank=2", "lora.targets=unembed/kernel", "lora.dropout=0.1",
                              "model.tie_embeddings=False")
    model = models.build(config.model, config.lora)
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    with pytest.raises(ValueError, match="unembed/kernel is none"):
        model.apply({"params": params}, tokens, deterministic=False, rngs={"dropout": jax.random.key(1)})


class _Dense(nn.Module):
    """A Dense layer [M, 3] -> [M, 4] called as the models are (`deterministic`)."""

    @nn.compact
    def __call__(self, x, deterministic=True):
        return nn.Dense(4, name="dense")(x)


def test_dropout_drops_the_adapters_input_in_training_alone():
    dense, x = _Dense(), jax.random.normal(jax.random.key(0), (64, 3))
    model = lora.Adapted(dense, lora.Lora(rank=2, alpha=4.0, dropout=0.5, targets="dense/kernel"))
    params = nn.unbox(model.init(jax.random.key(1), x)["params"])
    a, b = params[lora.ADAPTERS]["dense"]["kernel"]["a"], jnp.ones((2, 4))
    params = {**params, lora.ADAPTERS: {"dense": {"kernel": {"a": a, "b": b}}}}
    base = dense.apply({"params": {k: v for k, v in params.items() if k != lora.ADAPTERS}}, x)
    np.testing.assert_allclose(model.apply({"params": params}, x), base + 2.0 * x @ a @ b, atol=1e-5)
    masks = np.array([[i >> j & 1 for j in range(3)] for i in range(8)], np.float32)  # [8 masks, 3]
    candidates = 2.0 * (x[:, None, :] * masks / 0.5) @ a @ b  # [64, 8, 4]: each mask's update
    trained = [model.apply({"params": params}, x, deterministic=False, rngs={"dropout": jax.random.key(seed)})
               for seed in (2, 3)]
    for out in trained:
        chosen = np.abs(candidates - (out - base)[:, None, :]).max(-1).argmin(-1)  # [64]
        np.testing.assert_allclose(out - base, candidates[np.arange(64), chosen], atol=1e-5)
        assert 0 < np.mean(masks[chosen]) < 1  # some inputs dropped, some kept
    assert np.abs(trained[0] - trained[1]).max() > 1e-3


def test_adapted_generates_as_its_merged_base(small_gpt_config):
    from transformer.inference import engine, sampling
    config = small_gpt_config("lora.rank=2")
    model = models.build(config.model, config.lora)
    prompt = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    params = nn.unbox(model.init(jax.random.key(0), prompt)["params"])
    params = {**params, lora.ADAPTERS: jax.tree.map(lambda x: x + 0.3, params[lora.ADAPTERS])}
    greedy = lambda m, p: engine.new_tokens(m, p, prompt.tolist(), sampling.Sampling(max_new_tokens=6))  # noqa: E731
    ours = greedy(model, params)
    merged = greedy(models.build(config.model), lora.merged(params, model.lora.scale))
    plain = greedy(models.build(config.model), {k: v for k, v in params.items() if k != lora.ADAPTERS})
    np.testing.assert_array_equal(ours, merged)
    assert not np.array_equal(ours, plain)


@pytest.mark.torch
def test_export_folds_the_adapters_into_the_base(tmp_path, small_gpt_config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformer.data.text import tokenizers
    from transformer.interop import hf_export
    config = small_gpt_config("lora.rank=2", "lora.targets=attention,mlp")
    model = models.build(config.model, config.lora)
    tokens = np.asarray([list(b"def f(x): return x")], np.int32)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: x + 0.05 * rng.normal(size=x.shape).astype(x.dtype), params)
    run = rundir.RunDir(str(tmp_path / "run"))
    run.write_config(config)
    ckpt = run.checkpointer()
    ckpt.save_params(params)
    ckpt.wait()
    ckpt.close()
    tokenizers.ByteTokenizer().save(str(tmp_path / "run"))
    hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager")
    with torch.no_grad():
        logits = theirs.eval()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    ours = np.asarray(rundir.open(str(tmp_path / "run")).model().apply({"params": params}, tokens))
    assert np.abs(ours - logits).max() <= 1e-4


@pytest.mark.slow
def test_an_adapted_run_resumes_exactly(tmp_path, small_gpt_config):
    adapted = ("lora.rank=2", "train.sample_tokens=0")
    loop.train(small_gpt_config(*adapted, "train.steps=3"), str(tmp_path / "run"))
    loop.train(small_gpt_config(*adapted), str(tmp_path / "run"))
    loop.train(small_gpt_config(*adapted), str(tmp_path / "straight"))
    resumed, straight = (traverse_util.flatten_dict(rundir.open(str(tmp_path / d)).restore_params(), sep="/")
                         for d in ("run", "straight"))
    assert sorted(resumed) == sorted(straight) and any(p.startswith(lora.ADAPTERS) for p in resumed)
    for name, value in straight.items():
        np.testing.assert_allclose(resumed[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_merge_writes_a_run_whose_outputs_are_the_adapted_runs(tmp_path, small_gpt_config):
    from transformer.interop import adapters
    loop.train(small_gpt_config("lora.rank=2", "train.steps=3", "train.sample_tokens=0"), str(tmp_path / "run"))
    out = adapters.merge_run(str(tmp_path / "run"), str(tmp_path / "merged"))
    assert out["step"] == 3 and out["adapters"] == 4 * small_gpt_config().model.num_layers
    adapted, merged = rundir.open(str(tmp_path / "run")), rundir.open(str(tmp_path / "merged"))
    assert merged.config.lora.rank == 0 and lora.ADAPTERS not in merged.restore_params()
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    ours = adapted.model().apply({"params": adapted.restore_params()}, tokens)
    theirs = merged.model().apply({"params": merged.restore_params()}, tokens)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    with pytest.raises(ValueError, match="already holds a run"):
        adapters.merge_run(str(tmp_path / "run"), str(tmp_path / "merged"))


def test_a_changed_lora_key_is_refused_on_resume_and_no_whole_checkpoint_is_set_aside(tmp_path, small_gpt_config,
                                                                                       capfd):
    from transformer import checkpoints
    adapted = ("lora.rank=2", "train.steps=1", "train.sample_tokens=0", "data.eval_batches=1")
    workdir = str(tmp_path / "run")
    one = jax.devices()[:1]  # a cheaper compile than eight devices'
    loop.train(small_gpt_config(*adapted), workdir, one)
    refused = r"config.lora.rank=4: the run in .*run has lora.rank=2, .* resume with lora.rank=2"
    with pytest.raises(ValueError, match=refused):
        loop.train(small_gpt_config(*adapted, "lora.rank=4", "train.steps=2"), workdir, one)
    with pytest.raises(ValueError, match=refused):
        rundir.resumed_config(workdir, {"lora.rank": "4"})
    assert rundir.resumed_config(workdir, {"train.steps": "2"}).lora.rank == 2
    import json
    saved = json.load(open(f"{workdir}/config.json"))
    saved["lora"]["rank"] = 4  # config.json no longer the one its checkpoints were saved under
    json.dump(saved, open(f"{workdir}/config.json", "w"))
    capfd.readouterr()
    with pytest.raises(checkpoints.OtherShapes, match=r"other shapes .*\(lora/.*/a is \(\d+, 2\) there, \(\d+, 4\) "
                                                      r"here\): it reads under the run's own config.json"):
        loop.train(small_gpt_config(*adapted, "lora.rank=4", "train.steps=2"), workdir, one)
    assert "Traceback" not in capfd.readouterr().err  # no read was started
    assert rundir.open(workdir).steps == [1] and not (tmp_path / "run" / "checkpoints.skipped").exists()


def test_init_from_counts_the_fresh_adapters_in_one_phrase():
    from transformer.training import warm_start
    names = [f"{lora.ADAPTERS}/block_{i}/attn/{k}/kernel/{ab}" for i in range(4) for k in "qkv" for ab in "ab"]
    assert warm_start.described(["head/kernel", *names]) == "head/kernel, 24 LoRA weights (lora/...) start fresh"
    assert warm_start.described([]) == "none"
