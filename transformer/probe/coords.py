"""The coordinate check (Yang et al. 2022, "Tensor Programs V", its Figure 5): the size of each layer's
activations, and of how far the training steps move them, across widths.

Glossary of shapes: B batch, L length, W widths, T steps.

A language model of the config (a GPT: its next-token loss) is built at each of `widths` (d_model, the mlp
width in the config's ratio to it, the heads as the config has them), under each parametrization asked
for, and trained `steps` steps (the config's optimizer at its lr, no warmup) on one fixed batch of counting
sequences (each row `start + stride x t` mod V), the same batch at every width. Before each step the model
is applied to that batch and each layer's output kept: the embedding, each Block's attention and mlp
branches and the Block itself, the logits. A layer's coordinate size is the root mean square of its output's
entries; its update, the RMS of the output minus its value at step 0. Under muP neither changes with width;
under the standard parametrization they grow with it (layers/parametrization.py says why).
"""

import copy
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import models
from transformer.layers import parametrization
from transformer.training import optim

LEVELS = ("activation", "update")


@dataclasses.dataclass(frozen=True)
class Check:
    """The RMS of each layer's output (`activation`) and of its change from step 0 (`update`):
    rms[parametrization][level][layer] is a [W, T] list, widths by steps."""

    widths: tuple[int, ...]
    steps: int
    layers: tuple[str, ...]
    rms: dict

    def spread(self, name: str, level: str = "activation", step: int = -1) -> dict[str, float]:
        """Per layer, the largest over the smallest RMS across the widths at `step` (the last by default)."""
        table = self.rms[name][level]
        return {layer: float(max(row[step] for row in table[layer]) / max(min(row[step] for row in table[layer]),
                                                                            1e-30))
                for layer in self.layers}

    def growth(self, name: str, level: str = "activation", step: int = -1) -> dict[str, float]:
        """Per layer, the RMS at the widest over the RMS at the narrowest width, at `step`."""
        table = self.rms[name][level]
        return {layer: float(table[layer][-1][step] / max(table[layer][0][step], 1e-30)) for layer in self.layers}

    def to_json(self) -> dict:
        return {"widths": list(self.widths), "steps": self.steps, "layers": list(self.layers), "rms": self.rms,
                "spread": {name: self.spread(name) for name in self.rms},
                "growth": {name: self.growth(name) for name in self.rms}}


def counting_batch(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    """[B, L + 1] int32 rows start + stride x t (mod vocab), each row its own start and stride (1..7)."""
    rng = np.random.default_rng(seed)
    start, stride = rng.integers(0, vocab, (batch, 1)), rng.integers(1, 8, (batch, 1))
    return ((start + stride * np.arange(length + 1)[None]) % vocab).astype(np.int32)


def at_width(config, width: int, name: str, base_width: int):
    """A copy of `config` at d_model `width` (the mlp in the config's ratio) under parametrization `name`."""
    c = copy.deepcopy(config)
    m = c.model
    ratio = m.mlp_dim / m.d_model
    m.d_model, m.mlp_dim = width, max(1, round(ratio * width))
    m.parametrization, m.mup_base_width = name, (m.mup_base_width or base_width) if name == "mup" else 0
    if name != "mup":
        m.mup_base_depth = 0
    m.scan_layers, m.remat, m.dropout = False, "none", 0.0
    m.vocab_size = m.vocab_size or 256
    c.optim.warmup_steps, c.optim.schedule = 0, "constant"
    return c


def _kept(module: nn.Module, method: str) -> bool:
    return method == "__call__" and (module.name in ("embed", "self_attn", "mlp") or module.name is None
                                     or module.name.startswith("block_"))


def _outputs(intermediates: dict, logits: jax.Array) -> dict[str, jax.Array]:
    """The kept layers' outputs by name ('embed', 'block_0/self_attn', 'block_0', ..., 'logits')."""
    found = {}

    def walk(tree, prefix):
        for key, value in tree.items():
            if key == "__call__":
                found[prefix] = value[0]
            elif isinstance(value, dict):
                walk(value, f"{prefix}/{key}" if prefix else key)

    walk(intermediates, "")
    found.pop("", None)
    return {**dict(sorted(found.items(), key=lambda kv: _order(kv[0]))), "logits": logits}


def _order(name: str) -> tuple:
    if name == "embed":
        return (-1, 0)
    parts = name.split("/")
    return (int(parts[0].split("_")[1]), {"self_attn": 0, "mlp": 1}.get(parts[-1], 2) if len(parts) > 1 else 2)


def trace(config, steps: int, batch: np.ndarray, seed: int = 0) -> dict[str, dict[str, list[float]]]:
    """For one width's config: {level: {layer: [RMS at each of `steps` steps]}} on `batch` [B, L + 1]."""
    model = models.build(config.model)
    inputs, targets = jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:])
    params = nn.meta.unbox(model.init(jax.random.key(seed), inputs)["params"])
    tx, _ = optim.make_optimizer(config.optim, max(steps, 1),
                                 width_mult=parametrization.optimizer_width_mult(config.model))
    state = tx.init(params)

    @jax.jit
    def step(p, s):  # the layers' outputs before the update, and the updated params and state
        logits, kept = model.apply({"params": p}, inputs, capture_intermediates=_kept, mutable=["intermediates"])
        grads = jax.grad(lambda q: model.apply({"params": q}, inputs, targets=targets).mean())(p)
        updates, s = tx.update(grads, s, p)
        return _outputs(kept["intermediates"], logits), jax.tree.map(lambda a, u: a + u, p, updates), s

    rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))  # noqa: E731
    out = {level: {} for level in LEVELS}
    first = None
    for _ in range(steps):
        now, params, state = step(params, state)
        first = first or now
        for name, value in now.items():
            out["activation"].setdefault(name, []).append(rms(value))
            out["update"].setdefault(name, []).append(rms(value - first[name]))
    return out


