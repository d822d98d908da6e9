"""Shared tiny configurations for the model, recurrence, policy and train-step tests.

Compilation dominates the runtime of these tests, so every shape here is as small
as still exercises the code paths (GQA with 2 query heads per kv head, a prelude,
a 2-block core and a coda).
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from elastic_depth import config as config_lib


def tiny_model_config(**overrides) -> config_lib.ModelConfig:
  """A 32-wide looped LM: 4 query heads over 2 kv heads, 1/2/1 blocks, vocab 64."""
  base = config_lib.ModelConfig(
      vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
      n_prelude=1, n_core=2, n_coda=1, max_len=64)
  return dataclasses.replace(base, **overrides)


def tiny_config(model=None, depth=None, train=None) -> config_lib.Config:
  """A full Config around tiny_model_config with small depth buckets.

  Args:
    model: overrides of tiny_model_config.
    depth: overrides of the DepthConfig (buckets 1..4, mean 2.5).
    train: overrides of the TrainConfig (batch 4, seq 8).
  Returns:
    A validated Config.
  """
  cfg = config_lib.Config(
      model=tiny_model_config(**(model or {})),
      depth=dataclasses.replace(
          config_lib.DepthConfig(mean=2.5, sigma=0.5, r_max=4, buckets=(1, 2, 3, 4)),
          **(depth or {})),
      train=dataclasses.replace(
          config_lib.TrainConfig(seed=0, steps=100, batch_size=4, seq_len=8, lr=1e-2,
                                 warmup_steps=5),
          **(train or {})))
  config_lib.validate(cfg)
  return cfg


def random_batch(cfg: config_lib.Config, seed: int, batch_size=None, mask_frac=0.0):
  """One host batch dict of int32 inputs/targets and float32 mask, shaped [B, L]."""
  rng = np.random.default_rng(seed)
  b = batch_size or cfg.train.batch_size
  shape = (b, cfg.train.seq_len)
  v = cfg.model.vocab_size
  mask = (rng.random(shape) >= mask_frac).astype(np.float32)
  mask[:, 0] = 1.0  # never an empty micro-batch
  return dict(inputs=rng.integers(0, v, shape).astype(np.int32),
              targets=rng.integers(0, v, shape).astype(np.int32), mask=mask)


@functools.cache
def _tiny_tfds_builder():
  """A TFDS builder of 12 train ('t story i') and 3 validation ('v story i') texts."""
  tfds = pytest.importorskip('tensorflow_datasets')

  class ElasticDepthTinyText(tfds.core.GeneratorBasedBuilder):
    """Tiny local text dataset."""
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self, features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples('t', 12),
              'validation': self._generate_examples('v', 3)}

    def _generate_examples(self, prefix, n):
      for i in range(n):
        yield i, {'text': f'{prefix} story {i}'}

  return ElasticDepthTinyText


@pytest.fixture
def tiny_tfds(tmp_path) -> tuple[str, str]:
  """(tfds_name, tfds_data_dir) of a locally prepared array_record text dataset."""
  _tiny_tfds_builder()(data_dir=str(tmp_path / 'tfds'),
                       file_format='array_record').download_and_prepare()
  return 'elastic_depth_tiny_text', str(tmp_path / 'tfds')


@pytest.fixture(scope='session')
def make_config():
  """The tiny_config factory (for tests that need their own overrides)."""
  return tiny_config


@pytest.fixture(scope='session')
def make_batch():
  """The random_batch factory."""
  return random_batch


@pytest.fixture(scope='session')
def model_cfg() -> config_lib.ModelConfig:
  return tiny_model_config()


@pytest.fixture(scope='session')
def cfg() -> config_lib.Config:
  return tiny_config()


@pytest.fixture(autouse=True, scope='session')
def _cpu_float32_matmuls():
  """Full-precision matmuls so that float32 tolerances are meaningful everywhere."""
  with jax.default_matmul_precision('highest'):
    yield
