"""Saturation at the training-mean depth: loss versus depth of several runs on one plot.

  python -m experiments.eval_depth --workdir=runs/ts8     # first, for every run
  python -m experiments.saturation --workdirs=runs/ts8,runs/ts4 --out=runs/saturation

Reads each run's reports/eval_depth[_TAG].json; the saturation depth of a run is the
smallest depth whose loss is within --delta of its best loss. Writes
<out>/reports/saturation[_TAG].{json,md,png}.
"""

import math
import os

from absl import app, flags

from elastic_depth import books, reports
from experiments import flags_util

WORKDIRS = flags.DEFINE_list('workdirs', None, 'Run directories with eval_depth reports.')
TAG = flags.DEFINE_string('tag', '', 'Report tag (e.g. fineweb).')
DELTA = flags.DEFINE_float('delta', books.DEFAULT_DELTA, 'Nats/token within the best loss.')
OUT = flags.DEFINE_string('out', 'runs/saturation', 'Output directory.')


def saturation_depth(depths, losses, delta: float) -> int:
  """Smallest depth whose loss is within delta of the best loss."""
  best = min(losses)
  return next(d for d, l in zip(depths, losses) if l <= best + delta)


def main(argv):
  flags_util.no_arguments(argv)
  if not WORKDIRS.value:
    flags_util.fail('--workdirs is required')
  if not (math.isfinite(DELTA.value) and DELTA.value >= 0):
    flags_util.fail(f'--delta={DELTA.value} must be a finite number >= 0')
  if not flags_util.tag_fits_file_name(TAG.value):
    flags_util.fail(f'--tag={TAG.value!r}: letters, digits, _ . - only (it ends file names)')
  name = f'eval_depth_{TAG.value}' if TAG.value else 'eval_depth'
  runs = {}
  for wd in WORKDIRS.value:
    path = os.path.join(wd, 'reports', f'{name}.json')
    if not os.path.exists(path):
      flags_util.fail(f'no {path}: run python -m experiments.eval_depth --workdir={wd}')
    try:
      r = reports.read_results(path, ('depths', 'loss', 'train_mean'))
    except ValueError as e:
      flags_util.fail(f'{e}; rerun python -m experiments.eval_depth --workdir={wd}')
    if (not r['loss'] or len(r['loss']) != len(r['depths'])
        or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in r['loss'])):
      flags_util.fail(f'{path}: its losses are empty, missing or not finite; rerun '
                      f'python -m experiments.eval_depth --workdir={wd}')
    runs[wd] = dict(depths=r['depths'], loss=r['loss'], train_mean=r['train_mean'],
                    saturation=saturation_depth(r['depths'], r['loss'], DELTA.value))
  md = (f'Loss vs uniform depth from each run\'s reports/{name}.json\n\n'
        '| run | training mean depth | saturation depth (within '
        f'{DELTA.value} nats of best) | loss @1 | loss @2 | loss @4 | loss @8 | best |\n'
        '|---|---|---|---|---|---|---|---|\n')
  for wd, r in runs.items():
    at = dict(zip(r['depths'], r['loss']))
    md += (f"| {wd} | {r['train_mean']:g} | {r['saturation']} | " +
           ' | '.join(f'{at.get(d, float("nan")):.4f}' for d in (1, 2, 4, 8)) +
           f" | {min(r['loss']):.4f} |\n")

  def plot(fig):
    ax = fig.add_subplot(1, 1, 1)
    for wd, r in runs.items():
      line, = ax.plot(r['depths'], r['loss'], 'o-', ms=3,
                      label=f"{wd} (train mean {r['train_mean']:g})")
      ax.axvline(r['train_mean'], color=line.get_color(), ls=':', lw=1)
      ax.axvline(r['saturation'], color=line.get_color(), ls='--', lw=1)
    ax.set(xscale='log', xlabel='uniform depth (loops)', ylabel='validation loss (nats/token)',
           title='saturation: dotted = training mean, dashed = saturation depth')
    ax.legend()
  out_name = f'saturation_{TAG.value}' if TAG.value else 'saturation'
  paths = reports.write(OUT.value, out_name, runs, flags={'workdirs': WORKDIRS.value,
                                                   'delta': DELTA.value, 'tag': TAG.value},
                        checkpoint={}, markdown=md, plot=plot)
  print(md)
  print(f"report {paths['md']}")


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
