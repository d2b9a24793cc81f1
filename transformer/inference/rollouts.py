"""Rollouts for reinforcement learning: G sampled completions per prompt from the engine, with the
sampler's log-probs of the tokens it drew (under any other params: `training.grpo_loss.token_logprobs`).

Glossary of shapes: P prompts, G completions per prompt, B = P * G rollouts (grouped: rollout b answers
prompt b // G), N new tokens.

Rollouts are a function of (seed, step): the sampling key is fold_in(key(seed), step), so a resumed run
draws the same completions. Every prompt goes to one engine (`engine.continue_ids`): prefilled once, its cache
copied to its G rows, rows refilled as others stop; in a run of several processes each decodes its share
of the prompts with the whole params (`hosts`: the params gathered, the completions shared). A completion
ends at its first stop id, which it keeps (the policy learns to stop), and is masked after it. The sampler
hands back each drawn token's log-probability: drawn at temperature 1 with no cut, it is the policy's own, so
no second forward computes the old log-probs.
"""

from typing import NamedTuple

import jax
import numpy as np

from transformer.inference import hosts, sampling


class Rollouts(NamedTuple):
    prompts: list[np.ndarray]  # B id sequences (each prompt repeated G times)
    completions: np.ndarray  # int32 [B, N]
    mask: np.ndarray  # float32 [B, N]: 1 up to and including the stop id
    logp: np.ndarray  # float32 [B, N]: each drawn token's log-probability under what it was drawn from (0 masked)
    policy: bool  # whether that is the policy's own (temperature 1, no cut): then `logp` is the old log-probs


def rollout_key(seed: int, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), step)


def completion_mask(completions_BN: np.ndarray, stop_id: int | None) -> np.ndarray:
    """1 on each completion's tokens up to and including its first stop id, 0 after."""
    if stop_id is None:
        return np.ones(completions_BN.shape, np.float32)
    stopped_before = np.cumsum(completions_BN == stop_id, axis=1) - (completions_BN == stop_id)
    return (stopped_before == 0).astype(np.float32)


def sample(model, params, prompts: list, group_size: int, key: jax.Array, *, max_new_tokens: int,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_id: int | None = None) -> Rollouts:
    """G completions of each prompt (lists of ids), grouped prompt by prompt, with the sampler's log-probs; params
    on this process (`hosts.local_params`)."""
    rows = [np.asarray(p, np.int32) for p in prompts for _ in range(group_size)]
    if any(len(r) + max_new_tokens > model.max_len for r in rows):
        raise ValueError(f"a prompt plus {max_new_tokens} new tokens exceeds model.max_len={model.max_len}: "
                         "shorten the prompts or lower the completion length")
    settings = sampling.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                                 stop_ids=() if stop_id is None else (stop_id,))
    tokens, logp = (x.reshape(len(rows), -1) for x in hosts.continue_ids(
        model, params, [list(p) for p in prompts], settings, group_size, key, slots=64))
    completions = np.where(tokens >= 0, tokens, 0 if stop_id is None else stop_id).astype(np.int32)
    mask = completion_mask(completions, stop_id)
    return Rollouts(rows, completions, mask, logp * mask, temperature == 1 and not top_k and top_p == 1)
