"""Learn-then-Test calibration of eps: p-values and the guarantee on synthetic risks."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import exit_model_config
from elastic_depth import calibrate, model as model_lib

# true risk of each threshold, increasing; several sit just above delta = 0.1
P_TRUE = np.array([0.0, 0.02, 0.04, 0.06, 0.08, 0.09, 0.095, 0.1, 0.105, 0.11, 0.12, 0.15,
                   0.2, 0.3])
DELTA, ALPHA, N, TRIALS = 0.1, 0.1, 300, 400
# one-sided 3-sigma Monte-Carlo margin on a violation rate of alpha
MARGIN = 3 * math.sqrt(ALPHA * (1 - ALPHA) / TRIALS)


def _binom_cdf(k: int, n: int, p: float) -> float:
  return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(0, k + 1))


@pytest.mark.parametrize('mean,n,delta', [(0.05, 100, 0.1), (0.0, 30, 0.2), (0.09, 500, 0.1),
                                          (0.3, 50, 0.2),
                                          # n * mean not whole: the count rounds up
                                          (0.053, 100, 0.1), (0.071, 70, 0.15)])
def test_p_values_against_closed_forms(mean, n, delta):
  kl = (mean * math.log(mean / delta) if mean else 0.0) + (1 - mean) * math.log(
      (1 - mean) / (1 - delta))
  hoeff = math.exp(-n * kl) if mean < delta else 1.0
  assert calibrate.p_hoeffding(mean, n, delta) == pytest.approx(hoeff, rel=1e-6)
  bentkus = math.e * _binom_cdf(math.ceil(n * mean), n, delta)
  assert calibrate.p_hoeffding_bentkus(mean, n, delta) == pytest.approx(
      min(1.0, hoeff, bentkus), rel=1e-6)


def _violations(draw, pvalue, naive=False, seed=0):
  """Share of random calibration sets whose chosen threshold has true risk > delta."""
  rng = np.random.default_rng(seed)
  bad = 0
  for _ in range(TRIALS):
    risks = draw(rng)
    if naive:  # the largest threshold whose empirical risk is <= delta: no guarantee
      ok = np.nonzero(risks.mean(1) <= DELTA)[0]
      j = int(ok.max()) if ok.size else None
    else:
      j, _ = calibrate.fixed_sequence(risks, DELTA, ALPHA, pvalue)
    bad += j is not None and P_TRUE[j] > DELTA
  return bad / TRIALS


def _bernoulli(rng):
  return (rng.random((len(P_TRUE), N)) < P_TRUE[:, None]).astype(np.float64)


def _beta(rng):  # continuous risks in [0, 1] with mean P_TRUE (Beta with a + b = 4)
  a = np.maximum(P_TRUE * 4, 1e-3)
  return rng.beta(a[:, None], (4 - a)[:, None], (len(P_TRUE), N))


@pytest.mark.parametrize('pvalue', list(calibrate.PValue))
@pytest.mark.parametrize('draw', [_bernoulli, _beta])
def test_violation_rate_is_at_most_alpha(pvalue, draw):
  assert _violations(draw, pvalue) <= ALPHA + MARGIN
  # the test can fail: picking by the empirical risk alone violates far more often
  assert _violations(draw, pvalue, naive=True) > ALPHA + 3 * MARGIN


def test_fixed_sequence_stops_at_the_first_failure():
  risks = np.stack([np.full(100, 0.0), np.full(100, 0.5), np.full(100, 0.0)])
  j, ps = calibrate.fixed_sequence(risks, 0.1, 0.1)
  assert j == 0 and len(ps) == 2 and ps[1] == 1.0
  j, ps = calibrate.fixed_sequence(risks[1:], 0.1, 0.1)
  assert j is None and len(ps) == 1
  # risks in [0, bound] are tested on the same scale as delta
  j, _ = calibrate.fixed_sequence(np.full((1, 200), 0.2), delta=1.0, alpha=0.1, bound=4.0)
  assert j == 0
  # what certified the most aggressive threshold, or crashed deep inside, before
  for kw, words in [(dict(alpha=float('nan')), 'alpha=nan'), (dict(alpha=1.0), 'alpha=1.0'),
                    (dict(delta=1.5), 'delta=1.5 < bound=1.0'),
                    (dict(risks_GxN=np.full((2, 3), 2.0)), r'each in \[0, bound'),
                    (dict(risks_GxN=np.full((2, 0), 0.0)), 'N >= 1 units'),
                    (dict(risks_GxN=np.array([[0.0, np.nan]])), 'NaN')]:
    args = dict(risks_GxN=risks, delta=0.1, alpha=0.1) | kw
    with pytest.raises(ValueError, match=words):
      calibrate.fixed_sequence(**args)


def test_unit_risks_by_brute_force():
  rng = np.random.default_rng(1)
  g, n, l, bound = 3, 4, 5, 1.5
  nll = rng.random((g, n, l)) * 3
  ref = rng.random((n, l)) * 3
  am, am_ref = rng.integers(0, 3, (g, n, l)), rng.integers(0, 3, (n, l))
  mask = (rng.random((n, l)) < 0.6).astype(np.float32)
  mask[2] = 0  # a sequence without scored tokens is not a unit
  loss = calibrate.unit_risks(nll, am, ref, am_ref, mask, 'loss', bound)
  arg = calibrate.unit_risks(nll, am, ref, am_ref, mask, 'argmax', bound)
  assert loss.shape == arg.shape == (g, n - 1)
  for j in range(g):
    for u, i in enumerate([0, 1, 3]):
      toks = [t for t in range(l) if mask[i, t]]
      want = sum(min(max(nll[j, i, t] - ref[i, t], 0.0), bound) for t in toks) / len(toks)
      assert loss[j, u] == pytest.approx(want)
      assert arg[j, u] == pytest.approx(sum(am[j, i, t] != am_ref[i, t] for t in toks)
                                        / len(toks))


def test_calibrate_tests_the_grid_in_order_and_reports_the_chosen_eps():
  """calibrate() on hand-built scores: the fixed sequence runs from the most conservative
  eps, and the reported eps, p-values and per-split summaries are the brute force's."""
  rng = np.random.default_rng(3)
  g, n, l, delta, alpha = 4, 60, 6, 0.1, 0.1
  ref = rng.random((n, l)) * 2
  # the loss increase grows with eps: grid points 0 and 1 are certified, 2 and 3 are not
  rise = np.array([0.0, 0.01, 0.3, 0.9])[:, None, None] * rng.random((g, n, l))
  mask = (rng.random((n, l)) < 0.7).astype(np.float32)
  am = rng.integers(0, 5, (n, l))
  depth = np.arange(1, g + 1)[:, None, None] * np.ones((g, n, l), np.int32)
  scores = {'nll': ref + rise, 'argmax': np.stack([am] * g), 'depth': depth,
            'ref_nll': ref, 'ref_argmax': am}
  grid = [1e-3, 1e-2, 1e-1, 1.0]
  res = calibrate.calibrate(scores, mask, scores, mask, grid, delta=delta, alpha=alpha)
  # brute force: per-sequence mean clipped increase, p-values in grid order
  units = [[(np.clip(rise[j, i], 0, 1) * mask[i]).sum() / mask[i].sum() for i in range(n)]
           for j in range(g)]
  ps, chosen = [], None
  for j in range(g):
    ps.append(calibrate.p_hoeffding_bentkus(float(np.mean(units[j])), n, delta))
    if ps[-1] > alpha:
      break
    chosen = j
  assert chosen == 1 and res['index'] == 1 and res['eps'] == grid[1]
  np.testing.assert_allclose(res['p_values'], ps, rtol=1e-9)
  m = mask.astype(np.float64)
  assert res['heldout']['mean_loops'] == pytest.approx(2.0)
  assert res['heldout']['loss'] == pytest.approx(((ref + rise[1]) * m).sum() / m.sum())


