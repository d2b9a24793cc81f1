"""How every command line here starts and how it fails: absl flags, and a user's mistake in one line.

Each command (`python -m transformer.train | .evaluate | .predict | .generate | .convert | .inspect | .profile |
.report | .sweep | .probe | .bench | .bench.attention | .data.prepare | .data.tokenize`) is flags and `main`
over library calls, imported by nothing, and ends with `cli.run(main)`.
`--help` prints the module's docstring, whose first line says what the command does, and exits 0.
A mistake the user can fix (a bad config key or value, a missing file, data in the wrong
format) raises one of USER_ERRORS; `run` prints it as `error: ONE LINE` on stderr and exits
with code 2, before or after any work. Anything else is a bug and keeps its traceback.
Progress output and the user's cache are `transformer.console`'s, which the library imports (never this).
"""

import ctypes
import os
import re
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from absl import app, flags, logging

from transformer.console import USER_ERRORS

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
    except SystemExit as e:  # absl's --help, --helpfull, --helpxml print the usage and exit 1: nothing failed
        sys.exit(0 if e.code == 1 else e.code)
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


CONFIG_HELP = ("Config file and its arg (a preset, key=value pairs), e.g. configs/gpt.py:tiny. Override any key with "
               "--config.KEY=VALUE, e.g. --config.train.steps=200 --config.optim.lr=1e-3; list the keys with their "
               "values, defaults and meanings: python -m transformer.inspect --config configs/gpt.py:tiny --keys")


def define_config(help_text: str = CONFIG_HELP, required: bool = True):
    """The --config flag (an ml_collections config file with its arg; --config.KEY=VALUE overrides), shown
    in the command's --help."""
    from ml_collections import config_flags

    holder = config_flags.DEFINE_config_file("config", None, help_text, lock_config=True)
    _shown("config")
    if required:
        flags.mark_flag_as_required("config")
    return holder


def _shown(name: str) -> None:
    """Flag `name` listed in the command's --help as its own."""
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def define_step(help_text: str = "Checkpoint step (default: the latest).") -> None:
    """The --step flag of a command that reads a run's checkpoint."""
    flags.DEFINE_integer("step", None, help_text)
    _shown("step")


SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")  # inference.sampling.Sampling's fields


def define_sampling(max_new_tokens: int, temperature: float, tokens_help: str) -> None:
    """The flags of a command that samples text (`SAMPLING`)."""
    flags.DEFINE_integer("max_new_tokens", max_new_tokens, tokens_help)
    flags.DEFINE_float("temperature", temperature, "Softmax temperature; 0 = greedy.")
    flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = all).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the smallest set with this much mass.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    for name in SAMPLING:
        _shown(name)


def sampling_fields(f) -> dict:
    """The `SAMPLING` flags' values, for inference.sampling.Sampling (whose check names a flag out of range)."""
    return {name: getattr(f, name) for name in SAMPLING}


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
