"""The engine: greedy answers pinned from the loops it replaced, requests in flight together answered as
alone, no program compiled after warm-up, the sampler's log-probs the policy's, the sampling record's check."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.inference import engine, rollouts, sampling
from transformer.models import gpt
from transformer.training import grpo_loss

PROMPTS = [[1, 2, 3], [7] * 9, list(range(3, 20)), [5]]
# `decoding.generate`'s greedy tokens (12 each) before the engine replaced it, params scaled by 12
PINNED = {
    "learned": [[31, 18, 35, 21, 13, 44, 31, 21, 25, 23, 13, 18], [40, 40, 39, 43, 40, 39, 38, 16, 38, 31, 31, 40],
                [40, 13, 13, 10, 27, 4, 15, 10, 10, 13, 46, 17], [31, 38, 13, 40, 38, 14, 14, 38, 38, 38, 14, 38]],
    "rotary-window": [[33, 18, 12, 12, 5, 33, 40, 18, 43, 15, 9, 43], [16, 16, 16, 16, 16, 16, 16, 10, 10, 10, 10, 21],
                      [40, 13, 25, 37, 12, 4, 43, 15, 46, 19, 38, 12], [21, 33, 4, 46, 16, 21, 21, 4, 46, 32, 32, 7]],
    "moe": [[31, 46, 31, 44, 31, 44, 31, 13, 25, 9, 15, 15], [48, 28, 14, 40, 48, 48, 1, 48, 10, 44, 6, 25],
            [48, 44, 17, 17, 40, 36, 15, 29, 17, 19, 37, 21], [9, 15, 15, 26, 23, 37, 37, 8, 8, 13, 17, 17]],
}
VARIANTS = {"learned": {}, "rotary-window": dict(positions="rotary", window=8, num_kv_heads=2),
            "moe": dict(num_experts=4, experts_per_token=2)}


def tiny(**overrides):
    cfg = gpt.default_model_config("tiny")
    cfg.update(num_layers=2, d_model=32, num_heads=4, mlp_dim=64, max_len=48, vocab_size=50)
    cfg.update(overrides)
    model = gpt.build(cfg)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    return model, jax.tree.map(lambda x: x * 12, params)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_answers_are_the_replaced_loops(variant):
    model, params = tiny(**VARIANTS[variant])
    requests = [engine.Request(p, sampling.Sampling(max_new_tokens=12)) for p in PROMPTS]
    engine.Engine(model, params, slots=4).run(requests)
    assert [r.tokens[0] for r in requests] == PINNED[variant]


def test_a_scanned_stack_decodes_with_its_layers_apart_and_answers_the_same():
    """A model with scan_layers decodes as separate layers (each cache updated in place), its params sliced
    once, and again for params handed to `run`; the answers are the unscanned model's."""
    from transformer.models import common

    model, params = tiny()
    scanned = model.clone(scan_layers=True)
    stacked = common.stack_layers(params, "block", model.num_layers)
    runner = engine.Engine(scanned, stacked, slots=4)
    assert runner.scanned and not runner.model.scan_layers and "block_0" in runner.params
    for given in (None, jax.tree.map(lambda x: x, stacked)):
        requests = [engine.Request(p, sampling.Sampling(max_new_tokens=12)) for p in PROMPTS]
        runner.run(requests, given)
        assert [r.tokens[0] for r in requests] == PINNED["learned"]


@pytest.mark.parametrize("axes", [{"data": -1}, {"data": 4, "tensor": 2}], ids=["replicas", "tensor-parallel"])
def test_slots_split_over_a_mesh_answer_as_on_one_device(axes):
    """On the 8 fake CPU devices: the params replicated, or split over a tensor axis by the default rules."""
    from transformer import parallel, sharding

    model, params = tiny()
    mesh = parallel.make_mesh(axes, jax.devices())
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    params = jax.device_put(params, sharding.logical_shardings(boxed, mesh, sharding.DEFAULT_RULES))
    runner = engine.Engine(model, params, slots=8, mesh=mesh)
    assert jax.tree.leaves(runner.cache)[0].sharding.spec[0] == parallel.BATCH_AXES
    requests = [engine.Request(p, sampling.Sampling(max_new_tokens=12)) for p in PROMPTS * 2]
    runner.run(requests)
    assert [r.tokens[0] for r in requests] == PINNED["learned"] * 2
    rows = parallel.batch_divisor(mesh)
    with pytest.raises(ValueError, match=f"6 slots over {rows} data-parallel devices: give a multiple of them"):
        engine.Engine(model, params, slots=6, mesh=mesh)


