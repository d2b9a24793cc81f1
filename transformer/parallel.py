"""Device mesh, the batch's placement and multi-host start.

The mesh has axes ('data', 'fsdp', 'context', 'tensor', 'expert'); `config.mesh` gives their sizes
(-1 takes the devices left over; a config saved before `context` or `expert` existed has it 1).
With the default sizes (data=-1, the rest 1) this is plain data
parallelism: the successor of `jax.pmap`, written as `jax.jit` over a `Mesh` with
`NamedSharding`s. How parameters and activations are split over it (logical axis names and
rules) is `transformer.sharding`'s. The batch is split over data x fsdp x expert. The expert
axis comes last (neighbouring devices exchange a mixture of experts' tokens); at size 1 the
other axes hold the devices they hold without it. Devices of several TPU slices (multi-slice, joined by DCN)
put the data axis across the slices and every other axis within one (`over_slices`).

Multi-host: `initialize` joins the processes of a run through `jax.distributed`
(from --coordinator / --num_processes / --process_id, or a detected SLURM or Cloud TPU
cluster). Each process builds the rows of every global batch that its own devices hold
(`process_rows`, read from the batch sharding, so any device order works) and `global_batch`
places them.
`main_process_first` lets process 0 write the files of a workdir before the others read them.
"""

import contextlib
import math
import os

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer import sharding

MESH_AXES, BATCH_AXES = sharding.MESH_AXES, sharding.BATCH_AXES


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, ...]:
    """Sizes of (data, fsdp, context, tensor, expert) with one -1 resolved to the remaining devices."""
    sizes = [int(mesh_config.get(a, 1)) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"config.mesh: at most one of {MESH_AXES} may be -1, got {sizes}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"config.mesh: {num_devices} devices do not divide by the fixed axes {sizes}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                         f"there are {num_devices}")
    return tuple(sizes)


