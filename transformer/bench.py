"""Benchmark a config's model on the current device: training throughput and generation latency,
optionally against the same model in Hugging Face transformers on PyTorch.

  python -m transformer.bench --config configs/gpt.py:tiny [--steps 10] [--mode train|generate|data|all]
  python -m transformer.bench --config configs/gpt.py:gpt2-small,data.batch_size=4,data.seq_len=128 \
      --vs hf --rounds 5 --steps 3

Training runs the project's own jitted step (`loop.setup`: the config's task, optimizer, mesh
and donated state) on the task's real batches. Reported: items/s as the median over the timed
steps (after `--warmup` steps), step time, compile time, peak device memory, and MFU against
the device's nominal peak (PEAK_FLOPS, by `device_kind` and compute dtype) and against a
matmul peak measured on the spot. Model FLOPs are the one formula of `transformer.inspect`
(what `inspect` prints and the training loop's `train/mfu` uses), for every family.
Generation (families that continue a prompt): prefill latency, per-token decode latency and
tokens/s at batch 1 and 8 with the kv cache, greedy.

`--vs hf` builds the same GPT in `transformers` (GPT2LMHeadModel: gelu_new, tied embeddings,
no dropout, float32), the same AdamW step (clip, betas, decay masked off biases and norms),
compiled with torch.compile where it works, and times it in interleaved rounds (ours, theirs,
ours, ...) so that machine noise hits both; generation is compared with `model.generate`.
`--vs torch` does the same with the GPT a researcher would write in PyTorch (transformer/bench_torch.py:
nanoGPT-style, fused q/k/v, `scaled_dot_product_attention(is_causal=True)`, the same parameter count),
one training code path (`Theirs` over PEERS); its generation is a compiled static-kv-cache decoder.
`--hf_eager` and `--hf_threads` apply to either peer. The peer runs in a process of its own
(`PeerProcess`): our commands set glibc malloc to keep XLA:CPU's temporaries (transformer/hostmem.py),
and its single arena slows PyTorch's threads, so the peer gets the same settings but that one.
The peer follows config.optim's learning-rate schedule, and both sides print the loss of the same
step. Where JAX computes on a GPU the peer trains on the same GPU (issue 21's MFU
row: the peer's MFU is printed beside ours) and ours allocates as it goes
(XLA_PYTHON_CLIENT_PREALLOCATE=false unless set) so that both fit; its generation runs on CPU only, so
`--mode generate` times ours alone there.

`--mode data` times the task's batches alone (what the loader makes per second, against what
the train step consumes), the first batch at step 0 and at step 10^7 (the order is computed,
not replayed: the same), and prints the process's peak memory.

Glossary of shapes: B batch, L sequence length, P prompt length, N new tokens, V vocab.
"""

import contextlib
import copy
import dataclasses
import hashlib
import importlib
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
import types
from typing import Callable

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import traverse_util

from transformer import cli, generate, hostmem, inspect, models
from transformer.data import spawn
from transformer.interop import hf_families
from transformer.training import checks, loop, optim

def peak_memory(compiled) -> str:
    """Peak device memory from the allocator where it reports one, else XLA's compiled footprint."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return f"{stats['peak_bytes_in_use'] / 2**20:,.0f} MiB (allocator peak)"
    m = compiled.memory_analysis()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    if m is None:
        return f"n/a (process max RSS {rss:,.0f} MiB)"
    footprint = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return f"{footprint / 2**20:,.0f} MiB (compiled step: args + outputs + temps; process max RSS {rss:,.0f} MiB)"


# ---------------------------------------------------------------- ours: training


@dataclasses.dataclass
class Ours:
    """The project's train step as a run compiles it (`loop.setup`: memory checked), stepping on the
    task's batches."""

    run: object
    step: int = 0

    @classmethod
    def build(cls, config, workdir: str) -> "Ours":
        return cls(loop.setup(config, workdir))

    @property
    def compiled(self):
        return self.run.compiled_step

    def steps(self, n: int) -> float:
        """Runs n steps back to back, as training does, on batches made and placed beforehand (the loader
        is `--mode data`'s to time); the mean seconds a step, the last step's loss in `loss`."""
        batches = jax.block_until_ready([self.run.place(self.run.task.train_batch(self.step + i)) for i in range(n)])
        t = time.perf_counter()
        for batch in batches:
            self.run.state, metrics = self.compiled(self.run.state, batch, self.run.step_rng)
        self.loss = float(metrics["loss"])  # waits for the last step
        self.step += n
        return (time.perf_counter() - t) / n


