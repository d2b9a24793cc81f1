"""The PyTorch models the peer can be, by `--vs` kind: transformers' GPT2LMHeadModel ('hf') and the
nanoGPT-style GPT of torch_gpt.py ('torch'), each a TorchModel. The peer's process builds them; the
parent only calls `check`. torch (and transformers) are imported when first needed.

Glossary of shapes: B batch, L sequence length, V vocab.
"""

import dataclasses
from collections.abc import Callable

from transformer.interop import hf_families


@dataclasses.dataclass(frozen=True)
class TorchModel:
    """One kind of peer: `check(config)` refuses what it cannot be (no torch model made), `build(config,
    params)` -> its model (float32, seeded, our parameter count asserted), `load(model, weights)` copies
    our initial weights in (peer.initial_weights), `logits(forward, tokens [B, L])` -> [B, L, V]."""

    check: Callable
    build: Callable
    load: Callable
    logits: Callable
    label: str


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


def torch_gpt():
    """The torch_gpt module (it imports torch)."""
    try:
        from transformer.bench import torch_gpt
    except ImportError:
        raise ImportError("--vs torch needs PyTorch: pip install torch") from None
    return torch_gpt


MODELS = {
    "hf": TorchModel(lambda config: hf_families.GPT2.to_theirs(config.model.to_dict()), hf_build, hf_load,
                     lambda forward, tokens: forward(input_ids=tokens).logits, "GPT2LMHeadModel, sdpa attention"),
    "torch": TorchModel(lambda config: torch_gpt().check(config.model.to_dict()),
                        lambda config, params: torch_gpt().build(config, params),
                        lambda model, weights: torch_gpt().load(model, weights),
                        lambda forward, tokens: forward(tokens), "nanoGPT-style, fused qkv, sdpa is_causal"),
}
