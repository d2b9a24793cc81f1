"""Decoding in a run of several processes (hosts): each process a data-parallel replica of the engine, the
whole params on its own first device, decoding its share of the prompts, the answers gathered to every
process. On one process each function is the engine's own.

    params = hosts.local_params(params)          # once per new params: every process's shards, gathered
    done = hosts.continue_ids(model, params, prompts, settings, samples, key)   # [(tokens, logps)] a prompt

Prompt i is decoded by process i mod P with the key it has on one process (fold_in(key, i)), so the answers
are those of one process whatever P. Glossary of shapes: P processes, M prompts a process at most, G samples
a prompt, N new tokens.
"""

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer.inference import engine, sampling

_SAID: list = []  # the params' bytes, once said


def local_params(params):
    """`params` as they are on one process; where they span several, the whole of each gathered onto this
    process's first device (a replica: the params must fit one device)."""
    if jax.process_count() == 1:
        return params
    if not _SAID:
        _SAID.append(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))
        print(f"decoding: {jax.process_count()} processes, each a replica of the params ({_SAID[0] / 2**30:.2f} "
              "GiB, gathered onto its first device) decoding its share", file=sys.stderr)
    return jax.device_put(multihost_utils.process_allgather(params, tiled=True), jax.local_devices()[0])


def continue_ids(model, params, prompts: list, settings: sampling.Sampling, samples: int = 1, key=None,
                 slots: int = 32) -> list[tuple[list, list]]:
    """`engine.continue_ids` over every process with `local_params`: (its samples' tokens, their log-probs)
    for each prompt, in order, on every process."""
    count, index = jax.process_count(), jax.process_index()
    if count == 1:
        return [(r.tokens, r.logps) for r in engine.continue_ids(model, params, prompts, settings, samples, key, slots)]
    keys = None if key is None else list(jax.random.wrap_key_data(engine.sample_keys(key, len(prompts))))
    mine = list(range(index, len(prompts), count))
    done = engine.continue_ids(model, params, [prompts[i] for i in mine], settings, samples, slots=slots,
                               keys=None if keys is None else [keys[i] for i in mine]) if mine else []
    share = -(-len(prompts) // count)  # M
    tokens = np.full((share, samples, settings.max_new_tokens), -1, np.int32)
    logps = np.zeros(tokens.shape, np.float32)
    for j, request in enumerate(done):
        for g, (row, logp) in enumerate(zip(request.tokens, request.logps)):
            tokens[j, g, :len(row)], logps[j, g, :len(logp)] = row, logp
    tokens, logps = multihost_utils.process_allgather((tokens, logps))  # [P, M, G, N]
    answers = []
    for i in range(len(prompts)):
        rows, probs = tokens[i % count, i // count], logps[i % count, i // count]
        lengths = [int((row >= 0).sum()) for row in rows]
        answers.append(([row[:n].tolist() for row, n in zip(rows, lengths)],
                        [p[:n].tolist() for p, n in zip(probs, lengths)]))
    return answers
