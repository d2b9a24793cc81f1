"""Look inside a run: attention maps, embeddings, the logit lens, sampling temperatures, linear probes.

  python -m transformer.probe KIND --workdir RUN [--step STEP] [--text TEXT | --input TEXT | --image FILE] [--out DIR]

Writes PNG figures and a JSON of the numbers behind them (default folder WORKDIR/probes/KIND-STEP/)
and prints their paths (embeddings prints its neighbours and analogy answers first, also saved as
embeddings.txt). KIND:

  attention    a heatmap per layer and head (one grid per layer) and every layer's head-averaged map;
               for an encoder-decoder, encoder self-, decoder self- and cross-attention of its
               greedy output for --input; for a ViT, of --image FILE (default: the run's first eval
               image): [CLS]'s row of the last layer and the attention rollout over the patches laid
               over the image (pool='mean': the mean over query tokens instead), and the layer grids
  embeddings   the nearest tokens of --text by cosine similarity, --analogy a,b,c (a - b + c) and a
               PCA of --words (default: --text and its neighbours); a word of several tokens is the
               mean of their vectors
  lens         the logit lens: each position's top predictions read after each layer
  temperature  the next-token distribution after --text at several temperatures and with top-k /
               top-p; for a masked LM, the distribution at the [MASK] in --text
  linear       an ImageGPT run: held-out accuracy of a logistic regression on each layer's features
               (averaged over positions) beside one on the raw pixels; a figure and a table (linear.md)
  coords       no run: the coordinate check of a GPT --config at each of --widths, under sp and muP
               (probe/coords.py): each layer's activation RMS and its update's over --steps steps, against
               width (coords.png; flat under muP, growing under sp), in --out (default coords/)

  python -m transformer.probe attention --workdir runs/gpt-tiny --text "def f(x):"
  python -m transformer.probe temperature --workdir runs/bert-tiny --text "import [MASK]"
  python -m transformer.probe attention --workdir runs/vit-tiny --image digit.png
  python -m transformer.probe linear --workdir runs/igpt-tiny
  python -m transformer.probe coords --config configs/gpt.py:tiny,model.num_layers=2 --widths 32,64,128,256,512
"""

import json
import os
import sys

import jax
import numpy as np

from transformer import cli, probe
from transformer import config as config_lib
from transformer.data.images import batches, normalisation
from transformer.data.text import tokenizers
from transformer.inference import decoding, sampling
from transformer.probe import coords as coords_probe
from transformer.probe import linear as linear_probe
from transformer.probe import plots

KINDS = ("attention", "embeddings", "lens", "temperature", "linear", "coords")
TOP = 5


def text_inputs(run: probe.Run, flags_) -> tuple[tuple, list[str], list[str]]:
    """The model's inputs for the probed text, with the source and target token labels.

    A family that translates (generation 'input') gets --input and its greedy output as target."""
    if run.family.generation == "input":
        if not flags_.input:
            raise ValueError(f"{run.family.name} runs are probed on an --input TEXT (the source)")
        src = probe.encode(run, flags_.input, flags_.max_tokens)[None]  # [1, S]
        bos, eos = (tokenizers.require_special(run.tokenizer, name) for name in ("[BOS]", "[EOS]"))
        out, _ = decoding.greedy_decode(run.model, run.params, src, src != 0, bos_id=bos, eos_id=eos,
                                        max_len=min(flags_.max_tokens, run.model.max_len) - 1)
        tgt = np.array([[bos, *sampling.until_stop(out[0], (eos,))]], np.int32)  # [1, L]
        labels = probe.token_labels(run.tokenizer, src[0]), probe.token_labels(run.tokenizer, tgt[0])
        return (src, tgt, src != 0), *labels
    if probe.reads_images(run.model):
        raise ValueError(f"{run.family.name} runs read images and have no next-token head: probe their "
                         "attention (--image FILE)")
    if not flags_.text:
        raise ValueError("give the text to probe with --text")
    ids = probe.encode(run, flags_.text, flags_.max_tokens, wrap=run.family.generation is None)
    labels = probe.token_labels(run.tokenizer, ids)
    return (ids[None],), labels, labels


def image_input(run: probe.Run, flags_) -> tuple[np.ndarray, np.ndarray, str]:
    """The probed image: raw pixels [H, W, C], normalised as the run trained [H, W, C], and where from."""
    first, mean, std = probe.data_images(run.config, run.workdir)
    if flags_.image:
        pixels, source = batches.read_image(flags_.image, run.config), flags_.image
    else:
        pixels, source = first, f"the first eval image of config.data.source={run.config.data.source!r}"
        print(f"no --image: probing {source}", file=sys.stderr)
    return pixels, normalisation.normalise(pixels, mean, std), source


