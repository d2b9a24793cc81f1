"""Scaling: every family trains alike on any mesh, large matrices really shard, a checkpoint
moves between meshes, and accumulation, remat, scan and bfloat16 leave the losses alone."""

import os
import subprocess
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILES, REPO, SMALL_GPT, write_pairs

from transformer import config as config_lib
from transformer import models, rundir
from transformer.models import common
from transformer.training import checks, loop, shapes
from transformer.training import metrics as metrics_lib

MESHES = [(2, 2, 2), (1, 2, 4)]  # all three axes, fsdp x tensor without data (data alone: every other test's)
STEPS = 3

# Small configs whose sharded sizes (width, heads, mlp, vocab) divide by 8.
FAMILIES = {
    "gpt": ("gpt.py:tiny", SMALL_GPT),
    "bert": ("bert.py:tiny", [
        "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64", "model.max_len=32",
        "model.vocab_size=400", "data.vocab_size=400", "data.seq_len=24", "data.batch_size=8",
        f"data.source={sysconfig.get_paths()['stdlib']}/json/*.py", "data.eval_fraction=0.3",
        "optim.warmup_steps=1"]),
    "vit": ("vit.py:tiny", ["model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64",
                            "data.batch_size=16", "optim.warmup_steps=1"]),
    "encdec": ("encdec.py:tiny", [
        "model.num_layers=1", "model.num_decoder_layers=1", "model.d_model=32", "model.num_heads=4",
        "model.mlp_dim=64", "model.max_len=16", "model.vocab_size=64", "data.vocab_size=64",
        "data.tokenizer=wordpiece", "data.source_len=12", "data.target_len=12", "data.batch_size=8",
        "optim.warmup_steps=1"]),
}


def family_config(tmp_path, family, *overrides):
    spec, small = FAMILIES[family]
    extra = []
    if family == "encdec":
        for seed, (split, n) in enumerate((("train", 64), ("eval", 32))):
            write_pairs(tmp_path / f"{split}.tsv", n, seed)
            extra.append(f"data.{split}_path={tmp_path / f'{split}.tsv'}")
    return config_lib.load(os.path.join(REPO, "configs", spec), [*small, *extra, *overrides])


def mesh_overrides(shape):
    """(data, fsdp, tensor) sizes -> config overrides (the context axis: tests/test_ring.py)."""
    return [f"mesh.{axis}={size}" for axis, size in zip(("data", "fsdp", "tensor"), shape)]


def train_losses(config, workdir, devices=None, steps=STEPS, params=None):
    """Per-step train losses (and the final state) of `steps` steps, without writing checkpoints.

    `params` (a tree of host arrays) replaces the freshly initialised parameters.
    """
    run = loop.setup(checks.checked(config), str(workdir), devices)
    try:
        state = run.state
        if params is not None:
            state = state.replace(params=jax.device_put(params, jax.tree.map(lambda x: x.sharding, state.params)))
        losses = []
        for step in range(steps):
            batch = run.place(run.task.train_batch(step))
            state, metrics = run.compiled_step(state, batch, run.step_rng)
            losses.append(float(metrics["loss"]))
        return losses, state
    finally:
        run.ckpt.close()
        run.writer.close()


@pytest.fixture(scope="module")
def gpt_on_all_devices(tmp_path_factory):
    """dtype -> (train losses, final state) of the small GPT on the default mesh (every device on data),
    each trained once for the tests that compare with it."""
    runs = {}

    def trained(dtype: str):
        if dtype not in runs:
            config = shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"),
                                                     [*SMALL_GPT, f"model.dtype={dtype}"]))
            runs[dtype] = train_losses(config, tmp_path_factory.mktemp(dtype))
        return runs[dtype]
    return trained


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_mesh_gives_the_losses_of_one_device(tmp_path, family):
    assert len(jax.devices()) == 8
    one, _ = train_losses(family_config(tmp_path, family), tmp_path / "run", jax.devices()[:1])
    for shape in MESHES:
        losses, _ = train_losses(family_config(tmp_path, family, *mesh_overrides(shape)), tmp_path / "run")
        np.testing.assert_allclose(losses, one, rtol=1e-5, err_msg=f"mesh {shape}")


