"""Exit-policy sweep: uniform depth (A0) at 1..R against per-token exit (A1: KL < eps)
over a log-spaced eps grid, in loss, mean loops and FLOPs per token (exit checks
counted). Headline: the smallest mean depth within --delta of uniform depth at the
training mean, and A0's loss at the same mean loops (the frontier comparison). With
--semantics=cached, A0 is scored in cached semantics too ('a0_cached', uniform depth 1..R
token by token), and the @cached curves are judged against it. The exit-check books give
each cheap check's frontier gap against the exact one with a paired bootstrap interval
over the scored sequences (`books.frontier_gap_interval`).

  python -m experiments.sweep_eps --workdir=runs/tiny
  python -m experiments.sweep_eps --workdir=runs/ts --eps_grid=1e-5,1e-4,1e-3 \
      --curves=kl,reverse_kl,state_delta --delta=0.02
  python -m experiments.sweep_eps --workdir=runs/tiny --curves=kl,state_delta --kl_probe \
      --semantics=parallel,cached   # after train_router --probe=kl_probe, once per semantics

Writes <workdir>/reports/sweep_eps[_TAG].{json,png,md}.
"""

import dataclasses
import json
import math
import os
from typing import Optional

import jax
from absl import app, flags

from elastic_depth import books, frontier, kl_probe, reports
from elastic_depth import router as router_lib
from elastic_depth.config import Semantics
from experiments import common, flags_util



@dataclasses.dataclass
class SweepOptions:
  """This experiment's own settings."""
  eps_grid: Optional[list[float]] = None          # KL thresholds (None: 1e-6..1)
  delta: float = books.DEFAULT_DELTA           # loss tolerance of the headline
  curves: tuple[str, ...] = ('kl',)               # exit curves besides A0
  state_delta_grid: Optional[list[float]] = None
  router: bool = False                            # add the A2 curve from router.json
  router_grid: Optional[list[float]] = None
  kl_probe: bool = False                          # add kl_probe (kl_probe[_cached].json)
  semantics: tuple[str, ...] = ('parallel',)      # parallel (score), cached (decode_step)
  calibrated: bool = True                         # mark calibrate_eps's eps if chosen
  timing_repeats: int = 3                         # time each best point against A0
  check_every: tuple[int, ...] = (1,)             # also every curve checked every k loops
  min_loops: tuple[int, ...] = (1,)               # also every curve with no exit before m
  patience: tuple[int, ...] = (1,)                # also state_delta exiting after k loops below
  eps_growth: tuple[float, ...] = (1.0,)          # also every curve with eps * g^(i - 2) at loop i


# EPS_GRID and DELTA are shared with experiments.calibrate_eps
EPS_GRID = flags.DEFINE_list('eps_grid', None, 'KL thresholds (nats), comma-separated '
                             '(default: a log-spaced grid 1e-6..1; calibrate_eps: increasing).')
DELTA = flags.DEFINE_float('delta', SweepOptions.delta, 'Loss tolerance (nats/token) of the '
                           'headline; calibrate_eps: the risk level not to exceed.')
CURVES = flags.DEFINE_list('curves', list(SweepOptions.curves), 'Exit curves: kl (A1), '
                           'gated_kl (A1 where the state change < the median at loop 2), '
                           'reverse_kl, state_delta.')
ROUTER = flags.DEFINE_bool('router', False, 'Add the A2 curve from <workdir>/router[_TAG].json '
                           '(python -m experiments.train_router); refused if the router '
                           'was fitted on batches this sweep scores.')
KL_PROBE = flags.DEFINE_bool('kl_probe', False, 'Add the kl_probe curve (the KL estimated '
                             'from the state, no readout; thresholds: --eps_grid), scored in '
                             'each --semantics with the probe fitted in it: '
                             '<workdir>/kl_probe.json (parallel) and kl_probe_cached.json '
                             '(train_router --probe=kl_probe [--probe_semantics=cached]); '
                             'refused if a probe was fitted on batches this sweep scores.')
CALIBRATED = flags.DEFINE_bool('calibrated', True, 'Mark the eps chosen by '
                               'experiments.calibrate_eps (reports/calibrate_eps[_TAG].json) '
                               'on the frontier when that report exists.')