def _scores(nll_GxNxL, argmax_GxNxL, ref_nll_NxL, ref_argmax_NxL):
  """score_grid's output, hand-made (every token at depth 1 on every grid point)."""
  return {'nll': nll_GxNxL, 'argmax': argmax_GxNxL, 'depth': np.ones(np.shape(nll_GxNxL), np.int32),
          'ref_nll': ref_nll_NxL, 'ref_argmax': ref_argmax_NxL}


def test_argmax_risk_is_a_share_whatever_the_loss_bound():
  """risk=argmax: a unit's risk is the share of its scored tokens whose argmax moved, tested
  on [0, 1] whatever `bound` (which clips the loss risk only): p-values by brute force."""
  rng = np.random.default_rng(5)
  g, n, l, delta, alpha = 3, 80, 5, 0.2, 0.1
  ref_am = rng.integers(0, 4, (n, l))
  moved = rng.random((g, n, l)) < np.array([0.0, 0.05, 0.6])[:, None, None]
  mask = (rng.random((n, l)) < 0.8).astype(np.float32)
  mask[:, 0] = 1
  ref_nll = rng.random((n, l))
  scores = _scores(np.stack([ref_nll] * g), np.where(moved, (ref_am + 1) % 4, ref_am), ref_nll,
                   ref_am)
  share = [np.mean([moved[j, i][mask[i] > 0].mean() for i in range(n)]) for j in range(g)]
  ps = [calibrate.p_hoeffding_bentkus(s, n, delta) for s in share]
  assert ps[1] <= alpha < ps[2]  # the second point is certified, the third is not
  for bound in (0.5, 1.0, 4.0):
    res = calibrate.calibrate(scores, mask, scores, mask, [1e-3, 1e-2, 1e-1], delta=delta,
                              alpha=alpha, risk='argmax', bound=bound)
    np.testing.assert_allclose(res['p_values'], ps, rtol=1e-9)
    assert res['index'] == 1 and res['bound'] == 1.0
    np.testing.assert_allclose(res['calibration_risk_by_eps'], share, rtol=1e-9)


