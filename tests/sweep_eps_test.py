"""experiments.sweep_eps and calibrate_eps end to end, and the sweep's matched-eps choices."""

import dataclasses
import types

import numpy as np
import pytest

from conftest import mains_opts, report_results
from elastic_depth import calibrate, config as config_lib, frontier
from experiments import bench_generate_quality, calibrate_eps, common, sweep_eps
from elastic_depth.config import ExitPolicy

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"


def test_calibrate_eps_end_to_end_and_marked_on_the_sweep(workdir):
  x = calibrate_eps.CalibrateOptions(
      delta=0.5, alpha=0.2, risk=calibrate.Risk.LOSS, bound=4.0, cal_batches=1,
      pvalue=calibrate.PValue.HOEFFDING_BENTKUS, eps_grid=[1e-6, 1e-3, 1e9])
  out = calibrate_eps.run(mains_opts(workdir), x)
  res = report_results(out['paths']['json'])
  assert res['cal_batches'] == [0] and res['test_batches'] == [1]  # disjoint splits
  # the p-values are the Hoeffding-Bentkus bound of each eps's mean calibration risk over
  # the calibration sequences, in grid order until the first above alpha; the chosen eps
  # is the last of the certified prefix
  n, risks = res['units'], res['calibration_risk_by_eps']
  assert n == 4 and len(risks) == 3  # one batch of 4 sequences
  ps = [calibrate.p_hoeffding_bentkus(r / 4.0, n, 0.5 / 4.0) for r in risks]
  stop = next((i for i, p in enumerate(ps) if p > 0.2), len(ps) - 1)
  np.testing.assert_allclose(res['p_values'], ps[:stop + 1], rtol=1e-12)
  j = next((i - 1 for i, p in enumerate(ps) if p > 0.2), len(ps) - 1)
  assert res['index'] == (None if j < 0 else j)
  assert res['eps'] == (None if j < 0 else x.eps_grid[j])
  assert risks[0] <= risks[-1]  # eps 1e9 exits every token at its first check
  if res['eps'] is not None:
    assert 1 <= res['heldout']['mean_loops'] <= res['r_max']
  sw = sweep_eps.run(mains_opts(workdir), sweep_eps.SweepOptions(
      eps_grid=[1e-3], delta=0.01, calibrated=True))['results']
  assert ('calibrated' in sw['curves']) == (res['eps'] is not None)
  with pytest.raises(common.SetupError, match='alpha'):
    calibrate_eps.run(mains_opts(workdir), dataclasses.replace(x, alpha=1.5))
  with pytest.raises(common.SetupError, match='--bound=inf must be finite'):
    calibrate_eps.run(mains_opts(workdir), dataclasses.replace(x, risk='loss', bound=float('inf')))
  with pytest.raises(common.SetupError, match='held out'):
    calibrate_eps.run(mains_opts(workdir), dataclasses.replace(x, cal_batches=2))


def test_sweep_list_flags_name_a_bad_value():
  assert sweep_eps._positive_ints(['1', '3'], 'min_loops') == (1, 3)
  for bad in (['0'], ['x'], ['2', '-1']):
    with pytest.raises(common.SetupError, match='--min_loops: want positive integers'):
      sweep_eps._positive_ints(bad, 'min_loops')
  assert sweep_eps._growths(['1', '2.5']) == (1.0, 2.5)
  for bad in (['0'], ['-2']):
    with pytest.raises(common.SetupError, match='--eps_growth: want positive numbers'):
      sweep_eps._growths(bad)


def test_sweep_refuses_an_unknown_curve_before_loading_anything(tmp_path):
  missing = str(tmp_path / 'no_such_workdir')  # the curve is named first: nothing is read
  with pytest.raises(common.SetupError, match=r"--curves: unknown \['klx'\]; choose from kl, "):
    sweep_eps.run(mains_opts(missing), sweep_eps.SweepOptions(curves=('kl', 'klx')))
  # an empty list flag is refused too (it crashed after scoring, or wrote an empty report)
  for field in ('eps_grid', 'state_delta_grid', 'router_grid', 'semantics'):
    with pytest.raises(common.SetupError, match=f'--{field} is empty'):
      sweep_eps.run(mains_opts(missing), sweep_eps.SweepOptions(**{field: ()}))
  assert set(frontier.BUILTIN_CURVES) == set(frontier._grids((), None, None))


