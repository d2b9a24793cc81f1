"""Benchmark a config's model on the current device: training throughput and generation latency,
optionally against the same model in Hugging Face transformers on PyTorch.

  python -m transformer.bench --config configs/gpt.py:tiny [--steps 10] [--mode train|generate|data|all]
  python -m transformer.bench --config configs/gpt.py:gpt2-small,data.batch_size=4,data.seq_len=128 \
      --vs hf --rounds 5 --steps 3

Training runs the project's own jitted step (`loop.setup`: the config's task, optimizer, mesh
and donated state) on the task's real batches. Reported: items/s as the median over the timed
steps (after `--warmup` steps), step time, compile time (a compile's: the bench turns JAX's
compilation cache off, which training keeps on GPUs and TPUs), peak device memory, and MFU against
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
one training code path (`bench_peer.Theirs` over PEERS); its generation is a compiled static-kv-cache decoder.
`--hf_eager` and `--hf_threads` apply to either peer. The peer runs in a process of its own
(transformer/bench_peer.py): our commands set glibc malloc to keep XLA:CPU's temporaries (transformer/hostmem.py),
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
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from transformer import bench_peer, cli, decoding, inspect, models, profile
from transformer.training import checks, loop


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
    out = cli.user_cache("stores", key)
    tokenize.build(settings, out, os.cpu_count() or 1)
    config = copy.deepcopy(config)
    with config.unlocked():
        config.data.source = out
    return config


# ---------------------------------------------------------------- generation


def our_generate(model, params, prompt: np.ndarray, new_tokens: int) -> float:
    """Seconds for greedy `generate` of new_tokens after prompt [B, P] (compiled beforehand)."""
    run = lambda: decoding.generate(model, params, jnp.asarray(prompt), jax.random.key(0),
                                    max_new_tokens=new_tokens, temperature=0.0).block_until_ready()
    run()
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


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
    vs = bench_peer.peer_name(theirs_too)
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
        ops = profile.census(ours.compiled.as_text())
        print(f"ours: the compiled step's ops (outside fusions, a loop's body once): "
              f"{', '.join(f'{n:,} {op}' for op, n in ops.most_common())}")
        with contextlib.ExitStack() as stack:
            peer = vs and stack.enter_context(bench_peer.PeerProcess())
            if peer:
                weights = os.path.join(workdir, "initial_weights.npz")
                np.savez(weights, **bench_peer.initial_weights(run.state.params, config))  # before a step
            ours.steps(args.warmup + 1)  # as many as a peer's first (compiling) step and its warm-up: the same batches after
            if peer:
                batches = lambda start, n: [np.asarray(run.task.train_batch(s)["tokens"])
                                            for s in range(start, start + n)]  # made here, untimed (0.3 ms at shape 1)
                described, compile_s = peer("train", config, n_params, weights, batches(0, 1)[0],
                                            bench_peer.schedule_values(config), bench_peer.peer_device(),
                                            not args.hf_eager, args.hf_threads, vs)
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
    vs = bench_peer.peer_name(theirs_too)
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
        peer = vs and stack.enter_context(bench_peer.PeerProcess())
        if peer:
            described = peer("generation", config, models.count_params(config.model), bench_peer.peer_device(), vs,
                             not args.hf_eager, args.hf_threads, prompt_len + new_tokens)
        for batch in args.gen_batches:
            prompt = np.random.default_rng(0).integers(0, config.model.vocab_size, (batch, prompt_len), np.int32)
            ours, theirs = [], []
            for _ in range(args.gen_rounds):
                ours.append(bench_peer.generation_stats(ours_fn, prompt, new_tokens))
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
    jax.config.update("jax_enable_compilation_cache", False)
    if f.vs:
        bench_peer.PEERS[f.vs].check(config)  # refuses a model the peer cannot be, before any work
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