def image_attention(run: probe.Run, flags_, out: str) -> tuple[list[str], dict]:
    """A ViT's attention: what the pooled token reads, laid over the image, and each layer's maps."""
    pixels, image, source = image_input(run, flags_)
    maps = probe.attention(run.model, run.params, image[None])
    pool, layers = run.model.pool, list(maps.values())
    last, rolled = probe.pooled_row(layers[-1].mean(0), pool), probe.pooled_row(probe.rollout(layers), pool)
    reader = "[CLS]" if pool == "cls" else "mean over queries"
    on_cls = lambda row: f" ({float(row[0]):.2f} on [CLS])" if pool == "cls" else ""
    panels = [(f"last layer, {reader}{on_cls(last)}", probe.patch_grid(last, pool)),
              (f"rollout, {reader}{on_cls(rolled)}", probe.patch_grid(rolled, pool))]
    note = "" if pool == "cls" else "\npool='mean', no [CLS]: each map's mean over the query tokens"
    labels = (["CLS"] if pool == "cls" else []) + [str(p) for p in range(run.model.num_patches)]
    title = f"attention over the patches of {source}{note}"
    written = [plots.image_overlays(f"{out}/image.png", pixels, panels, title)]
    for path, weights in maps.items():
        written.append(plots.heads_grid(f"{out}/{path.replace('/', '-')}.png", weights, labels, labels,
                                        f"{path} (query down, key across)"))
    written.append(plots.layers_grid(f"{out}/layers.png", maps, labels, labels, "each layer, averaged over heads"))
    numbers = {"image": source, "pool": pool, "row": "[CLS]'s" if pool == "cls" else "mean over query tokens",
               "tokens": labels,
               "last_layer": np.round(last, 6).tolist(), "rollout": np.round(rolled, 6).tolist(),
               "layers": {k: np.round(w.mean(0), 5).tolist() for k, w in maps.items()}}
    if len(labels) <= 64:
        numbers["weights"] = {k: np.round(w, 5).tolist() for k, w in maps.items()}
    return written, numbers


def attention(run: probe.Run, flags_, out: str) -> tuple[list[str], dict]:
    if probe.reads_images(run.model):
        return image_attention(run, flags_, out)
    inputs, source, target = text_inputs(run, flags_)
    maps = probe.attention(run.model, run.params, *inputs)
    written, stacks = [], {}
    for path, weights in maps.items():
        rows = target if path.startswith("decoder") else source
        cols = target if path.startswith("decoder") and path.endswith("self_attn") else source
        name = path.replace("/", "-")
        written.append(plots.heads_grid(f"{out}/{name}.png", weights, rows, cols, f"{path} (query down, key across)"))
        stacks.setdefault((path.split("_")[0], path.split("/")[-1]), {})[path] = (weights, rows, cols)
    for (stack, kind), layers in stacks.items():
        _, rows, cols = next(iter(layers.values()))
        written.append(plots.layers_grid(f"{out}/{stack}-{kind}-layers.png", {k: w for k, (w, _, _) in layers.items()},
                                         rows, cols, f"{stack} {kind}: each layer, averaged over heads"))
    numbers = {"source": source, "target": target,
               "weights": {k: np.round(w, 5).tolist() for k, w in maps.items()}}
    return written, numbers