def test_sweep_in_cached_semantics_reports_its_own_a0(workdir):
  """sweep_eps --semantics=cached: the report carries A0 in cached semantics (a table in
  the markdown) and judges the @cached curve against it; state_delta at a huge threshold
  exits every token at loop 2, so its loss is cached A0's at depth 2."""
  out = sweep_eps.run(mains_opts(workdir, tag='cached'), sweep_eps.SweepOptions(
      curves=('state_delta',), state_delta_grid=[1e9], semantics=('parallel', 'cached'),
      timing_repeats=0))
  sw = report_results(out['paths']['json'])
  a0c = sw['a0_cached']
  assert a0c['threshold'] == list(range(1, sw['r_max'] + 1))
  c = sw['curves']['state_delta@cached']
  assert c['mean_loops'] == [2.0] and c['loss'][0] == pytest.approx(a0c['loss'][1], rel=1e-5)
  fr = sw['headline']['state_delta@cached']['frontier']
  assert fr['a0_loss_same_loops'][0] == pytest.approx(a0c['loss'][1])
  with open(out['paths']['md'], encoding='utf-8') as f:
    assert 'cached semantics' in f.read()


def test_a_calibrated_eps_is_starred_only_where_it_was_certified(workdir):
  """sweep_eps marks calibrate_eps's eps only for the step, depth cap and data it was
  certified on (its guarantee is about those); else a clear refusal (it starred it)."""
  from elastic_depth import reports  # pylint: disable=g-import-not-at-top
  opts = mains_opts(workdir, tag='starcheck')
  ld = common.load(opts)
  info = ld.checkpoint_info()

  def report(step_shift=0, r_max_shift=0, data=None):
    reports.write(workdir, 'calibrate_eps_starcheck', {'eps': 1e-3},
                  flags={'r_max': ld.r_max + r_max_shift},
                  checkpoint={**info, 'step': ld.step + step_shift,
                              'data_config': data or info['data_config']}, markdown='')
  report()
  got = sweep_eps._calibrated(opts, ld)
  assert got['calibrated'].policy == 'kl' and list(got['calibrated'].thresholds) == [1e-3]
  for kw, words in ((dict(step_shift=1), f'another step .step {ld.step + 1} vs {ld.step}'),
                    (dict(r_max_shift=1), 'another max depth'),
                    (dict(data={**info['data_config'], 'seed': 99}),
                     'another data .other data settings')):
    report(**kw)
    with pytest.raises(common.SetupError, match=words):
      sweep_eps._calibrated(opts, ld)


def _uniform_losses(by_depth):
  """A quality function: uniform depth d -> by_depth[d]; exit eps -> by_eps[eps]."""
  def make(by_eps):
    def loss(policy, eps, depth, prefill_depth=None):
      if policy == ExitPolicy.UNIFORM:
        return by_depth[depth]
      return by_eps[eps]
    return loss
  return make


def test_cheapest_uniform_takes_a_depth_exactly_at_the_tolerance():
  """Within tol means <= a0 + tol: a depth at exactly a0 + tol matches (brute force)."""
  by_depth = {1: 3.0, 2: 2.5, 3: 2.25, 4: 2.0}
  loss = _uniform_losses(by_depth)({})
  want = min(d for d in range(1, 5) if by_depth[d] <= by_depth[4] + 0.5)
  assert want == 2
  got = bench_generate_quality.cheapest_uniform(loss, 4, 2.0, 0.5)
  assert got['match_depth'] == want and got['match_loss'] == 2.5
  none = bench_generate_quality.cheapest_uniform(loss, 4, 2.0, 0.1)
  assert none['match_depth'] == 4 and none['match_loss'] == 2.0


