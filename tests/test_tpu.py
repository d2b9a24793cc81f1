"""Every family's train step compiled by libtpu for a v5e:2x2 slice on this CPU machine (training/topology.py),
each over a sharded mesh: splash attention's Mosaic kernel in a GPT's program (fsdp x tensor) and the paged
kernel in its decode call, ring attention and experts in an MoE with LoRA adapters, and BERT, ViT, the
encoder-decoder and ImageGPT on data x fsdp. Skipped where libtpu is not installed (`pip install -e '.[tpu]'`).
Shapes are tiny: each compile takes tens of seconds on a loaded two-core machine.
"""

import importlib.util
import os

import pytest

from transformer import config as config_lib
from transformer import parallel
from transformer.training import checks, topology

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (pip install -e '.[tpu]')")
SLICE = "v5e:2x2"
SMALL = ["model.num_layers=1", "model.d_model=64", "model.num_heads=4", "model.mlp_dim=128", "data.batch_size=8",
         "model.dtype=bfloat16"]
TEXT = ["data.seq_len=128", "model.max_len=128"]
RUNS = {  # name: (config, overrides); each one compile of its train step
    "moe-ring-lora": ("configs/gpt.py:tiny-moe", [*SMALL, *TEXT, "model.attention=ring", "mesh.data=1",
                                                  "mesh.context=2", "mesh.expert=2", "lora.rank=4",
                                                  "lora.targets=attention,mlp,experts"]),
    "bert": ("configs/bert.py:tiny", [*SMALL, "data.seq_len=32", "model.max_len=32", "mesh.data=2", "mesh.fsdp=2"]),
    "vit": ("configs/vit.py:tiny", [*SMALL, "mesh.data=2", "mesh.fsdp=2"]),
    "encdec": ("configs/encdec.py:tiny", [*SMALL, "mesh.data=2", "mesh.fsdp=2"]),
    "imagegpt": ("configs/gpt.py:igpt-tiny", [*SMALL, "mesh.data=2", "mesh.fsdp=2"]),
}


def compiled(spec: str, overrides: list[str], **kwargs) -> topology.Report:
    path, _, arg = spec.partition(":")
    launch = checks.checked(config_lib.load(os.path.join(REPO, path) + ":" + arg, overrides))
    return topology.compile_run(launch.config, SLICE, launch.task, **kwargs)


def test_a_gpt_compiles_with_splash_attention_on_fsdp_and_tensor_axes_and_its_decode_step_too():
    report = compiled("configs/gpt.py:tiny", [*SMALL, *TEXT, "model.attention=auto", "mesh.data=1", "mesh.fsdp=2",
                                              "mesh.tensor=2", "model.d_model=256", "model.num_heads=2"],
                      second=False, keep_hlo=True)  # a head width of 128, as TPU's paged kernel needs
    assert report.chip.kind == "TPU v5 lite" and report.mesh["fsdp"] == 2 and report.mesh["tensor"] == 2
    assert "tpu_custom_call" in report.train.hlo  # splash, Mosaic-compiled inside jax.shard_map
    assert "all-gather" in report.train.hlo or "all-reduce" in report.train.hlo
    assert report.train.fits and 0 < report.train.peak < 2**30 and report.train.flops > 0
    assert report.decode is not None and report.decode.fits and report.decode.peak > 0
    assert "tpu_custom_call" in report.decode.hlo and "jit(paged_attention)/pallas_call" in report.decode.hlo
    lines = topology.format_report(report)
    assert any("fits" in line for line in lines) and any("roofline" in line for line in lines)


@pytest.mark.parametrize("name", RUNS)
def test_every_family_compiles_its_train_step_on_a_sharded_v5e_slice(name):
    spec, overrides = RUNS[name]
    report = compiled(spec, overrides, second=False, decode=False)
    assert report.train.fits and 0 < report.train.peak < 2**30
    assert report.train.arguments > 0 and report.train.flops > 0
    if name == "moe-ring-lora":
        assert report.mesh["context"] == 2 and report.mesh["expert"] == 2


