"""Evaluate a run's checkpoint without training it (every family), on its own eval set or another one.

  python -m transformer.evaluate --workdir runs/bert-reviews [--step 200] \
      [--config.data.eval_path=test.tsv] [--config.data.batch_size=16 --config.mesh.data=1 ...]

Prints the eval metrics and appends them, with the step and the overrides, as one JSON line to
WORKDIR/evals.jsonl (metrics.jsonl stays the training's record). `--config.data.KEY=VALUE` names another
eval source (a GPT's data.source store or text, a classifier's data.eval_path, a ViT's data.source folder,
an encoder-decoder's data.eval_path); config.mesh, config.train and config.model's HOW_IT_COMPUTES keys
(attention, dtype, ...) may change too. A converted run (`transformer.convert`, weights only) evaluates
alike. The library call is `transformer.training.evaluation.evaluate_run`.
"""

from absl import flags

from transformer import cli, parallel
from transformer.training import evaluation


def main(argv):
    f = flags.FLAGS
    parallel.initialize(f.coordinator, f.num_processes, f.process_id, f.distributed)
    step, metrics = evaluation.evaluate_run(f.workdir, f.step, evaluation.flat_overrides(f.config.to_dict()))
    print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))


if __name__ == "__main__":
    try:
        evaluation.define_overrides()
    except KeyError as e:
        cli.fail(f"--config: {cli.one_line(e)} (evaluate takes --config.{{data,mesh,train,model}}.KEY=VALUE)")
    flags.DEFINE_string("workdir", None, "Run directory (config.json, checkpoints).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.mark_flag_as_required("workdir")
    parallel.define_flags()
    cli.run(main)