def embeddings(run: probe.Run, flags_, out: str) -> tuple[list[str], dict]:
    if probe.reads_images(run.model):
        raise ValueError(f"{run.family.name} runs have no token embeddings (they embed image patches): "
                         "probe their attention (--image FILE)")
    if "embed" not in run.params:
        raise ValueError(f"this {run.family.name} run has no input embedding table (params['embed'])")
    if not flags_.text:
        raise ValueError("give the word whose neighbours to show with --text")
    table = np.asarray(run.params["embed"]["embedding"], np.float32)
    labels = probe.token_labels(run.tokenizer, range(table.shape[0]))
    vector, ids = probe.word_vector(table, run.tokenizer, flags_.text)
    note = f"the mean of its {len(ids)} tokens" if len(ids) > 1 else "one token"
    found = probe.nearest(table, vector, flags_.k, exclude=ids)
    near = [(labels[i], s) for i, s in found]
    heading = f"nearest tokens to {flags_.text!r} ({note})"
    written = [plots.nearest_bars(f"{out}/nearest.png", near, heading)]
    lists = [(heading, near)]
    numbers = {"word": flags_.text, "tokens": probe.token_labels(run.tokenizer, ids), "vector": note,
               "nearest": near}
    if flags_.analogy:
        words = flags_.analogy.split(",")
        if len(words) != 3:
            raise ValueError(f"--analogy takes three words a,b,c (a - b + c), not {flags_.analogy!r}")
        (va, ia), (vb, ib), (vc, ic) = (probe.word_vector(table, run.tokenizer, w) for w in words)
        answers = [(labels[i], s) for i, s in probe.analogy(table, va, vb, vc, flags_.k, exclude=[*ia, *ib, *ic])]
        numbers["analogy"] = {"a - b + c": words, "answers": answers}
        heading = f"{words[0]} - {words[1]} + {words[2]} ({words[0]}, {words[1]} and {words[2]} excluded)"
        written.append(plots.nearest_bars(f"{out}/analogy.png", answers, heading))
        lists.append((heading, answers))
    if flags_.words:
        words = flags_.words.split(",")
        vectors = np.stack([probe.word_vector(table, run.tokenizer, w)[0] for w in words])
    else:  # the neighbours' own rows: a label ('␣', '<231>') is not the text of its token
        words, vectors = [flags_.text] + [t for t, _ in near], np.stack([vector, *table[[i for i, _ in found]]])
    coords = probe.project(vectors)
    numbers["pca"] = {w: c.tolist() for w, c in zip(words, coords)}
    written.append(plots.projection(f"{out}/pca.png", coords, words))
    text = ranked_text(lists)
    print(text)
    with open(f"{out}/embeddings.txt", "w") as f:
        f.write(text + "\n")
    return [*written, f"{out}/embeddings.txt"], numbers


def ranked_text(lists: list[tuple[str, list[tuple[str, float]]]]) -> str:
    """(heading, [(token, cosine similarity)]) lists as text: each heading, then its tokens ranked."""
    lines = []
    for heading, ranked in lists:
        width = max(len(t) for t, _ in ranked)
        lines += [f"{heading}, by cosine similarity:",
                  *(f"  {k:2d}. {t:<{width}}  {s:.4f}" for k, (t, s) in enumerate(ranked, 1))]
    return "\n".join(lines)


def lens(run: probe.Run, flags_, out: str) -> tuple[list[str], dict]:
    if not run.family.lens_entry:
        raise ValueError(run.family.no_lens)
    (tokens,), labels, _ = text_inputs(run, flags_)
    probs = np.asarray(jax.nn.softmax(probe.logit_lens(run.model, run.params, tokens[0], run.family.lens_entry)))
    top = np.argsort(-probs, axis=-1)[..., :TOP]  # [N, L, TOP]
    names = [probe.token_labels(run.tokenizer, layer[:, 0]) for layer in top]
    predicts = "the next token" if run.family.generation else "the token there"
    figure = plots.lens_table(f"{out}/lens.png", names, np.take_along_axis(probs, top[..., :1], -1)[..., 0], labels,
                              predicts)
    numbers = {"tokens": labels, "predicts": predicts,
               "layers": [[{t: round(float(p), 5)
                            for t, p in zip(probe.token_labels(run.tokenizer, ids), probs[k, j, ids])}
                           for j, ids in enumerate(layer)] for k, layer in enumerate(top)]}
    return [figure], numbers


def temperature(run: probe.Run, flags_, out: str) -> tuple[list[str], dict]:
    (tokens,), labels, _ = text_inputs(run, flags_)
    position, where = len(labels) - 1, "next-token distribution after the text"
    if run.family.generation is None:
        mask = tokenizers.require_special(run.tokenizer, "[MASK]")
        if mask not in tokens[0]:
            raise ValueError("a masked LM predicts the token at a [MASK]: put [MASK] in --text")
        position, where = int(np.flatnonzero(tokens[0] == mask)[0]), "distribution at the [MASK]"
    logits = np.asarray(probe.vocabulary_logits(run.model.apply({"params": run.params}, tokens)))[0, position]
    settings = [dict(temperature=float(t)) for t in flags_.temperatures] + [
        dict(temperature=1.0, top_k=flags_.k), dict(temperature=1.0, top_p=flags_.top_p)]
    dists = probe.distributions(logits, settings)
    shown = np.argsort(-logits)[:flags_.k * 2]
    names = probe.token_labels(run.tokenizer, shown)
    title = lambda s: ", ".join(f"{k}={v:g}" for k, v in s.items())
    panels = [(title(s), list(zip(names, d[shown].tolist()))) for s, d in zip(settings, dists)]
    figure = plots.distribution_bars(f"{out}/temperature.png", panels,
                                     f"{where}: {''.join(labels)!r}")
    return [figure], {"text": labels, "position": position, "settings": settings,
                      "probabilities": [dict(p) for _, p in panels]}


