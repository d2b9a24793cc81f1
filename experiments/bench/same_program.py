"""Is the compiled training step of a config the same program at two commits?

  python experiments/bench/same_program.py --base 2689d69 --configs configs/gpt.py:tiny configs/gpt.py:gpt2-small

For each config, the train step that `transformer.train` runs (`loop.setup` on one device)
is compiled at the base commit (a git worktree) and in the working tree, and XLA's optimised
HLO text is compared after dropping what names the source (metadata, file and function
tables, stack frame ids) and the module line. The same program runs at the same speed: a
stronger answer than timing on a shared machine. The lines that differ are printed.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from interleave import worktree  # noqa: E402

DUMP = """
import os, sys
import jax
from transformer import config as config_lib
from transformer.training import loop
config = config_lib.load(sys.argv[1], [])
try:  # a tree whose loop.setup takes the command's checked config
    from transformer.training import checks
    config = checks.checked(config)
except ImportError:
    pass
run = loop.setup(config, sys.argv[2], jax.devices()[:1])
batch = run.place(run.task.train_batch(0))
sys.stdout.write(run.train_step.lower(run.state, batch, run.step_rng).compile().as_text())
run.ckpt.close()
run.writer.close()
"""
SOURCE_TABLES = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$|^\d+ (\"|\{)")


def program(tree: str, config: str) -> list[str]:
    """The compiled train step's HLO at `tree`, without the source's names."""
    with tempfile.TemporaryDirectory() as workdir:
        out = subprocess.run([sys.executable, "-c", DUMP, os.path.join(tree, config), workdir], cwd=tree,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree}, check=True)
    lines = out.stdout.splitlines()[1:]
    lines = [re.sub(r", metadata=\{[^}]*\}|stack_frame_id=\d+", "", line) for line in lines
             if not SOURCE_TABLES.match(line)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--configs", nargs="+", default=["configs/gpt.py:tiny"])
    args = parser.parse_args()
    with worktree(args.base) as base:
        for config in args.configs:
            old, new = program(base, config), program(REPO, config)
            changed = [d for d in difflib.unified_diff(old, new, lineterm="", n=0)
                       if d[:1] in "+-" and not d.startswith(("+++", "---"))]
            print(f"{config}: {len(new):,} HLO lines; {len(changed) // 2:,} differ from {args.base}", flush=True)
            for line in changed[:12]:
                print("   ", line[:220])


if __name__ == "__main__":
    main()