@pytest.mark.parametrize("shape, sharded_dims", [((1, 8, 1), (8, 1)), ((1, 1, 8), (1, 8)), ((1, 2, 4), (2, 4))])
def test_a_large_matrix_and_its_optimizer_state_are_really_sharded(tmp_path, small_gpt_config, shape,
                                                                    sharded_dims):
    config = small_gpt_config("model.num_heads=8", *mesh_overrides(shape))
    _, state = train_losses(config, tmp_path, steps=1)
    kernel = state.params["block_0"]["mlp"]["up"]["kernel"]  # [D, F]: embed over fsdp, mlp over tensor
    moments = [x for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
               if "'block_0']['mlp']['up']['kernel']" in jax.tree_util.keystr(path)]
    assert len(moments) == 2  # adam's mu and nu
    for array in (kernel, *moments):
        shard = array.addressable_shards[0].data
        assert shard.shape == (kernel.shape[0] // sharded_dims[0], kernel.shape[1] // sharded_dims[1])
        assert shard.size == kernel.size // (sharded_dims[0] * sharded_dims[1])


def test_a_parameter_that_does_not_split_evenly_fails_naming_it(tmp_path, small_gpt_config):
    with pytest.raises(ValueError, match=r"config.mesh: parameter block_0/self_attn/key/.* 8 ways"):
        loop.setup(checks.checked(small_gpt_config(*mesh_overrides((1, 1, 8)))), str(tmp_path))


def test_a_vocabulary_that_does_not_split_fails_suggesting_the_padded_size(tmp_path, small_gpt_config):
    with pytest.raises(ValueError, match=r"embed/embedding \(257, 32\).* pad config.model.vocab_size to 384 "):
        loop.setup(checks.checked(small_gpt_config("model.vocab_size=257", *mesh_overrides((4, 1, 2)))), str(tmp_path))


def test_saved_on_eight_devices_resumes_on_four_with_another_mesh(tmp_path, small_gpt_config):
    whole = small_gpt_config("train.steps=6", "train.checkpoint_every=3", *mesh_overrides((8, 1, 1)))
    loop.train(whole, str(tmp_path / "whole"))
    loop.train(small_gpt_config("train.steps=3", *mesh_overrides((8, 1, 1))), str(tmp_path / "moved"))
    loop.train(small_gpt_config("train.steps=6", *mesh_overrides((2, 2, 1))), str(tmp_path / "moved"),
               devices=jax.devices()[:4])
    read = lambda d: {r["step"]: r["train/loss"] for r in metrics_lib.read(str(tmp_path / d / "metrics.jsonl"))
                      if "train/loss" in r}
    whole_losses, moved = read("whole"), read("moved")
    assert sorted(moved) == list(range(1, 7))
    np.testing.assert_allclose([moved[s] for s in (4, 5, 6)], [whole_losses[s] for s in (4, 5, 6)], rtol=1e-5)


@pytest.mark.parametrize("family, extra", [("gpt", []), ("bert", ["model.nsp=True", "train.z_loss=0.01"]),
                                           ("encdec", ["model.dropout=0.0", "train.z_loss=0.01"]), ("vit", [])],
                         ids=["gpt", "bert-nsp-z", "encdec-z", "vit"])
def test_four_accumulated_microbatches_equal_one_step_on_the_whole_batch(tmp_path, family, extra):
    """Masked tokens, target tokens and next-sentence rows are spread unevenly over the microbatches
    (without dropout: a microbatch draws its own masks); the z-loss averages over the cross entropy's tokens.
    The loss adds the z-loss to the cross entropies, so a wrong weighting of either term changes it."""
    big = ["data.batch_size=32", *extra]
    whole, _ = train_losses(family_config(tmp_path, family, *big), tmp_path / "run")
    accumulated, _ = train_losses(family_config(tmp_path, family, *big, "optim.accum_steps=4"), tmp_path / "run")
    np.testing.assert_allclose(accumulated, whole, rtol=1e-5)


def test_accumulation_must_divide_the_batch(tmp_path, small_gpt_config):
    with pytest.raises(ValueError, match="config.optim.accum_steps=3"):
        loop.setup(checks.checked(small_gpt_config("optim.accum_steps=3")), str(tmp_path))


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_keeps_the_losses(tmp_path, small_gpt_config, gpt_on_all_devices, remat):
    plain, _ = gpt_on_all_devices("float32")
    rematted, _ = train_losses(small_gpt_config(f"model.remat={remat}"), tmp_path / f"run-{remat}")
    np.testing.assert_allclose(rematted, plain, rtol=1e-5)


@pytest.mark.parametrize("family, stacks", [("gpt", ["block"]), ("encdec", ["encoder", "decoder"])])
def test_scanned_layers_from_the_same_weights_give_the_same_losses(tmp_path, family, stacks):
    config = family_config(tmp_path, family, *mesh_overrides((2, 2, 2)), "model.dropout=0.0")
    run = loop.setup(checks.checked(config), str(tmp_path / "plain"))
    params = jax.device_get(run.state.params)
    run.ckpt.close()
    run.writer.close()
    plain, _ = train_losses(config, tmp_path / "plain", params=params)
    for name in stacks:
        params = common.stack_layers(params, name, config.model.num_layers)
    scanned, state = train_losses(family_config(tmp_path, family, *mesh_overrides((2, 2, 2)), "model.dropout=0.0",
                                                "model.scan_layers=true", "model.remat=full"),
                                  tmp_path / "scanned", params=params)
    np.testing.assert_allclose(scanned, plain, rtol=1e-5)
    assert state.params[f"{stacks[0]}s"]["block"]["mlp"]["up"]["kernel"].shape[0] == config.model.num_layers


def test_remat_of_scanned_layers_lowers_the_compiled_step_memory(small_gpt_config):
    """(Unscanned, XLA's CPU scheduler recomputes every layer early, so remat saves nothing there.)"""
    temp = {}
    for remat in ("none", "full"):
        config = small_gpt_config("model.num_layers=8", "data.batch_size=32", "data.seq_len=32",
                                  "model.scan_layers=true", f"model.remat={remat}")
        model = models.build(config.model)
        loss = lambda p, x, model=model: model.apply({"params": p}, x).mean()
        init = lambda model=model: model.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))
        params = jax.eval_shape(init)["params"]
        compiled = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((32, 32), jnp.int32)).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["full"] < 0.7 * temp["none"], temp


