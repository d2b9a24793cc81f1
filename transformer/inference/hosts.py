"""Decoding in a run of several processes (hosts): each process a data-parallel replica of the engine with the
whole params (`local_params`) decoding its share of the prompts, the answers gathered to every process
(`continue_ids`). Prompt i goes to process i mod P with its one-process key, fold_in(key, i), so the answers
are one process's whatever P. Glossary of shapes: P processes, M prompts a process at most, G samples a
prompt, N new tokens.
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
    if not _SAID and jax.process_index() == 0:
        _SAID.append(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))
        print(f"decoding: {jax.process_count()} processes, each a replica of the params ({_SAID[0] / 2**30:.2f} "
              "GiB, gathered onto its first device) decoding its share", file=sys.stderr)
    return jax.device_put(multihost_utils.process_allgather(params, tiled=True), jax.local_devices()[0])


def continue_ids(model, params, prompts: list, settings: sampling.Sampling, samples: int = 1, key=None,
                 slots: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """`engine.continue_ids` over every process with `local_params` -> (tokens [len(prompts), G, N], -1 past
    each sample's end; their log-probs), on every process."""
    count, index = jax.process_count(), jax.process_index()
    keys = None if key is None else list(jax.random.wrap_key_data(engine.sample_keys(key, len(prompts))))
    mine = range(index, len(prompts), count)
    done = engine.continue_ids(model, params, [prompts[i] for i in mine], settings, samples, slots=slots,
                               keys=None if keys is None else [keys[i] for i in mine]) if mine else []
    tokens = np.full((-(-len(prompts) // count), samples, settings.max_new_tokens), -1, np.int32)  # [M, G, N]
    logps = np.zeros(tokens.shape, np.float32)
    for j, request in enumerate(done):
        for g, (row, logp) in enumerate(zip(request.tokens, request.logps)):
            tokens[j, g, :len(row)], logps[j, g, :len(logp)] = row, logp
    if count > 1:  # [P, M, G, N] -> prompt j * P + p
        gathered = multihost_utils.process_allgather((tokens, logps))
        tokens, logps = (x.swapaxes(0, 1).reshape(-1, *x.shape[2:])[:len(prompts)] for x in gathered)
    return tokens, logps
