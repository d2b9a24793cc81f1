"""Continue a prompt with a trained GPT, translate an input with an encoder-decoder, or complete images.

Which one a run does, its family's record says.

  python -m transformer.generate --workdir runs/gpt-tiny --prompt "def " \
      --max_new_tokens 200 --temperature 0.8 --top_k 40 --top_p 0.95 --seed 0
  python -m transformer.generate --workdir runs/igpt-tiny --images eval --num_samples 3
  python -m transformer.generate --workdir runs/encdec-tiny --input "def add(a, b): \\n return a + b" \
      --beam_size 4 --length_penalty 0.6

A completion ends at the end-of-document id (the one a token store writes after each document: byte
0xFF, else the tokenizer's end-of-text token; `store_encoding.end_of_document_id`), or goes on past it
with --ignore_eos; a translation ends at [EOS]. An ImageGPT run (a GPT trained on images) completes
--images instead of a --prompt: the upper half of each is kept, the rest sampled, and a grid PNG of
originals and completions written (its path printed). A flag of the other kind of generation is refused in
one line, not ignored. The decoding itself (sampling, greedy and beam search with the key/value cache)
is `transformer.inference.engine` (a GPT) and `transformer.inference.decoding` (an encoder-decoder's
search); the sampling flags are one `sampling.Sampling`, checked there.
"""

import shlex

from transformer import cli, rundir
from transformer.data.text import store_encoding
from transformer.inference import decoding, engine, sampling
from transformer.inference import images as image_completion

# The flags that only one kind of generation (a family record's `generation`) reads.
FLAGS_OF = {"prompt": ("prompt", *cli.SAMPLING, "num_samples", "ignore_eos", "images", "out", "num_images"),
            "input": ("input", "beam_size", "length_penalty")}
WHAT = {"prompt": "continue a --prompt TEXT", "input": "translate an --input TEXT"}


def check_flags(flags_) -> None:
    """Each sampling or search flag in its range, else a ValueError naming it (before the run is read)."""
    sampling.Sampling(**cli.sampling_fields(flags_))
    for name in ("num_samples", "beam_size"):
        if flags_[name].value < 1:
            raise ValueError(f"--{name}={flags_[name].value} must be >= 1")


def generate_cli(flags_) -> list[str]:
    """The texts the command prints: a family continues --prompt or translates --input (its record's
    `generation`), or refuses in one line."""
    check_flags(flags_)
    run = rundir.open(flags_.workdir)
    config, family = run.config, run.family
    if family.generation is None:
        raise ValueError(family.no_generation.format(workdir=shlex.quote(run.path))
                         or f"{family.name} models do not generate")
    others = [name for kind, names in FLAGS_OF.items() if kind != family.generation for name in names]
    given = [name for name in others if flags_[name].present]
    if given:
        raise ValueError(f"--{given[0]} does not apply to {family.name} models, which "
                         f"{WHAT[family.generation]}: drop it")
    if flags_.images:
        return [image_completion.complete_files(run, flags_.images, flags_.out, flags_.step, flags_.num_images,
                                                flags_.num_samples, flags_.seed, flags_.temperature, flags_.top_k)]
    model, params, tokenizer = run.model(), run.restore_params(flags_.step), run.tokenizer(framed=False)
    if image_completion.reads_images(tokenizer):
        raise ValueError(f"{run.path} is an ImageGPT run (its tokenizer is a palette): give --images DIR, FILES or "
                         "eval to complete, not a --prompt")
    if family.generation == "input":
        if not flags_.input:
            raise ValueError(f"{family.name} models {WHAT['input']}")
        return decoding.translate(model, params, tokenizer, [flags_.input], max_len=config.data.target_len,
                                  source_len=config.data.source_len, beam_size=flags_.beam_size,
                                  alpha=flags_.length_penalty, source_eos=config.data.get("source_eos", False))
    try:
        stop = None if flags_.ignore_eos else store_encoding.end_of_document_id(tokenizer)
    except ValueError as e:
        raise ValueError(f"{e} to stop a completion at: pass --ignore_eos to write all --max_new_tokens") from None
    settings = sampling.Sampling(**cli.sampling_fields(flags_), stop_ids=() if stop is None else (stop,))
    texts = engine.complete(model, params, tokenizer, flags_.prompt, settings, flags_.num_samples)
    return [flags_.prompt + text for text in texts]


def main(argv):
    from absl import flags

    texts = generate_cli(flags.FLAGS)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i}")
        print(text)


if __name__ == "__main__":
    from absl import flags

    flags.DEFINE_string("workdir", None, "Run directory (holds config.json, checkpoints, tokenizer).")
    flags.DEFINE_string("prompt", "", "Text to continue.")
    cli.define_sampling(200, 0.8, "Tokens to generate.")
    flags.DEFINE_integer("num_samples", 1, "Completions to draw.")
    flags.DEFINE_bool("ignore_eos", False, "Go on past the end-of-document id (by default a completion ends there).")
    cli.define_step()
    flags.DEFINE_string("images", "", "An ImageGPT run: a folder of images (searched recursively), comma-separated "
                        "image files, or 'eval' (the run's held-out images): each image's upper half is kept and "
                        "--num_samples completions of the rest are drawn into a grid PNG.")
    flags.DEFINE_string("out", "", "--images: the PNG to write (default WORKDIR/samples/completions-STEP.png).")
    flags.DEFINE_integer("num_images", 8, "--images: the most images completed (the first in sorted order).")
    flags.DEFINE_string("input", "", "Encoder-decoders: the source text to translate (e.g. code to summarise).")
    flags.DEFINE_integer("beam_size", 1, "Encoder-decoders: beam width; 1 = greedy.")
    flags.DEFINE_float("length_penalty", 0.6, "Encoder-decoders: alpha of GNMT's ((5 + length) / 6) ** alpha.")
    flags.mark_flag_as_required("workdir")
    cli.run(main)
