"""Randomised-depth pretraining.

  python -m experiments.pretrain --workdir=runs/tiny                 # embedded synthetic corpus
  python -m experiments.pretrain --flagfile=launch/135m.flags --workdir=runs/135m
  python -m experiments.pretrain --flagfile=launch/tiny.flags --workdir=runs/tiny --resume

Every config field is a flag: --config.model.d_model=256, --config.depth.mean=4, ...

Exit codes: 0 done (or preempted by SIGTERM/SIGINT after saving a checkpoint: rerun with
--resume); 2 a one-line `error: ...` on stderr (bad flag, config, data, checkpoint, a
non-finite loss, a failed save); 130 a second interrupt (stopped without saving).
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from elastic_depth import checkpoint
from elastic_depth import config as config_lib
from elastic_depth import train
from experiments import flags_util
from elastic_depth.data import DataError


def _fail(msg: str, code: int = 2):
  print(f'error: {msg}', file=sys.stderr, flush=True)
  sys.exit(code)


try:  # ml_collections resolves --config.* override types from sys.argv right here
  _CONFIG = config_flags.DEFINE_config_dataclass('config', config_lib.Config(),
                                                 'Experiment configuration.')
except (KeyError, AttributeError, TypeError, ValueError) as e:
  _fail(f'bad --config flag: {str(e).strip(chr(34))}')
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default', 'Where checkpoints, metrics and '
                               'reports go.')
_RESUME = flags.DEFINE_bool('resume', False, 'Continue from the latest checkpoint in workdir.')
_QUIET = flags.DEFINE_bool('quiet', False, 'No progress bar.')
_REPORT = flags.DEFINE_bool('difficulty_report', True, 'After a synthetic run with '
                            'data.loss_on=answers, print loss and A1 exit depth by '
                            'difficulty (experiments.difficulty; reports/difficulty.*).')

ERRORS = (config_lib.ConfigError, DataError, checkpoint.CheckpointError, train.NonFiniteError)


def parse_flags(argv):
  """absl flag parsing with a one-line error (exit 2) instead of a usage dump."""
  try:
    return flags.FLAGS(flags_util.dedupe_config_overrides(argv))
  except flags.Error as e:
    _fail(f'{e} (see --helpshort)')
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    _fail(f'bad flag: {e}')


def main(argv):
  if len(argv) > 1:
    _fail(f'unexpected arguments: {argv[1:]} (flags are --name=value)')
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  cfg = _CONFIG.value
  try:
    summary = train.run(cfg, _WORKDIR.value, resume=_RESUME.value, quiet=_QUIET.value)
  except ERRORS as e:
    _fail(str(e))
  except KeyboardInterrupt as e:
    _fail(f'interrupted ({e or "second signal"}); the last complete checkpoint is kept', 130)
  if 'preempted_at' in summary:
    at = summary['preempted_at']
    print('preempted: ' + (f'checkpoint at step {at} in {_WORKDIR.value}; continue with '
                            '--resume' if at else 'stopped before the first step'), flush=True)
    return
  losses = summary.get('val_loss', {})
  if losses:
    depths = sorted(losses)
    mean = min(depths, key=lambda d: abs(d - cfg.depth.mean))
    print(f'validation loss: depth 1 = {losses[depths[0]]:.4f}, depth {mean} '
          f'(training mean) = {losses[mean]:.4f}; all: '
          + ', '.join(f'r={d}: {losses[d]:.4f}' for d in depths))
  if _REPORT.value and cfg.data.source == 'synthetic' and cfg.data.loss_on == 'answers':
    from experiments import common, difficulty  # pylint: disable=g-import-not-at-top
    difficulty.run(common.Options(workdir=_WORKDIR.value, batches=8,
                                  progress=False))


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
