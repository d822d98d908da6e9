"""Choose the A1 exit threshold eps with a guarantee (Learn-then-Test, as in CALM).

  python -m experiments.calibrate_eps --workdir=runs/tiny --delta=0.02 --alpha=0.1
  python -m experiments.calibrate_eps --workdir=runs/tiny --risk=argmax --delta=0.02
  python -m experiments.sweep_eps --workdir=runs/tiny    # marks the calibrated point

The first --cal_batches validation batches calibrate, the remaining ones (up to
--batches) are held out and only report. The chosen eps is the most aggressive one of
the grid such that P(risk > delta) <= alpha over the draw of the calibration sequences
(risk: the loss increase against full depth or the argmax disagreement with it; see
elastic_depth/calibrate.py). Writes <workdir>/reports/calibrate_eps[_TAG].{json,md,png}.
"""

import dataclasses
from typing import Optional

import jax
import numpy as np
from absl import app, flags

from elastic_depth import analysis, books, calibrate, reports
from experiments import common, flags_util, sweep_eps



@dataclasses.dataclass
class CalibrateOptions:
  """This experiment's own settings."""
  delta: float = books.DEFAULT_DELTA  # the risk level not to exceed (--delta, shared)
  alpha: float = 0.1                  # allowed probability of exceeding delta
  risk: calibrate.Risk = calibrate.Risk.LOSS
  pvalue: calibrate.PValue = calibrate.PValue.HOEFFDING_BENTKUS
  bound: float = 1.0                  # clip of the per-token loss increase (nats)
  cal_batches: int = 0                # calibration batches (0: half of --batches)
  eps_grid: Optional[list[float]] = None  # increasing (None: 25 points 1e-6..1)


DELTA, EPS_GRID = sweep_eps.DELTA, sweep_eps.EPS_GRID  # --delta, --eps_grid: shared flags
ALPHA = flags.DEFINE_float('alpha', CalibrateOptions.alpha, 'Allowed probability of exceeding '
                           'delta.')
RISK = flags.DEFINE_enum_class('risk', CalibrateOptions.risk, calibrate.Risk,
                               'loss: loss increase against full depth (clipped to '
                               '[0, --bound]); argmax: argmax differs from full depth.')
PVALUE = flags.DEFINE_enum_class('pvalue', CalibrateOptions.pvalue,
                                 calibrate.PValue, 'p-value of H0: risk > delta.')
BOUND = flags.DEFINE_float('bound', CalibrateOptions.bound, 'Clip of the per-token loss increase (nats); '
                           'a looser clip needs more calibration sequences.')
CAL_BATCHES = flags.DEFINE_integer('cal_batches', 0, 'Calibration batches (the first ones; '
                                   '0: half of --batches); the rest are held out.')


def check(x: CalibrateOptions, n_batches: Optional[int] = None) -> int:
  """Validates the settings (the split once n_batches is known); returns the number of
  calibration batches."""
  if not 0 < x.delta:
    raise common.SetupError(f'--delta={x.delta} must be > 0')
  if not 0 < x.alpha < 1:
    raise common.SetupError(f'--alpha={x.alpha} must be in (0, 1)')
  if x.risk == calibrate.Risk.ARGMAX and not x.delta < 1:
    raise common.SetupError(f'--delta={x.delta} must be < 1 for --risk=argmax (the '
                            'probability that the argmax changes)')
  if x.risk == calibrate.Risk.LOSS and not (x.delta < x.bound < float('inf')):
    raise common.SetupError(f'--bound={x.bound} must be finite and exceed --delta={x.delta}')
  grid = x.eps_grid
  if grid is not None and (not grid or list(grid) != sorted(grid) or min(grid) < 0):
    raise common.SetupError(f'--eps_grid={grid} must be non-negative and increasing')
  if n_batches is None:
    return 0
  n_cal = x.cal_batches or n_batches // 2
  if not 0 < n_cal < n_batches:
    raise common.SetupError(f'--cal_batches={n_cal} must leave at least one of the '
                            f'{n_batches} validation batches (--batches) held out')
  return n_cal


