"""Spawned worker processes (tokenizer pool, image decoders) that do not re-import the parent's __main__.

multiprocessing's spawn start method imports the parent's `__main__` in every child: for
`python -m transformer.train` that is jax and every model (~380 MB a worker), and for a plain script
without an `if __name__ == "__main__":` guard it re-runs the script, which fails with
multiprocessing's bootstrapping error. The workers here need only their own module.
"""

import contextlib
import sys


@contextlib.contextmanager
def main_not_reimported(unless: str | None = None):
    """While open, processes spawned from here skip the parent's __main__ (it looks like an interactive
    one), unless __main__ is the module named `unless` (`python -m` of the workers' own module, whose
    functions and classes then live in __main__ and pickle as such)."""
    main = sys.modules["__main__"]
    if unless and getattr(main.__spec__, "name", None) == unless:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)
