"""elastic_depth.checkpoint: checksums, fall-back past corrupt checkpoints, clear save errors.

In-process on small pytrees (no model, nothing compiled).
"""

import dataclasses
import errno
import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from elastic_depth import checkpoint, config as config_lib, train_step
from elastic_depth.data import SyntheticVocab

MODEL = config_lib.ModelConfig(vocab_size=31, d_model=32)


def make_state(seed: int):
  rng = np.random.default_rng(seed)  # random floats: zstd stores them uncompressed
  return {'step': jnp.int32(seed),
          'params': {'w': jnp.asarray(rng.standard_normal((64, 64)), jnp.float32),
                     'b': jnp.asarray(rng.standard_normal(8), jnp.float32)}}


def meta(model=MODEL, vocab=SyntheticVocab(16)):
  cfg = config_lib.Config(model=model)
  return {'config': train_step.config_dict(cfg), 'data_iter': {'i': 1},
          'tokenizer': checkpoint.tokenizer_info(vocab)}


@pytest.fixture
def workdir(tmp_path):
  """Committed checkpoints at steps 1 and 2."""
  wd = str(tmp_path / 'run')
  mngr = checkpoint.manager(wd)
  for step in (1, 2):
    checkpoint.save(mngr, step, make_state(step), meta())
  checkpoint.wait(mngr)
  mngr.close()
  return wd


def step_dir(wd, step):
  return os.path.join(checkpoint.checkpoint_dir(wd), str(step))


def data_files(wd, step):
  root = os.path.join(step_dir(wd, step), 'state')
  return [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs
          if os.sep + 'd' + os.sep in os.path.join(r, f)]


def flip_one_bit(path):
  with open(path, 'r+b') as f:
    f.seek(os.path.getsize(path) // 2)
    b = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([b[0] ^ 0x01]))