def test_matched_eps_is_the_most_aggressive_within_tol_else_the_safest():
  by_depth = {1: 3.0, 2: 2.5, 3: 2.25, 4: 2.0}
  grid = [1e-3, 1e-1, 1e-2]  # any order
  # two thresholds within tol: the larger (most aggressive) one
  by_eps = {1e-1: 2.5, 1e-2: 2.005, 1e-3: 2.001}
  got = bench_generate_quality.matched(_uniform_losses(by_depth)(by_eps), 4, 8, 'kl', grid, 0.01)
  want = max(e for e in grid if by_eps[e] <= 2.0 + 0.01)
  assert got['eps'] == want == 1e-2 and got['matched'] is True
  assert got['a1_loss'] == 2.005 and got['a0_loss'] == 2.0
  # none within tol: the smallest eps of the grid (closest to full depth), flagged unmatched
  by_eps = {1e-1: 2.5, 1e-2: 2.3, 1e-3: 2.2}
  got = bench_generate_quality.matched(_uniform_losses(by_depth)(by_eps), 4, 8, 'kl', grid, 0.01)
  assert got['eps'] == min(grid) and got['matched'] is False and got['a1_loss'] == 2.2


def test_check_reaches_mean_allows_a_cap_equal_to_the_training_mean():
  cfg = config_lib.Config(depth=config_lib.DepthConfig(mean=2.0, r_max=4, buckets=(1, 2, 4)))
  ld = types.SimpleNamespace(cfg=cfg, r_max=2)
  common.check_reaches_mean(ld, 'x')  # r_max == mean: reached
  with pytest.raises(common.SetupError, match='below the training mean depth 2'):
    common.check_reaches_mean(types.SimpleNamespace(cfg=cfg, r_max=1), 'x')
  # r_max clips the draws: the mean training ran at is r_max, min(mean, r_max)
  clipped = config_lib.Config(depth=config_lib.DepthConfig(mean=6.0, r_max=4, buckets=(1, 2, 4)))
  assert common.train_mean(clipped) == 4
  common.check_reaches_mean(types.SimpleNamespace(cfg=clipped, r_max=4), 'x')


def test_calibration_split_must_leave_a_held_out_batch():
  x = calibrate_eps.CalibrateOptions()
  assert calibrate_eps.check(x, 4) == 2 and calibrate_eps.check(x, 3) == 1
  assert calibrate_eps.check(calibrate_eps.CalibrateOptions(cal_batches=3), 4) == 3
  for n_cal, n in ((4, 4), (5, 4), (0, 1)):
    with pytest.raises(common.SetupError, match='held out'):
      calibrate_eps.check(calibrate_eps.CalibrateOptions(cal_batches=n_cal), n)


def test_sweep_delta_zero_is_a_valid_tolerance(tmp_path, main_cases):
  """--delta=0 (the headline at exactly uniform depth's loss) passes the flag check and
  reaches the workdir (missing here); a negative one is refused."""
  missing = tmp_path / 'no_such_workdir'
  zero, neg = main_cases('experiments.sweep_eps', [[f'--workdir={missing}', f'--delta={d}']
                                                   for d in ('0', '-0.01')])
  assert zero['rc'] == 2 and 'does not exist' in zero['stderr'], zero['stderr'][-2000:]
  assert neg['rc'] == 2 and '--delta=-0.01 must be a finite number >= 0' in neg['stderr']


def test_sweep_stars_a_calibrated_eps_of_zero(tmp_path):
  """eps = 0 is a threshold calibrate_eps may certify (the smallest grid point): it is
  starred like any other; a report that certified none (eps None) stars nothing."""
  from elastic_depth import reports  # pylint: disable=g-import-not-at-top
  ld = types.SimpleNamespace(step=7, r_max=4, data_cfg=config_lib.DataConfig())
  opts = mains_opts(str(tmp_path))
  for eps, want in ((0.0, [0.0]), (1e-3, [1e-3]), (None, None)):
    reports.write(str(tmp_path), 'calibrate_eps', {'eps': eps}, flags={'r_max': 4},
                  checkpoint={'step': 7, 'data_config': dataclasses.asdict(ld.data_cfg)},
                  markdown='')
    got = sweep_eps._calibrated(opts, ld)  # pylint: disable=protected-access
    assert (list(got['calibrated'].thresholds) if got else None) == want
