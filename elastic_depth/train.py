"""The training loop in phases: prepare (config, data, resume), steps with evaluation and
checkpoints, preemption and non-finite steps, the summary; the step is train_step's."""

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
from jax.sharding import Mesh

from elastic_depth import distributed, lifecycle
from elastic_depth import model as model_lib
from elastic_depth.config import Config, ConfigError, NanPolicy, grad_accum_steps, validate
from elastic_depth.train_step import (TrainState, config_dict, evaluate, init_state,
                                      lr_schedule, make_eval_step, make_train_step,
                                      place_state, train_flops_per_token, validation_depths)


class NonFiniteError(FloatingPointError):
  """Raised when the loss or gradient is NaN/Inf and the policy is to stop."""


@dataclasses.dataclass
class _Run:
  """What the training loop needs, built by _prepare before anything compiles."""
  cfg: Config
  workdir: str
  mesh: Mesh
  mngr: Any
  ds: Any
  graphdef: Any
  state: TrainState
  start: int
  tok_info: dict
  skips: int = 0  # non-finite steps skipped before start (the checkpoint's meta)


def _check_batch_split(cfg: Config) -> None:
  b, n = cfg.train.batch_size, jax.process_count()
  if b % n or (b // n) % max(jax.local_device_count(), 1):
    raise ConfigError(f'train.batch_size={b} is not divisible across '
                      f'{jax.device_count()} devices')


def _build_data(cfg: Config, workdir: str):
  """The data pipeline; process 0 first (it may write tokenizer.json), then the others."""
  if jax.process_count() == 1:
    return _build_data_here(cfg, workdir)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  ds = _build_data_here(cfg, workdir) if distributed.is_lead() else None
  multihost_utils.sync_global_devices('elastic_depth: data of process 0 built')
  return ds if ds is not None else _build_data_here(cfg, workdir)


def _build_data_here(cfg: Config, workdir: str):
  """The data pipeline; a tokenizer trained on data that then failed is not kept."""
  from elastic_depth import data as data_lib  # pylint: disable=g-import-not-at-top
  tok_file = os.path.join(workdir, 'tokenizer.json')
  had_tok = os.path.exists(tok_file)
  if data_lib.sources.source_of(cfg.data) == data_lib.Source.TEXT and cfg.data.val_paths:
    data_lib.sources.check_disjoint(cfg.data.paths, cfg.data.val_paths)
  try:
    return data_lib.build(cfg.data, seq_len=cfg.train.seq_len,
                          batch_size=cfg.train.batch_size // jax.process_count(),
                          vocab_size=cfg.model.vocab_size, workdir=workdir,
                          shard_index=jax.process_index(), shard_count=jax.process_count())
  except data_lib.DataError:
    if not had_tok and os.path.exists(tok_file):
      os.remove(tok_file)
    raise


def _restore(mngr, state, mesh: Mesh, cfg: Config, ds) -> tuple[int, TrainState, int]:
  """(start step, state on the mesh, steps skipped before it) from the newest usable
  checkpoint, or step 0.

  The target carries this run's shardings, so a checkpoint restores onto any device or
  process count.
  """
  from elastic_depth import checkpoint  # pylint: disable=g-import-not-at-top
  target = distributed.abstract_like(
      state, distributed.state_shardings(state, mesh, cfg.train))
  restored = checkpoint.restore_latest(mngr, target, cfg, tokenizer=ds.tokenizer,
                                       quarantine=distributed.is_lead())
  if restored is None:
    print(f'--resume: no checkpoint in {mngr.directory} yet; starting at step 0', flush=True)
    return 0, place_state(state, mesh, cfg.train), 0
  start, state, meta = restored
  try:
    ds.train_iter.set_state(meta['data_iter'])
  except Exception as e:  # pylint: disable=broad-except
    raise checkpoint.CheckpointError(
        f'checkpoint {mngr.directory}/{start}: its data-iterator state does not fit the '
        f'current data ({type(e).__name__}: {e}); resume with the data flags of that run'
    ) from e
  return start, state, int(meta.get('skipped', 0))


def preflight(cfg: Config, workdir: str, resume: bool):
  """Every check before compiling: config, workdir, checkpoints, data; returns (mngr, data).

  mngr is None when the workdir holds no checkpoints folder yet (nothing is created).
  """
  from elastic_depth import checkpoint  # pylint: disable=g-import-not-at-top
  validate(cfg)
  lifecycle.check_workdir(workdir)
  _check_batch_split(cfg)
  mngr = checkpoint.existing_manager(workdir, cfg.train.keep_checkpoints)
  steps = list(mngr.all_steps()) if mngr is not None else []
  if steps and not resume:
    raise ConfigError(f'{workdir!r} already holds checkpoints {steps}; pass --resume to '
                      'continue, or choose a new --workdir (nothing deleted)')
  found = checkpoint.latest_meta(mngr) if steps else None
  if found is not None:  # before building data or compiling anything
    where = f'{mngr.directory}/{found[0]}'
    saved = found[1].get('config', {})
    checkpoint.check_model_config(saved.get('model', {}), cfg.model, where)
    changed = checkpoint.changed_stream_settings(saved, cfg)
    if changed:
      print(f'--resume: warning: {where} was trained with other data/depth/batch settings; '
            'the run continues, but not as the uninterrupted run would: '
            + '; '.join(changed), flush=True)
  ds = _build_data(cfg, workdir)
  if found is not None:
    checkpoint.check_tokenizer(found[1].get('tokenizer'), ds.tokenizer, where)
  return mngr, ds


def _prepare(cfg: Config, workdir: str, resume: bool) -> _Run:
  """Phase 1: preflight, then the state (fresh or restored) on the mesh."""
  from elastic_depth import checkpoint  # pylint: disable=g-import-not-at-top
  t = cfg.train
  mngr, ds = preflight(cfg, workdir, resume)
  if mngr is None:
    mngr = checkpoint.manager(workdir, t.keep_checkpoints)
  mesh = distributed.make_mesh(fsdp=t.fsdp)
  graphdef, state = init_state(cfg, t.seed)
  if resume:
    start, state, skips = _restore(mngr, state, mesh, cfg, ds)
  else:
    start, state, skips = 0, place_state(state, mesh, t), 0
  if start > t.steps:
    raise ConfigError(f'train.steps={t.steps} is below the step {start} restored from '
                      f'{mngr.directory}: nothing to train; raise --config.train.steps '
                      '(config.json and summary.json are left as they were)')
  if distributed.is_lead() and start < t.steps:
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      json.dump(config_dict(cfg), f, indent=1)
  return _Run(cfg, workdir, mesh, mngr, ds, graphdef, state, start,
              checkpoint.tokenizer_info(ds.tokenizer), skips)


def _bad_step(r: _Run, done: int, m: dict, skips: int) -> None:
  """Phase 3: a non-finite step; raises NonFiniteError when the policy says stop."""
  from elastic_depth import checkpoint  # pylint: disable=g-import-not-at-top
  t = r.cfg.train
  if t.nan_policy == NanPolicy.SKIP and skips <= t.max_skips:
    return
  checkpoint.wait(r.mngr)  # the bad state is never saved
  good = checkpoint.committed_steps(r.mngr)
  why = ('train.nan_policy=stop' if t.nan_policy == NanPolicy.STOP else
         f'{skips} non-finite steps skipped, more than train.max_skips={t.max_skips}')
  raise NonFiniteError(
      f'non-finite loss/gradient at step {done} (loss={m["loss"]}, grad_norm='
      f'{m["grad_norm"]}, depth {int(m["depth"])}; {why}); '
      + (f'last good checkpoint: step {good[-1]} in {r.mngr.directory} (resume with '
         '--resume, e.g. with a lower --config.train.lr)' if good else
         'no checkpoint was saved'))


_clock = time.perf_counter  # the throughput meter's clock (a test replaces it)


class _Throughput:
  """Tokens/s of the steps between log points: the first step (it compiles), evaluations
  and checkpoint saves are excluded (the meter restarts after them)."""

  def __init__(self, start: int, tokens_per_step: int):
    self.t0, self.step0, self.tokens_per_step = _clock(), start, tokens_per_step

  def reset(self, step: int) -> None:
    self.t0, self.step0 = _clock(), step

  def rate(self, step: int) -> float:
    now = _clock()
    tps = (step - self.step0) * self.tokens_per_step / max(now - self.t0, 1e-9)
    self.t0, self.step0 = now, step
    return tps


def _log_step(r: _Run, step: int, m: dict, skips: int, lr: float, writer, meter: _Throughput,
              bars: list, make_bar: Callable, mfu_per_tps: float) -> None:
  """The step's train record (tokens/s and MFU at log points after the first step) and
  the progress bar's postfix; the bar is made at the first step, which compiles."""
  t, done = r.cfg.train, step + 1
  # depth: the drawn r; loops: the bucket it rounds to, which the step ran
  rec = dict(loss=m['loss'], grad_norm=m['grad_norm'], depth=m['depth'], loops=m['bucket'],
             skipped=skips, lr=lr)
  log = done % t.log_every == 0 or done == t.steps
  if step == r.start:
    meter.reset(done)
    bars.append(make_bar(done))
  elif log:
    tps = meter.rate(done)
    rec.update(tokens_per_s=tps, **({'mfu': tps * mfu_per_tps} if mfu_per_tps else {}))
    bars[-1].set_postfix(loss=f'{m["loss"]:.3f}', loops=int(m['bucket']), tok_s=f'{tps:,.0f}')
  if log or step == r.start or not bool(m['finite']):
    writer.write(done, rec, 'train/')


def _loop(r: _Run, pre: 'lifecycle.Preemption', writer, bars: list,
          make_bar: Callable) -> tuple[dict, int]:
  """Phase 2: the steps, evaluation and checkpoints; returns (summary, skips).

  The progress bar, make_bar(initial step), starts after the first step (which compiles),
  so its rate and ETA are the steps'; it is appended to bars for the caller to close.
  """
  from elastic_depth import checkpoint, metrics  # pylint: disable=g-import-not-at-top
  cfg, t = r.cfg, r.cfg.train
  accum = grad_accum_steps(t)
  step_fn = make_train_step(r.graphdef, cfg, r.mesh)
  eval_step = make_eval_step(r.graphdef, cfg)
  val = r.ds.val_batches(t.eval_batches)
  depths = validation_depths(cfg)
  peak = metrics.peak_flops(t.peak_flops) * jax.device_count()  # the mesh's: tokens/s is global
  mfu_per_tps = train_flops_per_token(cfg) / peak if peak else 0.0
  schedule = lr_schedule(cfg)
  meter = _Throughput(r.start, accum * t.batch_size * t.seq_len)
  meta = lambda: {'config': config_dict(cfg), 'data_iter': r.ds.train_iter.get_state(),
                  'tokenizer': r.tok_info, 'skipped': skips}
  skips, summary, saved = r.skips, {}, r.start
  for step in range(r.start, t.steps):
    # signalled before this session's first step or during a save: every process agrees
    sig = distributed.agree_signal(pre.signum) if step == saved else None
    if sig is not None:
      print(f'\npreempted by signal {sig} before step {step + 1}: nothing new to '
            'save, exiting', flush=True)
      return {**summary, 'preempted_at': step}, skips
    batch = distributed.shard_batch([next(r.ds.train_iter) for _ in range(accum)], r.mesh,
                                    accum)
    # the learning rate applied: a skipped step leaves the optimizer's count behind
    lr = float(schedule(step - skips))
    r.state, m = step_fn(r.state, batch)
    m, done = jax.device_get(m), step + 1
    finite = bool(m['finite'])
    skips += (not finite) and t.nan_policy == NanPolicy.SKIP
    _log_step(r, step, m, skips, lr, writer, meter, bars, make_bar, mfu_per_tps)
    if not finite:
      _bad_step(r, done, m, skips)
    if step > r.start:
      bars[-1].update(1)
    paused = done % t.eval_every == 0 or done == t.steps
    if paused:
      val_loss = evaluate(eval_step, r.state.params, val, depths, r.mesh)
      writer.write(done, {f'loss_r{d}': v for d, v in val_loss.items()}, 'val/')
      summary = {**summary, 'step': done, 'val_loss': val_loss}
    # read once, agreed by every process: a signal arriving later is seen at the next step
    sig = distributed.agree_signal(pre.signum)
    if done % t.ckpt_every == 0 or done == t.steps or sig is not None:
      checkpoint.save(r.mngr, done, r.state, meta(), force=True)
      saved, paused = done, True
    if paused:  # the next interval times steps only
      meter.reset(done)
    if sig is not None:
      checkpoint.wait(r.mngr)
      print(f'\npreempted by signal {sig}: saved step {done}, exiting', flush=True)
      return {**summary, 'preempted_at': done}, skips
  checkpoint.wait(r.mngr)
  return summary, skips


def _saved_summary(workdir: str) -> dict:
  """The summary.json a finished run wrote ({} when there is none or it does not read)."""
  try:
    with open(os.path.join(workdir, 'summary.json'), encoding='utf-8') as f:
      summary = json.load(f)
    return {**summary, 'val_loss': {int(d): v for d, v in summary.get('val_loss', {}).items()}}
  except (OSError, ValueError, AttributeError):
    return {}


def _finish(r: _Run, summary: dict, skips: int) -> dict:
  """Phase 4: the summary file; a resumed session that validated nothing (a signal stopped
  it first) keeps the last validation that summary.json holds."""
  if r.start and 'val_loss' not in summary:
    saved = _saved_summary(r.workdir)
    summary = {**{k: saved[k] for k in ('step', 'val_loss') if k in saved}, **summary}
  summary.update(skipped=skips, last_step=int(r.state.step))
  if distributed.is_lead():
    with open(os.path.join(r.workdir, 'summary.json'), 'w', encoding='utf-8') as f:
      json.dump(summary, f, indent=1)
  return summary


def run(cfg: Config, workdir: str, *, resume: bool = False, quiet: bool = False) -> dict:
  """Trains cfg in workdir; returns the final summary (the last validation losses by
  depth, the step, skipped steps, last_step; preempted_at when stopped by a signal).

  Everything that can be checked is checked before compiling: the config (ConfigError),
  the workdir, the data (DataError), and on --resume the checkpoint's model config and
  tokenizer (CheckpointError). SIGTERM/SIGINT save a checkpoint at the next step boundary
  and return with summary['preempted_at']. A non-finite loss or gradient raises
  NonFiniteError (nan_policy=stop, or after max_skips skips) without saving the bad state.
  """
  from elastic_depth import metrics  # pylint: disable=g-import-not-at-top
  with lifecycle.Preemption() as pre:
    r = _prepare(cfg, workdir, resume)
    if r.start == cfg.train.steps:
      r.mngr.close()
      print(f'--resume: the checkpoint is at train.steps={r.start} already; nothing to '
            'train (summary.json kept)', flush=True)
      return _saved_summary(workdir)
    lead = distributed.is_lead()  # one log, banner and bar per job, not one per process
    writer = metrics.MetricWriter(workdir, enabled=lead, resume_step=r.start)
    if lead:
      print(f'elastic-depth: {model_lib.count_params(cfg.model):,} params, '
            f'{r.ds.describe()}, '
            f'{grad_accum_steps(cfg.train) * cfg.train.batch_size * cfg.train.seq_len} '
            f'tokens/step, steps {r.start}->{cfg.train.steps}', flush=True)
    bars = []
    make_bar = lambda initial: metrics.progress(cfg.train.steps, initial, unit='step',
                                                disable=quiet or not lead or None)
    try:
      summary, skips = _loop(r, pre, writer, bars, make_bar)
    finally:
      for bar in bars:
        bar.close()
      writer.close()
      try:
        r.mngr.close()
      except Exception:  # pylint: disable=broad-except  already raised or reported
        pass
  return _finish(r, summary, skips)
