"""Every key of a config a user can set: its value, its default and its one-line meaning.

    python -m transformer.inspect --config configs/gpt.py:tiny --config.optim.lr=1e-3 --keys

A key's meaning has one source: the `# comment` on the line that declares it, read with `tokenize`.
config.model's keys are the fields of the family's module (transformer/models/NAME.py, and the shared
ones in models/common.py); the other sections' are the keyword arguments that build them, in the
config file (configs/NAME.py) or in transformer/config.py (optim_config, train_config, mesh_config,
finish). A key's default is its family's base: the module field's default for config.model (but a
shape the config file leaves to the data: its 0), and for the rest the value the config file sets
before its preset's training settings and any override.
"""

import ast
import functools
import inspect
import io
import pathlib
import tokenize

from transformer import config as config_lib
from transformer import models
from transformer.models import common
from transformer.training import shapes

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
# Keys that no line declares: the family is the name of a transformer/models/ file.
UNDECLARED = {"model.family": "the model family, a file of transformer/models/: gpt | bert | vit | encdec"}
WIDTH = 28  # the most characters of a value shown


@functools.cache
def declared(path: str) -> dict[tuple[str | None, str], str]:
    """(class or None, name) -> the comment on the line that declares `name` in the file at `path`: a
    field of a class, or a keyword argument or an attribute assignment anywhere (the first one wins)."""
    source = pathlib.Path(path).read_text()
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for field in node.body:
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and field.lineno in comments:
                    found.setdefault((node.name, field.target.id), comments[field.lineno])
        elif isinstance(node, ast.keyword) and node.arg and node.lineno in comments:
            found.setdefault((None, node.arg), comments[node.lineno])
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute) and node.lineno in comments:
            found.setdefault((None, node.targets[0].attr), comments[node.lineno])
    return found


def meaning(key: str, family: str, config_file: str | None = None) -> str:
    """The one-line meaning of dotted `key` of a config of `family` ('' where none is declared)."""
    if key in UNDECLARED:
        return UNDECLARED[key]
    section, _, name = key.partition(".")
    if section == "model":
        classes = [c for c in models.family(family).module.__mro__ if issubclass(c, common.Shared)]
        return next((declared(inspect.getsourcefile(c)).get((c.__name__, name)) for c in classes
                     if (c.__name__, name) in declared(inspect.getsourcefile(c))), "")
    last = key.rpartition(".")[2]
    return next((declared(str(path)).get((None, last)) for path in sources(family, config_file)
                 if (None, last) in declared(str(path))), "")


def sources(family: str, config_file: str | None) -> list[pathlib.Path]:
    """Where the keys outside config.model are declared, nearest first."""
    files = [pathlib.Path(config_file)] if config_file else []
    files += [CONFIGS / f"{family}.py", *sorted(CONFIGS.glob("*.py")), pathlib.Path(config_lib.__file__)]
    return [path for path in dict.fromkeys(files) if path.exists()]


def defaults(config, base) -> dict:
    """Each key's default: the family module's field defaults for config.model, else `base`'s value (and
    `base`'s for a model key that the config file leaves to the data: shapes.FROM_DATA)."""
    fam = models.family(config.model.family)
    found = config_lib.leaves(base) if base is not None else {}
    left = [key for key in shapes.FROM_DATA if key in found and found[key] == shapes.FROM_DATA[key]]
    found.update({f"model.{k}": v for k, v in common.fields_of(fam.module).items() if f"model.{k}" not in left},
                 **{"model.family": fam.name})
    return found


def rows(config, base=None, config_file: str | None = None) -> list[tuple[str, str, str, str]]:
    """(key, value, default, meaning) of every settable key of `config`; a value that differs from its
    default is marked '*'."""
    family, base_values = config.model.family, defaults(config, base)
    found = []
    for key, value in sorted(config_lib.leaves(config).items()):
        default = base_values.get(key, "")
        mark = "*" if key in base_values and _same(value) != _same(default) else ""
        found.append((key, _short(value) + mark, _short(default) if key in base_values else "",
                      meaning(key, family, config_file)))
    return found


def format_keys(config, base=None, config_file: str | None = None) -> str:
    """The key table: a line per key, `key  value  default  meaning`."""
    table = [("key", "value", "default", "meaning"), *rows(config, base, config_file)]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3] for row in table]
    return "\n".join(lines) + "\n(* differs from the default: set by the preset or an override; "\
        "set any key with --config.KEY=VALUE)"


def _same(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _short(value) -> str:
    text = repr(_same(value))
    return text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."
