"""`pretrain --dry_run`: every check, the step compiled ahead of time, nothing trained."""

import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_depth import distributed, dry_run, model as model_lib, policies, train_step
from pretrain_errors_test import TINY, tiny_config


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"
def test_dry_run_compiles_reports_memory_and_trains_nothing(tmp_path):
  wd = tmp_path / 'wd'
  out = subprocess.run([sys.executable, '-m', 'experiments.pretrain', f'--workdir={wd}',
                        *TINY, '--dry_run'], cwd=REPO, capture_output=True, text=True,
                       timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout
  assert not (wd / 'checkpoints').exists() and not (wd / 'metrics.jsonl').exists()
  # the printed figures are the config's: parameters, and the compiled step's memory with
  # and without remat (compiled again here, to the printed precision)
  cfg = tiny_config()
  assert f'params {model_lib.count_params(cfg.model):,};' in text
  mesh = distributed.make_mesh(jax.devices()[:1])
  for remat in (True, False):
    c = dataclasses.replace(cfg, depth=dataclasses.replace(cfg.depth, remat=remat))
    m = dry_run.compiled_memory(c, mesh)
    line = next(x for x in text.splitlines() if x.strip().startswith(
        f'remat_{"on" if remat else "off"}:'))
    got = [float(v) for v in re.findall(r'([\d.]+) MiB', line)]
    want = [m[f] / 2**20 for f in ('argument_size_in_bytes', 'output_size_in_bytes',
                                   'temp_size_in_bytes', 'peak_bytes')]
    np.testing.assert_allclose(got, want, atol=0.051)
    assert want[2] > 0
  hours = re.search(r'H200 ([\d.]+) (h|min)', text)
  p = dry_run.plan(cfg)
  assert hours and float(hours.group(1)) == pytest.approx(
      p['hours_one_device']['H200'] * (60 if hours.group(2) == 'min' else 1), abs=0.051)


@pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"
def test_dry_run_still_refuses_bad_input(tmp_path):
  out = subprocess.run([sys.executable, '-m', 'experiments.pretrain',
                        f'--workdir={tmp_path / "wd"}', *TINY, '--dry_run',
                        '--config.data.source=text', f'--config.data.paths={tmp_path}/none.txt'],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 2 and out.stderr.strip().startswith('error:'), out.stderr[-2000:]
  assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"
def test_memory_grows_with_the_batch_and_the_plan_counts_flops():
  cfg = tiny_config()
  mesh = distributed.make_mesh(jax.devices()[:1])
  small = dry_run.compiled_memory(cfg, mesh)
  big_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=16))
  big = dry_run.compiled_memory(big_cfg, mesh)
  assert big['temp_size_in_bytes'] > small['temp_size_in_bytes'] > 0
  # arguments hold the parameters and two Adam moments (fp32) plus the batch
  n = model_lib.count_params(cfg.model)
  assert small['argument_size_in_bytes'] >= 3 * 4 * n
  p = dry_run.plan(cfg, mfu=0.5)
  tokens = cfg.train.batch_size * cfg.train.seq_len
  assert p['tokens_per_step'] == tokens and p['params'] == n
  # the expected executed loops (train_step_test checks that against the sampler's draws)
  probs = policies.bucket_probabilities(cfg.depth)
  loops = probs @ np.asarray(cfg.depth.buckets, np.float64)
  want = 3 * model_lib.flops_per_token(cfg.model, loops, cfg.train.seq_len)['total']
  assert p['train_flops_per_token'] == pytest.approx(want, rel=1e-12)
  assert p['hours_one_device']['H200'] == (
      want * tokens * cfg.train.steps / (989e12 * 0.5) / 3600)


def test_peak_memory_counts_a_donated_buffer_once():
  """memory_of's peak against the buffers themselves: a step whose output reuses its
  donated argument holds one copy (nbytes + temporaries); without donation, two."""
  x = jnp.ones((256, 1024), jnp.float32)
  nbytes = x.size * 4
  f = lambda x: x * 2 + 1
  donated = dry_run.memory_of(jax.jit(f, donate_argnums=0).lower(x).compile())
  plain = dry_run.memory_of(jax.jit(f).lower(x).compile())
  assert donated['alias_size_in_bytes'] == nbytes  # XLA:CPU honours the donation
  assert donated['peak_bytes'] == nbytes + donated['temp_size_in_bytes']
  assert plain['peak_bytes'] == 2 * nbytes + plain['temp_size_in_bytes']


@pytest.mark.parametrize('accum', [dict(grad_accum=3), dict(tokens_per_step=4 * 4 * 32)])
def test_plan_counts_every_micro_batch(accum):
  """With gradient accumulation a step trains A x B x L tokens (A micro-batches), and the
  total FLOPs and hours follow: reference, the counts multiplied out here."""
  cfg = tiny_config()
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **accum))
  a = accum.get('grad_accum') or accum['tokens_per_step'] // (4 * 32)
  p = dry_run.plan(cfg, mfu=0.5)
  tokens = a * cfg.train.batch_size * cfg.train.seq_len
  assert p['tokens_per_step'] == tokens
  assert p['tokens'] == tokens * cfg.train.steps
  assert p['total_flops'] == pytest.approx(
      train_step.train_flops_per_token(cfg) * tokens * cfg.train.steps, rel=1e-12)
  assert p['hours_one_device']['H200'] == pytest.approx(
      p['total_flops'] / (989e12 * 0.5) / 3600, rel=1e-12)
