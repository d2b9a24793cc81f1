"""Evaluate a run's checkpoint without training it (every family), on its own eval set or another one.

  python -m transformer.evaluate --workdir runs/bert-reviews [--step 200] \
      [--config.data.eval_path=test.tsv] [--config.data.batch_size=16 --config.mesh.data=1 ...]

Prints the eval metrics and appends them, with the step and the overrides, as one JSON line to
WORKDIR/evals.jsonl (metrics.jsonl stays the training's record). `--config.data.KEY=VALUE` names another
eval source (a GPT's data.source store or text, a classifier's data.eval_path, a ViT's data.source folder,
an encoder-decoder's data.eval_path); config.mesh, config.train and config.model's HOW_IT_COMPUTES keys
(attention, dtype, ...) may change too. A converted run (`transformer.convert`, weights only) evaluates
alike. The library call is `transformer.training.evaluation.evaluate_run`.

With --tasks, a language-model run (gpt, encdec) is scored on lm-evaluation-harness tasks instead (the
extra `eval`; `transformer.training.harness_tasks.evaluate_tasks`): the harness's table is printed and its
metrics appended to evals.jsonl as eval/harness/TASK/METRIC. Local tasks (a YAML file and JSON-lines
data) live in the folder given to --include_path:

  HF_DATASETS_OFFLINE=1 python -m transformer.evaluate --workdir runs/gpt-tiny --tasks TASK[,TASK] \
      [--num_fewshot 4] [--limit 100] [--include_path experiments/few_shot/tasks] [--batch_size 8] \
      [--apply_chat_template]     # a chat run (the sft task): prompts in its chat template
"""

from absl import flags

from transformer import cli, parallel
from transformer.training import evaluation, harness_tasks


def main(argv):
    f = flags.FLAGS
    parallel.initialize(f.coordinator, f.num_processes, f.process_id, f.distributed)
    if f.tasks:
        harness_main(f)
        return
    step, metrics = evaluation.evaluate_run(f.workdir, f.step, evaluation.flat_overrides(f.config.to_dict()))
    print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))


def harness_main(f):
    try:
        from lm_eval.utils import make_table
    except ImportError as e:
        raise ValueError(f"--tasks needs lm-evaluation-harness ({e}): pip install -e '.[eval]'") from None

    names = [name.strip() for name in f.tasks.split(",") if name.strip()]
    step, results = harness_tasks.evaluate_tasks(f.workdir, names, f.num_fewshot, harness_tasks.as_limit(f.limit),
                                                 f.include_path, f.step, evaluation.flat_overrides(f.config.to_dict()),
                                                 f.batch_size, apply_chat_template=f.apply_chat_template)
    if results is not None:
        print(f"step {step}:")
        print(make_table(results))
        if "groups" in results:
            print(make_table(results, "groups"))


if __name__ == "__main__":
    try:
        evaluation.define_overrides()
    except KeyError as e:
        cli.fail(f"--config: {cli.one_line(e)} (evaluate takes --config.{{data,mesh,train,model}}.KEY=VALUE)")
    flags.DEFINE_string("workdir", None, "Run directory (config.json, checkpoints).")
    cli.define_step()
    flags.DEFINE_string("tasks", None, "Comma-separated lm-evaluation-harness tasks to score a language model on.")
    flags.DEFINE_integer("num_fewshot", None, "--tasks: examples in each prompt (default: each task's own).")
    flags.DEFINE_float("limit", None, "--tasks: at most this many documents per task (< 1: a fraction).")
    flags.DEFINE_string("include_path", None, "--tasks: a folder of local task YAML files (and their data).")
    flags.DEFINE_integer("batch_size", 8, "--tasks: rows of each scoring program.")
    flags.DEFINE_bool("apply_chat_template", False, "--tasks: prompts in the run's chat template (a chat run).")
    flags.mark_flag_as_required("workdir")
    parallel.define_flags()
    cli.run(main)