ROUTER_GRID = flags.DEFINE_list('router_grid', None, 'A2 thresholds on P(change) (default '
                                '10 points 0.05..0.95).')
SEMANTICS = flags.DEFINE_list('semantics', list(SweepOptions.semantics), 'Scoring '
                              'semantics of the curves: parallel (inference.score), cached '
                              '(token by token through decode_step; curves named <curve>@cached).')
TIMING_REPEATS = flags.DEFINE_integer('timing_repeats', SweepOptions.timing_repeats,
                                      'Time each curve\'s best point against A0 at the '
                                      'training mean, interleaved, medians of this many '
                                      'runs (0: no timing).')
CHECK_EVERY = flags.DEFINE_list('check_every', ['1'], 'For each k > 1, every curve again '
                                'with checks every k loops (<curve>/every<k>).')
MIN_LOOPS = flags.DEFINE_list('min_loops', ['1'], 'For each m > 1, every curve again with '
                              'no exit before loop m (<curve>/min<m>); the books judge each '
                              'check over all of them too (<curve>/min*).')
PATIENCE = flags.DEFINE_list('patience', ['1'], 'For each k > 1, every state_delta curve '
                             'again, exiting only after k consecutive loops below its '
                             'threshold (<curve>/pat<k>).')
EPS_GROWTH = flags.DEFINE_list('eps_growth', ['1'], 'For each g != 1, every curve again with '
                               'its threshold at loop i eps * g^(i - 2) (exit.eps_growth, '
                               '<curve>/g<g>); the books judge each check over all of them '
                               'too (<curve>/g*).')
STATE_DELTA_GRID = flags.DEFINE_list('state_delta_grid', None, 'Relative state-change '
                                     'thresholds (default: 9 log-spaced points 1e-4..1).')


def _floats(xs, name):
  return flags_util.floats(xs, name, common.SetupError, lower=0.0)


def options_from_flags() -> SweepOptions:
  """SweepOptions from this experiment's flags."""
  if not (math.isfinite(DELTA.value) and DELTA.value >= 0) or TIMING_REPEATS.value < 0:
    raise common.SetupError(f'--delta={DELTA.value} must be a finite number >= 0 and '
                            f'--timing_repeats={TIMING_REPEATS.value} >= 0')
  return SweepOptions(eps_grid=_floats(EPS_GRID.value, 'eps_grid'), delta=DELTA.value,
                      curves=tuple(CURVES.value), router=ROUTER.value,
                      kl_probe=KL_PROBE.value,
                      state_delta_grid=_floats(STATE_DELTA_GRID.value, 'state_delta_grid'),
                      router_grid=_floats(ROUTER_GRID.value, 'router_grid'),
                      semantics=tuple(SEMANTICS.value), calibrated=CALIBRATED.value,
                      timing_repeats=TIMING_REPEATS.value,
                      check_every=_positive_ints(CHECK_EVERY.value, 'check_every'),
                      min_loops=_positive_ints(MIN_LOOPS.value, 'min_loops'),
                      patience=_positive_ints(PATIENCE.value, 'patience'),
                      eps_growth=_growths(EPS_GROWTH.value))


def _growths(xs) -> tuple[float, ...]:
  gs = flags_util.floats(xs, 'eps_growth', common.SetupError) or [1.0]
  if any(g <= 0 for g in gs):
    raise common.SetupError(f'--eps_growth: want positive numbers, got {xs}')
  return tuple(gs)


def _positive_ints(xs, name: str) -> tuple[int, ...]:
  try:
    ks = tuple(int(x) for x in xs)
  except ValueError:
    ks = ()
  if not ks or min(ks) < 1:
    raise common.SetupError(f'--{name}: want positive integers, got {",".join(xs)}')
  return ks


