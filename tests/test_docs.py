"""Docs that cannot drift: every fenced shell block of README.md and docs/*.md is read, and each
`python -m transformer.X` must exist, each `--flag` be one of that command's flags, each `--config.KEY` a key
of the config it names (or of some config, where a command reads a run's), each config file and preset load,
each repository path exist; every relative link between pages (and its anchor) resolves. Every command's
--help exits 0 and opens with what the command does. No training: commands are read in this process
(their flags defined, their `cli.run` stopped before it parses anything)."""

import argparse
import ast
import functools
import glob
import importlib.util
import json
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest
from conftest import FAST_COMPILES

from transformer import cli, config_keys, models
from transformer import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
COMMANDS = ["train", "evaluate", "predict", "generate", "chat", "serve", "convert", "inspect", "profile", "report",
            "sweep", "probe", "bench", "bench.attention", "data.tokenize", "data.prepare"]
ROOTS = ("configs/", "experiments/", "transformer/", "tests/", "docs/", ".ci/")
HELP = {"help", "helpshort", "helpfull", "helpxml", "only_check_args", "?"}
PLACEHOLDER = re.compile(r"NAME|KIND|STEP|\.X\b")  # a path or command to fill in, not one that exists
SEPARATORS = {"&&", "||", "|", ";"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def shell_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in ("bash", "sh", "shell", "console")]


def command_lines(block: str) -> list[list[str]]:
    """The commands of a shell block as token lists: continuations joined, heredoc bodies and comments dropped,
    `a && b | c` split, and a quoted command (gcloud's --command="...") read as commands too."""
    lines, heredoc = [], None
    for line in block.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if match := re.search(r"<<-?\s*'?(\w+)'?", line):
            heredoc, line = match[1], line[:match.start()]
        lines.append(line)
    found, pending = [], ""
    for line in lines:
        try:
            tokens = shlex.split(pending + line, comments=True)
        except ValueError:  # a quote open across lines
            pending += line + "\n"
            continue
        pending, command = "", []
        for token in tokens:
            if token in SEPARATORS:
                found.append(command)
                command = []
                continue
            quoted = token.partition("=")[2] if token.startswith("--") else token
            if " -m transformer." in quoted:
                found += command_lines(quoted)
            command.append(token)
        found.append(command)
    return [c for c in found if c]


@functools.cache
def known_flags(module: str) -> frozenset[str]:
    """The flags of command `module`: its `__main__` block run here with `cli.run` stopped, its new flags read
    from absl's FLAGS and taken out again (the next command defines its own)."""
    from absl import flags

    class Defined(Exception):
        pass

    def stop(*args, **kwargs):
        raise Defined

    before, run = set(flags.FLAGS), cli.run
    cli.run = stop
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    except Defined:
        pass
    finally:
        cli.run = run
        new = set(flags.FLAGS) - before
        for name in new:
            delattr(flags.FLAGS, name)
    return frozenset(new | before | HELP)


def harness_flags() -> frozenset[str]:
    """lm-evaluation-harness's own options (`python -m transformer.inference.harness` is its command line)."""
    from lm_eval._cli.harness import HarnessCLI

    parsers, names = [HarnessCLI()._parser], set()
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            names |= {o.lstrip("-") for o in action.option_strings}
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
    return frozenset(names)


def module_file(module: str) -> str | None:
    base = os.path.join(REPO, *module.split("."))
    return next((p for p in (base + ".py", os.path.join(base, "__main__.py")) if os.path.isfile(p)), None)


def main_of(module: str) -> str:
    """The module `python -m module` runs (a package's __main__)."""
    return module if module_file(module).endswith(module.split(".")[-1] + ".py") else module + ".__main__"


def every_key() -> set[str]:
    return set(config_keys.MEANINGS) | {key for table in config_keys.OWN.values() for key in table}