def coordinate_check(config, widths: tuple[int, ...], steps: int = 5, names=("sp", "mup"), batch: int = 8,
                     length: int = 32, seed: int = 0) -> Check:
    """The coordinate check of `config`'s model over `widths` under each parametrization of `names` (muP's
    base width: config.model.mup_base_width, or the narrowest of `widths`)."""
    if models.task_of(config.model) != "lm":
        raise ValueError(f"the coordinate check trains a language model's next-token loss; config.model.family="
                         f"{config.model.family!r}: give a configs/gpt.py config")
    if len(widths) < 2 or steps < 2:
        raise ValueError("the coordinate check needs two or more --widths and --steps of at least 2")
    tokens = counting_batch(batch, length, config.model.vocab_size or 256, seed)
    rms, layers = {}, ()
    for name in names:
        per_width = [trace(at_width(config, w, name, min(widths)), steps, tokens, seed) for w in widths]
        layers = tuple(per_width[0]["activation"])
        rms[name] = {level: {layer: [t[level][layer] for t in per_width] for layer in layers} for level in LEVELS}
    return Check(tuple(widths), steps, layers, rms)


def figure(path: str, check: Check, title: str) -> str:
    """Rows: each parametrization's activations, then their updates; a column per layer; RMS against width,
    a line per step, each panel's axis spanning at least a factor 10."""
    from transformer.probe import plots

    rows = [(name, level) for level in LEVELS for name in check.rms]
    fig, axes = plots.figure(len(rows), len(check.layers), 1.9 * len(check.layers), 1.8 * len(rows), sharex=True)
    colours = plots.plt.cm.viridis(np.linspace(0, 0.9, check.steps))
    for r, (name, level) in enumerate(rows):
        for c, layer in enumerate(check.layers):
            ax = axes[r][c]
            table = np.array(check.rms[name][level][layer])  # [W, T]
            first = 0 if level == "activation" else 1  # an update from step 1
            for t in range(first, check.steps):
                ax.plot(check.widths, table[:, t], color=colours[t], marker=".", label=f"step {t}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_ylim(*decade(table[:, first:]))
            ax.tick_params(labelsize=6)
            if r == 0:
                ax.set_title(layer, fontsize=7)
            if c == 0:
                ax.set_ylabel(f"{name}: {level} RMS", fontsize=7)
            if r == len(rows) - 1:
                ax.set_xlabel("d_model", fontsize=7)
    axes[0][-1].legend(fontsize=5)
    plots.suptitle(fig, title)
    return plots.save(fig, path)


def decade(values: np.ndarray) -> tuple[float, float]:
    """Log-axis limits around `values` spanning at least a factor 10, so that a flat curve looks flat."""
    positive = values[values > 0]
    lo, hi = (float(positive.min()), float(positive.max())) if positive.size else (1e-3, 1.0)
    centre, half = np.sqrt(lo * hi), max(np.sqrt(hi / lo), np.sqrt(10.0))
    return centre / half * 0.9, centre * half * 1.1
