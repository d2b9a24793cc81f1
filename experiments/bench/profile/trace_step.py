"""Where a train step's wall time goes on XLA:CPU: the project's step under `jax.profiler`, its thunks
by kind and by the model's part, and every dot with its shape, layout and GFLOP/s (joined with the
compiled HLO).

    PYTHONPATH=. python experiments/bench/profile/trace_step.py CONFIG [--steps 3] [--dots 30] [--others 30]

CONFIG is a `--config` spec (configs/gpt.py:tiny,model.dtype=bfloat16,...). Each step is traced on its
own and the step with the median busy time is reported. Times are wall-clock shares: each instant of the
step is divided equally among the thunks running then (XLA:CPU runs independent thunks side by side,
one thread each, and splits a large dot over its pool), so the columns add up to the step's busy time
and a dot's GFLOP/s is what it achieved in the step. (This script summed the thunks' durations over
threads and steps before; that showed the bf16 forward's dots at 124-250 GFLOP/s at issue 21's shape 1,
where the same dots alone run at 850-980 and wall shares give 740-900.) Layout: `lc`/`rc` are the
contracting dims of the lhs/rhs (lc=[0]: a transposed-lhs dot, which XLA:CPU's fast kernels do not
take), `b` the batch dims. Last, the step by the parts `peer_step.py` sums the `--vs torch` peer's
operators into (matmuls, attention core, loss, elementwise passes, optimizer), to set beside it.
"""

import argparse
import bisect
import collections
import glob
import re
import tempfile

import jax
import numpy as np

from transformer import hostmem


def wall_shares(trace_dir: str, names: set) -> collections.Counter:
    """Thunk name -> ms of the traced step's wall time, each instant shared among the thunks then running."""
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    spans = [(e.start_ns, e.start_ns + e.duration_ns, e.name) for plane in data.planes for line in plane.lines
             if line.name != "python" for e in line.events if e.name in names]
    bounds = sorted({t for start, end, _ in spans for t in (start, end)})
    running = collections.defaultdict(list)  # segment index -> the thunks running in it
    for start, end, name in spans:
        for i in range(bisect.bisect_left(bounds, start), bisect.bisect_left(bounds, end)):
            running[i].append(name)
    shares = collections.Counter()
    for i, thunks in running.items():
        for name in thunks:
            shares[name] += (bounds[i + 1] - bounds[i]) / 1e6 / len(thunks)
    return shares