@functools.cache
def config_leaves(spec: str, run: str) -> frozenset[str]:
    """The keys of config `spec` (configs/X.py:arg); a post-training file's init_from=RUN is `run`, a stand-in."""
    path, _, arg = spec.partition(":")
    arg = re.sub(r"(^|,)init_from=[^,]*", lambda m: f"{m[1]}init_from={run}", arg)
    config = config_lib.load(os.path.join(REPO, path) + (":" + arg if arg else ""))
    leaves = config_lib.leaves(config)
    return frozenset(leaves) | {k.rsplit(".", i)[0] for k in leaves for i in range(1, k.count(".") + 1)}


def value_of(args: list[str], i: int) -> str:
    return args[i].partition("=")[2] if "=" in args[i] else (args[i + 1] if i + 1 < len(args) else "")


def check_paths(tokens: list[str]) -> list[str]:
    errors = []
    for token in tokens:
        for word in re.split(r"[=,\s]", token):
            path = word.partition(":")[0]
            if path.startswith(ROOTS) and "*" not in path and not os.path.exists(os.path.join(REPO, path)):
                errors.append(f"no such path {path}")
    return errors


def check_command(tokens: list[str], run: str) -> list[str]:
    """What is wrong with one documented command line ([] where nothing is)."""
    errors = check_paths(tokens)
    at = next((i for i, t in enumerate(tokens) if os.path.basename(t).startswith("python")), None)
    if at is None or at + 1 >= len(tokens):
        return errors
    rest = tokens[at + 1:]
    if rest[0].endswith(".py"):  # a script: it exists (above) and names each flag given it
        source = open(os.path.join(REPO, rest[0])).read() if os.path.isfile(os.path.join(REPO, rest[0])) else ""
        return errors + [f"{rest[0]} has no flag --{name}" for name in
                         (t[2:].split("=")[0] for t in rest[1:] if t.startswith("--")) if source and name not in source]
    if rest[0] != "-m" or not rest[1].startswith("transformer"):
        return errors
    module, args = rest[1], rest[2:]
    if module_file(module) is None:
        return errors + [f"no command python -m {module}"]
    if module == "transformer.inference.harness":
        names = harness_flags() if importlib.util.find_spec("lm_eval") else None
    else:
        names = known_flags(main_of(module))
    spec = next((value_of(args, i) for i, a in enumerate(args) if re.match(r"--config(=|$)", a)), None)
    keys = every_key()
    if spec:
        try:
            keys = config_leaves(spec, run)
        except (*cli.CONFIG_ERRORS, KeyError) as e:
            return errors + [f"python -m {module}: --config {spec}: {cli.one_line(e)}"]
    for arg in args:
        if not arg.startswith("--"):
            continue
        name = arg[2:].split("=")[0]
        if name.startswith("config."):
            key = name[len("config."):]
            if key not in keys:
                errors.append(f"python -m {module}: " + (f"{spec} has no key {key}" if spec else
                                                         f"no config file has a key {key}"))
        elif names is not None and name not in names and not (name.startswith("no") and name[2:] in names):
            errors.append(f"python -m {module} has no flag --{name}")
    return errors


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m[1] or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def check_links(page: str, text: str) -> list[str]:
    errors = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(REPO, os.path.dirname(page), path)) if path else os.path.join(REPO, page)
        if not os.path.exists(full):
            errors.append(f"{page}: link to missing {target}")
        elif anchor and full.endswith(".md"):
            headings = re.findall(r"^#+ (.*)$", FENCE.sub("", open(full).read()), re.M)
            if anchor not in {slug(h) for h in headings}:
                errors.append(f"{page}: link to missing anchor {target}")
    return errors


def check_page(page: str, text: str, run: str) -> list[str]:
    """A page's links, the commands of its shell blocks, and its inline code: a command or a repository path."""
    errors = check_links(page, text)
    commands = [tokens for block in shell_blocks(text) for tokens in command_lines(block)]
    for span in re.findall(r"`([^`\n]+)`", FENCE.sub("", text)):
        if PLACEHOLDER.search(span):
            continue
        if span.startswith("python "):
            commands += command_lines(span)
        elif span.startswith(ROOTS) and " " not in span:
            errors += [f"{page}: {e}" for e in check_paths([span])]
    for tokens in commands:
        errors += [f"{page}: {e}" for e in check_command(tokens, run)]
    return errors


