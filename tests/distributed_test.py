"""Processes, meshes and shardings: the cluster probe, the argument checks and the fsdp
leaf rule in-process; data parallelism (2 steps on a 4-device CPU mesh equal 2 steps on
one device) in a subprocess.

The 4 host devices must be configured before jax starts, so the training runs in
a subprocess that prints its results as JSON; the assertions are made here.
"""

import json
import os
import subprocess
import sys

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from elastic_depth import distributed
from elastic_depth.config import ConfigError

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)

SCRIPT = r'''
import json
import sys

sys.path.insert(0, sys.argv[1])
import jax
import numpy as np

from conftest import random_batch, tiny_config
from elastic_depth import distributed
from elastic_depth import train_step

# Random initial recurrent state (the default), 2 micro-batches of 4 sequences.
cfg = tiny_config(train=dict(batch_size=4),
                  depth=dict(mean=1.5, sigma=0.5, r_max=2, buckets=(1, 2)))
steps = [[random_batch(cfg, 10 * s + a, mask_frac=0.2) for a in range(2)] for s in range(2)]
out = {'device_count': jax.device_count()}
for name, devices in (('mesh4', jax.devices()), ('mesh1', jax.devices()[:1])):
  mesh = distributed.make_mesh(devices)
  graphdef, state = train_step.init_state(cfg, seed=0)
  init = np.concatenate([np.asarray(p).ravel() for p in jax.tree.leaves(state.params)])
  state = train_step.place_state(state, mesh)
  step_fn = train_step.make_train_step(graphdef, cfg, mesh)
  metrics, shards = [], []
  for micro in steps:
    batch = distributed.shard_batch(micro, mesh, 2)
    x = batch['inputs']
    shards.append([x.shape, x.sharding.shard_shape(x.shape), len(x.sharding.device_set)])
    state, m = step_fn(state, batch)
    metrics.append({k: float(m[k]) for k in ('loss', 'grad_norm', 'depth', 'tokens')})
  leaves = jax.tree.leaves(state.params)
  out[name] = dict(
      metrics=metrics, shards=shards, init_params=init.tolist(), step_cache=step_fn._cache_size(),
      params=np.concatenate([np.asarray(p).ravel() for p in leaves]).tolist(),
      params_devices=min(len(p.sharding.device_set) for p in leaves),
      params_replicated=all(p.sharding.is_fully_replicated for p in leaves))
print('RESULT' + json.dumps(out))
'''


