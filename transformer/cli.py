"""How every command line here starts and how it fails: absl flags, and a user's mistake in one line.

Each CLI (`python -m transformer.train | .sweep | .report | .generate | .inspect | .bench |
.convert | .probe | .data.prepare | .data.tokenize`) defines its absl flags where it runs as a command
(`if __name__ == "__main__"`: the modules are libraries too) and ends with `cli.run(main)`.
A mistake the user can fix (a bad config key or value, a missing file, data in the wrong
format) raises one of USER_ERRORS; `run` prints it as `error: ONE LINE` on stderr and exits
with code 2, before or after any work. Anything else is a bug and keeps its traceback.
"""

import os
import sys
from typing import Callable, NoReturn

from absl import app, flags, logging

USER_ERRORS = (ValueError, KeyError, OSError, ImportError)
# Loading a config file runs its code: a wrong type or a misspelt attribute there is the user's too.
CONFIG_ERRORS = (AttributeError, TypeError, SyntaxError, *USER_ERRORS)


def one_line(e: BaseException) -> str:
    """The message of a user's mistake in one line (the last line of a multi-line one)."""
    if isinstance(e, AttributeError):  # ConfigDict's: the repr of "'key'\nDid you mean ...?"
        return "unknown key " + str(e).strip("'\"").replace("\\'", "'").replace("\\n", "; ")
    text = str(e.args[0]) if e.args else str(e)
    return ([line.strip() for line in text.splitlines() if line.strip()] or [type(e).__name__])[-1]


def fail(message) -> NoReturn:
    """Ends the process: `error: message` on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, then loading --config (config_flags defers that to its first use), so a
    bad file, key or value fails here in one line. Also quiets absl logging below ERROR (orbax
    writes several lines per checkpoint)."""
    logging.set_verbosity(logging.ERROR)
    try:
        rest = flags.FLAGS(argv)
        if "config" in flags.FLAGS and flags.FLAGS["config"].present:
            flags.FLAGS.config.keys()
    except flags.Error as e:
        fail(one_line(e))
    except CONFIG_ERRORS as e:
        fail(f"in --config: {one_line(e)}")
    return rest


def define_config(help_text: str = "Config file, e.g. configs/gpt.py:tiny.", required: bool = True):
    """The --config flag (an ml_collections config file with its arg; --config.KEY=VALUE overrides)."""
    from ml_collections import config_flags

    holder = config_flags.DEFINE_config_file("config", None, help_text, lock_config=True)
    if required:
        flags.mark_flag_as_required("config")
    return holder


def run(main: Callable[[list[str]], None], positional: int = 0) -> None:
    """Parses the flags and runs `main(argv)`; a user's mistake ends it in one line, exit code 2.

    `positional`: how many positional arguments the command takes (more is a usage error).
    """
    def guarded(argv: list[str]) -> None:
        if len(argv) - 1 > positional:
            fail(f"unexpected arguments: {' '.join(argv[1 + positional:])}")
        try:
            main(argv)
        except BrokenPipeError:  # the output's reader left (`| head`): nothing went wrong here
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except USER_ERRORS as e:
            fail(one_line(e))

    app.run(guarded, flags_parser=parse_flags)
