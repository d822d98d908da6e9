"""Orbax checkpoints: parameters, optimizer state, data-iterator state and config.

Fault model (see WORKSPACE.md, "Faults and bad input"):
  * Saves are atomic: orbax writes to `<step>.orbax-checkpoint-tmp-*` and renames it on
    commit, so a save interrupted by a kill, a crash or a full disk leaves the previous
    checkpoint restorable (tmp folders are never listed as steps).
  * Every checkpoint's metadata carries a CRC32 of the saved state (`checksum`) and a
    fingerprint of the tokenizer. `restore_latest` walks back from the newest step,
    skips any checkpoint that fails to restore or whose restored state does not match
    its checksum (truncated or garbled files), says which one and why, and (in a
    training run) moves it aside to `<workdir>/corrupt_checkpoints/` so the step can be
    saved again; nothing is ever deleted.
  * A checkpoint of another model config or tokenizer raises CheckpointError before
    anything is compiled; so does a failed save (e.g. disk full), naming the last
    complete checkpoint.
  * An imported checkpoint (experiments.import_huginn) holds only the parameters
    (`opt_state` None, meta `weights_only`): `load_state` reads it like any other, and
    `restore_latest` (training --resume) refuses it rather than calling it corrupt.
"""

import dataclasses
import errno
import json
import logging as std_logging
import os
import sys
import time
import zlib
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from elastic_depth.config import Config, ModelConfig
from elastic_depth.data.tokenizer import tokenizer_info

CORRUPT_DIR = 'corrupt_checkpoints'
WEIGHTS_ONLY = 'weights_only'  # meta key of checkpoints that hold no optimizer state


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used (corrupt, or for another model), or a failed save."""


class MismatchError(CheckpointError):
  """A readable checkpoint of another model config or tokenizer (never skipped over)."""


def checkpoint_dir(workdir: str) -> str:
  """<workdir>/checkpoints (absolute)."""
  return os.path.join(os.path.abspath(workdir), 'checkpoints')


def manager(workdir: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
  """A CheckpointManager over <workdir>/checkpoints (created if missing)."""
  opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                      enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=opts)


def existing_manager(workdir: str, keep: int = 3,
                     async_save: bool = True) -> Optional[ocp.CheckpointManager]:
  """The manager of an existing checkpoints folder, or None (creates nothing)."""
  if not os.path.isdir(checkpoint_dir(workdir)):
    return None
  return manager(workdir, keep, async_save)


def state_checksum(state: Any) -> Optional[str]:
  """CRC32 (hex) over every leaf's path, dtype, shape and bytes; None if not addressable."""
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  crc = 0
  for path, x in leaves:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return None
    a = np.ascontiguousarray(np.asarray(jax.device_get(x)))
    crc = zlib.crc32(f'{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape};'.encode(), crc)
    crc = zlib.crc32(a.view(np.uint8).reshape(-1) if a.size else b'', crc)
  return f'{crc:08x}'


def check_tokenizer(saved: Optional[dict], tok, where: str) -> None:
  """Raises CheckpointError if the tokenizer differs from the one the checkpoint used."""
  if not saved:  # checkpoints written before tokenizer fingerprints
    return
  now = tokenizer_info(tok)
  diff = [k for k in ('vocab_size', 'eos_id', 'fingerprint') if saved.get(k) != now[k]]
  if diff:
    raise MismatchError(
        f'checkpoint {where} was trained with another tokenizer ({saved.get("origin")}: '
        f'vocab {saved.get("vocab_size")}, eos {saved.get("eos_id")}) than the current one '
        f'({now["origin"]}: vocab {now["vocab_size"]}, eos {now["eos_id"]}); differs in '
        f'{", ".join(diff)}; use the data/tokenizer flags of that run or another workdir')


class _DropUnretrieved(std_logging.Filter):
  """Drops asyncio's 'exception was never retrieved' reports (the futures of a failed
  restore, which the walk has already recorded)."""

  def filter(self, record):
    return 'exception was never retrieved' not in str(record.msg)


