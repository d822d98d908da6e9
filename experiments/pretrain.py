"""Randomised-depth pretraining.

  python -m experiments.pretrain --workdir=runs/tiny                 # embedded synthetic corpus
  python -m experiments.pretrain --flagfile=launch/135m.flags --workdir=runs/135m
  python -m experiments.pretrain --flagfile=launch/tiny.flags --workdir=runs/tiny --resume

Every config field is a flag: --config.model.d_model=256, --config.depth.mean=4, ...
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from elastic_depth import config as config_lib
from elastic_depth import train

_CONFIG = config_flags.DEFINE_config_dataclass('config', config_lib.Config(),
                                               'Experiment configuration.')
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default', 'Where checkpoints, metrics and '
                               'reports go.')
_RESUME = flags.DEFINE_bool('resume', False, 'Continue from the latest checkpoint in workdir.')
_QUIET = flags.DEFINE_bool('quiet', False, 'No progress bar.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  cfg = _CONFIG.value
  try:
    summary = train.run(cfg, _WORKDIR.value, resume=_RESUME.value, quiet=_QUIET.value)
  except (config_lib.ConfigError, train.NonFiniteError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  losses = summary.get('val_loss', {})
  if losses:
    depths = sorted(losses)
    mean = min(depths, key=lambda d: abs(d - cfg.depth.mean))
    print(f'validation loss: depth 1 = {losses[depths[0]]:.4f}, depth {mean} '
          f'(training mean) = {losses[mean]:.4f}; all: '
          + ', '.join(f'r={d}: {losses[d]:.4f}' for d in depths))


if __name__ == '__main__':
  app.run(main)