def cached_text(config, task: str):
    """config with a text corpus (an LM's or MLM's single text source) tokenized once into a store that
    later bench runs share: TRANSFORMER_CACHE (~/.cache/transformer)/stores/KEY, KEY the tokenize
    settings' and Python's (stdlib) hash, so that the time to the first step is the compile's."""
    from transformer.data import lm, tokenize
    source = config.data.get("source", "")
    if task not in ("lm", "mlm") or len(lm.parse_source(source)) != 1 or lm.is_store(source):
        return config
    settings = lm.store_settings(config.data, config.model.vocab_size)
    key = hashlib.sha256(json.dumps([settings, sys.version], sort_keys=True, default=str).encode()).hexdigest()[:16]
    out = os.path.join(os.path.expanduser(os.environ.get("TRANSFORMER_CACHE", "~/.cache/transformer")), "stores", key)
    tokenize.build(settings, out, os.cpu_count() or 1)
    config = copy.deepcopy(config)
    with config.unlocked():
        config.data.source = out
    return config


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
                serve = importlib.import_module("transformer.bench")._serve_peer
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


def our_generate(model, params, prompt: np.ndarray, new_tokens: int) -> float:
    """Seconds for greedy `generate` of new_tokens after prompt [B, P] (compiled beforehand)."""
    run = lambda: generate.generate(model, params, jnp.asarray(prompt), jax.random.key(0),
                                    max_new_tokens=new_tokens, temperature=0.0).block_until_ready()
    run()
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


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


# ---------------------------------------------------------------- the report


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.2f}"


ARGS = ("steps", "warmup", "rounds", "prompt_len", "new_tokens", "gen_rounds", "hf_eager", "hf_threads")


def bench_train(config, args, theirs_too: bool | str) -> dict:
    """Times the config's train step (and the peer's, interleaved); prints and returns the numbers.

    `args` has the fields of ARGS (the command's flags of the same names); `theirs_too` names the
    peer ('hf', 'torch'; True: 'hf'; False or '': none). Result keys of the peer start with 'hf_'
    for either peer (and 'peer' names it).
    """
    vs = peer_name(theirs_too)
    device = jax.devices()[0]
    dtype = config.model.get("dtype", "float32")
    config = cached_text(config, checks.validate(config))
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        ours = Ours.build(config, workdir)
        run = ours.run
        n_params = sum(x.size for x in jax.tree.leaves(run.state.params))
        items = run.task.items_per_step
        print(f"model {config.model.family} {n_params:,} params | batch {config.data.batch_size} x "
              f"seq {config.data.get('seq_len', '-')} | {items} {run.task.item_name}/step | "
              f"device {device.device_kind} x{jax.device_count()} | compute {dtype}")
        print(f"ours: compile {run.compile_seconds:.2f} s (set-up in all {time.perf_counter() - start:.2f} s)")
        with contextlib.ExitStack() as stack:
            peer = vs and stack.enter_context(PeerProcess())
            if peer:
                weights = os.path.join(workdir, "initial_weights.npz")
                np.savez(weights, **initial_weights(run.state.params, config))  # before a step changes them
            ours.steps(args.warmup + 1)  # as many as a peer's first (compiling) step and its warm-up: the same batches after
            if peer:
                batches = lambda start, n: [np.asarray(run.task.train_batch(s)["tokens"])
                                            for s in range(start, start + n)]  # made here, untimed (0.3 ms at shape 1)
                described, compile_s = peer("train", config, n_params, weights, batches(0, 1)[0],
                                            schedule_values(config), peer_device(), not args.hf_eager,
                                            args.hf_threads, vs)
                print(f"{vs} ({described}; its own process, GLIBC_TUNABLES={peer.tunables}): "
                      f"compile + first step {compile_s:.2f} s")
                their_step = 1 + args.warmup
                if args.warmup:
                    peer("steps", batches(1, args.warmup))
            ours_t, theirs_t = [], []
            for _ in range(args.rounds):
                ours_t.append(ours.steps(args.steps))
                if peer:
                    seconds, their_loss = peer("steps", batches(their_step, args.steps))
                    theirs_t.append(seconds)
                    their_step += args.steps
        step_s = statistics.median(ours_t)
        result = {"step_s": step_s, "items_per_s": items / step_s, "loss": ours.loss,
                  "compile_s": run.compile_seconds}
        print(f"ours: {fmt_rate(items / step_s)} {run.task.item_name}/s | step {1e3 * step_s:.1f} ms "
              f"(median of {args.rounds} rounds of {args.steps} steps) | loss {ours.loss:.3f} | "
              f"peak memory {peak_memory(ours.compiled)}")
        result.update(_report_flops(config, device, dtype, step_s, run.task.item_name))
        if theirs_t:
            their_s = statistics.median(theirs_t)
            result.update(peer=vs, hf_step_s=their_s, hf_items_per_s=items / their_s, ratio=their_s / step_s,
                          hf_loss=their_loss)
            peak = result["nominal_peak"]
            theirs_mfu = f" | MFU {100 * result['flops_per_s'] * step_s / their_s / peak:.1f}% of nominal" if peak else ""
            print(f"{vs + ': ':6s}{fmt_rate(items / their_s)} {run.task.item_name}/s | step {1e3 * their_s:.1f} ms "
                  f"(median of {len(theirs_t)} rounds) | loss {their_loss:.3f}{theirs_mfu}")
            print(f"ratio ours/{vs} training throughput: {their_s / step_s:.2f}x")
        return result