def _mute_closed_loop_noise() -> None:
  """Drops the 'Event loop is closed' tracebacks that tensorstore callbacks print after a
  failed restore (orbax's event loop is gone by then) and asyncio's reports of its
  unretrieved futures; other unraisable errors still print."""
  aio = std_logging.getLogger('asyncio')
  if not any(isinstance(f, _DropUnretrieved) for f in aio.filters):
    aio.addFilter(_DropUnretrieved())
  old = sys.unraisablehook
  if getattr(old, '_elastic_depth', False):
    return

  def hook(u):
    if isinstance(u.exc_value, RuntimeError) and 'Event loop is closed' in str(u.exc_value):
      return
    if 'Encountered error while reading array' in str(u.exc_value):
      return  # the other reads of a restore that failed: recorded by the walk
    old(u)
  hook._elastic_depth = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


def _short(e: BaseException) -> str:
  """An error and its root cause, each cut to its first part (tensorstore appends
  kilobytes of JSON spec; the cause says what is wrong with the file)."""
  _mute_closed_loop_noise()
  def one(x):
    msg = str(x).split(' [tensorstore_spec')[0].split(' See full TensorStore details')[0]
    return f'{type(x).__name__}: ' + msg.split('\n')[0][:400]
  root, seen = e, {id(e)}
  while (root.__cause__ or root.__context__) is not None and len(seen) < 8:
    root = root.__cause__ or root.__context__
    seen.add(id(root))
  return one(e) + ('' if root is e else f' (cause: {one(root)})')


def _disk_hint(e: BaseException) -> str:
  if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
    return ' (the disk is full: free space or choose another --workdir)'
  return ''


def committed_steps(mngr: ocp.CheckpointManager) -> list[int]:
  """Steps whose folders are committed on disk (re-read, tmp folders excluded)."""
  try:
    mngr.reload()
    return sorted(mngr.all_steps())
  except Exception:  # pylint: disable=broad-except
    return []


def _save_error(mngr, step: int, e: BaseException) -> CheckpointError:
  try:  # let earlier asynchronous saves commit before listing what is complete
    mngr.wait_until_finished()
  except Exception:  # pylint: disable=broad-except
    pass
  done = [s for s in committed_steps(mngr) if s != step]
  last = (f'the last complete checkpoint, step {done[-1]}, is intact (continue with --resume)'
          if done else 'no earlier checkpoint exists')
  return CheckpointError(f'saving checkpoint step {step} in {mngr.directory} failed: '
                         f'{type(e).__name__}: {e}{_disk_hint(e)}; {last}')


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict,
         force: bool = False) -> None:
  """Saves the train state (a pytree) and JSON metadata (plus the state's checksum) at `step`.

  Raises CheckpointError if the save (or an earlier asynchronous one) fails.
  """
  meta = dict(meta, checksum=state_checksum(state))
  try:
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)), force=force)
  except Exception as e:  # pylint: disable=broad-except
    raise _save_error(mngr, step, e) from e


def wait(mngr: ocp.CheckpointManager) -> None:
  """Waits for asynchronous saves; CheckpointError if one failed."""
  try:
    mngr.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    raise _save_error(mngr, -1, e) from e


# Model fields that choose how the same weights are computed, not what they mean.
COMPUTE_FIELDS = ('dtype', 'attention_impl', 'fuse_projections')


def check_model_config(saved: dict, cfg: ModelConfig, where: str) -> None:
  """Raises CheckpointError naming every model field that differs from the checkpoint.

  A field the checkpoint does not record (added to ModelConfig after it was saved) is
  compared as its default; COMPUTE_FIELDS may differ.
  """
  now = json.loads(json.dumps(dataclasses.asdict(cfg)))
  default = json.loads(json.dumps(dataclasses.asdict(ModelConfig())))
  was = lambda k: saved.get(k, default[k])
  diff = {k: (was(k), v) for k, v in now.items() if k not in COMPUTE_FIELDS and was(k) != v}
  if diff:
    lines = ', '.join(f'{k}: checkpoint={a!r} vs config={b!r}' for k, (a, b) in diff.items())
    raise MismatchError(f'checkpoint {where} was trained with a different model '
                          f'config ({lines}); use the matching flags or another workdir')