def _markdown(res: dict, info: dict) -> str:
  c, h = res['calibration'], res['heldout']
  md = reports._title('Calibrated exit threshold (Learn-then-Test)', info)  # pylint: disable=protected-access
  md += (f"risk={res['risk']}, delta={res['delta']}, alpha={res['alpha']}, p-value "
         f"{res['pvalue']}; calibration batches {res['cal_batches']}, held-out "
         f"{res['test_batches']}\n\nchosen eps: {res['eps']}\n\n")
  return md + reports.table(['split', 'risk', 'loss', 'loss at full depth', 'mean loops'],
                            [[k, s['risk'], s['loss'], s['loss_full'], s['mean_loops']]
                             for k, s in (('calibration', c), ('held-out', h))])


def _plot(res: dict):
  def plot(fig):
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(res['eps_grid'], res['calibration_risk_by_eps'], 'o-', label='calibration risk')
    positive = [e for e in res['eps_grid'] if e > 0]  # symlog keeps eps = 0 on the axis
    ax.set_xscale('symlog', linthresh=min(positive) if positive else 1e-12)
    ax.axhline(res['delta'], color='gray', ls=':', label='delta')
    if res['eps'] is not None:
      ax.axvline(res['eps'], color='r', ls='--', label=f"chosen eps={res['eps']:.3g}")
    ax.set(xlabel='eps', ylabel=f"risk ({res['risk']})")
    ax.legend(fontsize=8)
  return plot


def run(opts: common.Options, x: CalibrateOptions = CalibrateOptions()) -> dict:
  """Scores the grid on both splits, calibrates, writes the report."""
  check(x)  # before loading anything
  ld = common.load(opts)
  n_cal = check(x, len(ld.batches))
  grid = x.eps_grid or analysis.default_grid(1e-6, 1.0, 25)
  rng = jax.random.key(opts.seed)
  keys = [analysis.batch_key(rng, k) for k in range(len(ld.batches))]
  split = {'cal': list(range(n_cal)), 'test': list(range(n_cal, len(ld.batches)))}
  scored = {s: calibrate.score_grid(ld.model, [ld.batches[k] for k in ix],
                                    [keys[k] for k in ix], grid, ld.r_max,
                                    progress=opts.progress)
            for s, ix in split.items()}
  mask = {s: np.concatenate([ld.batches[k]['mask'] for k in ix]) for s, ix in split.items()}
  res = calibrate.calibrate(scored['cal'], mask['cal'], scored['test'], mask['test'], grid,
                            delta=x.delta, alpha=x.alpha, risk=x.risk.value,
                            pvalue=x.pvalue.value, bound=x.bound)
  res.update(cal_batches=split['cal'], test_batches=split['test'], r_max=ld.r_max)
  info = ld.checkpoint_info()
  paths = reports.write(opts.workdir, common.report_name('calibrate_eps', opts), res,
                        flags=common.flag_record(opts, ld, x), checkpoint=info,
                        markdown=_markdown(res, info), plot=_plot(res))
  h = res['heldout']
  if res['eps'] is None:
    print(f"calibrate_eps: no eps of the grid is certified (risk {res['risk']} <= "
          f"{res['delta']} with probability {1 - res['alpha']:g}): keep full depth "
          f"{ld.r_max}; report {paths['md']}")
  else:
    print(f"calibrate_eps: eps={res['eps']:.3g} (P(risk > {res['delta']}) <= {res['alpha']});"
          f" held-out {res['risk']} risk {h['risk']:.4f}, loss {h['loss']:.4f} (full depth "
          f"{h['loss_full']:.4f}), mean loops {h['mean_loops']:.2f} of {ld.r_max}; "
          f"report {paths['md']}")
  return {'results': res, 'paths': paths}


def options_from_flags() -> CalibrateOptions:
  """CalibrateOptions from the flags."""
  return CalibrateOptions(delta=DELTA.value, alpha=ALPHA.value, risk=RISK.value,
                          pvalue=PVALUE.value, bound=BOUND.value, cal_batches=CAL_BATCHES.value,
                          eps_grid=flags_util.floats(EPS_GRID.value, 'eps_grid',
                                                     common.SetupError))


flags.adopt_module_key_flags(common)  # the shared flags show in --helpshort

if __name__ == '__main__':
  app.run(common.main(run, options_from_flags), flags_parser=flags_util.parse_or_fail)
