"""The bench's PyTorch peer (`--vs hf|torch`): the same GPT in PyTorch (transformers' GPT2LMHeadModel or
transformer/bench_torch.py's nanoGPT-style one) from our initial weights, trained with the same AdamW step
and learning-rate schedule, and its greedy generation, run in a process of its own (`PeerProcess`).

Glossary of shapes: B batch, L sequence length, P prompt length, V vocab.
"""

import dataclasses
import importlib
import multiprocessing
import os
import sys
import time
import traceback
from typing import Callable

import flax.linen
import jax
import numpy as np
from flax import traverse_util

from transformer import hostmem
from transformer.data import spawn
from transformer.interop import hf_families
from transformer.training import optim


# ---------------------------------------------------------------- theirs: PyTorch (transformers' or nanoGPT-style)


def import_torch():
    try:
        import torch
        import transformers
    except ImportError:
        raise ImportError("--vs hf needs PyTorch and transformers: pip install torch transformers") from None
    return torch, transformers


def hf_gpt(config, torch, transformers):
    """GPT2LMHeadModel shaped like config.model (a GPT-2-shaped model), float32, eval-free."""
    fields = hf_families.GPT2.to_theirs(config.model.to_dict())  # the interop's translation; refuses others
    cfg = transformers.GPT2Config(**{**fields, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").float()


@dataclasses.dataclass(frozen=True)
class Peer:
    """A PyTorch peer: `check(config)` refuses what it cannot be (no torch model made), `build(config,
    params)` -> its model (float32, seeded, our parameter count asserted), `load(model, weights)` copies
    our initial weights in (`initial_weights`), `logits(forward, tokens [B, L])` -> [B, L, V]."""

    check: Callable
    build: Callable
    load: Callable
    logits: Callable
    label: str


def hf_build(config, params: int):
    model = hf_gpt(config, *import_torch())
    assert sum(p.numel() for p in model.parameters()) == params, "GPT2LMHeadModel's parameter count differs"
    return model


def hf_load(model, weights: dict):
    """GPT-2's names and layout (Conv1D [in, out]) are the peer's own."""
    import torch
    state = model.state_dict()
    with torch.no_grad():
        for name, value in weights.items():
            state[name].copy_(torch.from_numpy(value))
    return model


def torch_module():
    try:
        from transformer import bench_torch  # imports torch
    except ImportError:
        raise ImportError("--vs torch needs PyTorch: pip install torch") from None
    return bench_torch


PEERS = {
    "hf": Peer(lambda config: hf_families.GPT2.to_theirs(config.model.to_dict()), hf_build, hf_load,
               lambda forward, tokens: forward(input_ids=tokens).logits, "GPT2LMHeadModel, sdpa attention"),
    "torch": Peer(lambda config: torch_module().check(config.model.to_dict()),
                  lambda config, params: torch_module().build(config, params),
                  lambda model, weights: torch_module().load(model, weights),
                  lambda forward, tokens: forward(tokens), "nanoGPT-style, fused qkv, sdpa is_causal"),
}


def initial_weights(params, config) -> dict[str, np.ndarray]:
    """Our params as GPT-2's tensors (transformers' names and Conv1D layout), through the interop's rules:
    numpy, so the peer's process takes them without building our model."""
    flat = traverse_util.flatten_dict(flax.linen.unbox(jax.device_get(params)), sep="/")
    return {f"transformer.{rule.theirs}": np.ascontiguousarray(
                rule.to_theirs(*(np.asarray(flat[o], np.float32) for o in rule.ours)))
            for rule in hf_families.GPT2.rules(config.model.to_dict())}


def peer_name(theirs_too) -> str:
    """'' (no peer), 'hf' or 'torch'; True means 'hf' (the original flag)."""
    return "hf" if theirs_too is True else (theirs_too or "")


def set_threads(torch, threads: int) -> None:
    torch.set_num_threads(threads or os.cpu_count() or 1)


class Theirs:
    """The same model (the peer's: PEERS) from our initial weights, batch, AdamW step and learning-rate
    schedule in PyTorch, torch.compile'd where that works, on `device` ('cpu' or 'cuda'): every tensor
    is made there.

    `lrs` [steps + 1] are the schedule's values at each step (`schedule_values`), made by the caller:
    the peer's process never runs JAX (which would take the GPU's memory beside PyTorch).
    """

    def __init__(self, config, params: int, weights: dict, first_batch: np.ndarray, lrs: np.ndarray,
                 device: str = "cpu", compile_model: bool = True, threads: int = 0, peer: str = "hf"):
        import torch
        set_threads(torch, threads)
        self.torch, self.peer, self.device = torch, PEERS[peer], device
        self.model = self.peer.load(self.peer.build(config, params), weights).train().to(device)
        o = config.optim
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]  # biases, norm scales
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        kw = dict(lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)
        try:
            self.opt = torch.optim.AdamW(groups, fused=True, **kw)
        except (RuntimeError, TypeError):
            self.opt = torch.optim.AdamW(groups, **kw)
        self.lrs, self.step_count = lrs, 0  # the schedule's step, as ours
        self.clip, self.compiled = o.clip_norm, "eager"
        self.autocast = config.model.dtype == "bfloat16"  # float32 weights, bf16 matmuls: PyTorch's mixed precision
        self.forward = self.model
        if compile_model:
            try:
                self.forward = torch.compile(self.model)
                t = time.perf_counter()
                self.loss = float(self._step(self._tensor(first_batch)))
                self.compile_s, self.compiled = time.perf_counter() - t, "torch.compile"
            except Exception as e:  # noqa: BLE001 - any backend failure falls back to eager
                print(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); timing eager", file=sys.stderr)
                self.forward = self.model

    def _tensor(self, tokens: np.ndarray):
        return self.torch.from_numpy(np.asarray(tokens, np.int64)).to(self.device)

    def _step(self, tokens):
        torch = self.torch
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.peer.logits(self.forward, tokens[:, :-1])  # [B, L, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        for group in self.opt.param_groups:
            group["lr"] = float(self.lrs[min(self.step_count, len(self.lrs) - 1)])
        self.opt.step()
        self.step_count += 1
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def steps(self, batches: list[np.ndarray]) -> float:
        """Trains on each token batch [B, L + 1] back to back, as ours (on the device beforehand); the mean
        seconds a step, the last step's loss (fetched: on a GPU it waits for the steps) in `loss`."""
        tensors = [self._tensor(tokens) for tokens in batches]
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        t = time.perf_counter()
        for tokens in tensors:
            loss = self._step(tokens)
        self.loss = float(loss)
        return (time.perf_counter() - t) / len(tensors)

    def describe(self) -> str:
        where = f"{self.torch.get_num_threads()} threads" if self.device == "cpu" else self.torch.cuda.get_device_name()
        return (f"{self.compiled}, {self.peer.label}, fused AdamW={bool(self.opt.defaults.get('fused'))}, "
                f"{'bfloat16 autocast' if self.autocast else 'float32'}, from our initial weights, {where}")


def schedule_values(config) -> np.ndarray:
    """config.optim's learning rate at steps 0 .. config.train.steps, as ours trains with it (the peer's)."""
    return np.asarray(optim.make_schedule(config.optim, config.train.steps)(np.arange(config.train.steps + 1)))


def peer_device() -> str:
    """Where the peer trains: 'cuda' when JAX computes on a GPU (the same GPU), else 'cpu'."""
    return "cuda" if jax.default_backend() == "gpu" else "cpu"


# ---------------------------------------------------------------- the peer's own process


def peer_tunables() -> str | None:
    """The peer process's GLIBC_TUNABLES: this process's without the single arena (hostmem.TUNABLES),
    which slows PyTorch's threads (its bf16 autocast step at issue 21's first shape: 317 ms with the
    other tunables, 481 with one arena, 471 with none; experiments/bench/RESULTS.md)."""
    given, single = os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.arena_max"
    return given and ":".join(t for t in given.split(":") if t != f"{single}={hostmem.TUNABLES[single]}")


class PeerProcess:
    """The peer in a spawned process of its own (its own malloc settings, torch's threads never beside
    XLA's), driven one call at a time: `peer("train", ...)` runs PEER_CALLS["train"](state, ...)
    there and returns its value; the two sides still run in turns (interleaved rounds)."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.tunables = peer_tunables()
        child_env = {"GLIBC_TUNABLES": self.tunables,  # read by the child's glibc when it starts
                     "JAX_PLATFORMS": "cpu"}  # JAX there, if ever used, leaves the GPU to PyTorch
        saved = {name: os.environ.get(name) for name in child_env}
        for name, value in child_env.items():
            _set_env(name, value)
        try:
            with spawn.main_not_reimported():  # the loop by its module's name: `python -m` runs it as __main__
                serve = importlib.import_module("transformer.bench_peer")._serve_peer
                self.process = ctx.Process(target=serve, args=(child,), daemon=True)
                self.process.start()
        finally:
            for name, value in saved.items():
                _set_env(name, value)
            child.close()

    def __call__(self, call: str, *args):
        self.conn.send((call, args))
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"the peer's process failed in {call!r}:\n{value}")
        return value

    def __enter__(self) -> "PeerProcess":
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


def _serve_peer(conn) -> None:
    """The peer process's loop: (call, args) -> (True, value) | (False, traceback); None ends it."""
    state = {}
    while (message := conn.recv()) is not None:
        call, args = message
        try:
            conn.send((True, PEER_CALLS[call](state, *args)))
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send((False, traceback.format_exc()))


def _peer_train(state, config, params: int, weights_path: str, first_batch, lrs, device: str, compile_model: bool,
                threads: int, peer: str) -> tuple[str, float]:
    with np.load(weights_path) as weights:
        theirs = Theirs(config, params, dict(weights), first_batch, lrs, device, compile_model, threads, peer)
    state["train"] = theirs
    return theirs.describe(), getattr(theirs, "compile_s", 0.0)


def _peer_steps(state, batches) -> tuple[float, float]:
    return state["train"].steps(batches), state["train"].loss


def _peer_generation(state, config, params: int, device: str, peer: str, compile_model: bool, threads: int,
                     positions: int) -> str:
    """Builds the peer's greedy decoder on `device` (hf: `generate`; torch: the compiled static-cache one)."""
    if peer == "hf":
        torch, _ = import_torch()
        set_threads(torch, threads)
        hf = hf_build(config, params).eval().to(device)
        state["generate"] = lambda p, n: their_generate(hf, torch, p, n)
        return f"transformers' generate, kv cache, {device}"
    bench_torch = torch_module()
    set_threads(bench_torch.torch, threads)
    decoder = bench_torch.Decoder(bench_torch.build(config, params).to(device), compile_model=compile_model)
    length = bench_torch.cache_length(config, positions)
    state["generate"] = lambda p, n: torch_generate(decoder, p, n, length)
    return f"{decoder.compiled}, static kv cache of {length} positions, {device}"


def _peer_generate(state, prompt: np.ndarray, new_tokens: int) -> dict:
    return generation_stats(state["generate"], prompt, new_tokens)


PEER_CALLS = {"train": _peer_train, "steps": _peer_steps, "generation": _peer_generation,
              "generate": _peer_generate}


# ---------------------------------------------------------------- generation


def their_generate(hf_model, torch, prompt: np.ndarray, new_tokens: int) -> float:
    ids = torch.from_numpy(prompt.astype(np.int64)).to(hf_model.device)
    run = lambda: hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                                    pad_token_id=0, eos_token_id=None)
    run()
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def torch_generate(decoder, prompt: np.ndarray, new_tokens: int, length: int) -> float:
    """Seconds for the torch peer's greedy static-cache decoding (run once untimed: compiles)."""
    decoder.run_compiled(prompt, new_tokens, length)
    t = time.perf_counter()
    decoder.generate(prompt, new_tokens, length)
    return time.perf_counter() - t


def generation_stats(time_fn, prompt: np.ndarray, new_tokens: int) -> dict:
    """Prefill (the time of 1 new token), per-token decode, tokens/s of the whole generation."""
    prefill, total = time_fn(prompt, 1), time_fn(prompt, new_tokens)
    return {"prefill_ms": 1e3 * prefill, "decode_ms": 1e3 * (total - prefill) / max(new_tokens - 1, 1),
            "tokens_per_s": prompt.shape[0] * new_tokens / total}
