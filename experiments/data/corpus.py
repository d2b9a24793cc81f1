"""The scale corpus: the standard library's .py files copied N times under different directory names.

  python experiments/data/corpus.py --copies 70 --out /tmp/stdlib_x70

Writes OUT/copy000/<stdlib relative path>, ... (real copies, not links, so reading them is real I/O);
an existing OUT with the same number of files is kept. Prints the corpus's size.
"""

import argparse
import os
import shutil
import sysconfig

from transformer.data.text import sources


def make(copies: int, out: str) -> tuple[int, int]:
    """(files, bytes) of the corpus at `out`, made if missing."""
    root = sysconfig.get_paths()["stdlib"]
    files = sources.stdlib_files()
    marker = os.path.join(out, f".complete-{copies}")
    if not os.path.isfile(marker):
        shutil.rmtree(out, ignore_errors=True)
        for k in range(copies):
            for path in files:
                target = os.path.join(out, f"copy{k:03d}", os.path.relpath(path, root))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(path, target)
        open(marker, "w").close()
    return copies * len(files), copies * sum(os.path.getsize(p) for p in files)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--out", default="/tmp/stdlib_x8")
    args = parser.parse_args()
    n, size = make(args.copies, args.out)
    print(f"{args.out}: {n:,} files, {size / 1e6:,.1f} MB")