def test_calibrate_refuses_a_grid_that_is_not_increasing():
  """Fixed-sequence testing must start at the most conservative eps: a grid out of order
  would certify an aggressive eps first, so it is refused."""
  ref = np.zeros((4, 3))
  scores = _scores(np.zeros((2, 4, 3)), np.zeros((2, 4, 3), int), ref, np.zeros((4, 3), int))
  mask = np.ones((4, 3))
  with pytest.raises(ValueError, match='must be increasing'):
    calibrate.calibrate(scores, mask, scores, mask, [1e-2, 1e-3], delta=0.1, alpha=0.1)


def test_no_certified_eps_keeps_full_depth_on_both_splits():
  """When not even the most conservative eps is certified, each split reports full depth:
  no risk, the full-depth loss (masked mean of ref_nll, float64) and no mean loops."""
  rng = np.random.default_rng(8)
  n, l = 20, 6
  ref = rng.random((n, l)) * 2
  am = rng.integers(0, 5, (n, l))
  mask = (rng.random((n, l)) < 0.7).astype(np.float32)
  mask[:, 0] = 1
  scores = _scores(np.stack([ref + 0.8, ref + 1.0]), np.stack([am, am]), ref, am)
  res = calibrate.calibrate(scores, mask, scores, mask, [1e-3, 1e-2], delta=0.1, alpha=0.1)
  assert res['eps'] is None and res['index'] is None and len(res['p_values']) == 1
  loss = float((ref * mask).sum() / mask.sum())
  for split in ('calibration', 'heldout'):
    assert res[split]['risk'] == 0.0 and res[split]['mean_loops'] is None
    assert res[split]['loss'] == pytest.approx(loss) == res[split]['loss_full']


def test_mask_only_keeps_the_unscored_tokens_at_full_depth():
  """score_grid(mask_only=True): tokens outside the mask may not exit, so they run r_max
  loops; at an eps above every KL the scored ones exit at the first check (loop 2), as
  every token does without mask_only."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(3))
  rng = np.random.default_rng(4)
  inputs = rng.integers(0, mdl.cfg.vocab_size, (2, 8)).astype(np.int32)
  mask = (rng.random((2, 8)) < 0.5).astype(np.float32)
  batch = {'inputs': inputs, 'targets': np.roll(inputs, -1, 1), 'mask': mask}
  r_max = 4
  for mask_only in (True, False):
    got = calibrate.score_grid(mdl, [batch], [jax.random.key(1)], [1e9], r_max,
                               mask_only=mask_only)
    want = np.where((mask > 0) | (not mask_only), 2, r_max)
    np.testing.assert_array_equal(got['depth'][0], want)
  assert 0 < mask.sum() < mask.size
