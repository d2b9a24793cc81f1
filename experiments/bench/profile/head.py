"""The tied vocabulary projection and its loss alone (issue 21 shape 1): einsum against a reshape + matmul.

    python experiments/bench/profile/head.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

B, L, D, V = 16, 256, 256, 8192
x = jnp.asarray(np.random.default_rng(0).normal(size=(B, L, D)), jnp.float32)
emb = jnp.asarray(np.random.default_rng(1).normal(size=(V, D)) * 0.02, jnp.float32)
t = jnp.asarray(np.random.default_rng(2).integers(0, V, (B, L)))
def a(x, e):
    logits = jnp.einsum("bld,vd->blv", x, e, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()
def b(x, e): return optax.softmax_cross_entropy_with_integer_labels((x.reshape(-1, D) @ e.T).reshape(B, L, V), t).mean()
def c(x, e):
    logits = x.reshape(-1, D) @ e.T
    lse = jax.nn.logsumexp(logits, -1)
    return (lse - jnp.take_along_axis(logits, t.reshape(-1, 1), -1)[:, 0]).mean()
for name, f in (("einsum", a), ("reshape-dot", b), ("lse", c)):
    g = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
    jax.block_until_ready(g(x, emb))
    ts = []
    for _ in range(7):
        s = time.perf_counter()
        jax.block_until_ready(g(x, emb))
        ts.append(time.perf_counter() - s)
    print(name, round(1e3 * np.median(ts)), "ms")
