"""Print a config's parameter counts, FLOPs per token and training memory, allocating nothing.

The summary is transformer/models/summary.py's; the FLOPs formula is transformer/models/flops.py's. With
--keys, every key of the config with its value, default and meaning (transformer/config_keys.py). Shapes the config
leaves to the data (transformer/training/shapes.py) are read from it first, and said on stderr.

    python -m transformer.inspect --config configs/gpt.py:gpt3-175b
    python -m transformer.inspect --config configs/gpt.py:gpt2-small --config.model.num_layers=2
    python -m transformer.inspect --config configs/gpt.py:tiny --config.optim.lr=1e-3 --keys
    python -m transformer.inspect --workdir runs/gpt-tiny --keys     # a run's own config
    python -m transformer.inspect --config configs/gpt.py:tiny --topology v5e:2x2   # compiled for a TPU slice
    python -m transformer.inspect --config configs/gpt.py:tiny,mesh.data=2,mesh.fsdp=-1 --topology v5e:2x2 \\
        --num_slices 2                                                              # two slices joined by DCN

With --topology, the run's train step (and a causal LM's decode step) is compiled for that TPU slice by libtpu on
this machine (transformer/training/topology.py): memory per chip against its HBM, the largest batch that fits,
the compiled FLOPs and a roofline time.
"""

import sys

from absl import flags

from transformer import cli, config_keys, rundir
from transformer import config as config_lib
from transformer.models import summary
from transformer.training import checks, shapes, topology


def main(argv: list[str]) -> None:
    f = flags.FLAGS
    if f.config is None:
        raise ValueError("pass --config (e.g. configs/gpt.py:tiny) or --workdir of a run")
    if f.topology:
        launch = checks.checked(f.config)
        for line in launch.said:
            print(line, file=sys.stderr)
        report = topology.compile_run(launch.config, f.topology, launch.task, slices=f.num_slices)
        print("\n".join(topology.format_report(report)))
        return
    if not f.keys:
        config = shapes.resolved(f.config, say=lambda line: print(line, file=sys.stderr))
        print(summary.format_summary(summary.summarize(config)))
        return
    spec = f["config"].config_filename if f["config"].present else f"configs/{f.config.model.family}.py"
    path, _, arg = spec.partition(":")
    base = config_lib.load_with_base(path + ":" + ",".join(w for w in arg.split(",") if "=" not in w))[1] \
        if f["config"].present else config_lib.load_with_base(path)[1]
    print(config_keys.format_keys(f.config, base, path))


if __name__ == "__main__":
    cli.define_config(cli.CONFIG_HELP + ". Left out: the --workdir's own.", required=False)
    flags.DEFINE_string("workdir", None, "A run directory whose config to show (its config.json), instead of --config.")
    flags.DEFINE_string("topology", None, f"Compile the train step for this TPU slice (libtpu): {topology.EXAMPLES}.")
    flags.DEFINE_integer("num_slices", 1, "With --topology: this many such slices joined by DCN (the data-centre "
                         "network), the mesh's data axis across them (config.mesh.data a multiple of it).")
    flags.DEFINE_bool("keys", False, "List every key of the config: its value, its default and its meaning.")
    cli.run(main, resume=rundir.resumed_config)
