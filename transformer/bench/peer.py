"""The PyTorch peer, parent side: what the bench's own process does to run the same model in PyTorch
(`--vs hf|torch`) in a process of its own. It starts that process (`Process`), feeds it our initial
weights, batches and learning rates, and reads back what it measured. What runs in the child is
peer_process.py; the PyTorch models it builds are torch_models.py's.

  with peer.Process() as child:
      described, compile_s = child("train", config, params, weights_path, first_batch, lrs, device, ...)
      seconds, loss = child("steps", batches)

The child gets this process's malloc settings (hostmem.py) less the single arena, which slows
PyTorch's threads, and JAX_PLATFORMS=cpu (the GPU is PyTorch's there); it never runs JAX.

Glossary of shapes: B batch, L sequence length.
"""

import multiprocessing
import os

import flax.linen
import jax
import numpy as np
from flax import traverse_util

from transformer import hostmem
from transformer.bench import peer_process, torch_models
from transformer.data import spawn
from transformer.interop import hf_families
from transformer.training import optim


def kind(vs) -> str:
    """The peer a `--vs` value names: '' (none), 'hf' or 'torch'; True means 'hf'."""
    return "hf" if vs is True else (vs or "")


def check(kind: str, config) -> None:
    """Refuses, before any work, a config.model the `kind` peer cannot be (no torch model made)."""
    torch_models.MODELS[kind].check(config)


def torch_device() -> str:
    """Where the peer trains: 'cuda' when JAX computes on a GPU (the same GPU), else 'cpu'."""
    return "cuda" if jax.default_backend() == "gpu" else "cpu"


def initial_weights(params, config) -> dict[str, np.ndarray]:
    """Our params as GPT-2's tensors (transformers' names and Conv1D layout), through the interop's rules:
    numpy, so the peer's process takes them without building our model."""
    flat = traverse_util.flatten_dict(flax.linen.unbox(jax.device_get(params)), sep="/")
    return {f"transformer.{rule.theirs}": np.ascontiguousarray(
                rule.to_theirs(*(np.asarray(flat[o], np.float32) for o in rule.ours)))
            for rule in hf_families.GPT2.rules(config.model.to_dict())}


def schedule_values(config) -> np.ndarray:
    """config.optim's learning rate at steps 0 .. config.train.steps, as ours trains with it (the peer's)."""
    return np.asarray(optim.make_schedule(config.optim, config.train.steps)(np.arange(config.train.steps + 1)))


def child_tunables() -> str | None:
    """The child's GLIBC_TUNABLES: this process's without the single arena (hostmem.TUNABLES), which slows
    PyTorch's threads (experiments/bench/RESULTS.md)."""
    given, single = os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.arena_max"
    return given and ":".join(t for t in given.split(":") if t != f"{single}={hostmem.TUNABLES[single]}")


class Process:
    """The peer's spawned process, driven one call at a time: `child("train", ...)` runs
    peer_process.CALLS["train"](state, ...) there and returns its value; the two sides still run in turns
    (interleaved rounds)."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.tunables = child_tunables()
        child_env = {"GLIBC_TUNABLES": self.tunables,  # read by the child's glibc when it starts
                     "JAX_PLATFORMS": "cpu"}  # JAX there, if ever used, leaves the GPU to PyTorch
        saved = {name: os.environ.get(name) for name in child_env}
        for name, value in child_env.items():
            _set_env(name, value)
        try:
            with spawn.main_not_reimported():
                self.process = ctx.Process(target=peer_process.serve, args=(child_end,), daemon=True)
                self.process.start()
        finally:
            for name, value in saved.items():
                _set_env(name, value)
            child_end.close()

    def __call__(self, call: str, *args):
        self.conn.send((call, args))
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"the peer's process failed in {call!r}:\n{value}")
        return value

    def __enter__(self) -> "Process":
        return self

    def __exit__(self, *exc) -> None:
        self.conn.send(None)
        self.process.join(timeout=60)
        self.conn.close()


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
