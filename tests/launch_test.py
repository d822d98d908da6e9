"""Every launch/*.flags file parses into a valid Config and builds its model abstractly."""

import contextlib
import dataclasses
import glob
import os
import shlex
import subprocess
import sys

import pytest

from elastic_depth import config as config_lib, model as model_lib
from experiments import flags_util

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(REPO, 'launch', '*.flags')))


def parse(argv):
  """Parses argv as pretrain does, from the repo root (nested flag files are relative to it)."""
  with contextlib.chdir(REPO):
    return flags_util.parse_config(argv)


def launch(name: str):
  """The Config of launch/<name>, parsed as pretrain does."""
  return parse(['prog', f'--flagfile={os.path.join(REPO, "launch", name)}'])


def test_there_are_launch_files():
  names = {os.path.basename(f) for f in FILES}
  assert {'tiny.flags', '135m.flags', '135m_mean4.flags', 'tinystories_cpu.flags',
          'tinystories_cpu_mean4.flags'} <= names


@pytest.mark.parametrize('path', FILES, ids=os.path.basename)
def test_flagfile_parses_validates_and_builds(path):
  text = open(path, encoding='utf-8').read()
  header = [l for l in text.splitlines() if l.startswith('#')]
  assert any('python -m experiments.pretrain' in l and os.path.basename(path) in l
             for l in header), 'the header must give the command'
  assert any('xpected' in l for l in header), 'the header must give the expected result'
  cfg = parse(['prog', f'--flagfile={path}'])
  config_lib.validate(cfg)
  n = model_lib.count_params(cfg.model)  # eval_shape: nothing allocated
  assert n > 0
  if os.path.basename(path).startswith('135m'):
    m = cfg.model
    assert (m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size) == (
        576, 9, 3, 64, 1536, 49152)
    assert (m.n_prelude, m.n_core, m.n_coda) == (2, 4, 2)
    assert abs(n - 57.3e6) < 0.05e6  # tied head
    assert cfg.train.tokens_per_step == 2 ** 18
    assert cfg.depth.mean == (4 if 'mean4' in path else 8)
    assert (cfg.data.source, cfg.data.paths) == ('tokens', 'data/fineweb-edu-10BT')
    assert any('python -m experiments.prepare_data --flagfile=launch/135m.flags' in l
               and '--config.data.source=hf' in l for l in header), 'the prepare command'


def test_135m_h200_is_the_base_file_without_remat_and_unrolled():
  """launch/135m_h200.flags: the paper's run with the step measured fastest on an H200."""
  base = launch('135m.flags')
  cfg = launch('135m_h200.flags')
  assert (base.depth.remat, base.depth.unroll, base.train.loss_chunk) == (True, 1, 4096)
  assert (cfg.depth.remat, cfg.depth.unroll) == (False, 8)
  assert dataclasses.replace(cfg.depth, remat=True, unroll=1) == base.depth
  assert (cfg.model, cfg.train, cfg.data) == (base.model, base.train, base.data)


def test_135m_mean4_is_the_base_file_plus_one_line():
  base = launch('135m.flags')
  path = os.path.join(REPO, 'launch', '135m_mean4.flags')
  lines = [l for l in open(path, encoding='utf-8').read().splitlines() if l.startswith('--')]
  assert lines == ['--flagfile=launch/135m.flags', '--config.depth.mean=4']
  mean4 = parse(['prog', f'--flagfile={path}'])
  assert mean4 == dataclasses.replace(base, depth=dataclasses.replace(base.depth, mean=4.0))


@pytest.mark.parametrize('path', [f for f in FILES if f.endswith('_mean4.flags')],
                         ids=os.path.basename)
def test_mean4_twin_differs_from_its_base_only_in_the_mean_depth(path):
  base = parse(['prog', f'--flagfile={path.replace("_mean4.flags", ".flags")}'])
  twin = parse(['prog', f'--flagfile={path}'])
  assert base.depth.mean == 8 and twin.depth.mean == 4
  assert twin == dataclasses.replace(base, depth=dataclasses.replace(base.depth, mean=4.0))


def test_tiny_mean8_differs_from_the_main_job_only_in_its_depths():
  """launch/tiny_mean8.flags: the main job at training mean 8 (its loops reach r_max 16)."""
  base = launch('tiny.flags')
  cfg = launch('tiny_mean8.flags')
  assert (cfg.depth.mean, cfg.depth.r_max, max(cfg.depth.buckets)) == (8.0, 16, 16)
  assert max(cfg.train.eval_depths) == 16
  assert dataclasses.replace(cfg.depth, mean=base.depth.mean, r_max=base.depth.r_max,
                             buckets=base.depth.buckets) == base.depth
  assert dataclasses.replace(cfg.train, eval_depths=base.train.eval_depths) == base.train
  assert (cfg.model, cfg.data) == (base.model, base.data)