def linear(run: probe.Run, flags_, out: str) -> tuple[list[str], dict]:
    result = linear_probe.probe(run)
    with open(f"{out}/linear.md", "w") as f:
        f.write(linear_probe.table(result, run.step))
    print(linear_probe.table(result, run.step))
    figure = linear_probe.figure(f"{out}/linear.png", result, f"linear probe of {run.workdir} at step {run.step}")
    return [figure, f"{out}/linear.md"], result


def coords(flags_) -> None:
    """The coordinate check of --config (no run): coords.png and coords.json in --out, their paths printed."""
    if not flags_.config:
        raise ValueError("coords checks a config, not a run: give --config configs/gpt.py:ARG")
    out = flags_.out or "coords"
    os.makedirs(out, exist_ok=True)
    widths = tuple(int(w) for w in flags_.widths)
    check = coords_probe.coordinate_check(config_lib.load(flags_.config), widths, flags_.steps,
                                          tuple(flags_.parametrizations))
    for name in check.rms:
        growth = check.growth(name)
        print(f"{name}: RMS at d_model {widths[-1]} over {widths[0]}, step {flags_.steps - 1}: "
              + ", ".join(f"{layer} {value:.2f}x" for layer, value in growth.items()))
    with open(f"{out}/coords.json", "w") as f:
        json.dump({"config": flags_.config, **check.to_json()}, f)
    figure = coords_probe.figure(f"{out}/coords.png", check, f"coordinate check of {flags_.config}")
    print(figure)
    print(f"{out}/coords.json")


def main(argv):
    from absl import flags

    flags_ = flags.FLAGS
    kind = argv[1] if len(argv) > 1 else ""
    if kind not in KINDS:
        raise ValueError(f"give the probe to run first: one of {', '.join(KINDS)} (not {kind!r})")
    if kind == "coords":
        return coords(flags_)
    if not flags_.workdir:
        raise ValueError(f"{kind} probes a run: give --workdir RUN")
    run = probe.load(flags_.workdir, flags_.step)
    out = flags_.out or os.path.join(flags_.workdir, "probes", f"{kind}-{run.step}")
    os.makedirs(out, exist_ok=True)
    written, numbers = globals()[kind](run, flags_, out)
    with open(f"{out}/{kind}.json", "w") as f:
        json.dump({"workdir": flags_.workdir, "step": run.step, **numbers}, f, ensure_ascii=False)
    for path in [*written, f"{out}/{kind}.json"]:
        print(path)


if __name__ == "__main__":
    from absl import flags

    flags.DEFINE_string("workdir", None, "Run directory (config.json, checkpoints, tokenizer).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_string("text", "", "The text to probe (the word, for embeddings).")
    flags.DEFINE_string("input", "", "Encoder-decoders: the source text.")
    flags.DEFINE_string("image", "", "ViT: the image file (PIL formats, or .npy [H, W(, C)]; default: the "
                        "run's first eval image).")
    flags.DEFINE_string("out", "", "Folder for the figures and JSON (default WORKDIR/probes/KIND-STEP).")
    flags.DEFINE_integer("max_tokens", 128, "Longest text probed, in tokens.")
    flags.DEFINE_integer("k", 8, "Neighbours, analogy answers, top-k of the temperature probe.")
    flags.DEFINE_string("analogy", "", "embeddings: a,b,c for a - b + c.")
    flags.DEFINE_string("words", "", "embeddings: comma-separated words to project (PCA).")
    flags.DEFINE_list("temperatures", ["0.5", "1.0", "1.5"], "temperature: the temperatures shown.")
    flags.DEFINE_float("top_p", 0.9, "temperature: the nucleus shown (at temperature 1).")
    flags.DEFINE_string("config", "", "coords: the GPT config to check (configs/gpt.py:ARG).")
    flags.DEFINE_list("widths", ["32", "64", "128", "256", "512"], "coords: the d_model values.")
    flags.DEFINE_integer("steps", 5, "coords: training steps measured.")
    flags.DEFINE_list("parametrizations", ["sp", "mup"], "coords: the parametrizations compared.")
    cli.run(main, positional=1)
