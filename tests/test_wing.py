"""The library never imports its workshop: nothing under transformer/ outside the measuring wing
(transformer/bench/) imports it, nothing imports the commands inspect and profile (their library
code lives in models/ and training/), and no modules import each other in a circle (cli, the floor
every command stands on, takes nothing from rundir). Read from the source (ast), so a lazy import inside
a function counts too."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WING = "transformer.bench"
COMMANDS = ("transformer.train", "transformer.generate", "transformer.convert", "transformer.inspect",
            "transformer.profile", "transformer.report", "transformer.sweep.__main__", "transformer.probe.__main__",
            "transformer.data.tokenize", "transformer.data.prepare", "transformer.chat", "transformer.serve")


def module_name(path: str, root: str) -> str:
    """'transformer/training/loop.py' -> 'transformer.training.loop' (a package's __init__: the package)."""
    parts = os.path.relpath(path, root)[:-len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: str, root: str) -> set[str]:
    """Every module name an import in `path` can load: `import a.b` -> a.b; `from a import b` -> a and a.b
    (b may be a module); relative imports resolved against the file's package."""
    name = module_name(path, root)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def importers(root: str, targets: tuple[str, ...], inside: str = WING) -> list[str]:
    """'path: modules' for each file under root/transformer, outside `inside`, that imports one of
    `targets` or anything below them."""
    found = []
    for folder, _, files in os.walk(os.path.join(root, "transformer")):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            name = module_name(path, root)
            if name == inside or name.startswith(inside + "."):
                continue
            hits = sorted(m for m in imported(path, root) if any(m == t or m.startswith(t + ".") for t in targets))
            if hits:
                found.append(f"{os.path.relpath(path, root)}: {', '.join(hits)}")
    return found


def test_nothing_outside_the_wing_imports_it():
    assert importers(REPO, (WING,)) == []


def test_nothing_imports_a_command_module():
    assert importers(REPO, COMMANDS) == []


def test_the_library_takes_progress_and_the_cache_from_console_not_cli():
    """cli is the commands' floor (flags, the one-line exit): only command modules and the sweep command's own
    package import it."""
    commands = {"transformer/" + m.removeprefix("transformer.").replace(".", "/") + ".py" for m in COMMANDS}
    commands |= {"transformer/evaluate.py", "transformer/predict.py", "transformer/bench/attention.py"}
    found = [line for line in importers(REPO, ("transformer.cli",))
             if line.split(":")[0] not in commands and not line.startswith("transformer/sweep/")]
    assert found == []


BELOW_THE_RUN = ("transformer/layers/", "transformer/models/", "transformer/data/", "transformer/rundir.py")


def test_nothing_below_the_run_directory_imports_training_or_inference():
    """layers/, models/, data/ and the run directory serve training and inference, never the reverse; a
    trained run used as a function (inference/) does not import training either."""
    found = importers(REPO, ("transformer.training", "transformer.inference"))
    assert [line for line in found if line.startswith(BELOW_THE_RUN)] == []
    training = importers(REPO, ("transformer.training",))
    assert [line for line in training if line.startswith("transformer/inference/")] == []


def test_the_scan_finds_every_form_of_import(tmp_path):
    """A planted file per form of import: each is found, and the wing's own imports are not."""
    package = tmp_path / "transformer"
    (package / "bench").mkdir(parents=True)
    (package / "training").mkdir()
    for init in (package, package / "bench", package / "training"):
        (init / "__init__.py").write_text("")
    (package / "bench" / "measure.py").write_text("from transformer.bench import peer\n")
    (package / "training" / "clean.py").write_text("from transformer import models\nimport benchmark\n")
    forms = {"plain.py": "import transformer.bench.measure\n",
             "named.py": "from transformer import bench\n",
             "deep.py": "from transformer.bench.census import census\n",
             "lazy.py": "def f():\n    from transformer.bench import measure\n"}
    for file, text in forms.items():
        (package / file).write_text(text)
    (package / "training" / "relative.py").write_text("from .. import bench\n")
    found = importers(str(tmp_path), (WING,))
    assert sorted(line.split(":")[0] for line in found) == sorted(
        [f"transformer/{file}" for file in forms] + ["transformer/training/relative.py"]), found


def library_graph(root: str) -> dict[str, set[str]]:
    """Each module under root/transformer -> the modules there that it imports; a package that it lies in is
    none (Python is loading that package already)."""
    paths = {}
    for folder, _, files in os.walk(os.path.join(root, "transformer")):
        paths.update((module_name(os.path.join(folder, f), root), os.path.join(folder, f))
                     for f in files if f.endswith(".py"))
    return {name: {m for m in imported(path, root) if m in paths and m != name and not name.startswith(m + ".")}
            for name, path in paths.items()}


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in `graph` as [a, b, ..., a], or [] where there is none."""
    state = {}  # 1: on the path being walked, 2: walked, no circle through it

    def walk(path: list[str]) -> list[str]:
        state[path[-1]] = 1
        for after in sorted(graph[path[-1]]):
            if state.get(after) == 1:
                return path[path.index(after):] + [after]
            if after not in state and (found := walk(path + [after])):
                return found
        state[path[-1]] = 2
        return []

    return next((found for name in sorted(graph) if name not in state and (found := walk([name]))), [])


def test_no_modules_import_each_other_in_a_circle():
    assert circle(library_graph(REPO)) == []


def test_the_circle_scan_finds_a_lazy_circle_and_not_a_package_its_modules_import(tmp_path):
    package = tmp_path / "transformer" / "data"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from transformer.data import store\n")
    (package / "store.py").write_text("from transformer.data import order\nfrom transformer import cli\n")
    (package / "order.py").write_text("import numpy\n")
    (package.parent / "cli.py").write_text("def resume():\n    from transformer import rundir\n")
    (package.parent / "rundir.py").write_text("from transformer.data.store import build\n")
    assert circle(library_graph(str(tmp_path))) == [
        "transformer.cli", "transformer.rundir", "transformer.data.store", "transformer.cli"]
