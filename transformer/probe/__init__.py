"""Looking inside a run: attention maps, embedding geometry, the logit lens and sampling temperature.

The Python API (the CLI is `python -m transformer.probe`, in __main__.py):

    run = probe.load("runs/gpt-tiny")                      # any run directory, the latest step
    tokens = probe.encode(run, "def f(x):", max_tokens=128)  # [L]
    maps = probe.attention(run.model, run.params, tokens[None])  # {'block_0/self_attn': [H, L, S], ...}
    lens = probe.logit_lens(run.model, run.params, tokens, run.family.lens_entry)  # [N, L, V]
    probe.nearest(run.params["embed"]["embedding"], vector, k)
    probe.analogy(table, a, b, c, k)                       # a - b + c, a, b and c excluded
    probe.project(vectors)                                 # [W, 2] principal components
    pixels = batches.read_image("cat.png", run.config)     # a ViT run: raw pixels, viewed as its eval does
    first, mean, std = probe.data_images(run.config, run.workdir)  # its first eval image, its statistics
    maps = probe.attention(run.model, run.params, normalisation.normalise(pixels, mean, std)[None])
    probe.pooled_row(probe.rollout(list(maps.values())), run.model.pool)  # [T]: what the pooled token reads

Attention weights come from the model's own `dense` attention (MultiHeadAttention sows them
as 'intermediates'); `load` clones the run's model with attention='dense' and its layers
unscanned, whatever it was trained with, so each layer's weights come out separately.

Glossary of shapes: B batch, L length, S key length, H heads, N layers, D width, V vocab, W words;
for a ViT, T tokens (P patches, plus [CLS] when it pools by it); an image is [height, width, channels].
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import rundir
from transformer.data.images import batches, host_views
from transformer.data.images import sources as image_sources
from transformer.data.text import tokenizers
from transformer.inference import sampling
from transformer.layers.block import Block
from transformer.models import common


@dataclasses.dataclass(frozen=True)
class Run:
    """A run's checkpoint, ready to probe: its model in probe form (dense attention, unscanned)."""

    family: common.Family
    model: nn.Module
    params: dict
    tokenizer: tokenizers.Tokenizer | None  # None for a run that reads images
    step: int
    config: object  # the run's config (config.json)
    workdir: str


def load(workdir: str, step: int | None = None) -> Run:
    """The run in `workdir` at `step` (default: its latest checkpoint), as `probe_form` of its model."""
    run = rundir.open(workdir)
    model = run.model()
    params = run.restore_params(step)
    step = run.latest_step if step is None else step
    tokenizer = None if reads_images(model) else run.tokenizer(framed=False)
    model, params = probe_form(run.family, model, params)
    return Run(run.family, model, params, tokenizer, step, run.config, workdir)


def reads_images(model: nn.Module) -> bool:
    """Whether the model reads images (a ViT) rather than tokens."""
    return hasattr(model, "image_size") and not hasattr(model, "vocab_size")


def probe_form(family: common.Family, model: nn.Module, params: dict) -> tuple[nn.Module, dict]:
    """`model` with dense attention, unscanned and without remat, and `params` in that layout."""
    model = model.clone(attention="dense", scan_layers=False, remat="none")
    target = jax.eval_shape(model.init, jax.random.key(0), *family.example_inputs(model))["params"]
    return model, common.match_layers(params, target)


def encode(run: Run, text: str, max_tokens: int, wrap: bool = False) -> np.ndarray:
    """text -> token ids [L], each '[MASK]' in it the tokenizer's [MASK] and, with `wrap`, between [CLS]
    and [SEP] as a masked LM reads it; refused (one line naming the flag) above `max_tokens` or max_len."""
    mask = run.tokenizer.special_id("[MASK]")
    pieces = [run.tokenizer.encode(part) for part in (text.split("[MASK]") if mask is not None else [text])]
    ids = [int(i) for piece in pieces for i in [*piece, mask]][:-1] if mask is not None else list(pieces[0])
    if not ids:
        raise ValueError("the text encodes to no tokens; give a non-empty --text")
    if wrap:
        ids = [tokenizers.require_special(run.tokenizer, "[CLS]"), *ids,
               tokenizers.require_special(run.tokenizer, "[SEP]")]
    ids = np.asarray(ids, np.int32)
    limit = min(max_tokens, getattr(run.model, "max_len", max_tokens))
    if ids.size > limit:
        raise ValueError(f"the text is {ids.size} tokens, more than the limit of {limit}: shorten it"
                         + (" or raise --max_tokens" if limit == max_tokens else " (the model's max_len)"))
    return ids


VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥"}


def token_labels(tokenizer: tokenizers.Tokenizer, ids) -> list[str]:
    """Each id as the text it decodes to: spaces, newlines and tabs made visible, other characters that
    print nothing escaped ('\\x15'), a piece of a character (a lone byte) its id '<231>'; no text at all
    its special's name ('[BOS]'), else '∅'."""
    specials = {tokenizer.special_id(name): name for name in tokenizers.SPECIALS}
    return [_token_label(tokenizer.decode([int(i)]), int(i), specials) for i in ids]


def _token_label(text: str, id_: int, specials: dict) -> str:
    if text and set(text) == {"\ufffd"}:
        return f"<{id_}>"
    return "".join(VISIBLE.get(c, c if c.isprintable() else ascii(c)[1:-1]) for c in text) or specials.get(id_, "∅")


def attention(model: nn.Module, params: dict, *inputs) -> dict[str, np.ndarray]:
    """Every attention layer's softmax weights of the first example of `inputs`: {layer path: [H, L, S]}.

    `model` must attend with the 'dense' implementation (see `probe_form`)."""
    _, state = model.apply({"params": params}, *inputs, mutable=["intermediates"])
    found = {}
    for path, value in jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]:
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        if names[-1] == "attention_weights":
            found["/".join(names[:-1])] = np.asarray(value[0])  # sow keeps a tuple: value is [B, H, L, S]
    return found


