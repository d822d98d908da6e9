"""Every launch/*.flags file parses into a valid Config and builds its model abstractly."""

import dataclasses
import glob
import os
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from elastic_depth import config as config_lib, model as model_lib
from experiments import flags_util

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(REPO, 'launch', '*.flags')))


def parse(argv):
  """Parses argv into a fresh FlagValues holding only --config (as pretrain defines it).

  Runs in the repository root, as the launch commands do: a nested --flagfile inside a
  launch file names its path relative to it.
  """
  old_cwd = os.getcwd()
  os.chdir(REPO)
  try:
    argv = flags_util.dedupe_config_overrides(argv)
    old, sys.argv = sys.argv, argv  # config_flags registers overrides found in sys.argv
    try:
      fv = flags.FlagValues()
      holder = config_flags.DEFINE_config_dataclass('config', config_lib.Config(), 'cfg',
                                                    flag_values=fv)
      fv(argv)
    finally:
      sys.argv = old
  finally:
    os.chdir(old_cwd)
  return holder.value


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


def test_135m_mean4_is_the_base_file_plus_one_line():
  base = parse(['prog', f'--flagfile={os.path.join(REPO, "launch", "135m.flags")}'])
  path = os.path.join(REPO, 'launch', '135m_mean4.flags')
  lines = [l for l in open(path, encoding='utf-8').read().splitlines() if l.startswith('--')]
  assert lines == ['--flagfile=launch/135m.flags', '--config.depth.mean=4']
  mean4 = parse(['prog', f'--flagfile={path}'])
  assert mean4 == dataclasses.replace(base, depth=dataclasses.replace(base.depth, mean=4.0))


def test_command_line_overrides_flagfile_tuples():
  path = os.path.join(REPO, 'launch', 'tiny.flags')
  cfg = parse(['prog', f'--flagfile={path}', '--config.depth.buckets=(1,2,3)',
               '--config.depth.r_max=3'])
  assert cfg.depth.buckets == (1, 2, 3) and cfg.depth.r_max == 3