def corrupt(wd, step, how):
  if how == 'truncate':
    for f in data_files(wd, step):
      os.truncate(f, os.path.getsize(f) // 2)
  elif how == 'garble':  # one bit of the largest array file: orbax restores it silently
    flip_one_bit(max((f for f in data_files(wd, step) if 'ocdbt.process_' in f),
                     key=os.path.getsize))
  elif how == 'meta':
    with open(os.path.join(step_dir(wd, step), 'meta', 'metadata'), 'w') as f:
      f.write('{"config": ')
  elif how == 'missing':
    for f in data_files(wd, step):
      os.remove(f)


def equal(a, b):
  chex.assert_trees_all_equal_structs(a, b)
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_round_trip_restores_the_newest_with_its_checksum(workdir):
  mngr = checkpoint.manager(workdir)
  step, state, m = checkpoint.restore_latest(mngr, make_state(0), config_lib.Config(model=MODEL),
                                             tokenizer=SyntheticVocab(16))
  assert step == 2 and equal(state, make_state(2))
  assert m['checksum'] == checkpoint.state_checksum(make_state(2)) != checkpoint.state_checksum(
      make_state(1))
  assert m['data_iter'] == {'i': 1} and m['tokenizer']['vocab_size'] == 31


def test_interrupted_save_leaves_a_tmp_folder_that_is_ignored(workdir, capsys):
  # what a kill during a save leaves behind: an uncommitted, half-written tmp folder
  tmp = os.path.join(checkpoint.checkpoint_dir(workdir), '3.orbax-checkpoint-tmp-1700000000')
  shutil.copytree(step_dir(workdir, 2), tmp)
  os.remove(os.path.join(tmp, 'commit_success.txt'))
  for f in data_files(workdir, 2):
    os.truncate(f.replace(step_dir(workdir, 2), tmp), 3)
  mngr = checkpoint.manager(workdir)
  assert list(mngr.all_steps()) == [1, 2]
  step, state, _ = checkpoint.restore_latest(mngr, make_state(0), quarantine=True)
  assert step == 2 and equal(state, make_state(2))
  assert 'warning' not in capsys.readouterr().out
  assert os.path.isdir(tmp)  # nothing deleted


@pytest.mark.parametrize('how', ['truncate', 'garble', 'meta', 'missing'])
def test_corrupt_latest_falls_back_to_the_previous_and_moves_it_aside(workdir, how, capsys):
  corrupt(workdir, 2, how)
  mngr = checkpoint.manager(workdir)
  step, state, _ = checkpoint.restore_latest(mngr, make_state(0), config_lib.Config(model=MODEL),
                                             quarantine=True)
  assert step == 1 and equal(state, make_state(1))
  out = capsys.readouterr().out
  assert 'skipped unusable checkpoint(s) [2]' in out and 'resumed from step 1' in out, out
  if how == 'garble':
    assert 'checksum' in out
  moved = os.listdir(os.path.join(workdir, checkpoint.CORRUPT_DIR))
  assert len(moved) == 1 and moved[0].startswith('2-')
  assert list(mngr.all_steps()) == [1]
  checkpoint.save(mngr, 2, make_state(22), meta())  # the step can be saved again
  checkpoint.wait(mngr)
  assert checkpoint.restore_latest(mngr, make_state(0))[0] == 2


def test_load_state_skips_a_garbled_latest_without_moving_it(workdir, capsys):
  corrupt(workdir, 2, 'garble')
  state, _ = checkpoint.load_state(workdir, make_state(0), config_lib.Config(model=MODEL))
  assert equal(state, make_state(1))
  assert os.path.isdir(step_dir(workdir, 2))
  err = capsys.readouterr().err  # evaluation says which step it fell back to, and why
  assert 'skipped unusable checkpoint(s) [2]' in err and 'using step 1' in err, err
  with pytest.raises(checkpoint.CheckpointError, match='checksum'):
    checkpoint.load_state(workdir, make_state(0), step=2)


def test_no_usable_checkpoint_is_an_error_naming_each(workdir):
  corrupt(workdir, 2, 'truncate')
  corrupt(workdir, 1, 'garble')
  with pytest.raises(checkpoint.CheckpointError,
                     match=r'no usable checkpoint in .*step 2: .*step 1: .*checksum') as e:
    checkpoint.restore_latest(checkpoint.manager(workdir), make_state(0))
  assert 'TensorStore(' not in str(e.value) and 'See full TensorStore' not in str(e.value)


def test_other_model_config_or_tokenizer_is_an_error_not_a_fall_back(workdir):
  mngr = checkpoint.manager(workdir)
  other = config_lib.Config(model=config_lib.ModelConfig(vocab_size=31, d_model=64))
  with pytest.raises(checkpoint.MismatchError, match='d_model: checkpoint=32 vs config=64'):
    checkpoint.restore_latest(mngr, make_state(0), other)
  with pytest.raises(checkpoint.MismatchError, match=r'another tokenizer .*vocab 31.*vocab 25'):
    checkpoint.restore_latest(mngr, make_state(0), tokenizer=SyntheticVocab(10))
  with pytest.raises(checkpoint.MismatchError):
    checkpoint.load_state(workdir, make_state(0), other)
  assert list(mngr.all_steps()) == [1, 2]
  checkpoint.check_tokenizer(None, SyntheticVocab(10), 'old')  # older checkpoints: no check


def test_model_config_check_ignores_compute_choices_and_defaults_fields_added_since():
  saved = json.loads(json.dumps(dataclasses.asdict(MODEL)))
  del saved['attention_impl']  # a checkpoint from before the field existed
  checkpoint.check_model_config(saved, MODEL, 'old')
  checkpoint.check_model_config(saved, dataclasses.replace(MODEL, attention_impl='xla',
                                                           dtype='bfloat16'), 'old')
  del saved['rope_theta']  # a field the checkpoint lacks is compared as its default
  with pytest.raises(checkpoint.MismatchError, match='rope_theta: checkpoint=10000.0 vs'):
    checkpoint.check_model_config(saved, dataclasses.replace(MODEL, rope_theta=500.0), 'old')


def test_changed_stream_settings_names_data_depth_and_batch_fields_only():
  cfg = config_lib.Config()
  saved = json.loads(json.dumps(dataclasses.asdict(cfg)))
  assert checkpoint.changed_stream_settings(saved, cfg) == []
  now = dataclasses.replace(
      cfg, data=dataclasses.replace(cfg.data, seed=cfg.data.seed + 1),
      depth=dataclasses.replace(cfg.depth, mean=cfg.depth.mean + 1),
      train=dataclasses.replace(cfg.train, batch_size=cfg.train.batch_size * 2,
                                lr=cfg.train.lr / 2, steps=cfg.train.steps + 1))
  got = checkpoint.changed_stream_settings(saved, now)
  assert got == [f'data.seed: checkpoint={cfg.data.seed} vs config={cfg.data.seed + 1}',
                 f'depth.mean: checkpoint={cfg.depth.mean} vs config={cfg.depth.mean + 1}',
                 f'train.batch_size: checkpoint={cfg.train.batch_size} vs config='
                 f'{cfg.train.batch_size * 2}'], got  # lr and steps may change freely
  del saved['data']['val_fraction']  # a field the checkpoint lacks is compared as its default
  assert checkpoint.changed_stream_settings(saved, cfg) == []
  # how the same step is computed is not the stream
  compute = dataclasses.replace(cfg, depth=dataclasses.replace(cfg.depth, remat=False, unroll=2))
  assert checkpoint.changed_stream_settings(saved, compute) == []


def test_tokenizer_fingerprint_sees_the_vocabulary_not_only_its_size():
  a, b = SyntheticVocab(16), SyntheticVocab(16)
  assert checkpoint.tokenizer_info(a) == checkpoint.tokenizer_info(b)
  b.tokens = b.tokens[:-2] + b.tokens[-1:] + b.tokens[-2:-1]  # same size, two ids swapped
  with pytest.raises(checkpoint.MismatchError, match='fingerprint'):
    checkpoint.check_tokenizer(checkpoint.tokenizer_info(a), b, 'x')


def test_disk_full_is_a_clear_error_and_keeps_the_previous(workdir, monkeypatch):
  mngr = checkpoint.manager(workdir)

  def full(self, step, *a, **kw):
    os.makedirs(os.path.join(str(self.directory), f'{step}.orbax-checkpoint-tmp-1'))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(ocp.CheckpointManager, 'save', full)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r'saving checkpoint step 3 .*No space left on device.*disk is '
                           r'full.*step 2, is intact'):
    checkpoint.save(mngr, 3, make_state(3), meta())
  monkeypatch.undo()
  step, state, _ = checkpoint.restore_latest(checkpoint.manager(workdir), make_state(0))
  assert step == 2 and equal(state, make_state(2))