def logit_lens(model: nn.Module, params: dict, tokens, entry: tuple[str, ...]) -> np.ndarray:
    """tokens [L] -> logits [N, L, V] read after each of the N blocks through the model's own head.

    One forward pass: each block's output is recorded, and the first module named in `entry`
    met after the last block (the final norm, or the head) takes them all, stacked on the
    batch, in place of the last one; what follows it is the head, applied to every layer.
    """
    outputs, swapped = [], []

    def interceptor(next_fun, args, kwargs, context):
        if isinstance(context.module, Block) and context.method_name == "__call__":
            out = next_fun(*args, **kwargs)
            outputs.append(out)
            return out
        if context.module.name in entry and context.method_name == "__call__" and outputs and not swapped:
            swapped.append(context.module.name)
            return next_fun(jnp.concatenate(outputs), *args[1:], **kwargs)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        out = model.apply({"params": params}, jnp.asarray(tokens)[None])
    if not swapped:
        raise ValueError(f"this run's model has none of {', '.join(entry)} after its blocks: no vocabulary to "
                         "read the lens through (a classifier head?)")
    return np.asarray(vocabulary_logits(out))  # [N, L, V]


def vocabulary_logits(out) -> jax.Array:
    """A model's output -> its logits over the vocabulary (a language model's, or a masked-LM head's)."""
    if isinstance(out, dict):
        if "mlm_logits" not in out:
            raise ValueError(f"this run's head gives {', '.join(out)}, not logits over the vocabulary: "
                             "probe its pretraining run")
        return out["mlm_logits"]
    return out


def word_vector(table: np.ndarray, tokenizer: tokenizers.Tokenizer, word: str) -> tuple[np.ndarray, list[int]]:
    """A word's embedding [D] (the mean of its tokens' rows of `table` [V, D]) and its token ids."""
    ids = [int(i) for i in tokenizer.encode(word)]
    if not ids:
        raise ValueError(f"{word!r} encodes to no tokens")
    return table[ids].mean(0), ids


def cosine(table: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of table [V, D] with vector [D] -> [V]."""
    norms = np.linalg.norm(table, axis=1) * np.linalg.norm(vector)
    return table @ vector / np.maximum(norms, 1e-12)


def nearest(table: np.ndarray, vector: np.ndarray, k: int, exclude=()) -> list[tuple[int, float]]:
    """The k rows of table [V, D] most cosine-similar to vector [D], as (id, similarity), best first."""
    scores = cosine(np.asarray(table, np.float32), np.asarray(vector, np.float32))
    scores[list(exclude)] = -np.inf
    best = np.argsort(-scores)[:k]
    return [(int(i), float(scores[i])) for i in best]


def analogy(table: np.ndarray, a, b, c, k: int, exclude=()) -> list[tuple[int, float]]:
    """a - b + c (token ids or vectors [D]) -> its k nearest rows of table [V, D]; token ids given as
    a, b and c, and those in `exclude`, are never answers."""
    table = np.asarray(table, np.float32)
    as_vector = lambda x: table[x] if np.ndim(x) == 0 else np.asarray(x, np.float32)
    own = [int(x) for x in (a, b, c) if np.ndim(x) == 0]
    return nearest(table, as_vector(a) - as_vector(b) + as_vector(c), k, [*own, *exclude])


def project(vectors: np.ndarray) -> np.ndarray:
    """vectors [W, D] -> their coordinates [W, 2] on the first two principal components."""
    centred = vectors - vectors.mean(0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    return centred @ vt[:2].T


def rollout(maps: list[np.ndarray]) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020): each layer's head-averaged map [L, L], half the
    residual added and rows renormalised, multiplied through the layers -> [L, L]."""
    out = np.eye(maps[0].shape[-1])
    for weights in maps:
        mixed = 0.5 * weights.mean(0) + 0.5 * np.eye(weights.shape[-1])
        out = (mixed / mixed.sum(-1, keepdims=True)) @ out
    return out


def pooled_row(weights: np.ndarray, pool: str) -> np.ndarray:
    """A ViT's map [T, T] -> the row [T] its pooled representation reads: [CLS]'s (query 0) with
    pool='cls', the mean over query tokens with pool='mean' (no [CLS]). It sums to 1."""
    return weights[0] if pool == "cls" else weights.mean(0)


def patch_grid(row: np.ndarray, pool: str) -> np.ndarray:
    """A row over the tokens [T] -> its weights on the patches as the image's patch grid [g, g]."""
    patches = row[1:] if pool == "cls" else row
    side = int(round(np.sqrt(patches.size)))
    return patches.reshape(side, side)


def data_images(config, workdir: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ViT run's data as its task reads it: the first eval image's eval view [H, W, C] (raw pixels), and
    the per-channel mean [C] and std [C] the run normalises by (fixed in its config, or saved in its
    workdir; sampled again for a run that saved none)."""
    splits = image_sources.load(config.data, workdir)
    recipe = host_views.Recipe.of(config)
    first = host_views.eval_view(batches.read_or_replace(splits["test"], 0)[0], recipe)
    return (first, *batches.ImageData(splits, recipe, 1, 0).run_statistics(config.data, workdir))


def distributions(logits: np.ndarray, settings: list[dict]) -> list[np.ndarray]:
    """Next-token logits [V] -> the probabilities [V] sampling draws from under each setting
    (temperature, top_k, top_p: `sampling.next_token_distribution`)."""
    return [np.asarray(sampling.next_token_distribution(jnp.asarray(logits)[None], **s)[0]) for s in settings]
