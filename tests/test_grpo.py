"""The GRPO objective (`training.grpo_loss`) against a direct numpy computation, and a bandit it solves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.training import grpo_loss

RNG = np.random.default_rng(0)
B, T, G = 6, 5, 3
OLD = np.log(RNG.uniform(0.05, 0.9, (B, T))).astype(np.float32)
LOGP = (OLD + RNG.normal(0, 0.3, (B, T))).astype(np.float32)
REF = (OLD + RNG.normal(0, 0.2, (B, T))).astype(np.float32)
MASK = (np.arange(T)[None] < np.array([5, 3, 1, 4, 5, 2])[:, None]).astype(np.float32)
REWARDS = np.array([1.0, 0.0, 0.0, 0.5, 0.5, 2.0], np.float32)


def numpy_advantages(rewards, scale):
    out = []
    for group in rewards.reshape(-1, G):
        centred = group - group.mean()
        out.extend(centred / (group.std() + 1e-4) if scale == "std" else centred)
    return np.array(out)


def numpy_loss_and_grad(logp, loss_type, clip_low, clip_high, kl_weight):
    """The objective and its gradient in logp, token by token with loops."""
    adv = numpy_advantages(REWARDS, "std")
    total, grad = 0.0, np.zeros_like(logp, dtype=np.float64)
    n_tokens = MASK.sum()
    for b in range(B):
        for t in range(T):
            if not MASK[b, t]:
                continue
            w = {"dapo": 1 / n_tokens, "grpo": 1 / (MASK[b].sum() * B), "dr_grpo": 1 / (B * T)}[loss_type]
            r = np.exp(logp[b, t] - OLD[b, t])
            unclipped, clipped = r * adv[b], np.clip(r, 1 - clip_low, 1 + clip_high) * adv[b]
            d = REF[b, t] - logp[b, t]
            total += w * (-min(unclipped, clipped) + kl_weight * (np.exp(d) - d - 1))
            g_surrogate = -r * adv[b] if unclipped <= clipped else 0.0
            grad[b, t] = w * (g_surrogate + kl_weight * (1 - np.exp(d)))
    return total, grad


def test_group_advantages_centre_and_scale_each_group():
    for scale in ("std", "none"):
        got = grpo_loss.group_advantages(jnp.asarray(REWARDS), G, scale)
        np.testing.assert_allclose(got, numpy_advantages(REWARDS, scale), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(grpo_loss.group_advantages(jnp.ones(4), 2), np.zeros(4))
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_loss.group_advantages(jnp.ones(6), 4)


def test_token_weights_average_tokens_as_the_loss_type_says():
    dapo = grpo_loss.token_weights(jnp.asarray(MASK), "dapo")
    np.testing.assert_allclose(dapo, MASK / MASK.sum(), rtol=1e-6)
    grpo = np.asarray(grpo_loss.token_weights(jnp.asarray(MASK), "grpo"))
    np.testing.assert_allclose(grpo.sum(axis=1), np.full(B, 1 / B), rtol=1e-6)
    assert grpo[2, 0] == pytest.approx(1 / B) and grpo[0, 0] == pytest.approx(1 / (5 * B))
    np.testing.assert_allclose(grpo_loss.token_weights(jnp.asarray(MASK), "dr_grpo"), MASK / (B * T))
    with pytest.raises(ValueError, match="loss_type 'ppo'"):
        grpo_loss.token_weights(jnp.asarray(MASK), "ppo")


@pytest.mark.parametrize("loss_type", grpo_loss.LOSS_TYPES)
@pytest.mark.parametrize("kl_weight", [0.0, 0.1])
def test_loss_and_gradient_equal_a_direct_computation(loss_type, kl_weight):
    adv = grpo_loss.group_advantages(jnp.asarray(REWARDS), G)
    kwargs = dict(clip_low=0.2, clip_high=0.28, loss_type=loss_type, kl_weight=kl_weight, ref_logp_BT=jnp.asarray(REF))
    loss = lambda lp: grpo_loss.policy_loss(lp, jnp.asarray(OLD), adv, jnp.asarray(MASK), **kwargs)
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(LOGP))
    want, want_grad = numpy_loss_and_grad(LOGP, loss_type, 0.2, 0.28, kl_weight)
    assert float(value) == pytest.approx(want, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert 0 < float(metrics["clip_fraction"]) < 1
    d = REF - LOGP
    assert float(metrics["kl"]) == pytest.approx(((np.exp(d) - d - 1) * MASK).sum() / MASK.sum(), rel=1e-5)


def test_the_first_step_is_the_policy_gradient_and_clipping_stops_it():
    adv = jnp.array([1.0, -1.0])
    mask = jnp.ones((2, 1))
    old = jnp.log(jnp.array([[0.5], [0.5]]))
    grad = jax.grad(lambda lp: grpo_loss.policy_loss(lp, old, adv, mask)[0])(old)
    np.testing.assert_allclose(grad, [[-0.5], [0.5]])
    moved = old + jnp.log(jnp.array([[1.5], [0.5]]))
    loss, metrics = grpo_loss.policy_loss(moved, old, adv, mask)
    assert float(metrics["clip_fraction"]) == 1.0
    np.testing.assert_allclose(jax.grad(lambda lp: grpo_loss.policy_loss(lp, old, adv, mask)[0])(moved), 0.0)
    with pytest.raises(ValueError, match="ref_logp_BT"):
        grpo_loss.policy_loss(old, old, adv, mask, kl_weight=0.1)


def test_entropy_of_a_uniform_distribution_is_log_v():
    np.testing.assert_allclose(grpo_loss.token_entropy(jnp.zeros((2, 3, 8))), np.full((2, 3), np.log(8)), rtol=1e-6)


def bandit_loss(logits_V, actions_B, old_B1, adv_B):
    logp_B1 = jax.nn.log_softmax(logits_V)[actions_B][:, None]
    return grpo_loss.policy_loss(logp_B1, old_B1, adv_B, jnp.ones_like(logp_B1))[0]


def test_bandit_policy_learns_the_rewarded_token():
    """One prompt, a softmax policy over V tokens, reward 1 for token 3: its probability goes to ~1."""
    V, group, rewarded = 8, 16, 3
    logits = jnp.zeros(V)
    optimizer = optax.adam(0.1)
    state = optimizer.init(logits)
    key = jax.random.PRNGKey(0)
    for _ in range(60):
        key, sample_key = jax.random.split(key)
        actions = jax.random.categorical(sample_key, logits, shape=(group,))
        rewards = (actions == rewarded).astype(jnp.float32)
        adv = grpo_loss.group_advantages(rewards, group)
        old = jax.nn.log_softmax(logits)[actions][:, None]
        for _ in range(2):
            updates, state = optimizer.update(jax.grad(bandit_loss)(logits, actions, old, adv), state)
            logits = optax.apply_updates(logits, updates)
    assert float(jax.nn.softmax(logits)[rewarded]) > 0.95


@pytest.mark.slow
def test_rollouts_are_a_function_of_seed_and_step_and_score_their_own_tokens():
    from transformer.inference import rollouts
    from transformer.models import gpt

    model = gpt.GPT(vocab_size=16, num_layers=1, d_model=16, num_heads=2, mlp_dim=32, max_len=32)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
    draw = lambda step: rollouts.sample(model, params, prompts, 2, rollouts.rollout_key(0, step),
                                        max_new_tokens=6, stop_id=0)
    first = draw(3)
    np.testing.assert_array_equal(first.completions, draw(3).completions)
    assert not np.array_equal(first.completions, draw(4).completions)
    assert [list(p) for p in first.prompts] == [[1, 2, 3]] * 2 + [[4, 5]] * 2 + [[6, 7, 8]] * 2
    np.testing.assert_array_equal(rollouts.completion_mask(np.array([[3, 0, 5, 0], [1, 2, 3, 4]]), 0),
                                  [[1, 1, 0, 0], [1, 1, 1, 1]])
    seqs, starts = grpo_loss.sequences(first)
    logp = grpo_loss.token_logprobs(model, params, jnp.asarray(seqs), jnp.asarray(starts), 6)
    row = np.concatenate([[4, 5], first.completions[2]])
    want = jax.nn.log_softmax(model.apply({"params": params}, jnp.asarray(row[None, :-1])))[0]
    np.testing.assert_allclose(logp[2], want[np.arange(1, 7), row[2:]], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bandit_on_a_gpt_with_the_project_sampler():
    """One prompt, reward 1 for one token: a tiny GPT sampled by the cached decoder learns to say it."""
    from transformer.inference import rollouts
    from transformer.models import gpt

    model = gpt.GPT(vocab_size=16, num_layers=1, d_model=16, num_heads=2, mlp_dim=32, max_len=8)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"]
    optimizer = optax.adam(3e-2)
    state = optimizer.init(params)
    rewarded, prompt = 5, jnp.array([[1, 2]])
    update = jax.jit(lambda p, b: jax.grad(lambda q: grpo_loss.rollout_loss(model, q, b)[0])(p))
    probability = lambda p: float(jax.nn.softmax(model.apply({"params": p}, prompt)[0, -1])[rewarded])
    start = probability(params)
    for step in range(25):
        drawn = rollouts.sample(model, params, [[1, 2]], 16, rollouts.rollout_key(0, step), max_new_tokens=1)
        seqs, starts = map(jnp.asarray, grpo_loss.sequences(drawn))
        batch = {"seqs": seqs, "starts": starts, "mask": jnp.asarray(drawn.mask),
                 "advantages": grpo_loss.group_advantages(jnp.asarray(drawn.completions[:, 0] == rewarded), 16)}
        batch["old_logp"] = grpo_loss.token_logprobs(model, params, seqs, starts, 1)
        for _ in range(2):
            updates, state = optimizer.update(update(params, batch), state)
            params = optax.apply_updates(params, updates)
    assert start < 0.2 and probability(params) > 0.95