def computations(hlo: str) -> dict:
    """Computation name (without its %) -> its body's text, for the fusions' `calls=`."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^%([\w.-]+) \(.*?\{\n(.*?)\n\}", hlo, re.S | re.M)}


def dots(hlo: str) -> dict:
    """Top-level dot or dot fusion name -> (FLOPs, 'lhs x rhs lc rc b', the op's source path)."""
    bodies = computations(hlo)
    shape = lambda text, var: [int(d) for d in re.search(re.escape(var) + r" = \w+\[([\d,]*)\]",
                                                         text).group(1).split(",") if d]
    found = {}
    for m in re.finditer(r"^\s+%((?:ynn_|onednn_)?fusion[.\d]*|dot[.\d]*) = (.*)$", hlo, re.M):
        name, rest = m.groups()
        calls = re.search(r"calls=%([\w.-]+)", rest)
        body = bodies.get(calls.group(1), "") if calls else m.group(0)
        d = re.search(r"(%[\w.]+) = \w+\[([\d,]*)\]\S* dot\((%[\w.]+), (%[\w.]+)\), (.*)", body)
        if not d:
            continue
        find = lambda var, body=body: shape(body, var) if re.search(re.escape(var) + r" = ", body) else shape(hlo, var)
        lhs, rhs, attrs = find(d.group(3)), find(d.group(4)), d.group(5)
        dims = {k: re.search(k + r"=\{([\d,]*)\}", attrs) for k in ("lhs_contracting_dims", "rhs_contracting_dims",
                                                                     "lhs_batch_dims")}
        lc, rc, b = ([int(x) for x in v.group(1).split(",") if x] if v else [] for v in dims.values())
        out = [int(x) for x in d.group(2).split(",") if x]
        op = re.search(r'op_name="([^"]*)"', rest)
        found[name] = (2 * np.prod(out) * np.prod([lhs[i] for i in lc]), f"{lhs}x{rhs} lc{lc} rc{rc} b{b}",
                       re.sub(r"block_\d+", "block_N", op.group(1)) if op else "")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=3, help="steps traced, one trace each")
    parser.add_argument("--kinds", type=int, default=20, help="thunk kinds to list")
    parser.add_argument("--dots", type=int, default=30, help="dot groups to list")
    parser.add_argument("--others", type=int, default=0, help="other thunks to list (grouped by source op)")
    args = parser.parse_args()
    hostmem.tune_malloc()  # as the commands run (transformer/hostmem.py)
    from transformer import config as config_lib
    from transformer.bench.measure import Ours
    path, *overrides = args.config.split(",")
    ours = Ours.build(config_lib.load(path, overrides), tempfile.mkdtemp())
    ours.steps(2)
    hlo = ours.compiled.as_text()
    ops = hlo_ops(hlo)
    traced = []
    for _ in range(args.steps):
        trace_dir = tempfile.mkdtemp()
        with jax.profiler.trace(trace_dir):
            step_ms = 1e3 * ours.steps(1)[0]
        traced.append((step_ms, wall_shares(trace_dir, set(ops))))
    step_ms, times = sorted(traced, key=lambda st: sum(st[1].values()))[len(traced) // 2]
    print(f"step {step_ms:.1f} ms (traced; steps {', '.join(f'{ms:.0f}' for ms, _ in traced)}); thunks busy "
          f"{sum(times.values()):.1f} ms of it (the step with the median busy time)")
    kinds = collections.Counter()
    for name, ms in times.items():
        kinds[re.sub(r"\.\d+$", "", name)] += ms
    print("\nwall ms by thunk kind:")
    for kind, ms in kinds.most_common(args.kinds):
        print(f"  {ms:8.1f}  {kind}")
    found = dots(hlo)
    print("\nwall ms by part (dots apart):")
    for part, ms in parts(ops, times, set(found)).most_common():
        print(f"  {ms:8.1f}  {part}")
    print("\nwall ms by the parts peer_step.py sums the peer's operators into:")
    for part, ms in peer_parts(ops, times, set(found)).most_common():
        print(f"  {ms:8.1f}  {part}")
    groups = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for name, (flops, layout, op) in found.items():
        g = groups[(op[-80:], layout)]
        g[0], g[1], g[2] = g[0] + times.get(name, 0.0), g[1] + flops / 1e9, g[2] + 1
    total_ms, total_gf = sum(g[0] for g in groups.values()), sum(g[1] for g in groups.values())
    print(f"\ndots: {total_ms:.1f} ms, {total_gf:.1f} GFLOP per step ({total_gf / total_ms * 1e3:.0f} GFLOP/s)")
    print("    wall ms    GFLOP  GFLOP/s  count  op | lhs x rhs, layout")
    for (op, layout), (ms, gf, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.dots]:
        print(f"  {ms:9.1f} {gf:8.2f} {gf / ms * 1e3 if ms else 0:8.0f}  x{n:<4}  {op} | {layout}")
    if args.others:
        others(ops, times, set(found), args.others)


def hlo_ops(hlo: str) -> dict:
    """Instruction name -> (result shape without layout, its source op's name or ""). A fusion that
    carries no op name of its own (a slice fused into a convert, say) takes the first one in its body."""
    bodies = computations(hlo)
    ops = {}
    for m in re.finditer(r"^\s+%([\w.-]+) = (\S+) (.*)$", hlo, re.M):
        calls = re.search(r"calls=%([\w.-]+)", m.group(3))
        op = re.search(r'op_name="([^"]*)"', m.group(3))
        op = op or (calls and re.search(r'op_name="([^"]*)"', bodies.get(calls.group(1), "")))
        ops[m.group(1)] = (re.sub(r"\{.*", "", m.group(2)), op.group(1) if op else "")
    return ops


def parts(ops: dict, times: dict, dot_names: set) -> collections.Counter:
    """Wall ms by (dot or not, forward or backward, the layer's part: the block's sublayer, or the op's
    name outside the blocks; the optimizer and what names no source op are `update/other`)."""
    found = collections.Counter()
    for name, ms in times.items():
        op = ops[name][1]
        if "jvp(" not in op:
            part = "update/other"
        elif "_residual/" in op:
            part = re.sub(r".*_residual/", "", op).split("/")[0]
        else:
            part = op.split("/")[-1]
        found[f"{'dot ' if name in dot_names else ''}{'backward' if 'transpose(' in op else 'forward'} {part}"] += ms
    return found


def peer_parts(ops: dict, times: dict, dot_names: set) -> collections.Counter:
    """Wall ms by the parts `peer_step.py` gives the peer's step: the matmuls (every dot but the attention
    core's), the attention core (its dots, softmax and layout moves: what ATen's flash kernel does there),
    the loss over the logits (outside the blocks: neither the final norm nor the embedding), the optimizer
    with the clipping and the logged norms, and the fused elementwise passes (norms, GELU, residuals, casts)."""
    found = collections.Counter()
    for name, ms in times.items():
        op = ops[name][1]
        if "jvp(" not in op:
            part = "optimizer, clipping, the logged norms"
        elif "/self_attn/" in op and not re.search(r"/self_attn/(self_attn\._|out/)", op):
            part = "attention core"
        elif name in dot_names:
            part = "matmuls"
        elif not re.search(r"block_\d+/|final_norm/|embed/|pos_embed/", op):
            part = "loss over the logits"
        else:
            part = "fused elementwise passes"
        found[part] += ms
    return found


def others(ops: dict, times: dict, dot_names: set, n: int) -> None:
    """The non-dot thunks grouped by (kind, result shape, source op), most wall ms first."""
    groups = collections.defaultdict(lambda: [0.0, 0])
    for name, ms in times.items():
        if name in dot_names:
            continue
        result, op = ops[name]
        key = (re.sub(r"\.\d+$", "", name), result, re.sub(r"block_\d+", "block_N", op)[-70:])
        groups[key][0] += ms
        groups[key][1] += 1
    print("\nother thunks: wall ms, count, kind, result, op")
    for (kind, result, op), (ms, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:n]:
        print(f"  {ms:8.1f}  x{count:<3} {kind} {result} {op}")


if __name__ == "__main__":
    main()
