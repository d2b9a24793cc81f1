"""Spawned worker processes (tokenizer pool, image decoders) that do not re-import the parent's __main__.

multiprocessing's spawn start method imports the parent's `__main__` in every child: for
`python -m transformer.train` that is jax and every model (~380 MB a worker), and for a plain script
without an `if __name__ == "__main__":` guard it re-runs the script, which fails with
multiprocessing's bootstrapping error. The workers here need only their own module.
"""

import contextlib
import sys


@contextlib.contextmanager
def main_not_reimported():
    """While open, processes spawned from here skip the parent's __main__ (it looks like an interactive
    one): their functions and classes must live in modules they import by name."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)
