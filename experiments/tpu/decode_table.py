"""The engine's decode call compiled by libtpu for TPU slices, its attention on the paged kernel against XLA's.

    python experiments/tpu/decode_table.py --out experiments/tpu/decode.jsonl      # the committed table
    python experiments/tpu/decode_table.py --slices v6e:2x4 --slots 8             # one pair of cells
    python experiments/tpu/decode_table.py --table experiments/tpu/decode.jsonl    # RESULTS.md's table

Each cell is `topology.decode_step`, what `inspect --topology` compiles as its decode row: `decoding.decode_slots`
(8 steps a call, sampling included) over `--slots` slots of a cache of model.max_len positions, the slots split
over the chips (`parallel.cache_sharding`), the params in the training layout (fsdp over every chip; for
llama3-8b-tensor the tensor axis, the cache's heads too), bfloat16, scanned layers. Each is
compiled twice: as the engine runs it (attention over the cache on jax's paged kernel, `kernels/paged.py`), and
with the kernel refused (XLA's attention over the swapped cache, what a TPU ran before). The compiled program's
memory per chip is the compiler's; its cost analysis does not see inside a Mosaic kernel, so the bytes printed
are XLA's ops' alone. Needs `pip install -e '.[tpu]'`.
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from transformer import config as config_lib  # noqa: E402
from transformer import models, parallel, sharding  # noqa: E402
from transformer.layers.attention.kernels import paged  # noqa: E402
from transformer.training import checks, topology  # noqa: E402

RUNS = {  # name: (config, overrides)
    "llama3-8b": ("configs/gpt.py:llama3-8b", ["data.tokenizer=byte", "model.vocab_size=128256", "model.max_len=8192",
                                               "data.seq_len=8192"]),
    "llama3-8b-2k": ("configs/gpt.py:llama3-8b", ["data.tokenizer=byte", "model.vocab_size=128256",
                                                  "model.max_len=2048", "data.seq_len=2048"]),
    "llama3-8b-2k-unscanned": ("configs/gpt.py:llama3-8b", ["data.tokenizer=byte", "model.vocab_size=128256",
                                                            "model.max_len=2048", "data.seq_len=2048",
                                                            "model.scan_layers=False"]),
    "llama3-8b-tensor": ("configs/gpt.py:llama3-8b", ["data.tokenizer=byte", "model.vocab_size=128256",
                                                      "model.max_len=8192", "data.seq_len=8192", "mesh.fsdp=1",
                                                      "mesh.tensor=-1"]),  # heads over every chip
}
COMMON = ["model.dtype=bfloat16", "model.scan_layers=True", "model.attention=auto", "mesh.data=1", "mesh.fsdp=-1"]
SLICES = ("v5e:2x4", "v6e:2x4", "v5p:2x2x1")


def cell(name: str, slice_name: str, slots: int, kernel: bool) -> dict:
    jax.clear_caches()  # the decode call is traced again: with the kernel refused, or not
    spec, overrides = RUNS[name]
    path, _, arg = spec.partition(":")
    config = checks.checked(config_lib.load(os.path.join(REPO, path) + ":" + arg, [*COMMON, *overrides])).config
    devs = topology.devices(slice_name)
    mesh, rules = parallel.make_mesh(config.mesh, devs), sharding.rules_of(config.mesh)
    model = models.build(config.model.to_dict())
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    params = jax.tree.map(lambda x: getattr(x, "value", x), boxed["params"], is_leaf=lambda x: hasattr(x, "value"))
    shardings = sharding.logical_shardings(boxed, mesh, rules)["params"]
    refusal = paged.refusal
    if not kernel:
        paged.refusal = lambda *args: "refused for the comparison"
    start = time.perf_counter()
    try:
        p = topology.program(lambda b: topology.decode_step(model, params, shardings, mesh, rules, b), slots, True)
    finally:
        paged.refusal = refusal
    chip = topology.chip_of(devs)
    return dict(run=name, slice=slice_name, chip=chip.kind, chips=len(devs), slots=slots, cache=config.model.max_len,
                attention="paged kernel" if kernel else "XLA", in_hlo="jit(paged_attention)/pallas_call" in p.hlo,
                fits=p.fits, arguments_gib=(p.arguments or 0) / topology.GiB,
                temporaries_gib=(p.temporaries or 0) / topology.GiB, peak_gib=p.peak / topology.GiB,
                hbm_gib=chip.hbm_gib, xla_bytes=p.bytes_accessed, seconds=time.perf_counter() - start)


def format_table(rows: list[dict]) -> str:
    head = ("| preset | slice | slots x cache | attention | kernel in the program | arguments GiB a chip | "
            "temporaries GiB a chip | peak GiB a chip (of) | XLA's ops' bytes a call | compile s |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        xla = "-" if r["xla_bytes"] is None else f"{r['xla_bytes'] / 1e9:,.2f} GB"
        lines.append(f"| {r['run']} | {r['slice']} | {r['slots']} x {r['cache']} | {r['attention']} | "
                     f"{'yes' if r['in_hlo'] else 'no'} | {r['arguments_gib']:.2f} | {r['temporaries_gib']:.2f} | "
                     f"{r['peak_gib']:.2f} ({r['hbm_gib']:g}) | {xla} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default="llama3-8b,llama3-8b-2k")
    parser.add_argument("--slices", default=",".join(SLICES))
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--out", default="", help="append each cell's JSON line here")
    parser.add_argument("--table", default="", help="print the table of a results file and stop")
    a = parser.parse_args()
    if a.table:
        print(format_table([json.loads(line) for line in open(a.table)]))
        return
    rows = []
    for name in a.runs.split(","):
        for slice_name in a.slices.split(","):
            for kernel in (True, False):
                rows.append(cell(name, slice_name, a.slots, kernel))
                print(json.dumps(rows[-1]), flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    print(format_table(rows))


if __name__ == "__main__":
    main()
