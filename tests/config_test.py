"""config.validate rejects every bad numeric field by name, before anything is built."""

import dataclasses
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_depth import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN, INF = math.nan, math.inf

# section.field -> values that must be rejected (written here, independent of config.RANGES).
BAD = {
    'model.vocab_size': [0, -1, 2.0],
    'model.d_model': [0, -5],
    'model.num_heads': [0, -4],
    'model.num_kv_heads': [0, -2],
    'model.head_dim': [0, -8, 1, 7],
    'model.mlp_dim': [0, -1],
    'model.n_prelude': [-1],
    'model.n_core': [0, -1],
    'model.n_coda': [-1],
    'model.max_len': [0, -1],
    'model.rope_theta': [0.0, -1.0, NAN, INF],
    'model.init_std': [0.0, -0.02, NAN, INF],
    'model.state_std': [-1.0, NAN, INF],
    'model.norm_eps': [0.0, -1e-6, NAN],
    'model.embed_scale': [0.0, -1.0, NAN, INF],
    'depth.mean': [0.5, 0.0, -3.0, NAN, INF],
    'depth.sigma': [-0.1, NAN, INF],
    'depth.r_max': [0, -1],
    'depth.buckets': [(), (0, 32), (-1, 32), (1, 2.5, 32), (2, 1, 32), (1, 1, 32), (1, 8)],
    'depth.backprop_depth': [-1],
    'depth.unroll': [0, -2, 1.5],
    'data.val_fraction': [0.0, 1.0, -0.1, 1.5, NAN],
    'data.max_docs': [-1],
    'data.seed': [-1],
    'data.synth_examples': [0, -1],
    'data.synth_num_ops': [0, -1],
    'data.synth_curriculum': [-1],
    'data.synth_max_hops': [0, -1],
    'data.synth_num_vars': [0, -1, 5],  # 5 < synth_max_hops=6
    'train.seed': [-1],
    'train.steps': [0, -1],
    'train.batch_size': [0, -1],
    'train.seq_len': [0, -1, 4096],  # 4096 > model.max_len
    'train.grad_accum': [0, -1],
    'train.tokens_per_step': [-1, 1000],  # 1000: not a multiple of batch*seq
    'train.lr': [0.0, -1e-3, NAN, INF],
    'train.min_lr_ratio': [-0.1, 1.5, NAN],
    'train.warmup_steps': [-1],
    'train.decay_frac': [-0.1, 1.5, NAN],
    'train.weight_decay': [-0.1, NAN],
    'train.b1': [-0.1, 1.0, NAN],
    'train.b2': [-0.1, 1.0, NAN],
    'train.grad_clip': [0.0, -1.0, NAN],
    'train.eval_every': [0, -1],
    'train.eval_batches': [0, -1],
    'train.eval_depths': [(), (0, 2), (1, -2)],
    'train.ckpt_every': [0, -1],
    'train.keep_checkpoints': [0, -1],
    'train.log_every': [0, -1],
    'train.max_skips': [-1], 'train.fsdp': [0, 1.5], 'train.peak_flops': [-1.0, float('nan')],
    'train.loss_chunk': [-1, 2.5],
    'exit.eps': [-0.1, NAN, INF],
    'exit.depth': [0, -1],
    'exit.min_loops': [0, -1, 33],  # 33 > exit.max_loops
    'exit.max_loops': [0, -1],
    'exit.check_every': [0, -1],
    'exit.compact_steps': [0, -2],
    'exit.gate': [-0.1, NAN],
    'exit.patience': [0, -1, 2],  # 2: the default policy (kl) has no patience
    'exit.eps_growth': [0.0, -1.0, NAN],
}

# Boundary values that must still be accepted.
GOOD = {
    'model.n_prelude': 0, 'model.n_coda': 0, 'model.head_dim': 2, 'model.state_std': 0.0,
    'depth.mean': 1.0, 'depth.sigma': 0.0, 'depth.backprop_depth': 0, 'depth.unroll': 1,
    'data.max_docs': 0,
    'train.tokens_per_step': 0, 'train.min_lr_ratio': 1.0, 'train.decay_frac': 0.0,
    'train.warmup_steps': 0, 'train.weight_decay': 0.0, 'train.b1': 0.0,
    'train.max_skips': 0, 'exit.eps': 0.0, 'exit.gate': 0.0, 'exit.min_loops': 32,
}


def numeric_fields() -> list[str]:
  """section.field of every int, float or tuple field of every section of Config."""
  out = []
  for section in dataclasses.fields(config_lib.Config):
    default = section.default_factory()
    for f in dataclasses.fields(default):
      v = getattr(default, f.name)
      if isinstance(v, (int, float, tuple)) and not isinstance(v, bool):
        out.append(f'{section.name}.{f.name}')
  return out