@pytest.fixture(scope="module")
def stand_in_run(tmp_path_factory):
    """A run directory holding a tiny GPT's config.json: what a post-training config file's init_from reads."""
    run = tmp_path_factory.mktemp("run")
    config_lib.save_json(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny")), str(run / "config.json"))
    return str(run)


@pytest.mark.parametrize("page", PAGES)
def test_every_command_flag_key_path_and_link_of_a_page_exists(page, stand_in_run):
    assert check_page(page, open(os.path.join(REPO, page)).read(), stand_in_run) == []


def test_the_check_finds_a_misspelt_command_flag_key_path_and_link(stand_in_run):
    page = "\n".join([
        "[a page](configs.md) [gone](nowhere.md) [no anchor](configs.md#no-such-heading)", "```bash",
        "python -m transformer.trian --workdir runs/x",
        "python -m transformer.generate --workdir runs/x --max_new_tokenz 3 && echo done",
        "python -m transformer.train --config configs/gpt.py:tiny --workdir runs/x \\",
        "    --config.optim.lrr=1e-3",
        "python -m transformer.evaluate --workdir runs/x --config.data.eval_pth=test.tsv",
        "python -m transformer.train --config configs/gpt.py:tinny --workdir runs/x",
        "python -m transformer.train --config configs/sft.py:init_from=RUN,data.train_pth=a.jsonl --workdir runs/x",
        "python experiments/chat_sft/run.py --out runs/chat --data_onyl", "cat configs/nope.py", "```",
        "Prose: `python -m transformer.inspect --kees` and `transformer/nope.py`, `configs/NAME.py` to write."])
    assert check_page("docs/planted.md", page, stand_in_run) == [
        "docs/planted.md: link to missing nowhere.md",
        "docs/planted.md: link to missing anchor configs.md#no-such-heading",
        "docs/planted.md: no such path transformer/nope.py",
        "docs/planted.md: no command python -m transformer.trian",
        "docs/planted.md: python -m transformer.generate has no flag --max_new_tokenz",
        "docs/planted.md: python -m transformer.train: configs/gpt.py:tiny has no key optim.lrr",
        "docs/planted.md: python -m transformer.evaluate: no config file has a key data.eval_pth",
        "docs/planted.md: python -m transformer.train: --config configs/gpt.py:tinny: unknown gpt preset 'tinny'; "
        "choose one of " + ", ".join(models.family("gpt").presets),
        "docs/planted.md: python -m transformer.train: --config configs/sft.py:init_from=RUN,data.train_pth=a.jsonl: "
        "unknown config key data.train_pth; did you mean data.train_path?",
        "docs/planted.md: experiments/chat_sft/run.py has no flag --data_onyl",
        "docs/planted.md: no such path configs/nope.py",
        "docs/planted.md: python -m transformer.inspect has no flag --kees"]


def test_the_quickstart_is_the_readmes_first_two_code_blocks():
    first, second = [body for _, body in FENCE.findall(open(os.path.join(REPO, "README.md")).read())][:2]
    assert first.startswith("python3 -m venv .venv && .venv/bin/pip install -q -e . && ")
    assert first.endswith("-m transformer.train --config configs/gpt.py:tiny --workdir runs/gpt-tiny\n")
    assert second == "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -q\n"


def test_every_command_has_a_line_in_the_readmes_table():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert [c for c in COMMANDS if f"| `python -m transformer.{c}` |" not in readme] == []


def test_the_readmes_families_table_says_the_class_each_config_exports_as():
    """Each row's first config gives the class its exports column names, or none (hf.export_line, no weights)."""
    from transformer.interop import hf

    readme = open(os.path.join(REPO, "README.md")).read()
    table = readme[readme.index("## Families and tasks"):].split("\n## ")[0]
    rows = [line.split("|")[1:4] for line in table.splitlines() if re.match(r"\| `\w+\.py:", line)]
    assert len(rows) >= 10
    for config, _, exports in rows:
        spec = re.search(r"`(\w+\.py:[^`]+)`", config)[1]
        model = config_lib.load(os.path.join(REPO, "configs", spec)).model
        with model.unlocked():
            for key, value in dict(vocab_size=256, num_labels=2, num_classes=10, channels=1, image_size=8).items():
                if key in model and not model[key]:
                    model[key] = value
        line, expected = hf.export_line(model), exports.strip()
        if expected.startswith("none"):
            assert line.startswith("export: no transformers class expresses this run"), (spec, line)
        else:
            assert line.endswith(f"transformers' {expected.split()[0]}"), (spec, line)


def story_steps(commands: list[list[str]]) -> list[tuple[str, str]]:
    """(command, config file) of each `python -m transformer.X` step."""
    steps = []
    for tokens in commands:
        if "-m" in tokens and tokens[tokens.index("-m") + 1].startswith("transformer."):
            args = tokens[tokens.index("-m") + 2:]
            spec = next((value_of(args, i) for i, a in enumerate(args) if a == "--config"), "")
            steps.append((tokens[tokens.index("-m") + 1], os.path.basename(spec.partition(":")[0])))
    return steps


def test_the_readmes_story_is_the_commands_its_test_runs():
    readme = open(os.path.join(REPO, "README.md")).read()
    story = shell_blocks(readme[readme.index("## From a base model to a tuned chatbot"):])[0]
    tested = re.findall(r'run\("(transformer\.\w+)", (?:"--config", os.path.join\(REPO, "configs/(\w+\.py))?',
                        open(os.path.join(REPO, "tests", "test_story.py")).read())
    assert story_steps(command_lines(story)) == tested == [
        ("transformer.train", "gpt.py"), ("transformer.evaluate", ""), ("transformer.train", "sft.py"),
        ("transformer.train", "dpo.py"), ("transformer.train", "grpo.py"), ("transformer.chat", ""),
        ("transformer.convert", "")]


def docstring(module: str) -> str:
    return ast.get_docstring(ast.parse(open(module_file(module)).read())) or ""


HELP_ALL = """
import contextlib, io, json, runpy, sys
from absl import app, flags
import transformer.cli
app.define_help_flags()
seen = {}
for module in sys.argv[1:]:
    before, out = set(flags.FLAGS), io.StringIO()
    sys.argv = [module, "--help"]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = "returned"
        except SystemExit as e:
            code = e.code
    for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)
    seen[module] = [code, out.getvalue()]
print(json.dumps(seen))
"""


def test_help_exits_0_and_opens_with_what_the_command_does():
    """Every command's --help, each run as `python -m` runs it (one process for all: jax imported once)."""
    modules = [main_of("transformer." + c) for c in COMMANDS]
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    env.update(PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", HELP_ALL, *modules], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for module, (code, text) in json.loads(out.stdout.splitlines()[-1]).items():
        first = docstring(module).splitlines()[0]
        assert first.endswith(".") and not first.startswith(("python", "usage")), (module, first)
        assert (code, text.splitlines()[0]) == (0, first), module
        assert "--" in text, module  # its flags follow


def test_the_harness_commands_help_opens_with_what_it_does():
    """`python -m transformer.inference.harness` is lm-eval's own command line: its --help says so first."""
    pytest.importorskip("lm_eval")
    from transformer.inference import harness

    out = subprocess.run([sys.executable, "-m", "transformer.inference.harness", "--help"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO, timeout=300)
    assert (out.returncode, out.stdout.splitlines()[0]) == (0, harness.HELP)
    assert "usage: lm-eval" in out.stdout  # lm-eval's own help follows