def test_a_failed_asynchronous_save_surfaces_in_wait(workdir, monkeypatch):
  mngr = checkpoint.manager(workdir)
  monkeypatch.setattr(ocp.CheckpointManager, 'wait_until_finished',
                      lambda self: (_ for _ in ()).throw(OSError(errno.ENOSPC, 'No space')))
  with pytest.raises(checkpoint.CheckpointError, match='disk is full.*step 2, is intact'):
    checkpoint.wait(mngr)


def test_existing_manager_creates_nothing(tmp_path):
  assert checkpoint.existing_manager(str(tmp_path / 'fresh')) is None
  assert not (tmp_path / 'fresh').exists()


def test_short_error_keeps_the_first_line_and_the_root_cause():
  """An orbax read error: its message without tensorstore's spec dump, plus the cause
  that names the truncated file."""
  cause = ValueError('OUT_OF_RANGE: Error reading "params.w/0.0": Requested byte range '
                     '[10, 20) is not valid for value of size 15')
  try:
    try:
      raise cause
    except ValueError as c:
      raise Exception('Encountered error while reading array index: (slice(0, 4, 1),). See '
                      "full TensorStore details: <bound method spec of TensorStore({\n"
                      "  'base': {'driver': 'zarr'}})>.") from c
  except Exception as e:  # pylint: disable=broad-except
    msg = checkpoint._short(e)  # pylint: disable=protected-access
  assert msg == ('Exception: Encountered error while reading array index: (slice(0, 4, 1),).'
                 ' (cause: ValueError: OUT_OF_RANGE: Error reading "params.w/0.0": Requested '
                 'byte range [10, 20) is not valid for value of size 15)')
  assert checkpoint._short(ValueError('x\ny')) == 'ValueError: x'  # pylint: disable=protected-access


def test_latest_meta_is_the_newest_readable_checkpoints(workdir):
  """The settings --resume checks before compiling are the newest checkpoint's (max step),
  or the next older one when the newest's metadata does not read."""
  mngr = checkpoint.manager(workdir)
  checkpoint.save(mngr, 3, make_state(3), dict(meta(), data_iter={'i': 3}))
  checkpoint.wait(mngr)
  steps = list(mngr.all_steps())
  step, m = checkpoint.latest_meta(mngr)
  assert step == max(steps) == 3 and m['data_iter'] == {'i': 3}
  corrupt(workdir, 3, 'meta')
  step, m = checkpoint.latest_meta(checkpoint.manager(workdir))
  assert step == 2 and m['data_iter'] == {'i': 1}


def test_a_field_the_checkpoint_lacks_is_compared_as_its_default_not_as_the_current_value():
  """A checkpoint written before data.synth_curriculum existed ran with its default (0);
  resuming with a curriculum changes the stream and must be named."""
  cfg = config_lib.Config()
  saved = json.loads(json.dumps(dataclasses.asdict(cfg)))
  del saved['data']['synth_curriculum']
  del saved['train']['tokens_per_step']
  now = dataclasses.replace(
      cfg, data=dataclasses.replace(cfg.data, synth_curriculum=5),
      train=dataclasses.replace(cfg.train, tokens_per_step=4 * cfg.train.batch_size
                                * cfg.train.seq_len))
  got = checkpoint.changed_stream_settings(saved, now)
  assert got == ['data.synth_curriculum: checkpoint=0 vs config=5',
                 f'train.tokens_per_step: checkpoint=0 vs config={now.train.tokens_per_step}']
