"""The one FLOPs formula: what a family's forward pass computes per example and per token, from shapes
alone (nothing allocated). `python -m transformer.inspect` prints it, the loop's `train/mfu` and the
bench's MFU divide by it.

  flops = forward_flops(config)   # {'per_example', 'tokens', 'per_token', 'matmul', 'context'}
  training = 3 * flops["per_token"]
  per_step = training_flops(config)   # a training step of the global batch (the MFU's and IsoFLOP sweeps')

Each family says what its matrices multiply and which (query, key) pairs its attention scores
(`Family.cost`, models/common.py); this module sums them. In a mixture of experts a token goes
through k of the E experts: each stacked expert weight [E, ...] counts k / E of its parameters
(`active_size`), the router all of its own: the FLOPs and `matmul` are those of the active path.
"""

import flax.linen as nn
from flax import traverse_util

from transformer import models
from transformer.layers.moe import EXPERT_BIASES, EXPERT_KERNELS

FLOPS_FORMULA = ("forward = 2 x (each matrix's parameters x the tokens it multiplies) + 4 x (each attention\n"
                 "layer's query width x the (query, key) pairs it scores), per example, / its tokens; training =\n"
                 "3 x forward. PaLM's 2N + 4LTD (Chowdhery et al. 2022, app. B) for a decoder; a lookup is not a\n"
                 "matmul; a mixture's experts count k / E of their parameters (each token's k of E), its router all;\n"
                 "auto and dense score every pair (causal masking is not discounted), blockwise only the\n"
                 "blocks its mask leaves (about half for causal, about L x W for a window W)")


def is_matrix(path: tuple[str, ...]) -> bool:
    """A kernel (a mixture's stacked expert kernels too), or the token embedding (position and type
    tables are lookups only)."""
    return path[-1] == "kernel" or path[-1] in EXPERT_KERNELS or path[-2:] == ("embed", "embedding")


def active_size(model: nn.Module, path: tuple[str, ...], size: int) -> int:
    """The parameters of the one at `path` (of `size`) that one token uses: k / E of a mixture's stacked
    expert weights, all of any other."""
    mixture = getattr(model, "mixture", None)
    if mixture is not None and mixture.num_experts and path[-1] in EXPERT_KERNELS + EXPERT_BIASES:
        return size * mixture.experts_per_token // mixture.num_experts
    return size


def forward_flops(config, param_shapes=None) -> dict:
    """The one FLOPs formula (FLOPS_FORMULA) for the model and lengths of `config`.

    Returns {'per_example', 'tokens' (per example), 'per_token' (exact where it divides),
    'matmul' (parameters of the matrices that multiply tokens, those a token uses), 'active' (the
    parameters a token uses: all but the experts it is not routed to), 'context' (the lengths)}.
    """
    family = models.family(config.model.family)
    model = family.build(config.model)
    cost = family.cost(model, config)
    shapes = traverse_util.flatten_dict(nn.unbox(models.param_shapes(config.model) if param_shapes is None
                                                 else param_shapes))
    active = {path: active_size(model, path, leaf.size) for path, leaf in shapes.items()}
    matrices = {path: size for path, size in active.items() if is_matrix(path)}
    weights = sum(2 * size * cost.weight_tokens(path) for path, size in matrices.items())
    attention = sum(4 * a.layers * a.width * a.pairs for a in cost.attention)
    total = weights + attention
    per_token, rest = divmod(total, cost.tokens)
    return dict(per_example=total, tokens=cost.tokens, per_token=per_token if rest == 0 else total / cost.tokens,
                matmul=sum(size for path, size in matrices.items() if cost.weight_tokens(path)),
                active=sum(active.values()), context=cost.context)


def training_flops(config, param_shapes=None) -> float:
    """Training FLOPs of one step of the global batch: 3 x the forward pass (backward twice the forward), per
    example, x data.batch_size."""
    flops = forward_flops(config, param_shapes)
    return 3 * flops["per_token"] * flops["tokens"] * config.data.batch_size
