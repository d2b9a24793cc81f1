"""Platform kernels: a room a reader of attention may skip.

Each file here is one vendor's fused attention behind an interface the rest of the sub-package
defines, and is chosen in one place (`attention/platforms.py`); none is needed to understand what
attention computes (`dense.py` says that, `blockwise.py` how it is done in blocks).

  pallas_gpu.py  the Pallas (Triton) kernel for NVIDIA GPUs: blockwise attention's `Kernel` for the
                 whole mask description, forward and backward
  cudnn.py       cuDNN's fused attention through jax.nn, for the masks it takes, and why it refuses
                 the others
  splash.py      splash attention (Pallas, TPU) for no mask, causal and windows
  paged.py       a decode step over the key/value cache read as pages: jax's paged attention, Pallas,
                 for TPUs and NVIDIA GPUs
"""
