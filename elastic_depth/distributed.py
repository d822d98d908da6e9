"""Processes, meshes and shardings: JAX's own engine (jax.distributed + jax.sharding).

The mesh has two named axes, `data` and `fsdp`. The batch is split over both (every
device sees its own rows). Parameters and optimizer state are sharded by logical axis:
a leaf's logical axes are the letters of its shape suffix (`wq_DxHxK` -> D, H, K), and
`TrainConfig.fsdp_axis` names the letter whose dimension is split over `fsdp`
(default D). Leaves without a suffix (norm scales, step counters) are replicated, as is
everything when fsdp = 1.
"""

import os
import re
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from elastic_depth.config import ConfigError, TrainConfig

BATCH_AXES = ('data', 'fsdp')
_SUFFIX = re.compile(r'_((?:\d*[A-Z])(?:x\d*[A-Z])*)$')

# Environment variables that announce a multi-process job jax.distributed can join.
CLUSTER_ENV = ('JAX_COORDINATOR_ADDRESS', 'SLURM_STEP_NUM_TASKS', 'OMPI_COMM_WORLD_SIZE',
               'TPU_WORKER_HOSTNAMES', 'MEGASCALE_COORDINATOR_ADDRESS')


def cluster_detected(env=None) -> bool:
  """True when the environment describes a job of more than one process."""
  env = os.environ if env is None else env
  for name in CLUSTER_ENV:
    value = env.get(name, '')
    if not value:
      continue
    if name in ('SLURM_STEP_NUM_TASKS', 'OMPI_COMM_WORLD_SIZE'):
      if value.isdigit() and int(value) > 1:
        return True
    elif name == 'TPU_WORKER_HOSTNAMES':
      if ',' in value:
        return True
    else:
      return True
  return False


def initialize(coordinator_address: Optional[str] = None,
               num_processes: Optional[int] = None, process_id: Optional[int] = None,
               heartbeat_timeout_s: int = 100) -> bool:
  """Joins a multi-process job before anything touches a device; returns True if joined.

  Explicit arguments win; otherwise a cluster environment (SLURM, Open MPI, Cloud TPU,
  GKE, JAX_COORDINATOR_ADDRESS) is detected by jax itself. One process stays the default.
  """
  explicit = coordinator_address is not None or (num_processes or 1) > 1
  if not explicit and not cluster_detected():
    return False
  if explicit and (coordinator_address is None or num_processes is None
                   or process_id is None):
    raise ConfigError('--coordinator_address, --num_processes and --process_id go together')
  if explicit and not 0 <= process_id < num_processes:
    raise ConfigError(f'--process_id={process_id} not in [0, --num_processes='
                      f'{num_processes})')
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_s)
  return True


def is_lead() -> bool:
  """True on the process that writes files and prints a job's own lines (process 0)."""
  return jax.process_index() == 0


def make_mesh(devices: Optional[Sequence[Any]] = None, *, fsdp: int = 1) -> Mesh:
  """A (data, fsdp) mesh over all (or the given) devices; data = devices / fsdp."""
  devices = jax.devices() if devices is None else list(devices)
  if fsdp < 1 or len(devices) % fsdp:
    raise ConfigError(f'train.fsdp={fsdp} does not divide the {len(devices)} devices')
  return Mesh(np.asarray(devices).reshape(len(devices) // fsdp, fsdp), BATCH_AXES)


def logical_axes(name: str) -> tuple[str, ...]:
  """Logical axes from a shape suffix: 'wq_DxHxK' -> ('D', 'H', 'K'); none -> ()."""
  m = _SUFFIX.search(name)
  return tuple(m.group(1).split('x')) if m else ()


def leaf_spec(path, leaf, fsdp_axis: str, fsdp: int) -> P:
  """PartitionSpec of one parameter or optimizer-state leaf under the fsdp rule."""
  shape = getattr(leaf, 'shape', ())
  if fsdp <= 1 or not shape:
    return P()
  keys = [getattr(k, 'key', getattr(k, 'name', None)) for k in path]
  name = next((k for k in reversed(keys) if isinstance(k, str)), '')
  axes = logical_axes(name)
  if len(axes) != len(shape) or fsdp_axis not in axes:
    return P()
  i = axes.index(fsdp_axis)
  if shape[i] % fsdp:
    raise ConfigError(f'{name}: dimension {fsdp_axis}={shape[i]} is not divisible by '
                      f'train.fsdp={fsdp}')
  return P(*[('fsdp' if j == i else None) for j in range(len(shape))])


def state_shardings(state: Any, mesh: Mesh, t: TrainConfig) -> Any:
  """NamedShardings for every leaf of a TrainState (or any params/opt-state tree)."""
  fsdp = mesh.shape['fsdp']
  return jax.tree_util.tree_map_with_path(
      lambda p, x: NamedSharding(mesh, leaf_spec(p, x, t.fsdp_axis, fsdp)), state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[A, B, L] micro-batches: B split over every device (data and fsdp)."""
  return NamedSharding(mesh, P(None, BATCH_AXES))


def agree_signal(signum: Optional[int]) -> Optional[int]:
  """The signal any process has seen (None when none has), the same on every process.

  Signals reach the hosts of a job at different instants; acting on each process's own
  flag would send one process into the collective checkpoint save while another runs the
  next collective step, and both would wait forever. Every process must call this at the
  same points (one small all-gather each; nothing when there is one process).
  """
  if jax.process_count() == 1:
    return signum
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  seen = np.asarray(multihost_utils.process_allgather(np.int32(signum or 0)))
  return int(seen.max()) or None


def shard_rows(batch: dict, mesh: Mesh) -> dict:
  """This process's [B_local, L] rows of 'inputs', 'targets', 'mask' as global arrays."""
  sharding = NamedSharding(mesh, P(BATCH_AXES))
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(batch[k]))
          for k in ('inputs', 'targets', 'mask')}


def shard_batch(batch, mesh: Mesh, accum: int):
  """Stacks this process's host batches to [A, B_local, L] and makes global arrays."""
  sharding = batch_sharding(mesh)
  out = {}
  for k in ('inputs', 'targets', 'mask'):
    x = np.stack([b[k] for b in batch]) if accum > 1 else batch[0][k][None]
    out[k] = jax.make_array_from_process_local_data(sharding, x)
  return out


def abstract_like(state: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings (restore or compile onto a mesh)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)