def test_tiny_mean8_d256_differs_from_tiny_mean8_only_in_its_width():
  """launch/tiny_mean8_d256.flags: the mean-8 chain job with d_model 256 (heads of dim 64)."""
  base = launch('tiny_mean8.flags')
  cfg = launch('tiny_mean8_d256.flags')
  m = cfg.model
  assert (m.d_model, m.num_heads * m.head_dim, m.mlp_dim) == (256, 256, 512)
  assert dataclasses.replace(m, d_model=base.model.d_model, head_dim=base.model.head_dim,
                             mlp_dim=base.model.mlp_dim) == base.model
  assert (cfg.depth, cfg.train, cfg.data) == (base.depth, base.train, base.data)


def test_tiny_digit_last_differs_from_tiny_mean8_in_its_task_only():
  """launch/tiny_digit_last.flags: the mean-8 job on the digit_last task (k <= 3, 1,500
  steps)."""
  base = launch('tiny_mean8.flags')
  cfg = launch('tiny_digit_last.flags')
  d = cfg.data
  assert (d.synth_task, d.synth_max_hops, cfg.train.steps) == ('digit_last', 3, 1500)
  assert dataclasses.replace(d, synth_task=base.data.synth_task,
                             synth_max_hops=base.data.synth_max_hops) == base.data
  assert dataclasses.replace(cfg.train, steps=base.train.steps) == base.train
  assert (cfg.model, cfg.depth) == (base.model, base.depth)


def test_tiny_digit_last_k5_differs_from_tiny_digit_last_in_its_data_and_length():
  """launch/tiny_digit_last_k5.flags: k <= 5, 60,000 programs, 12,000 steps."""
  base = launch('tiny_digit_last.flags')
  cfg = launch('tiny_digit_last_k5.flags')
  d, t = cfg.data, cfg.train
  assert (d.synth_max_hops, d.synth_examples, d.synth_curriculum) == (5, 60000, 16000)
  assert (t.steps, t.eval_every, t.ckpt_every) == (12000, 2000, 2000)
  assert dataclasses.replace(d, synth_max_hops=3, synth_examples=base.data.synth_examples,
                             synth_curriculum=base.data.synth_curriculum) == base.data
  assert dataclasses.replace(t, steps=1500, eval_every=base.train.eval_every,
                             ckpt_every=base.train.ckpt_every) == base.train
  assert (cfg.model, cfg.depth) == (base.model, base.depth)


def test_nested_flagfile_is_expanded_in_place(tmp_path):
  inner = tmp_path / 'inner.flags'
  inner.write_text('--config.model.d_model=48\n--config.depth.mean=3\n')
  outer = tmp_path / 'outer.flags'
  outer.write_text(f'# comment\n--config.depth.mean=2\n--flagfile={inner}\n'
                   '--config.model.d_model=40\n')
  cfg = parse(['prog', f'--flagfile={outer}'])
  assert (cfg.depth.mean, cfg.model.d_model) == (3.0, 40)  # the later line wins


def test_command_line_overrides_flagfile_tuples():
  path = os.path.join(REPO, 'launch', 'tiny.flags')
  cfg = parse(['prog', f'--flagfile={path}', '--config.depth.buckets=(1,2,3)',
               '--config.depth.r_max=3'])
  assert cfg.depth.buckets == (1, 2, 3) and cfg.depth.r_max == 3


_PARSE_ONLY = ("import importlib, sys\nfrom absl import flags\n"
               "importlib.import_module(sys.argv[1])\nflags.FLAGS(['prog'] + sys.argv[2:])\n")


def test_device_check_script_runs_real_mains_with_valid_flags(tmp_path):
  """launch/device_check.sh (DRY=1: its commands) names existing tests and parseable flags."""
  script = os.path.join(REPO, 'launch', 'device_check.sh')
  subprocess.run(['bash', '-n', script], check=True)
  env = dict(os.environ, DRY='1', OUT=str(tmp_path))
  out = subprocess.run(['bash', script], env=env, capture_output=True, text=True, check=True)
  cmds = [shlex.split(l) for l in out.stdout.splitlines()]
  cmds = [c[1 + sum('=' in a for a in c[1:3]):] if c[0] == 'env' else c for c in cmds]
  assert [c[2] for c in cmds] == [
      'experiments.bench_train', 'experiments.bench_train', 'experiments.bench_train',
      'experiments.bench_train', 'experiments.profile_train', 'pytest', 'experiments.bench_exit']
  assert any('--fuse_projections' in c for c in cmds)
  assert all(c[:2] == ['python3', '-m'] for c in cmds)
  assert any('--shapes=135m' in c for c in cmds)  # issue 13's GPU step
  for c in cmds:
    if c[2] == 'pytest':
      for a in (a for a in c[3:] if a.startswith('tests/')):  # files, or file::test ids
        path, _, test = a.partition('::')
        with open(os.path.join(REPO, path), encoding='utf-8') as f:
          assert not test or f'def {test}(' in f.read(), a
      continue
    res = subprocess.run([sys.executable, '-c', _PARSE_ONLY, c[2], *c[3:]], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert all(str(tmp_path) in a for a in c if a.startswith('--out='))


def test_parse_only_rejects_an_unknown_flag():
  res = subprocess.run([sys.executable, '-c', _PARSE_ONLY, 'experiments.bench_exit',
                        '--shapez=P'], cwd=REPO, capture_output=True, text=True)
  assert res.returncode != 0 and 'shapez' in res.stderr
