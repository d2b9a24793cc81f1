"""Learning-rate transfer across depth, with and without CompleteP: transfer.py's GPT at width 32 and depths
2, 8 and 16, its eval loss against lr, a curve per depth.

    python -m transformer.sweep --experiment experiments/mup/depth.py --workdir experiments/mup/depth --parallel 2
    python experiments/mup/depth.py experiments/mup/depth      # draws experiments/mup/depth.png

Each (parametrization, depth) of TRIALS at its lrs: the standard parametrization, and CompleteP
(model.parametrization=mup at its base width, model.mup_base_depth=BASE_DEPTH: each residual branch multiplied
by BASE_DEPTH / num_layers). At depth 2 CompleteP is muP at its base, where nothing is scaled.
"""

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transfer  # noqa: E402

BASE_DEPTH = 2
CONFIG = transfer.CONFIG
TRIALS = {  # (parametrization, num_layers) -> its lrs, each's middle first
    ("completep", 16): (4e-3, 8e-3, 2e-3, 1.6e-2),
    ("sp", 16): (2e-3, 4e-3, 1e-3, 8e-3),
    ("completep", 8): (4e-3, 8e-3, 2e-3, 1.6e-2),
    ("sp", 8): (2e-3, 4e-3, 1e-3, 8e-3),
    ("completep", 2): (4e-3, 8e-3, 2e-3, 1.6e-2),
    ("sp", 2): (4e-3, 8e-3, 2e-3, 1.6e-2),
}


def get_sweep():
    completep = {"model.parametrization": "mup", "model.mup_base_width": transfer.BASE,
                 "model.mup_base_depth": BASE_DEPTH}
    columns = [[(name, n, lr) for lr in lrs] for (name, n), lrs in TRIALS.items()]
    return [{**(completep if name == "completep" else {}), "model.d_model": transfer.BASE,
             "model.mlp_dim": 4 * transfer.BASE, "model.num_layers": n, "optim.lr": lr}
            for row in itertools.zip_longest(*columns) for name, n, lr in filter(None, row)]


if __name__ == "__main__":
    transfer.plot(sys.argv[1], os.path.join(os.path.dirname(os.path.abspath(__file__)), "depth.png"),
                  dial="model.num_layers",
                  titles=("standard parametrization", f"CompleteP (base depth {BASE_DEPTH}, width {transfer.BASE})"))
