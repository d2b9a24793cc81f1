"""The `bench --vs torch` peer: the GPT a researcher would otherwise write, nanoGPT-style, in PyTorch.

One fused q/k/v Linear, `F.scaled_dot_product_attention(is_causal=True)`, tanh GELU (this
project's `gelu`), pre-LN LayerNorm with biases, learned positions, tied embeddings (lm_head
weight = token embedding), no dropout, float32; shaped from config.model like the project's GPT
(same parameter count, asserted) and refusing what it cannot express. Module names are
nanoGPT's (= GPT-2's), so `load` takes the project's params as the interop's GPT-2 rules write them
(`peer.initial_weights`). Every tensor is made on the model's device (a GPU's, with the bench).
Generation: a static kv cache ([B, H, T, Dh] per layer, written in place with index_copy_), one
compiled prefill, then one compiled single-token step per token, greedy.

Glossary of shapes: B batch, L length, P prompt length, N new tokens, T cache length, V vocab.
"""

import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# config.model key -> the value this peer needs (the first mismatch is refused in one line)
NEEDS = dict(family="gpt", positions="learned", norm="layernorm", norm_placement="pre", activation="gelu",
             use_bias=True, tie_embeddings=True, num_kv_heads=0, head_dim=0, window=0, head="lm",
             param_dtype="float32", scan_layers=False, qk_norm=False, logit_softcap=0.0)
COMPUTE = ("float32", "bfloat16")  # bfloat16: the peer trains under torch.autocast (peer_process.Theirs)


def check(m: dict) -> None:
    """Raises ValueError naming the first config.model key the nanoGPT peer cannot express."""
    if m.get("dtype", "float32") not in COMPUTE:
        raise ValueError(f"--vs torch: config.model.dtype={m['dtype']!r} has no equivalent in the nanoGPT peer "
                         f"(needs one of {COMPUTE})")
    for key, value in NEEDS.items():
        if m.get(key, value) != value and not (key == "num_kv_heads" and m[key] == m["num_heads"]):
            raise ValueError(f"--vs torch: config.model.{key}={m[key]!r} has no equivalent in the nanoGPT "
                             f"peer (needs {value!r})")


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)  # q, k, v fused
        self.c_proj = nn.Linear(d, d)

    def qkv(self, x):
        """x [B, L, D] -> q, k, v [B, H, L, Dh]."""
        b, length, d = x.shape
        return self.c_attn(x).view(b, length, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)

    def out(self, y):
        b, _, length, _ = y.shape
        return self.c_proj(y.transpose(1, 2).reshape(b, length, -1))

    def forward(self, x, cache=None, pos=None):
        """Training and prefill: causal over x; with cache (k, v [B, H, T, Dh]) and pos (a 0-d long
        tensor), the keys and values are written at pos.. in place first."""
        q, k, v = self.qkv(x)
        if cache is None:
            return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        kc, vc = cache
        index = pos + torch.arange(x.shape[1], device=x.device)
        kc.index_copy_(2, index, k)
        vc.index_copy_(2, index, v)
        if x.shape[1] > 1:  # prefill from position 0: the prompt alone, causal
            return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        visible = (torch.arange(kc.shape[2], device=x.device) <= pos).view(1, 1, 1, -1)  # one query: keys 0..pos
        return self.out(F.scaled_dot_product_attention(q, kc, vc, attn_mask=visible))