MIX = [([1, 2, 3], sampling.Sampling(max_new_tokens=9), 1),
       ([7] * 9, sampling.Sampling(temperature=1.0, seed=3, max_new_tokens=12), 2),
       (list(range(3, 20)), sampling.Sampling(temperature=0.7, top_k=5, seed=1, max_new_tokens=5), 1),
       ([5], sampling.Sampling(temperature=1.2, top_p=0.8, max_new_tokens=20, stop_ids=(13, 40)), 1),
       ([9, 8, 7, 6, 5, 4], sampling.Sampling(max_new_tokens=3), 1)]


@pytest.mark.slow
def test_requests_in_flight_together_get_what_they_get_alone_and_nothing_compiles_after_warm_up():
    model, params = tiny()
    together = engine.Engine(model, params, slots=3, steps=4).warm()  # fewer slots than rows: rows join later
    compiled = together.programs
    asked = [engine.Request(p, s, samples=g) for p, s, g in MIX]
    together.run(asked)
    alone = [engine.Engine(model, params, slots=3, steps=4).run([engine.Request(p, s, samples=g)])[0]
             for p, s, g in MIX]
    assert [r.tokens for r in asked] == [r.tokens for r in alone]
    flat = lambda done: np.concatenate([lp for r in done for lp in r.logps])  # noqa: E731
    np.testing.assert_allclose(flat(asked), flat(alone), rtol=1e-6, atol=1e-6)  # float32 rounding
    assert together.programs == compiled  # new prompt lengths and request counts compiled nothing
    assert asked[1].tokens[0] != asked[1].tokens[1]  # two samples of one prompt differ
    stopped = asked[3].tokens[0]
    assert len(stopped) == 20 or stopped[-1] in (13, 40)


def test_the_sampler_log_probs_are_the_policys_at_temperature_one():
    model, params = tiny()
    drawn = rollouts.sample(model, params, [[1, 2, 3], [4, 5]], 3, rollouts.rollout_key(0, 1), max_new_tokens=6,
                            stop_id=0)
    assert drawn.policy
    seqs, starts = grpo_loss.sequences(drawn)
    again = np.asarray(grpo_loss.token_logprobs(model, params, jnp.asarray(seqs), jnp.asarray(starts), 6))
    np.testing.assert_allclose(drawn.logp, again * drawn.mask, atol=5e-5)  # float32 rounding of x12 params
    greedy = rollouts.sample(model, params, [[1, 2, 3]], 1, rollouts.rollout_key(0, 1), max_new_tokens=6,
                             temperature=0.0)
    assert not greedy.policy


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), r"--temperature=-1 must be >= 0"), (dict(top_k=-2), r"--top_k=-2 must be >= 0"),
    (dict(top_p=0.0), r"--top_p=0.0 must be in \(0, 1\]"), (dict(max_new_tokens=0), "--max_new_tokens=0"),
    (dict(stop_strings=tuple(str(i) for i in range(100))), "100 stop strings: give at most 16")])
def test_the_sampling_record_names_a_value_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling.Sampling(**kwargs)


def test_a_request_past_the_context_is_refused_in_one_line():
    model, params = tiny()
    runner = engine.Engine(model, params, slots=2)
    assert runner.run([engine.Request([1] * 40, sampling.Sampling(max_new_tokens=9))])[0].tokens[0]  # 48 fed
    with pytest.raises(ValueError, match="exceeds the context of 48"):
        runner.run([engine.Request([1] * 40, sampling.Sampling(max_new_tokens=10))])
