"""Parameter counts, FLOPs per token and training memory of a config, allocating nothing
(transformer/models/summary.py; the FLOPs formula is transformer/models/flops.py's).

    python -m transformer.inspect --config configs/gpt.py:gpt3-175b
    python -m transformer.inspect --config configs/gpt.py:gpt2-small --config.model.num_layers=2
"""

from absl import flags

from transformer import cli
from transformer.models import summary


def main(argv: list[str]) -> None:
    print(summary.format_summary(summary.summarize(flags.FLAGS.config)))


if __name__ == "__main__":
    cli.define_config("Config file, e.g. configs/gpt.py:gpt3-175b.")
    cli.run(main)
