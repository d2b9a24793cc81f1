"""The PyTorch peer, child side: what runs in the process peer.Process spawns. `serve` answers the
parent's calls (CALLS) one at a time: build the peer's model from our initial weights with the same AdamW
step and learning-rate schedule (`Theirs`), time its train steps, build its greedy decoder and time its
generation. The models are torch_models.py's; nothing here imports JAX.

Glossary of shapes: B batch, L sequence length, P prompt length, V vocab.
"""

import os
import sys
import time
import traceback

import numpy as np

from transformer.bench import torch_models


def set_threads(torch, threads: int) -> None:
    torch.set_num_threads(threads or os.cpu_count() or 1)


class Theirs:
    """The same model (torch_models.MODELS[kind]) from our initial weights, batch, AdamW step and
    learning-rate schedule in PyTorch, torch.compile'd where that works, on `device` ('cpu' or 'cuda'):
    every tensor is made there.

    `lrs` [steps + 1] are the schedule's values at each step (peer.schedule_values), made by the parent:
    the peer's process never runs JAX (which would take the GPU's memory beside PyTorch).
    """

    def __init__(self, config, params: int, weights: dict, first_batch: np.ndarray, lrs: np.ndarray,
                 device: str = "cpu", compile_model: bool = True, threads: int = 0, kind: str = "hf"):
        import torch
        set_threads(torch, threads)
        self.torch, self.torch_model, self.device = torch, torch_models.MODELS[kind], device
        self.model = self.torch_model.load(self.torch_model.build(config, params), weights).train().to(device)
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
            logits = self.torch_model.logits(self.forward, tokens[:, :-1])  # [B, L, V]
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
        return (f"{self.compiled}, {self.torch_model.label}, fused AdamW={bool(self.opt.defaults.get('fused'))}, "
                f"{'bfloat16 autocast' if self.autocast else 'float32'}, from our initial weights, {where}")


# ---------------------------------------------------------------- the calls the parent makes


def serve(conn) -> None:
    """The child's loop: (call, args) -> (True, value) | (False, traceback); None ends it."""
    state = {}
    while (message := conn.recv()) is not None:
        call, args = message
        try:
            conn.send((True, CALLS[call](state, *args)))
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send((False, traceback.format_exc()))


def start_training(state, config, params: int, weights_path: str, first_batch, lrs, device: str,
                   compile_model: bool, threads: int, kind: str) -> tuple[str, float]:
    """Builds `Theirs` (compiling it on the first batch); (what it is, the compile + first step's seconds)."""
    with np.load(weights_path) as weights:
        theirs = Theirs(config, params, dict(weights), first_batch, lrs, device, compile_model, threads, kind)
    state["train"] = theirs
    return theirs.describe(), getattr(theirs, "compile_s", 0.0)


def train_steps(state, batches) -> tuple[float, float]:
    """(the mean seconds a step over `batches`, the last step's loss)."""
    return state["train"].steps(batches), state["train"].loss


def start_generation(state, config, params: int, device: str, kind: str, compile_model: bool, threads: int,
                     positions: int) -> str:
    """Builds the peer's greedy decoder on `device` (hf: `generate`; torch: the compiled static-cache one)."""
    if kind == "hf":
        torch, _ = torch_models.import_torch()
        set_threads(torch, threads)
        hf = torch_models.hf_build(config, params).eval().to(device)
        state["generate"] = lambda p, n: hf_generate(hf, torch, p, n)
        return f"transformers' generate, kv cache, {device}"
    torch_gpt = torch_models.torch_gpt()
    set_threads(torch_gpt.torch, threads)
    decoder = torch_gpt.Decoder(torch_gpt.build(config, params).to(device), compile_model=compile_model)
    length = torch_gpt.cache_length(config, positions)
    state["generate"] = lambda p, n: torch_generate(decoder, p, n, length)
    return f"{decoder.compiled}, static kv cache of {length} positions, {device}"


def generation_times(state, prompt: np.ndarray, new_tokens: int) -> tuple[float, float]:
    """Seconds to generate 1 token after `prompt` [B, P] (the prefill), then `new_tokens`."""
    return state["generate"](prompt, 1), state["generate"](prompt, new_tokens)


CALLS = {"train": start_training, "steps": train_steps, "generation": start_generation,
         "generate": generation_times}


# ---------------------------------------------------------------- generation


def hf_generate(hf_model, torch, prompt: np.ndarray, new_tokens: int) -> float:
    """Seconds for transformers' greedy `generate` (run once untimed first)."""
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
