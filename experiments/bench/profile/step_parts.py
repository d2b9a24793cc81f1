# python experiments/bench/profile/step_parts.py model.num_layers=N  (repository root, PYTHONPATH=.)
"""Time the parts of the GPT train step at issue 21's first shape (4 layers, width 256, seq 256, batch 16,
vocab 8192)."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from transformer import config as config_lib
from transformer import models
from transformer.training import optim

cfg = config_lib.load("configs/gpt.py:tiny", sys.argv[1:] + ["model.d_model=256", "model.num_heads=4",
                                                            "model.mlp_dim=1024", "model.vocab_size=8192",
                                                            "model.max_len=256"])
model = models.build(cfg.model)
B, L = 16, 256
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 8192, (B, L + 1)), jnp.int32)
params = nn.unbox(model.init(jax.random.key(0), tokens[:, :-1])["params"])
tx, _ = optim.make_optimizer(cfg.optim, 1000)
opt_state = tx.init(params)

def loss_fn(p):
    logits = model.apply({"params": p}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

fwd = jax.jit(loss_fn)
grad = jax.jit(jax.grad(loss_fn))
def full(p, s):
    g = jax.grad(loss_fn)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
full = jax.jit(full, donate_argnums=(0, 1))
def full_norms(p, s):
    g = jax.grad(loss_fn)(p)
    u, s = tx.update(g, s, p)
    p2 = optax.apply_updates(p, u)
    return p2, s, (optax.tree.norm(g), optax.tree.norm(p2), optax.tree.norm(u))
full_norms = jax.jit(full_norms, donate_argnums=(0, 1))
upd = jax.jit(lambda g, s, p: tx.update(g, s, p))

def timeit(f, *a, n=5):
    out = f(*a)
    jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        out = f(*a)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
    return np.median(ts)

g = grad(params)
print("forward      ", round(1e3 * timeit(fwd, params)), "ms")
print("fwd+bwd      ", round(1e3 * timeit(grad, params)), "ms")
print("optimizer    ", round(1e3 * timeit(upd, g, opt_state, params)), "ms")
p, s = jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state)
ts = []
for _ in range(6):
    t = time.perf_counter()
    p, s = full(p, s)
    jax.block_until_ready(p)
    ts.append(time.perf_counter() - t)
print("step         ", round(1e3 * np.median(ts[1:])), "ms", round(B * L / np.median(ts[1:])), "tok/s")
p, s = jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state)
ts = []
for _ in range(6):
    t = time.perf_counter()
    p, s, m = full_norms(p, s)
    jax.block_until_ready(p)
    ts.append(time.perf_counter() - t)
print("step + norms ", round(1e3 * np.median(ts[1:])), "ms")
