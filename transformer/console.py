"""How the library speaks to the person running it: progress of long work, the user's cache, and which
exceptions are a user's mistake. The library imports this, never `transformer.cli` (the commands' flags and
their one-line exit).

Long work shows its progress through `progress`: a tqdm bar on a terminal, whole lines where stderr is a
file (a SLURM job's log, nohup's), never carriage-return frames.
"""

import datetime
import os
import sys
import time

from tqdm import tqdm

# A mistake the user can fix (a bad config key or value, a missing file, data in the wrong format) raises one of
# these; a command prints it in one line (`transformer.cli.run`), and the library passes it on as it is.
USER_ERRORS = (ValueError, KeyError, OSError, ImportError)


def user_cache(*parts: str) -> str:
    """A path under the user's cache of this project, TRANSFORMER_CACHE (default ~/.cache/transformer): what
    later runs reuse (the bench's tokenized corpora, compiled programs)."""
    return os.path.join(os.path.expanduser(os.environ.get("TRANSFORMER_CACHE", "~/.cache/transformer")), *parts)


def progress(iterable=None, *, every: float = 30.0, **kwargs):
    """tqdm(iterable, **kwargs) where stderr is a terminal, else `Lines` (a line per `every` seconds at
    most; every=0: a line at each set_postfix, which the training loop calls once a log interval)."""
    if sys.stderr.isatty() or kwargs.get("disable"):
        return tqdm(iterable, **kwargs)
    return Lines(iterable, every=every, **kwargs)


class Lines:
    """tqdm's calls that the commands here make, written as whole lines: `desc: n/total (pct) elapsed,
    eta, postfix`."""

    def __init__(self, iterable=None, *, total=None, initial=0, desc="", every=30.0, unit="it", unit_scale=False,
                 unit_divisor=1000, **_):
        self.iterable, self.n, self.initial, self.desc, self.every = iterable, initial, initial, desc, every
        self.size = (lambda n: f"{tqdm.format_sizeof(n, divisor=unit_divisor)}{unit}") if unit_scale else str
        self.unit = unit
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.start = self.last = time.perf_counter()
        self.postfix, self.said = "", initial

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.every and time.perf_counter() - self.last >= self.every:
            self._line()

    def set_postfix(self, **values) -> None:
        self.set_postfix_str(", ".join(f"{k}={v}" for k, v in values.items()))

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text
        if not self.every or time.perf_counter() - self.last >= self.every:
            self._line()

    def set_description_str(self, text: str) -> None:
        self.desc = text
        self.set_postfix_str(self.postfix)

    @staticmethod
    def write(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.n != self.said:
            self._line()

    def _line(self) -> None:
        self.last, self.said = time.perf_counter(), self.n
        elapsed = self.last - self.start
        done = f"{self.size(self.n)}/{self.size(self.total)} ({self.n / self.total:.0%}), " if self.total else \
            f"{self.size(self.n)} {self.unit}, " if self.n else ""
        eta = ""
        if self.total and self.initial < self.n < self.total:
            left = elapsed / (self.n - self.initial) * (self.total - self.n)
            eta = f", eta {datetime.timedelta(seconds=round(left))}"
        postfix = f", {self.postfix}" if self.postfix else ""
        self.write(f"{self.desc}: {done}{datetime.timedelta(seconds=round(elapsed))}{eta}{postfix}")
