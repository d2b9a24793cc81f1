"""What the bench times on the current device, for any family: the config's own train step as a run
compiles it (items/s as the median of timed rounds, step and compile time, peak memory, MFU by
models/flops.py against the device's peak), the loader alone against the step, and greedy kv-cache
generation (prefill, per-token decode, tokens/s). With the PyTorch peer (peer.py) both sides are timed
in interleaved rounds, ours then theirs, so that machine noise hits both.

Glossary of shapes: B batch, L sequence length, P prompt length, N new tokens, V vocab.
"""

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer import console, models
from transformer.bench import peer
from transformer.bench.census import census
from transformer.inference import engine, sampling
from transformer.models.flops import forward_flops
from transformer.training import checks, loop, mfu


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
        return cls(loop.setup(checks.checked(config), workdir))

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
    from transformer.data.text import lm_streams, store_build
    source = config.data.get("source", "")
    if task not in ("lm", "mlm") or len(lm_streams.parse_source(source)) != 1 or lm_streams.is_store(source):
        return config
    settings = lm_streams.store_settings(config.data, config.model.vocab_size)
    key = hashlib.sha256(json.dumps([settings, sys.version], sort_keys=True, default=str).encode()).hexdigest()[:16]
    out = console.user_cache("stores", key)
    store_build.build(settings, out, os.cpu_count() or 1)
    config = copy.deepcopy(config)
    with config.unlocked():
        config.data.source = out
    return config


# ---------------------------------------------------------------- generation


def our_generate(model, params, prompt: np.ndarray, new_tokens: int) -> float:
    """Seconds for the engine's greedy continuation of new_tokens after each row of prompt [B, P] (its
    programs compiled beforehand)."""
    settings = sampling.Sampling(max_new_tokens=new_tokens)
    run = lambda: engine.continue_ids(model, params, prompt.tolist(), settings, slots=len(prompt))  # noqa: E731
    run()
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def generation_stats(prefill: float, total: float, batch: int, new_tokens: int) -> dict:
    """Prefill, per-token decode and tokens/s of the whole generation, from the seconds to generate 1 token
    (the prefill) and `new_tokens` after a prompt of `batch` rows."""
    return {"prefill_ms": 1e3 * prefill, "decode_ms": 1e3 * (total - prefill) / max(new_tokens - 1, 1),
            "tokens_per_s": batch * new_tokens / total}


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
    vs = peer.kind(theirs_too)
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
        ops = census(ours.compiled.as_text())
        print(f"ours: the compiled step's ops (outside fusions, a loop's body once): "
              f"{', '.join(f'{n:,} {op}' for op, n in ops.most_common())}")
        with contextlib.ExitStack() as stack:
            child = vs and stack.enter_context(peer.Process())
            if child:
                weights = os.path.join(workdir, "initial_weights.npz")
                np.savez(weights, **peer.initial_weights(run.state.params, config))  # before a step
            # as many as a peer's first (compiling) step and its warm-up: the same batches after
            ours.steps(args.warmup + 1)
            if child:
                batches = lambda start, n: [np.asarray(run.task.train_batch(s)["tokens"])
                                            for s in range(start, start + n)]  # made here, untimed
                described, compile_s = child("train", config, n_params, weights, batches(0, 1)[0],
                                             peer.schedule_values(config), peer.torch_device(),
                                             not args.hf_eager, args.hf_threads, vs)
                print(f"{vs} ({described}; its own process, GLIBC_TUNABLES={child.tunables}): "
                      f"compile + first step {compile_s:.2f} s")
                their_step = 1 + args.warmup
                if args.warmup:
                    child("steps", batches(1, args.warmup))
            ours_t, theirs_t = [], []
            for _ in range(args.rounds):
                ours_t.append(ours.steps(args.steps))
                if child:
                    seconds, their_loss = child("steps", batches(their_step, args.steps))
                    theirs_t.append(seconds)
                    their_step += args.steps
        step_s = statistics.median(ours_t)
        result = {"step_s": step_s, "items_per_s": items / step_s, "loss": ours.loss,
                  "compile_s": run.compile_seconds, "ops": dict(ops)}
        print(f"ours: {fmt_rate(items / step_s)} {run.task.item_name}/s | step {1e3 * step_s:.1f} ms "
              f"(median of {args.rounds} rounds of {args.steps} steps) | loss {ours.loss:.3f} | "
              f"peak memory {peak_memory(ours.compiled)}")
        result.update(_report_flops(config, device, dtype, step_s, run.task.item_name))
        if theirs_t:
            their_s = statistics.median(theirs_t)
            result.update(peer=vs, hf_step_s=their_s, hf_items_per_s=items / their_s, ratio=their_s / step_s,
                          hf_loss=their_loss)
            peak = result["nominal_peak"]
            theirs_mfu = (f" | MFU {100 * result['flops_per_s'] * step_s / their_s / peak:.1f}% of nominal"
                          if peak else "")
            print(f"{vs + ': ':6s}{fmt_rate(items / their_s)} {run.task.item_name}/s | step {1e3 * their_s:.1f} ms "
                  f"(median of {len(theirs_t)} rounds) | loss {their_loss:.3f}{theirs_mfu}")
            print(f"ratio ours/{vs} training throughput: {their_s / step_s:.2f}x")
        return result


def _report_flops(config, device, dtype: str, step_s: float, item_name: str) -> dict:
    """Prints and returns the model FLOP/s and MFU: against the device's datasheet peak, or where it has
    none (a CPU) against a matmul measured on the spot (on a GPU such a measure varies between runs)."""
    flops = forward_flops(config)
    tokens = flops["tokens"] * config.data.batch_size
    achieved = 3 * flops["per_token"] * tokens / step_s
    peak = mfu.nominal_peak(device.device_kind, dtype)
    measured = None if peak else mfu.measured_matmul_peak(dtype)
    against = f"MFU {100 * achieved / peak:.1f}% of nominal {peak / 1e12:.0f} TFLOP/s ({dtype})" if peak else \
        f"MFU {100 * achieved / measured:.1f}% of the measured {dtype} matmul peak {measured / 1e9:,.1f} GFLOP/s " \
        f"(no nominal peak for {device.device_kind!r})"
    print(f"ours: {achieved / 1e9:,.1f} GFLOP/s model flops ({3 * flops['per_token']:,.0f} per token x {tokens:,} "
          f"tokens per step: models/flops.py's formula) | {against}")
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
    vs = peer.kind(theirs_too)
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
        child = vs and stack.enter_context(peer.Process())
        if child:
            described = child("generation", config, models.count_params(config.model), peer.torch_device(), vs,
                              not args.hf_eager, args.hf_threads, prompt_len + new_tokens)
        for batch in args.gen_batches:
            prompt = np.random.default_rng(0).integers(0, config.model.vocab_size, (batch, prompt_len), np.int32)
            ours, theirs = [], []
            for _ in range(args.gen_rounds):
                ours.append(generation_stats(ours_fn(prompt, 1), ours_fn(prompt, new_tokens), batch, new_tokens))
                if child:
                    theirs.append(generation_stats(*child("generate", prompt, new_tokens), batch, new_tokens))
            _report_generation(results, batch, prompt_len, new_tokens, {"ours": ours, vs: theirs}, vs)
    if vs:
        print(f"{vs} decoder: {described}; its own process, GLIBC_TUNABLES={child.tunables}")
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
