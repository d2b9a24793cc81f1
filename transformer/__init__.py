"""A JAX/Flax transformer research codebase: see README.md."""

from transformer import hostmem

if hostmem.started_as_a_command():
    hostmem.tune_malloc()
