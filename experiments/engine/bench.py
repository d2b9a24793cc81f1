"""Prefill and decode speed of the engine against transformers' `generate`, and serve-like concurrency.

  PYTHONPATH=. python experiments/engine/bench.py --layers 12 --new 16 --rounds 2   # GPT-2-small's shape
  PYTHONPATH=. python experiments/engine/bench.py --layers 2 --new 8 --rounds 1     # a laptop minute

A GPT-2-small-shaped model (random weights, vocab 50257) writes `--new` greedy tokens after a 16-token prompt
at batch 1, 8 and 32, ours (the engine) and transformers' GPT2LMHeadModel.generate (PyTorch, the same
threads), interleaved round by round; the best round is kept. Each batch prints three rows: the prefill (ours:
the engine's admission of the batch, timed around `Engine._admit`; theirs: one forward of the prompts with the
cache, the last position's logits alone, as `generate` runs it), the decode (the rest of the run, in new
tokens per second; MBU is the bytes a decode step reads, params and the cache, per second over `--peak_gbs`)
and the whole run. Then 32 requests of 32 prompt lengths sent at once to the server (`inference/server.py`
over a warm 32-slot engine, uvicorn on a local port, HTTP and JSON included), against the same requests one
after another (`--serve 0` skips it). Prints a markdown table.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer.data.text import tokenizers
from transformer.inference import engine, sampling
from transformer.models import gpt
from transformer.training import mfu

VOCAB, PROMPT = 50257, 16


def ours(layers: int, dtype: str = "float32"):
    cfg = gpt.default_model_config("gpt2-small")
    cfg.update(num_layers=layers, vocab_size=VOCAB, max_len=256, dtype=dtype)
    model = gpt.build(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    params = jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
    return model, jax.tree.map(lambda x: x.astype(dtype), params)


def theirs(layers: int):
    import torch
    import transformers

    torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count() or 1)))
    config = transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=VOCAB, n_positions=256)
    return transformers.GPT2LMHeadModel(config).eval(), torch


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_run(go, admitting: list[float]) -> tuple[float, float]:
    """(seconds of go(), of them the admissions')."""
    admitting[0] = 0.0
    return timed(go), admitting[0]


def admission_clock(runner: engine.Engine) -> list[float]:
    """[seconds], to which each of the runner's admissions (prefills and copies, to the device's end) adds."""
    spent, admit = [0.0], runner._admit

    def clocked():
        start = time.perf_counter()
        admit()
        jax.block_until_ready(runner.cache)
        spent[0] += time.perf_counter() - start
    runner._admit = clocked
    return spent


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", type=int, default=1, help="1: then the 32 requests at once and one by one")
    parser.add_argument("--peak_gbs", type=float, default=0.0,
                        help="the machine's memory bandwidth, GB/s (0: a GPU's datasheet, else measured here)")
    parser.add_argument("--batches", default="1,8,32", help="the decode batches, comma-separated")
    parser.add_argument("--peer", type=int, default=1, help="0: the engine alone (no transformers)")
    parser.add_argument("--dtype", default="float32", help="params, activations and cache")
    parser.add_argument("--json", default="", help="also write the engine's rows here")
    a = parser.parse_args()
    model, params = ours(a.layers, a.dtype)
    peak = a.peak_gbs or (mfu.nominal_bandwidth(jax.devices()[0].device_kind) or mfu.measured_bandwidth()) / 1e9
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    context = -(-(PROMPT + a.new) // 64) * 64
    rng, rows = np.random.default_rng(0), {}
    hf, torch = theirs(a.layers) if a.peer else (None, None)
    print(f"layers {a.layers}, {a.new} new tokens, best of {a.rounds} rounds, {a.dtype}, jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}, MBU against {peak:,.0f} GB/s"
          + (f", torch {torch.__version__}, {torch.get_num_threads()} torch threads" if a.peer else ""))
    print("| what | ours | theirs | ours' speed-up | |\n|---|---|---|---|---|", flush=True)
    for batch in map(int, a.batches.split(",")):
        prompts = rng.integers(0, VOCAB, (batch, PROMPT)).tolist()
        settings = sampling.Sampling(max_new_tokens=a.new)
        runner = engine.Engine(model, params, slots=batch, context=context, steps=8)
        admitting = admission_clock(runner)
        go = lambda runner=runner, prompts=prompts, settings=settings: runner.run(  # noqa: E731
            [engine.Request(p, settings) for p in prompts])
        read = weight_bytes + a.layers * batch * context * 768 * 2 * jax.tree.leaves(params)[0].dtype.itemsize
        if not a.peer:
            go()
            whole, prefill = min(timed_run(go, admitting) for _ in range(a.rounds))
            decode = batch * a.new / (whole - prefill)
            rows[batch] = {"decode_tok_s": decode, "prefill_s": prefill, "mbu": read * decode / batch / 1e9 / peak}
            print(f"| batch {batch}: decode, {a.new} new tokens | {decode:,.1f} tok/s | | | MBU "
                  f"{100 * rows[batch]['mbu']:.1f}% |", flush=True)
            continue
        ids = torch.tensor(prompts)
        hf_go = lambda ids=ids: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new,  # noqa: E731
                                            min_new_tokens=a.new, do_sample=False, pad_token_id=0)
        hf_prefill = lambda ids=ids: hf(ids, attention_mask=torch.ones_like(ids), use_cache=True,  # noqa: E731
                                             logits_to_keep=1)
        with torch.no_grad():
            go(), hf_go(), hf_prefill()  # compiled, warmed
            mine, yours = [], []
            for _ in range(a.rounds):
                mine.append(timed_run(go, admitting))
                yours.append((timed(hf_go), timed(hf_prefill)))
        (whole, prefill), (hf_whole, hf_prefill_s) = min(mine), min(yours)
        decode, hf_decode = batch * a.new / (whole - prefill), batch * a.new / (hf_whole - hf_prefill_s)
        mbu = read * decode / batch / 1e9 / peak  # the params and the whole cache read a step
        rows[batch] = {"decode_tok_s": decode, "prefill_s": prefill, "mbu": mbu, "vs_transformers": decode / hf_decode}
        print(f"| batch {batch}: prefill, {PROMPT}-token prompts | {prefill:.2f} s | {hf_prefill_s:.2f} s | "
              f"{hf_prefill_s / prefill:.2f}x | |", flush=True)
        print(f"| batch {batch}: decode, {a.new} new tokens | {decode:,.1f} tok/s | {hf_decode:,.1f} tok/s | "
              f"{decode / hf_decode:.2f}x | MBU {100 * mbu:.1f}% |", flush=True)
        print(f"| batch {batch}: the whole run | {batch * a.new / whole:,.1f} tok/s | "
              f"{batch * a.new / hf_whole:,.1f} tok/s | {hf_whole / whole:.2f}x | {whole:.2f} s vs "
              f"{hf_whole:.2f} s |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not a.serve:
        return
    lengths = list(range(4, 36))
    prompts = [rng.integers(0, 256, n).tolist() for n in lengths]
    runner = engine.Engine(model, params, slots=32, context=64, steps=8, tokenizer=tokenizers.ByteTokenizer()).warm()
    together, one_by_one = served(runner, prompts, a.new)
    print(f"| serve: 32 requests of 32 lengths over HTTP | {together:.2f} s at once | {one_by_one:.2f} s one at a "
          f"time | {one_by_one / together:.2f}x | |", flush=True)


def served(runner: engine.Engine, prompts: list, new: int) -> tuple[float, float]:
    """(seconds for `prompts` sent to `/v1/completions` all at once, one after another), through the server's
    app over `runner` on a local port: HTTP, JSON and the engine's thread included."""
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import uvicorn

    from transformer.inference import server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = server.make_app(runner.start(), "bench", server.Limits(max_tokens=new))
    http_server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    threading.Thread(target=http_server.run, daemon=True).start()
    while not http_server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/completions"

    def ask(ids):
        r = httpx.post(url, json={"prompt": ids, "max_tokens": new, "temperature": 0}, timeout=600)
        assert r.status_code == 200, r.text

    ask(prompts[0])
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = timed(lambda: list(pool.map(ask, prompts)))
    one_by_one = timed(lambda: [ask(p) for p in prompts])
    http_server.should_exit = True
    return together, one_by_one

if __name__ == "__main__":
    main()
