"""The order of a run's examples: without replacement, a pure function of (seed, example index).

Glossary: g the global index of an example (step x batch size + row), N the examples of a
source (its windows), K the sources of a mixture, M a mixture's block of examples.

Nothing here holds an array of the size of the data: `permute` is a Feistel network over
[0, N) (cycle-walked from the next even power of two), so the order of any example is computed
from its index alone, in O(1) memory, and a step's batch needs only the step. Epoch e of a
source is the permutation keyed by (seed, source, e).

A mixture of sources draws each block of M consecutive examples with a fixed count per
source (the weights' shares of M, largest remainders first), its slots permuted by (seed,
segment, block), as Levanter's mixtures do: every source is read without replacement and
its position is computable from the index. A weight schedule [(first step, weights), ...]
changes the counts from a step on: each change starts a new segment whose blocks count from
its first example, and each source's position goes on from where the earlier segments left it.
"""

import numpy as np

_ROUNDS = 4
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _round_keys(key: tuple[int, ...]) -> np.ndarray:
    return np.random.SeedSequence([int(k) for k in key]).generate_state(_ROUNDS, np.uint64)


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    """One pass of the balanced Feistel network on 2 * half bits (uint64 values)."""
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
        h = (right * _MIX) ^ k
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
        left, right = right, (left ^ h) & mask
    return (left << np.uint64(half)) | right


def permute(index, n: int, key: tuple[int, ...]) -> np.ndarray:
    """index (int array, values in [0, n)) -> their images under a permutation of [0, n) picked by `key`."""
    x = np.asarray(index, np.uint64)
    if n <= 1:
        return np.zeros(x.shape, np.int64)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    keys = _round_keys(key)
    x = _feistel(x, half, keys)
    outside = x >= n
    while outside.any():  # cycle-walking: at most a few passes (the domain is < 4n)
        x[outside] = _feistel(x[outside], half, keys)
        outside = x >= n
    return x.astype(np.int64)


def epochs(g, n: int, key: tuple[int, ...]) -> np.ndarray:
    """Examples g (int64) of a source of n: epoch g // n is a permutation keyed by (*key, epoch)."""
    g = np.asarray(g, np.int64)
    out = np.empty(g.shape, np.int64)
    for epoch in np.unique(g // n):
        at = g // n == epoch
        out[at] = permute(g[at] % n, n, (*key, int(epoch)))
    return out


def counts(weights, block: int) -> np.ndarray:
    """Examples of each source in a block of `block`: the weights' shares, largest remainders first."""
    w = np.asarray(weights, np.float64)
    share = w / w.sum() * block
    out = np.floor(share).astype(np.int64)
    for i in np.argsort(-(share - out), kind="stable")[: block - out.sum()]:
        out[i] += 1
    return out


class Mixture:
    """Which source, and which of its examples, each global example g reads (see the module docstring)."""

    def __init__(self, schedule: list[tuple[int, list[float]]], batch_size: int, seed: int, block: int = 1024):
        self.batch_size, self.seed, self.block = batch_size, seed, block
        self.starts = [step * batch_size for step, _ in schedule]  # first example of each segment
        self.counts = [counts(weights, block) for _, weights in schedule]
        self.offsets = [np.zeros(len(self.counts[0]), np.int64)]  # where each source is at a segment's start
        for k in range(1, len(schedule)):
            blocks = -(-(self.starts[k] - self.starts[k - 1]) // block)  # a segment's last block counts whole
            self.offsets.append(self.offsets[-1] + blocks * self.counts[k - 1])

    def __call__(self, g) -> tuple[np.ndarray, np.ndarray]:
        """(source [..], index within that source [..]) of examples g [..]."""
        g = np.asarray(g, np.int64)
        segment = np.searchsorted(self.starts, g, side="right") - 1
        source, local = np.empty(g.shape, np.int64), np.empty(g.shape, np.int64)
        for k in np.unique(segment):
            at = segment == k
            within = g[at] - self.starts[k]
            block, position = within // self.block, within % self.block
            slot = np.empty(position.shape, np.int64)
            for b in np.unique(block):
                here = block == b
                slot[here] = permute(position[here], self.block, (self.seed, int(k), int(b)))
            ends = np.cumsum(self.counts[k])
            s = np.searchsorted(ends, slot, side="right")
            source[at] = s
            local[at] = self.offsets[k][s] + block * self.counts[k][s] + slot - (ends[s] - self.counts[k][s])
        return source, local