# Settings that shape the training stream: changing one on --resume continues a different
# run than the one checkpointed (the model's own fields are refused by check_model_config).
# depth.remat / remat_policy / unroll choose how the same step is computed: not listed.
STREAM_FIELDS = {'data': None,
                 'depth': ('mean', 'sigma', 'r_max', 'buckets', 'backprop_depth'),
                 'train': ('seed', 'batch_size', 'seq_len', 'grad_accum', 'tokens_per_step')}


def changed_stream_settings(saved: dict, cfg: Config) -> list[str]:
  """'section.field: checkpoint=.. vs config=..' for every STREAM_FIELDS setting that differs.

  A field the checkpoint does not record is compared as its default.
  """
  now = json.loads(json.dumps(dataclasses.asdict(cfg)))
  default = json.loads(json.dumps(dataclasses.asdict(Config())))
  out = []
  for section, fields in STREAM_FIELDS.items():
    was = saved.get(section, {})
    for k in fields or sorted(now[section]):
      a, b = was.get(k, default[section][k]), now[section][k]
      if a != b:
        out.append(f'{section}.{k}: checkpoint={a!r} vs config={b!r}')
  return out


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
  """Reads only the JSON metadata of a checkpoint."""
  out = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  meta = out['meta']
  if not isinstance(meta, dict):
    raise CheckpointError(f'metadata is {type(meta).__name__}, not a dict')
  return meta


def latest_meta(mngr: ocp.CheckpointManager) -> Optional[tuple[int, dict]]:
  """(step, meta) of the newest checkpoint whose metadata reads; None if there is none."""
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      return step, read_meta(mngr, step)
    except Exception:  # pylint: disable=broad-except
      continue
  return None


def weights_only(state: Any) -> Any:
  """The abstract train state without optimizer state, placed on the default device (an
  imported checkpoint is written from host memory, its saved sharding names the CPU)."""
  where = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
                      if isinstance(x, jax.ShapeDtypeStruct) else x,
                      state.replace(opt_state=None))


def _verify(state: Any, meta: dict) -> None:
  want = meta.get('checksum')
  if want is None:
    return
  got = state_checksum(state)
  if got is not None and got != want:
    raise CheckpointError(f'restored state has checksum {got} but {want} was saved '
                          '(garbled or truncated array files)')


def _quarantine(mngr: ocp.CheckpointManager, step: int) -> Optional[str]:
  """Moves a corrupt step folder to <workdir>/corrupt_checkpoints/ (never deletes)."""
  src = os.path.join(str(mngr.directory), str(step))
  if not os.path.isdir(src):
    return None
  root = os.path.join(os.path.dirname(str(mngr.directory)), CORRUPT_DIR)
  os.makedirs(root, exist_ok=True)
  dst = os.path.join(root, f'{step}-{time.strftime("%Y%m%d-%H%M%S")}-{os.getpid()}')
  os.rename(src, dst)
  return dst


class _Walk(NamedTuple):
  """Result of walking back through checkpoints."""
  found: Optional[tuple[int, Any, dict]]  # (step, state, meta) of the first usable one
  errors: list                            # 'step N: why' for each unusable newer one
  bad: list                               # their steps


