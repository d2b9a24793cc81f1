"""Training tasks: what a model is trained on (batches), how (loss) and how it is judged (eval).

A config names its task in `config.task`; each task lives in its own file here and
provides `build(config, workdir) -> Task`. A Task has:

  init_inputs()                      positional inputs for `model.init` (batch of 1)
  train_batch(step) -> dict          this process's rows of step's batch (numpy), a pure
                                     function of (seed, step)
  eval_batches() -> list[dict]       fixed eval batches (numpy, this process's rows)
  loss(model, params, batch, rng)    (scalar loss, metrics dict): traced inside the jitted step
  loss_weights(batch)                optional: {metric name: how many items it averages over} for
                                     the terms whose sum is the loss (default: {'loss': rows}), so
                                     that accumulated microbatches give the whole batch's loss
  eval_outputs(model, params, batch) dict of arrays: traced inside the jitted eval step
  eval_metrics(outputs) -> dict      host side: 'eval/...' metrics from every batch's outputs
  report(model, params, step)        host side: optional text printed after an eval (a sample)
  items_per_step, item_name          for the throughput metric (e.g. tokens)
"""

import importlib

TASKS = ("lm", "mlm", "sequence_classification", "token_classification", "image_classification",
         "seq2seq")


def build(config, workdir: str):
    if config.task not in TASKS:
        raise ValueError(f"config.task={config.task!r}: choose one of {', '.join(TASKS)}")
    return importlib.import_module(f"transformer.training.tasks.{config.task}").build(config, workdir)
