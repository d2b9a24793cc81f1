"""Test setup: 8 fake CPU devices (set before jax is imported) and small configs."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from transformer import config as config_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A GPT small enough to train in seconds on the stdlib bytes.
SMALL_GPT = [
    "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64", "model.max_len=32",
    "data.seq_len=16", "data.batch_size=8", "data.eval_batches=2",
    "optim.lr=3e-3", "optim.warmup_steps=2",
    "train.steps=6", "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3",
    "train.sample_tokens=8",
]


@pytest.fixture
def small_gpt_config():
    def make(*overrides):
        return config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), [*SMALL_GPT, *overrides])
    return make


def write_pairs(path, n, seed):
    """n lines 'four words<TAB>the same words reversed' (a tiny seq2seq task)."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]
    with open(path, "w") as f:
        for _ in range(n):
            src = " ".join(rng.choice(words, 4))
            f.write(f"{src}\t{' '.join(reversed(src.split()))}\n")
