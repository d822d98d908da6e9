"""A2: train the oracle-labelled linear router on a frozen checkpoint.

  python -m experiments.train_router --workdir=runs/tiny
  python -m experiments.sweep_eps --workdir=runs/tiny --router   # adds the A2 curve

Labels come from the model itself: for token t at loop i, 1 if its argmax changes at a
later loop up to R. Training pairs come from the first half of the validation batches,
accuracy and calibration are reported on the second half (held out). Writes
<workdir>/router.json and <workdir>/reports/router.{json,md}.
"""

import dataclasses
import os

import jax
from absl import app, flags

from elastic_depth import reports, router
from experiments import common



@dataclasses.dataclass
class RouterOptions:
  """This experiment's own settings."""
  steps: int = 500           # full-batch AdamW steps of the probe
  lr: float = 1e-2           # probe learning rate
  max_pairs: int = 200_000   # (token, loop) pairs used to train


STEPS = flags.DEFINE_integer('router_steps', RouterOptions.steps, 'Full-batch AdamW steps of '
                             'the probe.')
LR = flags.DEFINE_float('router_lr', RouterOptions.lr, 'Probe learning rate.')
MAX_PAIRS = flags.DEFINE_integer('max_pairs', RouterOptions.max_pairs, '(token, loop) pairs '
                                 'used to train.')


def _reliability(fig, res) -> None:
  """Calibration plot: predicted P(change) against the observed frequency."""
  ax = fig.add_subplot(1, 1, 1)
  for split, style in (('train', 'o--'), ('heldout', 's-')):
    rel = res[split]['reliability']
    ax.plot([r['mean_p'] for r in rel], [r['frac_pos'] for r in rel], style, label=split)
  ax.plot([0, 1], [0, 1], 'k:', lw=1)
  ax.set(xlabel='predicted P(argmax changes later)', ylabel='observed frequency',
         title='A2 router calibration')
  ax.legend()


def run(opts: common.Options, x: RouterOptions = RouterOptions()) -> dict:
  """Harvests labels, fits the probe, evaluates it on held-out text and saves it."""
  ld = common.load(opts)
  if len(ld.batches) < 2:
    raise common.SetupError('train_router needs at least 2 validation batches (--batches)')
  half = len(ld.batches) // 2
  rng = jax.random.key(opts.seed)
  fit_h = router.harvest(ld.model, ld.batches[:half], ld.r_max, rng, x.max_pairs)
  test_h = router.harvest(ld.model, ld.batches[half:], ld.r_max, rng, x.max_pairs)
  probe = router.fit(fit_h, steps=x.steps, lr=x.lr)
  res = {'train': router.evaluate(probe, fit_h), 'heldout': router.evaluate(probe, test_h),
         'r_max': ld.r_max, 'pairs_train': int(len(fit_h.labels_N))}
  path = os.path.join(opts.workdir, 'router.json')
  router.save(probe, path)
  h = res['heldout']
  md = ('| split | pairs | base rate (changes later) | accuracy | balanced acc. | ECE |\n'
        '| --- | ---: | ---: | ---: | ---: | ---: |\n' +
        ''.join(f"| {k} | {v['n']} | {v['base_rate']:.3f} | {v['accuracy']:.3f} | "
                f"{v['balanced_accuracy']:.3f} | {v['ece']:.3f} |\n"
                for k, v in (('train', res['train']), ('held-out', h))))
  paths = reports.write(opts.workdir, common.report_name('router', opts), res,
                        flags=common.flag_record(opts, ld, x), checkpoint=ld.checkpoint_info(),
                        markdown=md, plot=lambda fig: _reliability(fig, res))
  print(f"router: held-out accuracy {h['accuracy']:.3f} (balanced {h['balanced_accuracy']:.3f},"
        f" base rate {h['base_rate']:.3f}, ECE {h['ece']:.3f}); saved {path}; "
        f"report {paths['md']}")
  return {'results': res, 'paths': paths, 'router': path}


if __name__ == '__main__':
  app.run(common.main(run, lambda: RouterOptions(steps=STEPS.value, lr=LR.value,
                                                 max_pairs=MAX_PAIRS.value)))