def with_value(name: str, value) -> config_lib.Config:
  section, field = name.split('.')
  cfg = config_lib.Config()
  setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **{field: value}))
  return cfg


def test_every_numeric_field_has_bad_values():
  assert sorted(BAD) == sorted(numeric_fields())
  assert len(BAD) > 40


def test_defaults_validate():
  config_lib.validate(config_lib.Config())


@pytest.mark.parametrize('name', sorted(BAD))
def test_bad_value_is_rejected_by_name(name):
  for value in BAD[name]:
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.validate(with_value(name, value))
    msg = str(e.value)
    assert f'{name}=' in msg and '\n' not in msg, (value, msg)


@pytest.mark.parametrize('name', sorted(GOOD))
def test_boundary_value_is_accepted(name):
  config_lib.validate(with_value(name, GOOD[name]))


def test_cross_field_checks_name_both_fields():
  cfg = with_value('model.num_heads', 3)  # default num_kv_heads = 2
  with pytest.raises(config_lib.ConfigError, match='model.num_heads=3.*model.num_kv_heads=2'):
    config_lib.validate(cfg)


def test_bad_remat_policy_is_rejected_by_name():
  cfg = with_value('depth.remat_policy', 'everything')
  with pytest.raises(config_lib.ConfigError, match="depth.remat_policy='everything' not in "
                     r"\['all_dots', 'dots', 'nothing'\]"):
    config_lib.validate(cfg)


@pytest.mark.parametrize('flag,needle', [('--config.model.d_model=-5', 'model.d_model=-5'),
                                         ('--config.model.head_dim=0', 'model.head_dim=0')])
def test_pretrain_exits_2_with_one_line(flag, needle, tmp_path):
  out = subprocess.run([sys.executable, '-m', 'experiments.pretrain', '--quiet',
                        f'--workdir={tmp_path / "run"}', flag], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ') and needle in lines[0], lines
  assert not (tmp_path / 'run' / 'checkpoints').exists()


def test_check_exit_refuses_what_the_engines_cannot_honour():
  E = config_lib.ExitConfig
  config_lib.check_exit(E(eps=-1.0))  # below every statistic: the benchmarks' scheduled exits
  config_lib.check_exit(E(eps=np.array([0.1, 0.2])))  # per-row thresholds are not scalars
  for kw, words in [(dict(eps=float('nan')), 'exit.eps=nan'), (dict(max_loops=0), 'max_loops'),
                    (dict(check_every=0), 'check_every'), (dict(depth=0), 'exit.depth'),
                    (dict(eps_growth=0.0), 'eps_growth'),
                    (dict(gate=float('inf')), 'exit.gate=inf'),
                    # numpy and jax scalars and per-row arrays are concrete values too
                    (dict(eps=np.float32('nan')), 'exit.eps=.*must be a finite'),
                    (dict(eps=jnp.float32(float('nan'))), 'exit.eps=.*must be a finite'),
                    (dict(eps=np.array([0.1, np.nan])), 'exit.eps=.*must be a finite'),
                    (dict(max_loops=np.int32(0)), 'max_loops')]:
    with pytest.raises(config_lib.ConfigError, match=words):
      config_lib.check_exit(E(**kw))
  jax.jit(lambda eps: config_lib.check_exit(E(eps=eps)) or eps)(jnp.float32(0.1))  # traced: skipped


def test_seq_len_equal_to_max_len_is_accepted_and_one_more_is_not():
  """The model has positions 0..max_len-1, so a sequence of exactly max_len tokens fits."""
  max_len = config_lib.ModelConfig().max_len
  config_lib.validate(with_value('train.seq_len', max_len))
  with pytest.raises(config_lib.ConfigError, match=f'train.seq_len={max_len + 1}'):
    config_lib.validate(with_value('train.seq_len', max_len + 1))


@pytest.mark.parametrize('batch,seq,accum', [(1, 16, 3), (4, 8, 2), (16, 128, 1), (3, 5, 7)])
def test_grad_accum_steps_makes_up_tokens_per_step(batch, seq, accum):
  """tokens_per_step = accum micro-batches of batch x seq tokens; grad_accum is then ignored
  (and used as given when tokens_per_step is 0)."""
  t = config_lib.TrainConfig(batch_size=batch, seq_len=seq, grad_accum=11,
                             tokens_per_step=accum * batch * seq)
  config_lib.validate(dataclasses.replace(config_lib.Config(), train=t))
  got = config_lib.grad_accum_steps(t)
  assert got == accum and got * batch * seq == t.tokens_per_step
  assert config_lib.grad_accum_steps(dataclasses.replace(t, tokens_per_step=0)) == 11
