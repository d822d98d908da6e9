"""Orbax checkpoints: parameters, optimizer state, data-iterator state and config.

Saves are atomic (orbax writes to a temporary folder and renames it on commit), so
an interrupted save leaves the previous checkpoint restorable. `restore_latest`
walks back from the newest step and skips any checkpoint that fails to restore,
saying which one and why.
"""

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from absl import logging

from elastic_depth.config import Config, ModelConfig


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used (corrupt, or for another model)."""


def manager(workdir: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
  """A CheckpointManager over <workdir>/checkpoints."""
  path = os.path.join(os.path.abspath(workdir), 'checkpoints')
  opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                      enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(path, options=opts)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict,
         force: bool = False) -> None:
  """Saves the train state (a pytree) and JSON metadata at `step`."""
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          meta=ocp.args.JsonSave(meta)), force=force)


def check_model_config(saved: dict, cfg: ModelConfig, where: str) -> None:
  """Raises CheckpointError naming every model field that differs from the checkpoint."""
  now = dataclasses.asdict(cfg)
  now = json.loads(json.dumps(now))
  diff = {k: (saved.get(k), v) for k, v in now.items()
          if k != 'dtype' and saved.get(k) != v}
  if diff:
    lines = ', '.join(f'{k}: checkpoint={a!r} vs config={b!r}' for k, (a, b) in diff.items())
    raise CheckpointError(f'checkpoint {where} was trained with a different model '
                          f'config ({lines}); use the matching flags or another workdir')


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
  """Reads only the JSON metadata of a checkpoint."""
  out = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  return out['meta']


def restore_latest(mngr: ocp.CheckpointManager, abstract_state: Any,
                   cfg: Optional[Config] = None) -> Optional[tuple[int, Any, dict]]:
  """Restores the newest checkpoint that loads; returns (step, state, meta) or None."""
  steps = sorted(mngr.all_steps(), reverse=True)
  errors = []
  for step in steps:
    where = f'{mngr.directory}/{step}'
    try:
      meta = read_meta(mngr, step)
    except Exception as e:  # corrupt or truncated metadata: fall back
      errors.append(f'step {step}: {type(e).__name__}: {e}')
      logging.warning('checkpoint %s is unreadable (%s); trying an older one', where, e)
      continue
    if cfg is not None:
      check_model_config(meta.get('config', {}).get('model', {}), cfg.model, where)
    try:
      out = mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))
      state = out['state']
      jax.block_until_ready(state)
    except Exception as e:
      errors.append(f'step {step}: {type(e).__name__}: {e}')
      logging.warning('checkpoint %s is corrupt (%s); trying an older one', where, e)
      continue
    if errors:
      print(f'warning: skipped unusable checkpoints: {"; ".join(errors)[:2000]}; '
            f'resumed from step {step}', flush=True)
    return step, state, meta
  if errors:
    raise CheckpointError('no usable checkpoint in '
                          f'{mngr.directory}: ' + '; '.join(errors)[:4000])
  return None


def load_state(workdir: str, abstract_state: Any, cfg: Optional[Config] = None,
                step: Optional[int] = None) -> tuple[Any, dict]:
  """Loads a saved train state without a manager for writing; returns (state, meta)."""
  path = os.path.join(os.path.abspath(workdir), 'checkpoints')
  if not os.path.isdir(path):
    raise CheckpointError(f'no checkpoints folder in {workdir!r}: train first '
                          f'(python -m experiments.pretrain --workdir={workdir})')
  mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))
  steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
  if not steps:
    raise CheckpointError(f'no checkpoint in {path}')
  errors = []
  for s in steps:
    try:
      meta = read_meta(mngr, s)
      if cfg is not None:
        check_model_config(meta['config']['model'], cfg.model, f'{path}/{s}')
      tree = mngr.restore(s, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))
      return tree['state'], meta
    except CheckpointError:
      raise
    except Exception as e:
      errors.append(f'step {s}: {type(e).__name__}: {e}')
  raise CheckpointError(f'no usable checkpoint in {path}: ' + '; '.join(errors)[:4000])
