"""The parts of a GPT training step, ours (the project's layers, jitted) against PyTorch (what the
nanoGPT-style peer calls), forward + backward each, interleaved, on this machine's threads.

    PYTHONPATH=. python experiments/bench/profile/parts_vs_torch.py --shape 1 [--dtype bfloat16] [--torch_compile]
    PYTHONPATH=. python experiments/bench/profile/parts_vs_torch.py --shape 2

Shapes are issue 21's: 1 = 16 x 256 tokens, width 256, 4 heads, mlp 1024, vocab 8192; 2 = gpt2-small
at 8 x 256 tokens (width 768, 12 heads, mlp 3072, vocab 50304). Parts: the causal attention core
(ours: `layers.attention.attend`, the `auto` path; theirs: `F.scaled_dot_product_attention`), the
MLP (`layers.mlp.Mlp` against two Linears and tanh GELU), the q/k/v and output projections
(`MultiHeadAttention` minus its core against one fused Linear and c_proj), and the tied head with
its loss (`Embed.attend` + cross entropy against `x @ wte.T` + `F.cross_entropy`). In bfloat16 ours
is the config's `model.dtype=bfloat16` (layers/matmul.py on CPU), theirs runs under autocast.
Theirs runs eagerly unless `--torch_compile` compiles each part (forward and, through AOTAutograd,
backward) as the peer's `torch.compile` compiles its whole model. Reported: the median ms of each
over `--rounds` alternations, and ours/theirs.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
from flax import linen as nn

from transformer import hostmem
from transformer.layers import attention, embeddings, mlp
from transformer.layers.attention import Mask

SHAPES = {1: dict(B=16, L=256, D=256, H=4, F=1024, V=8192), 2: dict(B=8, L=256, D=768, H=12, F=3072, V=50304)}


def median_ms(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def ours(s: dict, dtype) -> dict:
    """Part -> a no-argument function running its jitted forward + backward to completion."""
    r = np.random.default_rng(0)
    B, L, D, H, V = s["B"], s["L"], s["D"], s["H"], s["V"]
    x = jnp.asarray(r.normal(size=(B, L, D)), jnp.float32)
    q, k, v = (jnp.asarray(r.normal(size=(B, L, H, D // H)), dtype) for _ in range(3))
    ids = jnp.asarray(r.integers(0, V, (B, L)))

    def grad_of(module, inputs, loss):
        params = nn.unbox(module.init(jax.random.key(0), *inputs)["params"])
        g = jax.jit(jax.grad(lambda p, *a: loss(module.apply({"params": p}, *a)), argnums=(0, 1)))
        return lambda: jax.block_until_ready(g(params, *inputs))

    square = lambda y: (y.astype(jnp.float32) ** 2).sum()
    core = jax.jit(jax.grad(lambda q, k, v: square(attention.attend(q, k, v, Mask(causal=True))), argnums=(0, 1, 2)))

    class Projections(nn.Module):  # MultiHeadAttention's four projections around an identity core
        @nn.compact
        def __call__(self, x):
            dense = lambda name, feats, axis=-1: nn.DenseGeneral(feats, axis=axis, dtype=dtype, name=name,
                                                                 dot_general=attention.matmul.dot_general_for(dtype))
            q, k, v = (dense(n, (H, D // H))(x) for n in "qkv")
            return dense("out", D, (-2, -1))(q + k + v)

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            embed = embeddings.Embed(V, D, dtype=dtype)
            embed(ids)  # creates the table
            return optax.softmax_cross_entropy_with_integer_labels(embed.attend(x), ids).mean()

    return {
        "attention core": lambda: jax.block_until_ready(core(q, k, v)),
        "q/k/v + out projections": grad_of(Projections(), (x,), square),
        "mlp": grad_of(mlp.Mlp(s["F"], dtype=dtype), (x,), square),
        "tied head + loss": grad_of(Head(), (x,), lambda y: y),
    }


def theirs(s: dict, bf16: bool, compile_parts: bool = False) -> dict:
    torch.manual_seed(0)
    B, L, D, H, V = s["B"], s["L"], s["D"], s["H"], s["V"]
    x = torch.randn(B, L, D, requires_grad=True)
    q, k, v = (torch.randn(B, H, L, D // H, requires_grad=True) for _ in range(3))
    qkv, proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
    up, down = torch.nn.Linear(D, s["F"]), torch.nn.Linear(s["F"], D)
    wte = torch.nn.Parameter(torch.randn(V, D) * 0.02)
    ids = torch.randint(0, V, (B * L,))
    auto = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def run(forward):
        forward = torch.compile(forward) if compile_parts else forward

        def fn():
            with auto():
                y = forward()
            (y.float() ** 2).sum().backward() if y.ndim else y.backward()
        return fn

    def projections():
        a, b, c = qkv(x).split(D, -1)
        return proj(a + b + c)

    return {
        "attention core": run(lambda: F.scaled_dot_product_attention(*(t.to(torch.bfloat16) if bf16 else t
                                                                       for t in (q, k, v)), is_causal=True)),
        "q/k/v + out projections": run(projections),
        "mlp": run(lambda: down(F.gelu(up(x), approximate="tanh"))),
        "tied head + loss": run(lambda: F.cross_entropy((x.reshape(-1, D) @ wte.t()).float(), ids)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, default=1, choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch_compile", action="store_true", help="compile each of PyTorch's parts")
    args = parser.parse_args()
    hostmem.tune_malloc()  # as the commands run (transformer/hostmem.py)
    torch.set_num_threads(args.threads)
    s = SHAPES[args.shape]
    mine, peer = ours(s, jnp.dtype(args.dtype)), theirs(s, args.dtype == "bfloat16", args.torch_compile)
    print(f"shape {args.shape} {s} {args.dtype}: forward + backward, median ms over {args.rounds} x {args.steps}"
          f"{', torch parts compiled' if args.torch_compile else ''}")
    print(f"  {'part':26s} {'ours':>9s} {'torch':>9s}  ours/torch time")
    for part in mine:
        a, b = [], []
        for _ in range(args.rounds):
            a.append(median_ms(mine[part], args.steps))
            b.append(median_ms(peer[part], args.steps))
        a, b = float(np.median(a)), float(np.median(b))
        print(f"  {part:26s} {a:9.1f} {b:9.1f}  {a / b:5.2f}x"
              + ("" if part == "tied head + loss" else "  (per layer)"))


if __name__ == "__main__":
    main()