def test_slices_joined_by_dcn_take_the_data_axis_and_the_step_compiles_over_them():
    devices = topology.devices(SLICE, slices=2)
    mesh = parallel.make_mesh({"data": 2, "fsdp": -1}, devices)
    assert [{d.slice_index for d in mesh.devices[i].flat} for i in range(2)] == [{0}, {1}]  # a data row a slice
    with pytest.raises(ValueError, match=r"mesh.data=1: the devices span 2 TPU slices.*a multiple of 2$"):
        parallel.make_mesh({"data": 1, "fsdp": -1}, devices)
    report = compiled("configs/gpt.py:tiny", [*SMALL, *TEXT, "mesh.data=2", "mesh.fsdp=-1"], slices=2, second=False,
                      decode=False)
    assert report.topology == f"2 x {SLICE}" and report.mesh["data"] == 2 and report.train.fits


def test_the_largest_batch_is_solved_from_two_compiles():
    a = topology.Program(batch=8, peak=3 * 2**30, fits=True)
    b = topology.Program(batch=4, peak=2 * 2**30, fits=True)  # 1 GiB fixed, 0.25 GiB a row
    assert topology.largest_batch(a, b, 16 * 2**30, step=4) == 60
    assert topology.largest_batch(a, topology.Program(batch=16, peak=3 * 2**30, fits=True), 16 * 2**30, 4) is None


def test_the_largest_batch_is_compiled_and_guessed_again_where_it_does_not_fit():
    """A compiler whose memory is affine to 40 rows and steeper after: the line's 60 does not fit, nor the
    next guess; the third fits."""
    gib = 2**30
    peak = lambda batch: (1 + 0.25 * batch if batch <= 40 else 11 + 0.5 * (batch - 40)) * gib  # noqa: E731

    def compile_fn(batch):
        if peak(batch) > 16 * gib:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used "
                               f"{peak(batch) / gib}G of 16G hbm.")
        return _Compiled(peak(batch))
    known = [topology.Program(batch=8, peak=peak(8), fits=True), topology.Program(batch=4, peak=peak(4), fits=True)]
    guess = topology.largest_batch(*known, 16 * gib, step=4)
    assert guess == 60 and topology.checked_largest(compile_fn, known, guess, 16 * gib, 4) == (48, 3)
    assert topology.checked_largest(compile_fn, known, 36, 16 * gib, 4) == (36, 1)  # fits at once
    flat = [topology.Program(batch=8, peak=3 * gib, fits=True), topology.Program(batch=4, peak=2.9 * gib, fits=True)]
    guess = topology.largest_batch(*flat, 16 * gib, step=4)  # remat's two peaks: a long extrapolation
    assert guess > 400 and topology.checked_largest(compile_fn, flat, guess, 16 * gib, 4)[0] >= 40


class _Compiled:
    """What `topology.program` reads of a compiled program, with `peak` bytes of temporaries."""

    def __init__(self, peak):
        self.peak = peak

    def memory_analysis(self):
        return type("M", (), dict(argument_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0,
                                  temp_size_in_bytes=int(self.peak), generated_code_size_in_bytes=0,
                                  host_temp_size_in_bytes=0))()

    def cost_analysis(self):
        return {}

    def as_text(self):
        return ""


def test_a_program_the_compiler_cannot_fit_is_one_that_does_not_fit_with_the_bytes_it_asked_for():
    said = ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.50G of 15.75G hbm.",
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (150.15G) "
            "exceeds available HBM (95.74G).")
    for error, gib in zip(said, (20.5, 150.15)):
        def refused(batch, error=error):
            raise RuntimeError(error)
        p = topology.program(refused, 8)
        assert not p.fits and p.peak == int(gib * 2**30)
    with pytest.raises(RuntimeError, match="other"):
        topology.program(lambda batch: (_ for _ in ()).throw(RuntimeError("other")), 8)


def test_a_topology_that_does_not_exist_fails_in_one_line():
    for name, says in (("v9z:2x2", "a TPU chip (v4, v5e, v5p, v6e)"), ("v5e:3x7", "libtpu cannot make it")):
        with pytest.raises(ValueError, match=r"--topology=") as error:
            topology.devices(name)
        assert says in str(error.value) and "\n" not in str(error.value)


def test_without_libtpu_a_topology_fails_saying_how_to_install_it(monkeypatch):
    monkeypatch.setattr(topology.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"libtpu, which is not installed: pip install -e '\.\[tpu\]'$"):
        topology.devices(SLICE)