def test_bfloat16_compute_keeps_float32_weights_and_optimizer_state(small_gpt_config, gpt_on_all_devices):
    (f32, _), (bf16, state) = gpt_on_all_devices("float32"), gpt_on_all_devices("bfloat16")
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(bf16, f32, rtol=2e-2)
    model = models.build(small_gpt_config("model.dtype=bfloat16").model)
    jaxpr = str(jax.make_jaxpr(lambda p, x: model.apply({"params": p}, x))(
        jax.device_get(state.params), jnp.zeros((2, 8), jnp.int32)))
    assert "dot_general" in jaxpr and "bf16[2,8,4,8]" in jaxpr


def test_bfloat16_compute_on_a_mesh_gives_the_losses_of_one_device(tmp_path, small_gpt_config, gpt_on_all_devices):
    """On CPU, bf16 dense layers take layers/matmul.py (layout-constrained backward): sharded too."""
    one, _ = train_losses(small_gpt_config("model.dtype=bfloat16"), tmp_path / "one", jax.devices()[:1])
    data, _ = gpt_on_all_devices("bfloat16")  # mesh (8, 1, 1)
    np.testing.assert_allclose(data, one, rtol=1e-4, err_msg="mesh (8, 1, 1)")
    losses, _ = train_losses(small_gpt_config("model.dtype=bfloat16", *mesh_overrides((1, 2, 4))), tmp_path / "m")
    np.testing.assert_allclose(losses, one, rtol=1e-4, err_msg="mesh (1, 2, 4)")


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"gpt"}))
def test_bfloat16_compute_trains_every_family_close_to_float32(tmp_path, family):
    f32, _ = train_losses(family_config(tmp_path, family), tmp_path / "f32")
    bf16, _ = train_losses(family_config(tmp_path, family, "model.dtype=bfloat16"), tmp_path / "bf16")
    np.testing.assert_allclose(bf16, f32, rtol=2e-2)


def test_a_bad_dtype_or_remat_policy_fails_naming_the_key(small_gpt_config):
    with pytest.raises(ValueError, match="config.model.dtype='float8'"):
        models.build(small_gpt_config("model.dtype=float8").model)
    with pytest.raises(ValueError, match="config.model.remat='some'"):
        models.build(small_gpt_config("model.remat=some").model)


def test_init_from_converts_between_unscanned_and_scanned_layers(tmp_path, small_gpt_config):
    loop.train(small_gpt_config("train.steps=2"), str(tmp_path / "plain"))
    plain = rundir.open(str(tmp_path / "plain")).restore_params()
    run = loop.setup(checks.checked(small_gpt_config(f"init_from={tmp_path / 'plain'}", "model.scan_layers=true")),
                     str(tmp_path / "scanned"))
    np.testing.assert_array_equal(run.state.params["blocks"]["block"]["mlp"]["up"]["kernel"][1],
                                  plain["block_1"]["mlp"]["up"]["kernel"])
    run.ckpt.save(run.state, force=True)
    run.ckpt.wait()
    run.ckpt.close()
    back = loop.setup(checks.checked(small_gpt_config(f"init_from={tmp_path / 'scanned'}")), str(tmp_path / "back"))
    np.testing.assert_array_equal(back.state.params["block_1"]["mlp"]["up"]["kernel"],
                                  plain["block_1"]["mlp"]["up"]["kernel"])
    back.ckpt.close()


def test_the_fsdp_memory_study_compiles_its_step_and_shards_the_state_eightfold():
    script = os.path.join(REPO, "experiments", "scaling", "fsdp_memory.py")
    done = subprocess.run([sys.executable, script, "--config", "configs/gpt.py:tiny", "--fsdp", "1,8", "--seq_len",
                           "16", "--batch_size", "8", "--num_layers", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "XLA_FLAGS": FAST_COMPILES})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("configs/gpt.py:tiny: 10,119,168 params"), done.stdout  # GPT-2's 50,257 ids
    state = {int(row.split()[0]): float(row.split()[1]) for row in done.stdout.splitlines()
             if row.split() and row.split()[0] in ("1", "8")}
    assert state[8] < state[1] / 4
