"""How every command line here starts and how it fails: absl flags, and a user's mistake in one line.

Each command (`python -m transformer.train | .evaluate | .predict | .generate | .convert | .inspect | .profile |
.report | .sweep | .probe | .bench | .bench.attention | .data.prepare | .data.tokenize`) is flags and `main`
over library calls, imported by nothing, and ends with `cli.run(main)`.
A mistake the user can fix (a bad config key or value, a missing file, data in the wrong
format) raises one of USER_ERRORS; `run` prints it as `error: ONE LINE` on stderr and exits
with code 2, before or after any work. Anything else is a bug and keeps its traceback.
Long work shows its progress through `progress`: a tqdm bar on a terminal, whole lines where
stderr is a file (a SLURM job's log, nohup's), never carriage-return frames.
"""

import ctypes
import datetime
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from absl import app, flags, logging
from tqdm import tqdm

USER_ERRORS = (ValueError, KeyError, OSError, ImportError)
# Loading a config file runs its code: a wrong type or a misspelt attribute there is the user's too.
CONFIG_ERRORS = (AttributeError, TypeError, SyntaxError, *USER_ERRORS)


def one_line(e: BaseException) -> str:
    """The message of a user's mistake in one line (the last line of a multi-line one)."""
    if isinstance(e, AttributeError):  # ConfigDict's: the repr of "'key'\nDid you mean ...?"
        return "unknown key " + str(e).strip("'\"").replace("\\'", "'").replace("\\n", "; ")
    if isinstance(e, OSError) and e.strerror:  # args (errno, strerror): name the path, not the number
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        return f"{e.strerror}: {paths}" if paths else f"{e.strerror} ({type(e).__name__})"
    text = str(e.args[0]) if e.args and isinstance(e.args[0], str) and not isinstance(e, UnicodeError) else str(e)
    return ([line.strip() for line in text.splitlines() if line.strip()] or [type(e).__name__])[-1]


def fail(message) -> NoReturn:
    """Ends the process: `error: message` on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str], resume: Callable[[str, dict[str, str]], object] | None = None) -> list[str]:
    """absl's flag parsing, then loading --config (config_flags defers that to its first use), so a
    bad file, key or value fails here in one line. Where a command passes `resume` (train and inspect:
    `rundir.resumed_config`) and is given --workdir and no --config, `resume(workdir, overrides)` is the config,
    the overrides being its --config.KEY=VALUE flags; evaluate's --config.KEY=VALUE flags are its overrides alone.
    Also quiets absl logging below ERROR (orbax writes several lines per checkpoint)."""
    from ml_collections.config_flags.config_flags import ConfigFileFlagParser

    logging.set_verbosity(logging.ERROR)
    has_config = "config" in flags.FLAGS and isinstance(flags.FLAGS["config"].parser, ConfigFileFlagParser)
    given = has_config and any(re.match(r"-{1,2}config(=|$)", arg) for arg in argv[1:])
    argv, loose = (argv, {}) if given or not has_config else split_overrides(argv)
    try:
        rest = flags.FLAGS(argv)
        if given:
            flags.FLAGS.config.keys()
    except flags.Error as e:
        fail(one_line(e))
    except BrokenPipeError:  # --help's reader left (`| head`)
        reader_left()
    except CONFIG_ERRORS as e:
        fail(f"in --config: {one_line(misspelt(argv) or e)}")
    if resume is not None and has_config and not given and flags.FLAGS.workdir:
        try:
            flags.FLAGS["config"].value = resume(flags.FLAGS.workdir, loose)
        except USER_ERRORS as e:
            fail(one_line(e))
    return rest


def reader_left() -> NoReturn:
    """Ends the process quietly where the output's reader left (`| head`): nothing went wrong here."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv without its --config.KEY=VALUE (or --config.KEY VALUE) flags, and those as {KEY: VALUE}."""
    kept, overrides, args = [], {}, iter(argv)
    for arg in args:
        match = re.match(r"-{1,2}config\.([^=]+)(?:=(.*))?$", arg, re.DOTALL)
        if match is None:
            kept.append(arg)
        else:
            overrides[match[1]] = match[2] if match[2] is not None else next(args, "")
    return kept, overrides


def misspelt(argv: list[str]) -> KeyError | None:
    """The error naming the nearest key for the first --config.KEY override that the --config file lacks."""
    from transformer import config as config_lib

    given = [(arg, after) for arg, after in zip(argv, [*argv[1:], ""]) if re.match(r"-{1,2}config(=|$)", arg)]
    try:
        config = config_lib.load(given[-1][0].partition("=")[2] or given[-1][1])
    except (*CONFIG_ERRORS, IndexError):
        return None
    known = config_lib.leaves(config)
    return next((config_lib.unknown_key(key, config) for key in split_overrides(argv)[1]
                 if key not in known and not any(k.startswith(key + ".") for k in known)), None)


def user_cache(*parts: str) -> str:
    """A path under the user's cache of this project, TRANSFORMER_CACHE (default ~/.cache/transformer): what
    later runs reuse (the bench's tokenized corpora, compiled programs)."""
    return os.path.join(os.path.expanduser(os.environ.get("TRANSFORMER_CACHE", "~/.cache/transformer")), *parts)


CONFIG_HELP = ("Config file and its arg (a preset, key=value pairs), e.g. configs/gpt.py:tiny. Override any key with "
               "--config.KEY=VALUE, e.g. --config.train.steps=200 --config.optim.lr=1e-3; list the keys with their "
               "values, defaults and meanings: python -m transformer.inspect --config configs/gpt.py:tiny --keys")


def define_config(help_text: str = CONFIG_HELP, required: bool = True):
    """The --config flag (an ml_collections config file with its arg; --config.KEY=VALUE overrides), shown
    in the command's --help."""
    from ml_collections import config_flags

    holder = config_flags.DEFINE_config_file("config", None, help_text, lock_config=True)
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS["config"])
    if required:
        flags.mark_flag_as_required("config")
    return holder


PARENT = "TRANSFORMER_PARENT_PID"


def follow_parent() -> None:
    """A command started with TRANSFORMER_PARENT_PID (a sweep's trial) gets SIGTERM when that parent dies
    (Linux), so it saves and exits. Asked for here, after exec: between fork and exec the parent's JAX
    threads make a Python callback unsafe."""
    parent = os.environ.pop(PARENT, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # it died before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


def run(main: Callable[[list[str]], None], positional: int = 0,
        resume: Callable[[str, dict[str, str]], object] | None = None) -> None:
    """Parses the flags and runs `main(argv)`; a user's mistake ends it in one line, exit code 2.

    `positional`: how many positional arguments the command takes (more is a usage error).
    `resume`: where given, the config of a --workdir run when --config is left out (`parse_flags`).
    """
    def guarded(argv: list[str]) -> None:
        if len(argv) - 1 > positional:
            fail(f"unexpected arguments: {' '.join(argv[1 + positional:])}")
        try:
            main(argv)
        except BrokenPipeError:
            reader_left()
        except USER_ERRORS as e:
            fail(one_line(e))

    follow_parent()
    app.run(guarded, flags_parser=lambda argv: parse_flags(argv, resume))


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
