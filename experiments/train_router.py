"""A2: train the oracle-labelled linear router on a frozen checkpoint.

  python -m experiments.train_router --workdir=runs/tiny
  python -m experiments.sweep_eps --workdir=runs/tiny --router   # adds the A2 curve

Labels come from the model itself: for token t at loop i, 1 if its argmax changes at a
later loop up to R. Training pairs come from validation batches --fit_from ..
--fit_from + --fit_batches - 1, after the ones sweep_eps scores by default (0..7), so the
A2 curve is held out; accuracy and calibration are reported on batches 0..--fit_from - 1.
router.json records which validation tokens the probe saw, and sweep_eps refuses to
score them. Writes <workdir>/router.json and <workdir>/reports/router.{json,md}.
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
  fit_from: int = 8          # first validation batch fitted on (earlier ones: held out)
  fit_batches: int = 4       # validation batches fitted on


STEPS = flags.DEFINE_integer('router_steps', RouterOptions.steps, 'Full-batch AdamW steps of '
                             'the probe.')
LR = flags.DEFINE_float('router_lr', RouterOptions.lr, 'Probe learning rate.')
MAX_PAIRS = flags.DEFINE_integer('max_pairs', RouterOptions.max_pairs, '(token, loop) pairs '
                                 'used to train.')
FIT_FROM = flags.DEFINE_integer('fit_from', RouterOptions.fit_from, 'First validation batch '
                                'the probe fits on; batches before it are held out (sweep_eps '
                                'scores them).')
FIT_BATCHES = flags.DEFINE_integer('fit_batches', RouterOptions.fit_batches, 'Validation '
                                   'batches the probe fits on.')


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
  first, n_fit = x.fit_from, x.fit_batches
  if first < 1 or n_fit < 1:
    raise common.SetupError(f'--fit_from={first} and --fit_batches={n_fit} must be >= 1 '
                            '(batches before --fit_from are the held-out ones)')
  ld = common.load(dataclasses.replace(opts, batches=first + n_fit))
  if len(ld.batches) < first + n_fit:
    raise common.SetupError(
        f'the validation set has {len(ld.batches)} batches, fewer than --fit_from={first} + '
        f'--fit_batches={n_fit}; lower them (sweep_eps --batches must stay <= --fit_from) '
        'or enlarge the validation split')
  rng = jax.random.key(opts.seed)
  fit_h = router.harvest(ld.model, ld.batches[first:], ld.r_max, rng, x.max_pairs)
  test_h = router.harvest(ld.model, ld.batches[:first], ld.r_max, rng, x.max_pairs)
  probe = router.fit(fit_h, steps=x.steps, lr=x.lr)
  res = {'train': router.evaluate(probe, fit_h), 'heldout': router.evaluate(probe, test_h),
         'r_max': ld.r_max, 'pairs_train': int(len(fit_h.labels_N))}
  b, l = ld.data.batch_size, ld.data.seq_len
  fit = {'batches': list(range(first, first + n_fit)), 'batch_size': b, 'seq_len': l,
         'tokens': router.batch_tokens(first, n_fit, b, l),
         'data_config': dataclasses.asdict(ld.data_cfg)}
  res['fit'] = fit
  path = os.path.join(opts.workdir, 'router.json')
  router.save(probe, path, fit)
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
  app.run(common.main(run, lambda: RouterOptions(
      steps=STEPS.value, lr=LR.value, max_pairs=MAX_PAIRS.value, fit_from=FIT_FROM.value,
      fit_batches=FIT_BATCHES.value)))
