"""Every key of a config a user can set: its value, its default and its one-line meaning.

    python -m transformer.inspect --config configs/gpt.py:tiny --config.optim.lr=1e-3 --keys

A key's meaning is its line in the table of transformer/config_meanings.py. A key's default is its family's
base: the module field's default for config.model (but a shape the config file leaves to the data: its 0), and
for the rest the value the config file sets before its preset's training settings and any override.
"""

import pathlib

from transformer import config as config_lib
from transformer import config_meanings, models
from transformer.models import common
from transformer.training import shapes

WIDTH = 28  # the most characters of a value shown


def meaning(key: str, family: str, config_file: str | None = None) -> str:
    """The one-line meaning of dotted `key` of a config of `family` made by `config_file` (configs/NAME.py;
    None: the family's own) ('' where the table has none)."""
    owners = [family] if key.startswith("model.") or not config_file else [pathlib.Path(config_file).stem, family]
    own = next((table for table in map(config_meanings.OWN.get, owners) if table and key in table), {})
    return own.get(key, config_meanings.MEANINGS.get(key, ""))


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
