"""The GRPO objective as pure functions: group-normalised advantages and the clipped policy-ratio loss.

Glossary of shapes: P prompts, G completions per prompt (the group), B = P * G rollouts (grouped:
rollout b belongs to prompt b // G), T (or N) completion tokens, L a sequence, V vocab.

A rollout batch is sampled once from the policy as it was (`old_logp`); several optimisation steps then
reuse it, and the ratio exp(logp - old_logp) corrects for the policy having moved since. The per-token loss
is PPO's clipped surrogate -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) (DAPO's
asymmetric clip when clip_high > clip_low), plus kl_weight times the k3 estimate of KL(policy || reference),
exp(ref - logp) - (ref - logp) - 1, against the frozen starting policy. How tokens are averaged is
`loss_type` (TRL's names):

- "dapo": every completion token of the batch weighs the same (sum / number of tokens);
- "grpo": each completion weighs the same, its tokens averaged within it (long answers are diluted);
- "dr_grpo": sum / (B * T), a constant normaliser (Dr. GRPO), with no length bias.
"""

import jax
import jax.numpy as jnp
import numpy as np

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
ADVANTAGE_SCALES = ("std", "none")


def group_advantages(rewards_B: jax.Array, group_size: int, scale: str = "std", eps: float = 1e-4) -> jax.Array:
    """Each reward minus its group's mean, divided by the group's standard deviation (population) + eps
    with scale='std' (GRPO), or not divided with scale='none' (Dr. GRPO, nanochat). A group whose
    rewards are all equal gets zero advantages: it carries no signal."""
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"advantage scale {scale!r}: choose one of {', '.join(ADVANTAGE_SCALES)}")
    if rewards_B.shape[0] % group_size:
        raise ValueError(f"{rewards_B.shape[0]} rewards do not split into groups of {group_size}")
    r_PG = rewards_B.reshape(-1, group_size).astype(jnp.float32)
    centred_PG = r_PG - r_PG.mean(axis=1, keepdims=True)
    if scale == "std":
        centred_PG = centred_PG / (r_PG.std(axis=1, keepdims=True) + eps)
    return centred_PG.reshape(-1)


def token_weights(mask_BT: jax.Array, loss_type: str = "dapo") -> jax.Array:
    """[B, T] weights w with loss = sum(w * per-token loss): how `loss_type` averages the tokens
    (mask_BT: 1 on completion tokens, 0 on padding and after the end)."""
    mask_BT = mask_BT.astype(jnp.float32)
    if loss_type == "dapo":
        return mask_BT / jnp.maximum(mask_BT.sum(), 1.0)
    if loss_type == "grpo":
        per_row_B = jnp.maximum(mask_BT.sum(axis=1, keepdims=True), 1.0)
        return mask_BT / per_row_B / mask_BT.shape[0]
    if loss_type == "dr_grpo":
        return mask_BT / mask_BT.size
    raise ValueError(f"loss_type {loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")


def k3_kl(logp_BT: jax.Array, ref_logp_BT: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(policy || reference) at the sampled tokens: unbiased, never negative."""
    delta_BT = ref_logp_BT - logp_BT
    return jnp.exp(delta_BT) - delta_BT - 1.0


def token_entropy(logits_BTV: jax.Array) -> jax.Array:
    """[B, T] entropy of the policy's next-token distribution, in nats."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -(jnp.exp(logp_BTV) * logp_BTV).sum(axis=-1)


def policy_loss(
    logp_BT: jax.Array,
    old_logp_BT: jax.Array,
    advantages_B: jax.Array,
    mask_BT: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    loss_type: str = "dapo",
    kl_weight: float = 0.0,
    ref_logp_BT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the scalar loss, its metrics) for the sampled tokens' log-probs under the policy being trained
    (logp_BT, differentiated), the policy that sampled them (old_logp_BT) and, with kl_weight > 0, the
    frozen reference (ref_logp_BT). Metrics, averaged over completion tokens: clip_fraction (tokens whose
    clipped branch is active, so they pass no gradient), and with the reference, kl."""
    if kl_weight and ref_logp_BT is None:
        raise ValueError("kl_weight > 0 needs the reference policy's log-probs (ref_logp_BT)")
    weights_BT = token_weights(mask_BT, loss_type)
    ratio_BT = jnp.exp(logp_BT - jax.lax.stop_gradient(old_logp_BT))
    a_B1 = advantages_B[:, None].astype(jnp.float32)
    clipped_BT = jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    per_token_BT = -jnp.minimum(ratio_BT * a_B1, clipped_BT * a_B1)
    mask_BT = mask_BT.astype(jnp.float32)
    n_tokens = jnp.maximum(mask_BT.sum(), 1.0)
    clipped_low = (ratio_BT < 1.0 - clip_low) & (a_B1 < 0)
    clipped_high = (ratio_BT > 1.0 + clip_high) & (a_B1 > 0)
    metrics = {"clip_fraction": ((clipped_low | clipped_high) * mask_BT).sum() / n_tokens}
    if ref_logp_BT is not None:
        kl_BT = k3_kl(logp_BT, jax.lax.stop_gradient(ref_logp_BT))
        metrics["kl"] = (kl_BT * mask_BT).sum() / n_tokens
        per_token_BT = per_token_BT + kl_weight * kl_BT
    return (weights_BT * per_token_BT).sum(), metrics


def rollout_loss(model, params, batch: dict, **settings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`policy_loss` of a rollout batch under `params`: batch holds 'seqs' [B, L] and 'starts' [B]
    (`sequences`), 'old_logp', 'mask' [B, N], 'advantages' [B] and, for the KL, 'ref_logp'."""
    n = batch["mask"].shape[1]
    logp_BN = token_logprobs(model, params, batch["seqs"], batch["starts"], n)
    return policy_loss(logp_BN, batch["old_logp"], batch["advantages"], batch["mask"],
                       ref_logp_BT=batch.get("ref_logp"), **settings)


def sequences(drawn) -> tuple[np.ndarray, np.ndarray]:
    """Of `inference.rollouts.Rollouts`: (prompt ‖ completion right-padded with 0: int32 [B, L], the index in it
    of each completion's first target position, int32 [B]: the position whose next-token prediction is the
    completion's first token), L = longest prompt + N."""
    n = drawn.completions.shape[1]
    seqs = np.zeros((len(drawn.prompts), max(len(p) for p in drawn.prompts) + n), np.int32)
    for b, prompt in enumerate(drawn.prompts):
        seqs[b, : len(prompt)] = prompt
        seqs[b, len(prompt): len(prompt) + n] = drawn.completions[b]
    return seqs, np.array([len(p) - 1 for p in drawn.prompts], np.int32)


def token_logprobs(model, params, seqs_BL: jax.Array, starts_B: jax.Array, n: int) -> jax.Array:
    """[B, N] log-probs of each completion's tokens under `params` (differentiable; the model's own
    blockwise cross entropy, so the [B, L, V] logits are never whole)."""
    logp_BL = -model.apply({"params": params}, seqs_BL[:, :-1], targets=seqs_BL[:, 1:])
    index_BN = starts_B[:, None] + jnp.arange(n)[None]
    return jnp.take_along_axis(logp_BL, index_BN, axis=1)
