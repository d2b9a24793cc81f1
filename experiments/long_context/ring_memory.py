"""Ring attention on 8 (fake CPU) devices: compiled memory per device of GPT tiny's train step against L.

  python experiments/long_context/ring_memory.py [--context 8] [--lengths 65536,...] [--budget_gib 20]

`configs/gpt.py:tiny-long` at batch 1 with `model.attention=ring` on a mesh of
`--context` devices on the context axis (data=1): each device holds L / context tokens of
every activation and passes key/value blocks around the ring. Each length builds the run's
own jitted step (`loop.setup` through `transformer.bench.measure.Ours`) and compiles it; XLA's
`memory_analysis()` of the SPMD program is one device's (arguments + outputs + temporaries
- aliased). Compile only: fake devices share this machine's 2 cores and say nothing of speed.
The sweep doubles L until a device's total passes `--budget_gib` or `--extend_to`. Results go
to ring_memory.json and a markdown table is printed.
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
GIB = 2**30


def compiled_memory(length: int, context: int) -> dict:
    from transformer import config as config_lib
    from transformer.bench.measure import Ours
    overrides = [f"data.seq_len={length}", f"model.max_len={length}", "data.eval_batches=1",
                 f"data.eval_fraction={0.02 if length <= 2**18 else 0.1}", "model.attention=ring",
                 "mesh.data=1", f"mesh.context={context}"]
    config = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-long"), overrides)
    with tempfile.TemporaryDirectory() as workdir:
        ours = Ours.build(config, workdir)
        m = ours.compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        return {"L": length, "context": context, "per_device_tokens": length // context,
                "compile_s": round(ours.compile_s, 1), "temp_bytes": m.temp_size_in_bytes, "total_bytes": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--lengths", default="65536,131072,262144,524288")
    parser.add_argument("--extend_to", type=int, default=2**22)
    parser.add_argument("--budget_gib", type=float, default=20.0)
    parser.add_argument("--out", default=os.path.join(HERE, "ring_memory.json"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.context}"
    import jax
    rows, length = [], None
    lengths = [int(x) for x in args.lengths.split(",")]
    while lengths:
        length = lengths.pop(0)
        row = compiled_memory(length, args.context)
        rows.append(row)
        print(f"L {length:>9,}  per device {row['per_device_tokens']:>8,} tokens"
              f"  temp {row['temp_bytes'] / GIB:7.2f} GiB  total {row['total_bytes'] / GIB:7.2f} GiB"
              f"  (compile {row['compile_s']} s)", flush=True)
        if not lengths and row["total_bytes"] <= args.budget_gib * GIB and 2 * length <= args.extend_to:
            lengths.append(2 * length)
    fits = [r["L"] for r in rows if r["total_bytes"] <= args.budget_gib * GIB]
    result = {"jax": jax.__version__, "devices": f"{args.context} fake CPU devices", "budget_gib": args.budget_gib,
              "longest_L_in_budget": max(fits) if fits else None, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n| L | tokens per device | temp GiB | total GiB per device |\n| ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['L']:,} | {r['per_device_tokens']:,} | {r['temp_bytes'] / GIB:.2f} "
              f"| {r['total_bytes'] / GIB:.2f} |")
    print(f"\nlongest L within {args.budget_gib:g} GiB per device: {result['longest_L_in_budget']:,}")


if __name__ == "__main__":
    main()
