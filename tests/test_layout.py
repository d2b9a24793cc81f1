"""The house's rooms, as a newcomer meets them: a small package root with no workshop in it, attention
and data in sub-packages of their own, every file readable in one sitting."""

import glob
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "transformer")
MAX_ROOT_MODULES = 19  # 15 modules (checkpoints.py beside rundir.py) + the evaluate, predict, chat and serve commands
MAX_LINES = 420


def test_the_package_root_is_small_and_holds_no_workshop():
    modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(PACKAGE, "*.py")))
    modules.remove("__init__.py")
    assert len(modules) <= MAX_ROOT_MODULES, modules
    assert not [m for m in modules if m.startswith("bench")]


def test_each_room_is_a_package():
    for room in ("layers/attention", "layers/attention/kernels", "data/text", "data/images", "bench", "models",
                 "training", "inference", "interop", "probe", "sweep"):
        assert os.path.isfile(os.path.join(PACKAGE, room, "__init__.py")), room
    layers = {os.path.basename(p) for p in glob.glob(os.path.join(PACKAGE, "layers", "*.py"))}
    assert not layers & {"masks.py", "blockwise.py", "ring.py", "flash.py", "cudnn.py", "pallas_gpu.py",
                         "splash.py", "xla.py"}
    data = {os.path.basename(p) for p in glob.glob(os.path.join(PACKAGE, "data", "*.py"))}
    assert data <= {"__init__.py", "tokenize.py", "prepare.py", "spawn.py"}, data


def test_every_file_reads_in_one_sitting():
    files = glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(REPO, "configs", "*.py")) + glob.glob(os.path.join(REPO, "tests", "*.py"))
    long = {os.path.relpath(p, REPO): n for p in files if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert long == {}