def _result() -> dict:
  """Both meshes' shards, metrics and parameters from the 4-device subprocess."""
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=(os.environ.get('XLA_FLAGS', '') +
                        ' --xla_force_host_platform_device_count=4').strip())
  proc = subprocess.run([sys.executable, '-c', SCRIPT, TESTS_DIR], cwd=REPO_DIR, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-5000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT')]
  assert len(lines) == 1, proc.stdout[-2000:]
  return json.loads(lines[0][len('RESULT'):])


@pytest.mark.slow
def test_four_devices_really_shard_the_batch_and_train_like_one_device():
  """One test over one subprocess (a module fixture would be rebuilt on each xdist worker)."""
  result = _result()
  assert result['device_count'] == 4
  for shape, shard, n in result['mesh4']['shards']:
    assert shape == [2, 4, 8] and shard == [2, 1, 8] and n == 4
  for shape, shard, n in result['mesh1']['shards']:
    assert shape == shard == [2, 4, 8] and n == 1
  assert result['mesh4']['params_devices'] == 4
  assert result['mesh4']['params_replicated'] and result['mesh1']['params_replicated']
  assert result['mesh4']['step_cache'] == result['mesh1']['step_cache'] == 1
  # four-device training equals one device
  m4, m1 = result['mesh4'], result['mesh1']
  for a, b in zip(m4['metrics'], m1['metrics']):
    assert a['depth'] == b['depth'] and a['tokens'] == b['tokens']
    assert a['loss'] == pytest.approx(b['loss'], rel=1e-5)
    assert a['grad_norm'] == pytest.approx(b['grad_norm'], rel=1e-4)
  p4, p1 = np.asarray(m4['params']), np.asarray(m1['params'])
  assert p4.shape == p1.shape and p4.size > 10_000
  np.testing.assert_allclose(p4, p1, rtol=1e-5, atol=1e-5)
  # Same init, and the two steps really moved the parameters.
  np.testing.assert_array_equal(m4['init_params'], m1['init_params'])
  assert np.abs(p1 - np.asarray(m1['init_params'])).max() > 1e-3


@pytest.mark.parametrize('env,want', [
    ({}, False),
    ({'SLURM_STEP_NUM_TASKS': '1'}, False),  # a one-task SLURM step is one process
    ({'SLURM_STEP_NUM_TASKS': '4'}, True),
    ({'OMPI_COMM_WORLD_SIZE': '2'}, True),
    ({'OMPI_COMM_WORLD_SIZE': 'x'}, False),
    ({'TPU_WORKER_HOSTNAMES': 'localhost'}, False),  # a single-host TPU VM
    ({'TPU_WORKER_HOSTNAMES': 'h0,h1'}, True),
    ({'JAX_COORDINATOR_ADDRESS': '10.0.0.1:1234'}, True),
    ({'JAX_COORDINATOR_ADDRESS': ''}, False),
])
def test_cluster_detected_reads_the_launchers_environment(env, want):
  assert distributed.cluster_detected(env) is want


@pytest.mark.parametrize('kwargs,match', [
    (dict(coordinator_address='127.0.0.1:1'), 'go together'),
    (dict(num_processes=2, process_id=0), 'go together'),
    (dict(coordinator_address='127.0.0.1:1', num_processes=2, process_id=2), 'not in'),
])
def test_initialize_refuses_partial_or_wrong_arguments_before_joining(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    distributed.initialize(**kwargs)


def test_leaf_specs_split_the_named_axis_and_replicate_the_rest():
  assert distributed.logical_axes('wq_DxHxK') == ('D', 'H', 'K')
  assert distributed.logical_axes('scale') == ()
  tree = {'wq_DxHxK': np.zeros((8, 2, 4)), 'w_down_FxD': np.zeros((6, 8)),
          'scale': np.zeros(8), 'w_bad_DxF': np.zeros((8, 6, 1)), 'count': np.zeros(())}
  specs = jax.tree_util.tree_map_with_path(
      lambda p, x: distributed.leaf_spec(p, x, 'D', 4), tree)
  assert specs == {'wq_DxHxK': P('fsdp', None, None), 'w_down_FxD': P(None, 'fsdp'),
                   'scale': P(), 'w_bad_DxF': P(), 'count': P()}  # rank != suffix: replicated
  one = jax.tree_util.tree_map_with_path(lambda p, x: distributed.leaf_spec(p, x, 'D', 1), tree)
  assert all(s == P() for s in jax.tree.leaves(one, is_leaf=lambda s: isinstance(s, P)))
  with pytest.raises(ConfigError, match='not divisible'):
    distributed.leaf_spec([jax.tree_util.DictKey('w_up_DxF')], np.zeros((6, 8)), 'D', 4)
  with pytest.raises(ConfigError, match='does not divide'):
    distributed.make_mesh(jax.devices()[:1], fsdp=2)


def test_initialize_joins_nothing_without_a_cluster_or_arguments(monkeypatch):
  """One process (no arguments and no launcher in the environment, or num_processes=1):
  nothing to join, and jax.distributed is never called."""
  for name in distributed.CLUSTER_ENV:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(jax.distributed, 'initialize', lambda *a, **k: pytest.fail('joined'))
  assert distributed.initialize() is False
  assert distributed.initialize(num_processes=1) is False


def test_mesh_rows_are_data_replicas_of_fsdp_devices():
  """make_mesh: devices / fsdp rows along `data`, fsdp devices along `fsdp` (one host device
  repeated stands in for n devices: the mesh's shape is what is checked)."""
  device = jax.devices()[0]
  for n, fsdp in ((4, 1), (8, 2), (6, 3), (4, 4)):
    mesh = distributed.make_mesh([device] * n, fsdp=fsdp)
    assert dict(mesh.shape) == {'data': n // fsdp, 'fsdp': fsdp}


def test_leaf_specs_read_the_innermost_name_of_a_nested_state():
  """A TrainState's leaves sit under params/<module>/<index>/... and optimizer states: the
  suffix is read from the leaf's own (innermost) name."""
  tree = {'params': {'coda': [{'attn': {'wq_DxHxK': np.zeros((8, 2, 4))}}],
                     'norm': {'scale': np.zeros(8)}},
          'opt_state': ({'mu': {'w_up_DxF': np.zeros((8, 6))}}, np.zeros(()))}
  specs = jax.tree_util.tree_map_with_path(
      lambda p, x: distributed.leaf_spec(p, x, 'D', 4), tree)
  assert specs == {'params': {'coda': [{'attn': {'wq_DxHxK': P('fsdp', None, None)}}],
                              'norm': {'scale': P()}},
                   'opt_state': ({'mu': {'w_up_DxF': P('fsdp', None)}}, P())}