def _walk(mngr: ocp.CheckpointManager, steps, abstract_state: Any, cfg: Optional[Config],
          tokenizer, resuming: bool) -> _Walk:
  """Tries steps in order; the first that reads, matches cfg/tokenizer and verifies wins.

  A checkpoint of another model config or tokenizer raises MismatchError at once (never
  skipped over); an unreadable or garbled one is recorded and the walk goes on. Imported
  weights (no optimizer state) load for evaluation; resuming training from them is refused.
  """
  _mute_closed_loop_noise()
  errors, bad = [], []
  for step in steps:
    where = f'{mngr.directory}/{step}'
    try:
      meta = read_meta(mngr, step)
      if cfg is not None:
        check_model_config(meta.get('config', {}).get('model', {}), cfg.model, where)
      if tokenizer is not None:
        check_tokenizer(meta.get('tokenizer'), tokenizer, where)
      target = abstract_state
      if meta.get(WEIGHTS_ONLY):
        if resuming:
          raise MismatchError(f'checkpoint {where} holds imported weights without optimizer '
                              f'state ({meta.get("source", "imported")}): it can be '
                              'evaluated, not resumed; train in another --workdir')
        target = weights_only(abstract_state)
      out = mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target)))
      state = out['state']
      jax.block_until_ready(state)
      _verify(state, meta)
      return _Walk((step, state, meta), errors, bad)
    except MismatchError:
      raise
    except Exception as e:  # pylint: disable=broad-except  corrupt or truncated files
      errors.append(f'step {step}: {_short(e)}')
      bad.append(step)
      logging.info('checkpoint %s is unusable (%s); trying an older one', where, e)
  return _Walk(None, errors, bad)


def restore_latest(mngr: ocp.CheckpointManager, abstract_state: Any,
                   cfg: Optional[Config] = None, tokenizer=None,
                   quarantine: bool = False) -> Optional[tuple[int, Any, dict]]:
  """Restores the newest checkpoint that loads and verifies; returns (step, state, meta).

  Args:
    mngr: the run's manager.
    abstract_state: target pytree (shapes, dtypes, shardings).
    cfg: if given, CheckpointError when the checkpoint's model config differs.
    tokenizer: if given, CheckpointError when the checkpoint used another tokenizer.
    quarantine: move unusable newer checkpoints to <workdir>/corrupt_checkpoints/ so that
      training can save those steps again.

  Returns:
    None if there is no checkpoint at all; CheckpointError if none is usable.
  """
  w = _walk(mngr, sorted(mngr.all_steps(), reverse=True), abstract_state, cfg, tokenizer,
            resuming=True)
  if w.found is None:
    if w.errors:
      raise CheckpointError(f'no usable checkpoint in {mngr.directory}: '
                            + '; '.join(w.errors)[:4000])
    return None
  if w.errors:
    moved = [p for p in (_quarantine(mngr, s) for s in w.bad) if p] if quarantine else []
    if moved:
      mngr.reload()
    print(f'warning: skipped unusable checkpoint(s) {w.bad} in {mngr.directory} '
          f'({"; ".join(w.errors)[:1500]}); resumed from step {w.found[0]}'
          + (f'; moved the unusable ones to {os.path.dirname(moved[0])}' if moved else ''),
          flush=True)
  return w.found


def load_state(workdir: str, abstract_state: Any, cfg: Optional[Config] = None,
               step: Optional[int] = None) -> tuple[Any, dict]:
  """Loads a saved train state without a manager for writing; returns (state, meta)."""
  path = checkpoint_dir(workdir)
  if not os.path.isdir(path):
    raise CheckpointError(f'no checkpoints folder in {workdir!r}: train first '
                          f'(python -m experiments.pretrain --workdir={workdir})')
  _mute_closed_loop_noise()
  mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))
  steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
  if not steps:
    raise CheckpointError(f'no checkpoint in {path}')
  w = _walk(mngr, steps, abstract_state, cfg, None, resuming=False)
  if w.found is None:
    raise CheckpointError(f'no usable checkpoint in {path}: ' + '; '.join(w.errors)[:4000])
  if w.errors:
    print(f'warning: skipped unusable checkpoint(s) {w.bad} in {path} '
          f'({"; ".join(w.errors)[:1500]}); using step {w.found[0]} (--step chooses one)',
          file=sys.stderr, flush=True)
  return w.found[1], w.found[2]
