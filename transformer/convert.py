"""Hugging Face checkpoints in and out: a model directory into a run directory, or a run back out.

  python -m transformer.convert --hf_dir path/to/gpt2 --workdir runs/gpt2 [--configs DIR] [--param_dtype D]
  python -m transformer.convert --workdir runs/bert-reviews --to_hf out/bert-reviews [--step N] [--param_dtype D]
  python -m transformer.convert --workdir runs/gpt-lora --merge_to runs/gpt-merged [--step N]
  python -m transformer.convert --workdir runs/gpt2-lora --to_hf out/gpt2 --adapter out/gpt2-adapter
  python -m transformer.convert --hf_dir out/gpt2 --adapter out/gpt2-adapter --workdir runs/gpt2-adapted

In (--hf_dir): the run directory holds config.json (the family's config file, from the configs/ beside the
installed package wherever the command runs, or --configs, with the imported model), an orbax checkpoint of
the weights at step 0, in their stored dtype (no optimizer state: an 8B model converts in the memory of its
weights), the tokenizer, a classifier's label names (its
id2label, as labels.json, unless they are transformers' LABEL_0, LABEL_1, ...) and an image classifier's
statistics and crop (its preprocessor_config.json, as config.data.mean, std and crop_fraction). It
generates, evaluates and fine-tunes like any run; the commands are printed, ready to run:

  generate:  python -m transformer.generate --workdir runs/gpt2 --prompt TEXT
  evaluate:  python -m transformer.evaluate --workdir runs/gpt2
  fine-tune: python -m transformer.train --config configs/gpt.py:gpt2-small --config.model.dropout=0.1 \\
      --config.data.tokenizer=hf --config.data.tokenizer_path=/home/me/runs/gpt2 --config.optim.lr=5e-05 \\
      --config.optim.warmup_steps=100 --config.init_from=runs/gpt2 --workdir NEW_RUN_DIR

Out (--to_hf): a run (trained here, fine-tuned, or converted) at its latest checkpoint (or --step) into a
directory that transformers' `from_pretrained` and `AutoTokenizer.from_pretrained` load, with its label
names and special-token ids (`transformer.interop.hf_export`, which says how each tokenizer is written).

LoRA (--adapter): out, a run's adapters as a PEFT adapter directory (adapter_config.json,
adapter_model.safetensors) beside its base written unmerged, for `peft.PeftModel.from_pretrained(base, DIR)`
(without --adapter a run's adapters are merged into the weights written); in, a PEFT adapter put onto the
converted model, a run with config.lora set (`transformer.interop.hf_peft`).

The library is `transformer.interop.hf_import` and `hf_export`; see `transformer.interop.hf` for the supported
classes; a model none expresses fails naming why.
"""

import jax

from transformer import cli
from transformer import config as config_lib
from transformer.interop import adapters, hf_export, hf_import

# An exported model's input files -> the transformers class that reads them.
INPUT_LOADERS = {"tokenizer_config.json": "AutoTokenizer", "preprocessor_config.json": "AutoImageProcessor"}


def main(argv):
    from absl import flags

    f = flags.FLAGS
    if f.merge_to:
        if f.hf_dir or f.to_hf or f.adapter:
            raise ValueError("--merge_to writes a run of --workdir with its LoRA adapters merged; give it alone")
        out = adapters.merge_run(f.workdir, f.merge_to, f.step)
        print(f"{out['adapters']} adapted kernels of {f.workdir} (step {out['step']}) merged: {out['params']:,} "
              f"params -> {f.merge_to}")
        return
    if (f.hf_dir is None) == (f.to_hf is None):
        raise ValueError("give --hf_dir DIR (a Hugging Face model into the run --workdir) or --to_hf DIR (the run "
                         "--workdir out to transformers), one of them")
    if f.to_hf:
        if f.configs:
            raise ValueError("--configs is for --hf_dir (the config an imported run starts from)")
        out = hf_export.export_run(f.workdir, f.to_hf, f.step, f.param_dtype, f.adapter or "")
        print(f"{out['class']} {out['params']:,} params, step {out['step']} of {f.workdir} -> {f.to_hf} "
              f"({', '.join(out['files'])}{'' if not f.adapter else f'; its LoRA adapters -> {f.adapter}'})")
        inputs = [f", transformers.{auto}.from_pretrained({f.to_hf!r})" for file, auto in INPUT_LOADERS.items()
                  if file in out["files"]]
        print(f"load:      transformers.{out['class']}.from_pretrained({f.to_hf!r})"
              f"{''.join(inputs) or '; no tokenizer in the run to export'}")
        if f.adapter:
            print(f"adapter:   peft.PeftModel.from_pretrained(that model, {f.adapter!r})")
        return
    if f.step is not None:
        raise ValueError("--step is for --to_hf (the checkpoint exported); --hf_dir writes step 0")
    configs = f.configs or config_lib.CONFIGS
    out = hf_import.convert(f.hf_dir, f.workdir, f.param_dtype, configs, f.adapter or "")
    n = sum(x.size for x in jax.tree.leaves(out["params"]))
    adapted = f", LoRA rank {out['config'].lora.rank} from {f.adapter}" if f.adapter else ""
    print(f"{out['config'].model.family} {n:,} params{adapted} -> {f.workdir} (config.json, checkpoints/0"
          f"{', tokenizer' if out['tokenizer'] else ''})")
    for line in hf_import.import_commands(out["config"], f.workdir, configs, out["tokenizer"]):
        print(line)


if __name__ == "__main__":
    from absl import flags

    flags.DEFINE_string("hf_dir", None, "In: a Hugging Face model directory (config.json, model.safetensors, "
                        "tokenizer files) to write into --workdir as a run.")
    flags.DEFINE_string("to_hf", None, "Out: the directory to write the run in --workdir into, for transformers' "
                        "from_pretrained (config.json, model.safetensors, tokenizer files).")
    flags.DEFINE_string("workdir", None, "The run directory: written with --hf_dir, read with --to_hf.")
    flags.DEFINE_string("configs", "", "In: the directory of the families' config files (gpt.py, ...), where the "
                        "run's config starts from (default: the configs/ beside the installed package).")
    flags.DEFINE_string("merge_to", None, "Out: a new run directory of --workdir's weights with its LoRA adapters "
                        "merged into them (config.lora.rank=0).")
    flags.DEFINE_string("adapter", None, "LoRA as a PEFT adapter directory: with --to_hf, where the run's adapters "
                        "are written (the base then unmerged); with --hf_dir, the adapter put onto the model.")
    cli.define_step("Out: the checkpoint to export or merge (default: the latest).")
    flags.DEFINE_enum("param_dtype", "", ["", "float32", "bfloat16", "float16"],
                      "The weights' dtype (default: in, as the checkpoint stores them; out, the run's "
                      "config.model.param_dtype).")
    flags.mark_flag_as_required("workdir")
    cli.run(main)