def make_mesh(mesh_config, devices=None) -> Mesh:
    """A mesh over `devices` (default: all of them, every host) shaped by config.mesh."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh_config, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        return Mesh(over_slices(shape, slices, devices), MESH_AXES, axis_types=auto)
    if shape[-1] > 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    # without experts: the mesh of the other axes (the device order make_mesh picks for them), expert of size 1
    mesh = jax.make_mesh(shape[:-1], MESH_AXES[:-1], axis_types=auto[:-1], devices=devices)
    return Mesh(mesh.devices[..., None], MESH_AXES, axis_types=auto)


def over_slices(shape: tuple[int, ...], slices: int, devices) -> np.ndarray:
    """The devices of several TPU slices laid out as `shape`: the data axis across the slices (over DCN, the
    data-centre network), every other axis within one slice (over its ICI links), as MaxText's dcn_data."""
    from jax.experimental import mesh_utils

    data = MESH_AXES.index("data")
    if shape[data] % slices:
        raise ValueError(f"config.mesh.data={shape[data]}: the devices span {slices} TPU slices, which only the data "
                         f"axis crosses (over DCN): make it a multiple of {slices}")
    within, across = list(shape), [1] * len(shape)
    within[data], across[data] = shape[data] // slices, slices
    return mesh_utils.create_hybrid_device_mesh(within, across, devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data x fsdp x expert, the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def cache_sharding(mesh: Mesh, cache) -> object:
    """NamedShardings of the engine's slot caches (leaves [S, ...]): the slots over the batch axes and the keys'
    and values' heads (cached_key, cached_value: [S, ..., K, C, Dh]) over the tensor axis, each where it divides
    them."""
    tensor = mesh.shape.get("tensor", 1)

    def one(path, x):
        axes = [BATCH_AXES if x.shape[0] % batch_divisor(mesh) == 0 else None] + [None] * (x.ndim - 1)
        if path[-1].key in ("cached_key", "cached_value") and tensor > 1 and x.shape[-3] % tensor == 0:
            axes[-3] = "tensor"
        return NamedSharding(mesh, P(*axes))
    return jax.tree_util.tree_map_with_path(one, cache)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def process_rows(mesh: Mesh, batch_size: int) -> np.ndarray:
    """The rows of a global batch that this process's devices hold (sorted global indices), from the
    batch sharding itself: whatever the devices' order in the mesh, each process builds just these."""
    held = batch_sharding(mesh).addressable_devices_indices_map((batch_size,)).values()
    return np.unique(np.concatenate([np.arange(*index[0].indices(batch_size)) for index in held]))


def global_batch(local_batch, mesh: Mesh, rows: np.ndarray, batch_size: int):
    """This process's rows of a batch (a tree of numpy arrays, rows `rows` in that order) -> global
    arrays split over the batch axes, each device given the rows it holds."""
    placement = batch_sharding(mesh)

    def place(x):
        shape = (batch_size, *x.shape[1:])
        pieces = [jax.device_put(x[np.searchsorted(rows, np.arange(batch_size)[index[0]])], device)
                  for device, index in placement.addressable_devices_indices_map(shape).items()]
        return jax.make_array_from_single_device_arrays(shape, placement, pieces)

    return jax.tree.map(place, local_batch)


def batch_divisor(mesh: Mesh) -> int:
    """How many ways the batch is split: the global batch must be a multiple of it."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_mesh(config, mesh: Mesh) -> None:
    """The config fits the mesh: its batch splits over the batch axes (times the accumulated microbatches),
    and a mixture's experts over the expert axis."""
    split, accum = batch_divisor(mesh), config.optim.accum_steps
    axes = " x ".join(a for a in BATCH_AXES if a != "expert" or mesh.shape[a] > 1)
    if config.data.batch_size % (split * accum):
        raise ValueError(f"config.data.batch_size={config.data.batch_size} must divide by the "
                         f"{split}-way batch split of the mesh ({axes}) times "
                         f"config.optim.accum_steps={accum}")
    experts = config.model.get("num_experts", 0)
    if experts and experts % mesh.shape["expert"]:
        raise ValueError(f"config.model.num_experts={experts} does not split over the {mesh.shape['expert']} "
                         "devices of config.mesh.expert: make it a multiple")


# What jax.distributed's own detection reads: jax/_src/clusters/{slurm,cloud_tpu}_cluster.py.
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
TPU_HOSTS_VARS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")


def define_flags() -> None:
    """--coordinator, --num_processes and --process_id, for a CLI that passes them to `initialize`."""
    flags.DEFINE_string("coordinator", None, "host:port of process 0, where the processes of a multi-host "
                        "run meet (e.g. 10.0.0.1:1234); with --num_processes and --process_id. Left out, a "
                        "SLURM (srun) or Cloud TPU cluster is detected.")
    flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-host run.")
    flags.DEFINE_integer("process_id", None, "This process's index in a multi-host run, 0..num_processes-1.")
    flags.DEFINE_bool("distributed", False, "Join a multi-host run found by jax.distributed's own detection "
                      "(Cloud TPU VM slices through the metadata server, SLURM, Open MPI, ...).")


def detected_cluster() -> str | None:
    """'SLURM' or 'Cloud TPU' when this is one of several processes that jax.distributed finds by itself.

    A Cloud TPU VM slice that sets none of TPU_HOSTS_VARS (gcloud's TPU VMs) is joined by the TPU
    runtime without jax.distributed.
    """
    env = os.environ
    if all(name in env for name in SLURM_VARS) and int(env["SLURM_NTASKS"]) > 1:
        return "SLURM"
    hosts = next((env[name] for name in TPU_HOSTS_VARS if env.get(name)), "")
    if len(hosts.split(",")) > 1 or int(env.get("MEGASCALE_NUM_SLICES") or 1) > 1:
        return "Cloud TPU"
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, distributed: bool = False) -> None:
    """Joins this process to the others of a multi-host run: through the three flags if given, else
    through a detected cluster, or through jax's own detection with `distributed`; a single process
    is left alone. Call before anything touches a device."""
    given = {"--coordinator": coordinator, "--num_processes": num_processes, "--process_id": process_id}
    if any(value is not None for value in given.values()):
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ValueError(f"{' and '.join(missing)} missing: a multi-host run needs --coordinator, "
                             "--num_processes and --process_id together")
        jax.distributed.initialize(coordinator, num_processes, process_id)
    elif distributed or detected_cluster():
        jax.distributed.initialize()


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.process_allgather(np.int32(flag)).any())


def _main_failed(failed: bool) -> bool:
    """Process 0's `failed`, on every process (a collective: every process calls it)."""
    return bool(multihost_utils.broadcast_one_to_all(np.int32(failed)))


@contextlib.contextmanager
def main_process_first(what: str):
    """Runs the body on process 0, then on the others: they read what it wrote into the workdir
    (tokenizer, data files, config.json) instead of racing it. When it fails on process 0, the
    others fail too, saying so, rather than wait for it."""
    if jax.process_count() == 1:
        yield
        return
    if jax.process_index() > 0:
        if _main_failed(False):
            raise ValueError(f"process 0 failed while {what} (its error says why)")
        yield
        return
    try:
        yield
    except BaseException:
        _main_failed(True)
        raise
    _main_failed(False)