class Mlp(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int, eps: float):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d, eps=eps), Attention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d, eps=eps), Mlp(d, hidden)

    def forward(self, x, cache=None, pos=None):
        x = x + self.attn(self.ln_1(x), cache, pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, m: dict):
        super().__init__()
        check(m)
        d, layers = m["d_model"], m["num_layers"]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(m["vocab_size"], d), wpe=nn.Embedding(m["max_len"], d),
            h=nn.ModuleList(Block(d, m["num_heads"], m["mlp_dim"], m["norm_epsilon"]) for _ in range(layers)),
            ln_f=nn.LayerNorm(d, eps=m["norm_epsilon"])))
        self.lm_head = nn.Linear(d, m["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        for name, p in self.named_parameters():  # nanoGPT's init (GPT-2's, as the project's)
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens, caches=None, pos=None):
        """tokens [B, L] -> logits [B, L, V] (float32); with caches, continues from pos."""
        t = self.transformer
        offset = 0 if pos is None else pos
        x = t.wte(tokens) + t.wpe(offset + torch.arange(tokens.shape[1], device=tokens.device))
        for i, block in enumerate(t.h):
            x = block(x, None if caches is None else caches[i], pos)
        return self.lm_head(t.ln_f(x))


def build(config, expected_params: int | None = None, seed: int = 0) -> GPT:
    """The peer shaped like config.model, float32; asserts its parameter count (tied: counted once)."""
    torch.manual_seed(seed)
    model = GPT(config.model.to_dict()).float()
    n = sum(p.numel() for p in model.parameters())
    if expected_params is not None:
        assert n == expected_params, f"the torch peer has {n:,} params, the project's GPT {expected_params:,}"
    return model


def load(model: GPT, weights: dict) -> GPT:
    """Copies GPT-2's tensors (transformers' names and Conv1D [in, out] layout: `peer.initial_weights`)
    into the peer, whose Linear weights are [out, in]."""
    state = model.state_dict()
    linears = {f"{n}.weight" for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    with torch.no_grad():
        for name, value in weights.items():
            state[name].copy_(torch.from_numpy(np.array(value.T if name in linears else value)))
    return model


# ---------------------------------------------------------------- generation


def cache_length(config, total: int) -> int:
    """As the project's `generate` sizes its cache: prompt + new tokens rounded up to 64, at most max_len."""
    return min(config.model.max_len, -(-total // 64) * 64)


class Decoder:
    """Greedy decoding with a static kv cache: prefill once, then a compiled single-token step."""

    def __init__(self, model: GPT, compile_model: bool = True):
        self.model = model.eval()
        self.prefill, self.step, self.compiled = self._prefill, self._step, "eager"
        if compile_model:
            try:
                self.step = torch.compile(self._step, mode="reduce-overhead", fullgraph=True)
                self.prefill = torch.compile(self._prefill, fullgraph=True)
                self.compiled = "torch.compile (step: reduce-overhead)"
            except Exception as e:  # noqa: BLE001 - fall back to eager with a message
                print(f"torch.compile of the decoder failed ({type(e).__name__}: {str(e)[:200]}); eager",
                      file=sys.stderr)

    def _prefill(self, tokens, caches):
        return self.model(tokens, caches, torch.zeros((), dtype=torch.long, device=tokens.device))[:, -1].argmax(-1)

    def _step(self, token, caches, pos):
        return self.model(token[:, None], caches, pos)[:, -1].argmax(-1)

    @torch.no_grad()
    def generate(self, prompt: np.ndarray, new_tokens: int, length: int) -> np.ndarray:
        """prompt [B, P] -> the new tokens [B, N], greedy; caches of `length` positions."""
        b, p = prompt.shape
        first = self.model.transformer.h[0].attn
        d = self.model.transformer.wte.embedding_dim
        shape, device = (b, first.heads, length, d // first.heads), first.c_attn.weight.device
        caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
                  for _ in self.model.transformer.h]
        token = self.prefill(torch.from_numpy(prompt.astype(np.int64)).to(device), caches)
        out = [token]
        for i in range(new_tokens - 1):
            token = self.step(token.clone(), caches, torch.tensor(p + i, device=device))
            out.append(token)
        return torch.stack(out, 1).cpu().numpy()

    def run_compiled(self, prompt, new_tokens, length):
        """generate, falling back to eager (with a message) when the compiled path fails when first run."""
        try:
            return self.generate(prompt, new_tokens, length)
        except Exception as e:  # noqa: BLE001
            if self.compiled == "eager":
                raise
            print(f"compiled decoding failed ({type(e).__name__}: {str(e)[:200]}); eager", file=sys.stderr)
            self.prefill, self.step, self.compiled = self._prefill, self._step, "eager"
            return self.generate(prompt, new_tokens, length)