def _report_flops(config, device, dtype: str, step_s: float, item_name: str) -> dict:
    """Prints and returns the model FLOP/s and MFU: against the device's datasheet peak, or where it has
    none (a CPU) against a matmul measured on the spot (on a GPU that measure moved 2x between runs)."""
    flops = inspect.forward_flops(config)
    tokens = flops["tokens"] * config.data.batch_size
    achieved = 3 * flops["per_token"] * tokens / step_s
    peak = inspect.nominal_peak(device.device_kind, dtype)
    measured = None if peak else inspect.measured_matmul_peak(dtype)
    against = f"MFU {100 * achieved / peak:.1f}% of nominal {peak / 1e12:.0f} TFLOP/s ({dtype})" if peak else \
        f"MFU {100 * achieved / measured:.1f}% of the measured {dtype} matmul peak {measured / 1e9:,.1f} GFLOP/s " \
        f"(no nominal peak for {device.device_kind!r})"
    print(f"ours: {achieved / 1e9:,.1f} GFLOP/s model flops ({3 * flops['per_token']:,.0f} per token x {tokens:,} "
          f"tokens per step: transformer.inspect's formula) | {against}")
    return {"flops_per_s": achieved, "measured_peak": measured, "nominal_peak": peak,
            "mfu": achieved / peak if peak else None}


def bench_data(config, args) -> dict:
    """The loader's items/s alone and the train step's consumption; the first batch at step 0 and 10^7."""
    config = cached_text(config, checks.validate(config))
    with tempfile.TemporaryDirectory() as workdir:
        ours = Ours.build(config, workdir)
        task, items = ours.run.task, ours.run.task.items_per_step
        first = {}
        for step in (0, 10**7):
            t = time.perf_counter()
            task.train_batch(step)
            first[step] = time.perf_counter() - t
        n = max(args.steps, 1)
        t = time.perf_counter()
        for step in range(1, n + 1):
            task.train_batch(step)
        loader = items * n / (time.perf_counter() - t)
        ours.steps(max(args.warmup, 1))
        step_s = ours.steps(n)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        print(f"data: loader {fmt_rate(loader)} {task.item_name}/s alone ({n} batches) | the train step consumes "
              f"{fmt_rate(items / step_s)} {task.item_name}/s | loader / step {loader * step_s / items:.1f}x")
        print(f"data: first batch at step 0 {1e3 * first[0]:.1f} ms, at step 10^7 {1e3 * first[10**7]:.1f} ms | "
              f"process max RSS {rss:,.0f} MiB")
        result = {"loader_per_s": loader, "step_per_s": items / step_s, "first_batch_s": first, "max_rss_mib": rss}
        workers = getattr(getattr(task, "data", None), "workers", 0)
        if workers:  # decoding and host views: what one core makes, and how many cores the step needs
            result["per_worker_per_s"] = loader / workers
            print(f"data: {fmt_rate(loader / workers)} {task.item_name}/s per worker process ({workers} workers): "
                  f"the step needs {items / step_s / (loader / workers):.1f} of them")
        return result


def bench_generate(config, args, theirs_too: bool | str) -> dict:
    """Times greedy kv-cache generation at each of args.gen_batches (and the peer's: `generate` of hf,
    the static-cache compiled decoder of torch). Result keys '{ours,hf,torch}_b{B}', 'ratio_b{B}'."""
    vs = peer_name(theirs_too)
    if models.family(config.model.family).generation != "prompt":
        print(f"generate: skipped ({config.model.family} models do not continue a prompt)")
        return {}
    model = models.build(config.model)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    prompt_len = args.prompt_len or min(config.data.seq_len, config.model.max_len) // 2
    new_tokens = min(args.new_tokens, config.model.max_len - prompt_len)
    ours_fn = lambda p, n: our_generate(model, params, p, n)
    results = {}
    with contextlib.ExitStack() as stack:
        peer = vs and stack.enter_context(PeerProcess())
        if peer:
            described = peer("generation", config, models.count_params(config.model), peer_device(), vs,
                             not args.hf_eager, args.hf_threads, prompt_len + new_tokens)
        for batch in args.gen_batches:
            prompt = np.random.default_rng(0).integers(0, config.model.vocab_size, (batch, prompt_len), np.int32)
            ours, theirs = [], []
            for _ in range(args.gen_rounds):
                ours.append(generation_stats(ours_fn, prompt, new_tokens))
                if peer:
                    theirs.append(peer("generate", prompt, new_tokens))
            _report_generation(results, batch, prompt_len, new_tokens, {"ours": ours, vs: theirs}, vs)
    if vs:
        print(f"{vs} decoder: {described}; its own process, GLIBC_TUNABLES={peer.tunables}")
    return results