def _probe(opts: common.Options, ld: common.Loaded, name: str):
  """The workdir's state probe `name` (router, or a kl_probe file); SetupError if it is
  missing, unreadable or saw any batch scored here."""
  path = os.path.join(opts.workdir, common.report_name(name, opts) + '.json')
  fit_flag = {'router': '', 'kl_probe': ' --probe=kl_probe',
              'kl_probe_cached': ' --probe=kl_probe --probe_semantics=cached'}[name]
  fit_flag += f' --tag={opts.tag}' if opts.tag else ''
  flag = 'router' if name == 'router' else 'kl_probe'
  if not os.path.exists(path):
    raise common.SetupError(f'--{flag}: no {path}; run python -m experiments.train_router'
                            f'{fit_flag} --workdir={opts.workdir} first')
  tokens = router_lib.batch_tokens(0, len(ld.batches), ld.data.batch_size, ld.data.seq_len)
  try:
    fit = router_lib.load_fit(path)
    why = router_lib.overlap_error(fit, dataclasses.asdict(ld.data_cfg), tokens, flag)
    fitted_at = (fit or {}).get('checkpoint_step')  # older files do not record it
    probe = (router_lib.load(path) if name == 'router' else
             kl_probe.load(path, ld.model.cfg.d_model))
    if name == 'router' and probe.w_D.shape != (ld.model.cfg.d_model,):
      raise ValueError(f'its weights have width {probe.w_D.shape}, the model '
                       f'd_model={ld.model.cfg.d_model}: fitted on another model')
  except (ValueError, KeyError, TypeError) as e:
    raise common.SetupError(f'--{flag}: {path} is unreadable ({e}); refit it') from None
  if fitted_at is not None and fitted_at != ld.step:
    raise common.SetupError(f'--{flag}: {path} was fitted on the checkpoint of step '
                            f'{fitted_at}, and this sweep scores step {ld.step}; refit it, '
                            f'or pass --step={fitted_at}')
  if why:
    raise common.SetupError(f'--{flag}: {why}; score fewer batches (--batches) or refit '
                            'with a larger train_router --fit_from')
  return probe


def _calibrated(opts: common.Options, ld: common.Loaded) -> dict:
  """{'calibrated': a one-point KL curve} at the eps of calibrate_eps, if it chose one for
  this checkpoint, depth cap and data (its guarantee holds for those only)."""
  path = os.path.join(opts.workdir, 'reports', common.report_name('calibrate_eps', opts)
                      + '.json')
  if not os.path.exists(path):
    return {}
  try:
    rec = reports.read_report(path, ('eps',))
    eps = rec['results']['eps']
    was = {'step': rec['checkpoint']['step'], 'max depth': rec['flags']['r_max'],
           'data': rec['checkpoint']['data_config']}
  except (ValueError, KeyError, TypeError) as e:
    raise common.SetupError(f'{path}: {e}; rerun calibrate_eps or pass --nocalibrated'
                            ) from None
  if eps is None:
    return {}
  now = {'step': ld.step, 'max depth': ld.r_max, 'data': dataclasses.asdict(ld.data_cfg)}
  differ = [k for k in now if json.loads(json.dumps(now[k])) != was[k]]
  if differ:
    said = [f'{k} {was[k]} vs {now[k]} here' for k in differ if k != 'data']
    raise common.SetupError(
        f'{path} certified its eps for another {" and ".join(differ)} ('
        + ', '.join(said + ['other data settings'] * ('data' in differ))
        + '): its guarantee does not hold here; rerun calibrate_eps with the same --step, '
        '--max_depth and data, or pass --nocalibrated')
  return {'calibrated': frontier.Curve('kl', [eps])}


def _interval(ci) -> str:
  return ('' if ci is None else f" [{100 * ci['level']:.0f}% bootstrap over "
          f"{ci['sequences']} sequences: {ci['interval'][0]:+.4f} to {ci['interval'][1]:+.4f}]")


def _operating(g, ci=None) -> str:
  return ('' if g is None else f", {g['max_gap']:+.4f}{_interval(ci)} in the operating range "
          f"({g['range'][0]:.2f}-{g['range'][1]:.2f} loops)")


def _timed(wc) -> str:
  if not wc:
    return ''
  return (f"; wall-clock {100 * wc['saving']:.1f}% less than uniform depth {wc['a0_depth']} "
          f"(median of {wc['repeats']}, same run)")


