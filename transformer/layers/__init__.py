"""Pure flax.linen modules, one concern per file: mlp.py (the MLP forms), moe.py and moe_dispatch.py (a
mixture of experts: router, dispatches, the expert axis), embeddings.py (tokens, positions, rotary, the
decode position), block.py (the residual block and the layer stack), matmul.py (bfloat16 dense layers on
CPU), cross_entropy.py (the blockwise LM head and its loss); attention/ is its own sub-package."""