def _report_generation(results: dict, batch: int, prompt_len: int, new_tokens: int, rows: dict, vs: str) -> None:
    """Prints and records the medians of each side's generation stats at one batch size, and the ratio."""
    for name, stats in rows.items():
        if not stats:
            continue
        med = {k: statistics.median(r[k] for r in stats) for k in stats[0]}
        results[f"{name}_b{batch}"] = med
        print(f"generate {name:5s} batch {batch}: prompt {prompt_len} + {new_tokens} new | prefill "
              f"{med['prefill_ms']:.1f} ms | decode {med['decode_ms']:.2f} ms/token | "
              f"{fmt_rate(med['tokens_per_s'])} tokens/s (median of {len(stats)} rounds)")
    if vs:
        ratio = results[f"ours_b{batch}"]["tokens_per_s"] / results[f"{vs}_b{batch}"]["tokens_per_s"]
        results[f"ratio_b{batch}"] = ratio
        print(f"ratio ours/{vs} generation tokens/s at batch {batch}: {ratio:.2f}x")


def define_flags() -> None:
    cli.define_config(required=False)
    flags.DEFINE_integer("steps", 10, "Timed training steps per round.")
    flags.DEFINE_integer("warmup", 2, "Untimed training steps after compiling.")
    flags.DEFINE_integer("rounds", 1, "Rounds of timed steps (interleaved with the peer's under --vs).")
    flags.DEFINE_enum("mode", "train", ["train", "generate", "data", "all"], "What to time.")
    flags.DEFINE_enum("vs", "", ["", "hf", "torch"], "Peer to compare with: 'hf' (transformers' GPT2LMHeadModel) "
                      "or 'torch' (a nanoGPT-style GPT in PyTorch, transformer/bench_torch.py).")
    flags.DEFINE_integer("prompt_len", 0, "Generation prompt length (default: half of seq_len).")
    flags.DEFINE_integer("new_tokens", 64, "Generated tokens (capped by max_len - prompt_len).")
    flags.DEFINE_list("gen_batches", ["1", "8"], "Generation batch sizes.")
    flags.DEFINE_integer("gen_rounds", 3, "Interleaved generation rounds.")
    flags.DEFINE_bool("hf_eager", False, "Time the peer (hf or torch) without torch.compile.")
    flags.DEFINE_integer("hf_threads", 0, "The peer's (hf or torch) torch threads (default: the core count; "
                         "XLA:CPU's intra-op pool takes the cores available to the process).")
    flags.DEFINE_string("json", "", "Also write the results, by mode, to this JSON file.")
    flags.DEFINE_enum("suite", "", ["", "gpu"], "Run a suite of benchmarks instead (transformer/bench_suite.py): "
                      "'gpu', every GPU row beside experiments/bench/GPU.md.")
    flags.DEFINE_list("rows", [], "--suite: only these rows (default: all).")
    flags.DEFINE_bool("record", False, "--suite: write the measured table into experiments/bench/GPU.md.")


def main(argv):
    f = flags.FLAGS
    if f.suite:
        from transformer import bench_suite
        bench_suite.main(f.rows, f.record)
        return
    if f.config is None:
        raise ValueError("--config is required (or --suite gpu)")
    if f.vs:  # on a GPU the peer trains on it too: JAX takes what it uses, not 75% of its memory up front
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    config = f.config
    checks.validate(config)
    if f.vs:
        PEERS[f.vs].check(config)  # refuses a model the peer cannot be, before any work
    args = types.SimpleNamespace(**{name: getattr(f, name) for name in ARGS}, gen_batches=[int(b) for b in f.gen_batches])
    threads = f"| XLA:CPU pool {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} " \
        f"cores " if jax.default_backend() == "cpu" else ""
    if f.vs:
        import torch
        threads += f"| torch {torch.__version__}, {f.hf_threads or os.cpu_count() or 1} threads "
    print(f"transformer.bench {' '.join(argv[1:]) or ''}| jax {jax.__version__} {threads}| {time.strftime('%Y-%m-%d')}")
    results = {}
    if f.mode in ("train", "all"):
        results["train"] = bench_train(config, args, f.vs)
    if f.mode == "data":
        results["data"] = bench_data(config, args)
    if f.mode in ("generate", "all"):
        results["generate"] = bench_generate(config, args, f.vs)
    if f.json:
        with open(f.json, "w") as out:
            json.dump(results, out, default=str)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