def run(opts: common.Options, x: SweepOptions = SweepOptions()) -> dict:
  """Loads the workdir, runs A0 and the exit curves and writes the report."""
  empty = [n for n, v in (('eps_grid', x.eps_grid), ('state_delta_grid', x.state_delta_grid),
                          ('router_grid', x.router_grid), ('semantics', x.semantics))
           if v is not None and not len(v)]
  if empty:
    raise common.SetupError(f'--{empty[0]} is empty: give at least one value (or leave the '
                            'flag out for its default)')
  bad = sorted(set(x.semantics) - {s.value for s in Semantics})
  if bad:
    raise common.SetupError(f'--semantics: unknown {bad}; choose from parallel, cached')
  bad = frontier.unknown_curves(x.curves)
  if bad or not x.curves:
    raise common.SetupError(f'--curves: unknown {bad}; choose from '
                            f'{", ".join(frontier.BUILTIN_CURVES)}')
  ld = common.load(opts)
  common.check_reaches_mean(ld, 'the headline (A0 at the training mean)')
  probe = _probe(opts, ld, 'router') if x.router else None
  extra = _calibrated(opts, ld) if x.calibrated else {}
  kl_probes = ({sem: _probe(opts, ld, kl_probe.file_name(sem)) for sem in x.semantics}
               if x.kl_probe else None)
  res = frontier.sweep(ld.model, ld.batches, jax.random.key(opts.seed), ld.r_max,
                       common.train_mean(ld.cfg), eps_grid=x.eps_grid, delta=x.delta,
                       curves=tuple(x.curves), state_delta_grid=x.state_delta_grid,
                       router=probe, router_grid=x.router_grid, kl_probes=kl_probes,
                       semantics=x.semantics,
                       extra_curves=extra, timing_repeats=x.timing_repeats,
                       check_every=x.check_every, min_loops=x.min_loops,
                       patience=x.patience, eps_growth=x.eps_growth, progress=opts.progress)
  info = ld.checkpoint_info()
  paths = reports.write(opts.workdir, common.report_name('sweep_eps', opts), res,
                        flags=common.flag_record(opts, ld, x), checkpoint=info,
                        markdown=reports.sweep_markdown(res, info),
                        plot=reports.sweep_plot(res))
  for name, h in res['headline'].items():
    b = h['best']
    if b is None:
      print(f"{name}: no threshold within {h['delta']} nats of uniform depth "
            f"{h['ref_depth']:g} (loss {h['ref_loss']:.4f})")
    else:
      print(f"{name}: eps={b['threshold']:.3g} -> {b['mean_loops']:.2f} mean loops "
            f"(loss {b['loss']:.4f} vs {h['ref_loss']:.4f} at depth {h['ref_depth']:g}; "
            f"{100 * b['loop_saving']:.1f}% fewer loops; FLOPs as executed: "
            f"{100 * b['flops_saving']:.1f}% fewer (the engine as run), "
            f"{100 * b['flops_active_saving']:.1f}% fewer (active tokens only)"
            f"{_timed(b.get('wall_clock'))}); uniform depth at the same mean loops: "
            f"{b['a0_loss_same_loops']:.4f} (gap {b['gap_same_loops']:+.4f}"
            f"{_interval(b.get('gap_same_loops_interval'))})")
  for name, b in res['check_books'].items():
    g = b['frontier_vs_exact']
    vs = ('' if g is None else f"; frontier vs {b['exact']}: at most {g['max_gap']:+.4f}"
          f"{_interval(b.get('frontier_vs_exact_interval'))} nats at equal mean loops "
          f"({g['range'][0]:.2f}-{g['range'][1]:.2f} loops)"
          + _operating(b.get('frontier_vs_exact_operating'),
                       b.get('frontier_vs_exact_operating_interval')))
    print(f"{name}: check cost per loop {max(b['cost']):.3f} core loops here, "
          f"{max(b['cost_135m']):.3f} at the 135M blocks (max over the curve){vs}")
  print(f"report {paths['md']}")
  return {'results': res, 'paths': paths}


flags.adopt_module_key_flags(common)  # the shared flags show in --helpshort

if __name__ == '__main__':
  app.run(common.main(run, options_from_flags), flags_parser=flags_util.parse_or_fail)
