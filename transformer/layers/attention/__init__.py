"""Attention: one function, `attend`, fed a mask description and the name of an implementation.

    from transformer.layers.attention import attend, Mask
    out = attend(q, k, v, Mask(causal=True), "auto")  # q [B, L, H, Dh], k, v [B, S, K, Dh]

Glossary of shapes: B batch, L queries, S keys, H heads, K kv heads (H % K == 0), Dh head width.

The map of this sub-package, in reading order:

  masks.py       `Mask`: which keys each query may see (causal, padding, documents, window, global
                 tokens, block-sparse `BlockSparse`, an additive `Bias`), as a description that no
                 implementation has to expand; `FAR`, the position of an empty decode-cache slot
  alibi.py       ALiBi's slopes and its distance bias (`model.positions=alibi`), a `Bias` split with the heads
  dense.py       `dense_attention`: the reference over the whole [L, S] mask (and its weights)
  layer.py       `attend` and `IMPLEMENTATIONS` (auto | dense | blockwise | ring | flash);
                 `MultiHeadAttention`, the flax layer: projections, rotary positions, kv cache
  blockwise.py   online softmax over the blocks the mask leaves visible, memory O(L x block)
  ring.py        the sequence split over the mesh's `context` axis, blockwise per hop
  xla.py         attention written out for XLA: `auto` on CPU and TPU, and the dense reference's math
  platforms.py   the one place that chooses per platform: what `auto` and `flash` run, and which
                 kernel runs blockwise's blocks
  kernels/       platform kernels (Pallas on GPU, cuDNN, splash on TPU): skip them unless you work
                 on one; `platforms.py` says when each runs

Every implementation is tested against `dense`, forward and gradients (tests/test_attention.py,
test_ring.py, test_gpu_attention.py). A query that may see no key gets output 0 and gradient 0.
"""

from transformer.layers.attention.dense import dense_attention
from transformer.layers.attention.layer import IMPLEMENTATIONS, MultiHeadAttention, attend
from transformer.layers.attention.masks import FAR, Bias, BlockSparse, Mask

__all__ = ["FAR", "IMPLEMENTATIONS", "Bias", "BlockSparse", "Mask", "MultiHeadAttention", "attend",
           "dense_attention"]
