"""Turn a local Hugging Face model directory into a run directory.

  python -m transformer.convert --hf_dir path/to/gpt2 --workdir runs/gpt2 [--configs configs]

The run directory holds config.json (the family's config file, from --configs, with the imported model),
an orbax checkpoint of the weights at step 0, in their stored dtype (no optimizer state: an
8B model converts in the memory of its weights), and the tokenizer; it generates like any run
and fine-tuning starts from it:

  python -m transformer.generate --workdir runs/gpt2 --prompt "def "
  python -m transformer.train --config configs/gpt.py:gpt2-small --config.optim.lr=5e-05 \
      --config.optim.warmup_steps=100 --config.init_from=runs/gpt2 \
      --workdir runs/gpt2-finetuned                    # fine-tuning (the command is printed)

See `transformer.interop.hf` for the supported classes.
"""

import os

import jax

from transformer import cli, models, rundir
from transformer import config as config_lib
from transformer.data.text import tokenizers
from transformer.interop import hf


def convert(hf_dir: str, workdir: str, param_dtype: str = "", configs: str = "configs") -> dict:
    """Writes the run directory; returns {'config', 'tokenizer' (or None), 'params'}. The weights keep
    their stored dtype unless `param_dtype` is given (config.model.param_dtype records it); the config
    is the family's file under `configs` (config.model alone where that is no directory)."""
    if os.path.isdir(os.path.join(workdir, rundir.CHECKPOINTS)):
        raise ValueError(f"{workdir} already holds a run; choose a new --workdir")
    _, params, config = hf.load_pretrained(hf_dir, param_dtype=param_dtype or None, configs=configs)
    tokenizer = _tokenizer(hf_dir, hf.read_config(hf_dir), config)
    run = rundir.RunDir(workdir)
    run.write_config(config)
    if tokenizer is not None:
        tokenizer.save(workdir)
    ckpt = run.checkpointer()
    ckpt.save_params(params)
    ckpt.wait()
    ckpt.close()
    return {"config": config, "tokenizer": tokenizer, "params": params}


def _tokenizer(hf_dir: str, hf_config: dict, config):
    """The directory's tokenizer (None without tokenizer files); an encoder-decoder's [BOS] is the
    token its decoder starts from."""
    try:
        tokenizer = tokenizers.hf_tokenizer(hf_dir)
    except FileNotFoundError:
        return None
    start = hf.architecture_of(hf_config)[0].decoder_start(hf_config)
    if start is not None:
        tokenizer.specials["[BOS]"] = tokenizer.token(start)
    tokenizers.check_fits(tokenizer.vocab_size, tokenizer.kind, config.model.vocab_size)
    return tokenizer


# A pretrained model's fine-tuning: transformers' Trainer default learning rate (the presets' are for
# training from scratch, 6e-4 and up, enough to wreck pretrained weights) and a short warmup.
FINETUNE_OPTIM = {"lr": 5e-5, "warmup_steps": 100}


def finetune_command(config, workdir: str, configs: str = "configs") -> str:
    """The `transformer.train` command that starts from the converted run (FINETUNE_OPTIM's settings)."""
    spec = hf.run_config_spec(config.model)
    preset = config_lib.load(os.path.join(configs, spec))
    changed = [f"--config.model.{k}={v}" for k, v in config.model.items() if preset.model.get(k) != v]
    data = [f"--config.data.{k}={config.data[k]}" for k in ("tokenizer", "vocab_size")
            if k in config.data and preset.data[k] != config.data[k]]
    optim = [f"--config.optim.{k}={v}" for k, v in FINETUNE_OPTIM.items() if preset.optim.get(k) != v]
    return " ".join(["python -m transformer.train", f"--config {os.path.join(configs, spec)}", *changed, *data,
                     *optim, f"--config.data.tokenizer_path={workdir}", f"--config.init_from={workdir}",
                     "--workdir NEW_RUN_DIR"])


def main(argv):
    from absl import flags

    f = flags.FLAGS
    out = convert(f.hf_dir, f.workdir, f.param_dtype, f.configs)
    config = out["config"]
    n = sum(x.size for x in jax.tree.leaves(out["params"]))
    print(f"{config.model.family} {n:,} params -> {f.workdir} (config.json, checkpoints/0"
          f"{', tokenizer' if out['tokenizer'] else '; no tokenizer files found'})")
    generation = models.family(config.model.family).generation
    if generation:
        print(f"generate:  python -m transformer.generate --workdir {f.workdir} --{generation} 'TEXT'")
    if os.path.isdir(f.configs):
        print(f"fine-tune: {finetune_command(config, f.workdir, f.configs)}")


if __name__ == "__main__":
    from absl import flags

    flags.DEFINE_string("hf_dir", None, "A Hugging Face model directory (config.json, model.safetensors, tokenizer).")
    flags.DEFINE_string("workdir", None, "The run directory to write.")
    flags.DEFINE_string("configs", "configs", "The directory of the families' config files (gpt.py, ...), where "
                        "the run's config starts from.")
    flags.DEFINE_enum("param_dtype", "", ["", "float32", "bfloat16", "float16"],
                      "The weights' dtype (default: as the checkpoint stores them).")
    flags.mark_flags_as_required(["hf_dir", "workdir"])
    cli.run(main)
