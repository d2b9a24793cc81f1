"""A JAX/Flax transformer research codebase: see README.md."""

from transformer import hostmem

hostmem.quiet_libtpu()

if hostmem.started_as_a_command():
    hostmem.tune_malloc()
