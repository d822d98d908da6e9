"""Randomised-depth pretraining.

  python -m experiments.pretrain --workdir=runs/default   # the config's defaults (synthetic data)
  python -m experiments.pretrain --flagfile=launch/135m.flags --workdir=runs/135m
  python -m experiments.pretrain --flagfile=launch/tiny.flags --workdir=runs/tiny --resume

Every config field is a flag: --config.model.d_model=256, --config.depth.mean=4, ...

  python -m experiments.pretrain --flagfile=launch/135m.flags --workdir=runs/135m --dry_run
      # every check, then the step compiled ahead of time: memory per device, FLOPs, time

Several processes (JAX's own engine): pass --coordinator_address=HOST:PORT
--num_processes=N --process_id=I to each, or run under SLURM / Open MPI / Cloud TPU / GKE
(or with JAX_COORDINATOR_ADDRESS set), where jax.distributed finds its peers itself.

Exit codes: 0 done (or preempted by SIGTERM/SIGINT after saving a checkpoint: rerun with
--resume); 2 a one-line `error: ...` on stderr (bad flag, config, data, checkpoint, a
non-finite loss, a failed save); 130 a second interrupt (stopped without saving).
"""


import os
import sys

import jax
from absl import app, flags, logging

from elastic_depth import checkpoint
from elastic_depth import config as config_lib
from elastic_depth import distributed, dry_run, train
from experiments import flags_util
from elastic_depth.data import DataError


# ml_collections resolves --config.* override types from sys.argv right here
_CONFIG = flags_util.define_config(config_lib.Config(), 'Experiment configuration.')
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default', 'Where checkpoints, metrics and '
                               'reports go.')
_RESUME = flags.DEFINE_bool('resume', False, 'Continue from the latest checkpoint in workdir.')
_QUIET = flags.DEFINE_bool('quiet', False, 'No progress bar.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Check everything and compile the step ahead '
                             'of time (memory, FLOPs, time estimates); train nothing.')
_DRY_REMAT = flags.DEFINE_enum('dry_run_remat', 'both', ['both', 'on', 'off'], 'Which remat '
                               'settings the dry run compiles.')
_DRY_MFU = flags.DEFINE_float('dry_run_mfu', 0.30, 'MFU assumed by the dry run\'s estimates '
                               '(the 135M step measured 26.8-33.3% on an H200).')
_COORD = flags.DEFINE_string('coordinator_address', None, 'HOST:PORT of process 0 '
                             '(multi-process runs).')
_NPROC = flags.DEFINE_integer('num_processes', None, 'Number of processes.')
_PID = flags.DEFINE_integer('process_id', None, 'This process\'s index, 0..num_processes-1.')
_HEARTBEAT = flags.DEFINE_integer('heartbeat_timeout_s', 100, 'Seconds without a peer\'s '
                                  'heartbeat before a multi-process run stops with an error.')
_REPORT = flags.DEFINE_bool('difficulty_report', True, 'After a synthetic run with '
                            'data.loss_on=answers, print loss and A1 exit depth by '
                            'difficulty (experiments.difficulty; reports/difficulty.*).')

ERRORS = (config_lib.ConfigError, DataError, checkpoint.CheckpointError, train.NonFiniteError)


def _peer_lost(e: BaseException) -> None:
  """A collective failed in a multi-process run: one clear line, then exit at once.

  os._exit skips jax.distributed's shutdown barrier, which would abort the process with
  pages of coordination-service logs when a peer is gone.
  """
  first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
  print(f'error: process {jax.process_index()} of {jax.process_count()}: a peer process '
        f'failed or became unreachable ({first}); the job stops. The last complete '
        f'checkpoint in {_WORKDIR.value} is intact: restart every process with --resume',
        file=sys.stderr, flush=True)
  os._exit(3)  # pylint: disable=protected-access


def _note_validation_depths(cfg) -> None:
  """Says which train.eval_depths lie beyond depth.r_max (validation stops at r_max)."""
  beyond = sorted(d for d in cfg.train.eval_depths if d > cfg.depth.r_max)
  if beyond and jax.process_index() == 0:
    print(f'note: train.eval_depths {beyond} exceed depth.r_max={cfg.depth.r_max}; '
          f'validation scores up to {cfg.depth.r_max} (score deeper afterwards: python -m '
          f'experiments.eval_depth --workdir={_WORKDIR.value} --max_depth={beyond[-1]})',
          flush=True)


def _mean_label(depth: int, mean: float) -> str:
  """'(training mean)' for the depth equal to depth.mean, else names the mean it is nearest."""
  return '(training mean)' if depth == mean else f'(nearest the training mean {mean:g})'


def main(argv):
  flags_util.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  cfg = _CONFIG.value
  try:
    distributed.initialize(_COORD.value, _NPROC.value, _PID.value, _HEARTBEAT.value)
    if _DRY_RUN.value:
      remat = {'both': (True, False), 'on': (True,), 'off': (False,)}[_DRY_REMAT.value]
      print(dry_run.describe(dry_run.run(cfg, _WORKDIR.value, resume=_RESUME.value,
                                         mfu=_DRY_MFU.value, remat_choices=remat)),
            flush=True)
      return
    _note_validation_depths(cfg)
    summary = train.run(cfg, _WORKDIR.value, resume=_RESUME.value, quiet=_QUIET.value)
  except ERRORS as e:
    flags_util.fail(str(e))
  except KeyboardInterrupt as e:
    flags_util.fail(f'interrupted ({e or "second signal"}); the last complete checkpoint is kept', 130)
  except jax.errors.JaxRuntimeError as e:
    if jax.process_count() == 1:
      raise
    _peer_lost(e)
  lead = distributed.is_lead()  # the job's closing lines once, not once per process
  if 'preempted_at' in summary:
    at = summary['preempted_at']
    if lead:
      print('preempted: ' + (f'checkpoint at step {at} in {_WORKDIR.value}; continue with '
                              '--resume' if at else 'stopped before the first step'),
            flush=True)
    return
  losses = summary.get('val_loss', {})
  if losses and lead:
    depths = sorted(losses)
    mean = min(depths, key=lambda d: abs(d - cfg.depth.mean))
    print(f'validation loss: depth {depths[0]} = {losses[depths[0]]:.4f}, depth {mean} '
          f'{_mean_label(mean, cfg.depth.mean)} = {losses[mean]:.4f}; all: '
          + ', '.join(f'r={d}: {losses[d]:.4f}' for d in depths))
  if _REPORT.value and cfg.data.source == 'synthetic' and cfg.data.loss_on == 'answers':
    from experiments import common, difficulty  # pylint: disable=g-import-not-at-top
    # every process runs it alike, as each ran training; only the lead writes and prints
    difficulty.run(common.Options(workdir=_WORKDIR.value, batches=8,
                                  progress=False))


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
