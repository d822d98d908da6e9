"""Exit-policy frontiers (elastic_depth.frontier) against separate runs and hand counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import nll_np, traced_setup

from elastic_depth import analysis, config, decoding, frontier, inference, losses, policies
from elastic_depth import model as model_lib

R, B, L = 6, 2, 8


@pytest.fixture(scope='module')
def setup():
  return traced_setup(R, L, B)


def _score(mdl, batches, rng, cfg):
  """Per-token NLL and depth of separate (unjitted) inference.score runs."""
  nll, depth = [], []
  with jax.default_matmul_precision('highest'):
    for k, b in enumerate(batches):
      out = inference.score(mdl, jnp.asarray(b['inputs']), cfg, analysis.batch_key(rng, k))
      nll.append(np.asarray(losses.nll(out.logits, jnp.asarray(b['targets']))))
      depth.append(np.asarray(out.depth))
  return np.concatenate(nll), np.concatenate(depth)


def test_sweep_end_points_and_accounting(setup):
  mdl, batches, rng, trace = setup
  mask = np.concatenate([b['mask'] for b in batches]).astype(np.float64)
  a0 = frontier.uniform_curve(trace, mdl.cfg)
  mid = float(np.median(trace.stats['kl'][1:]))
  c = frontier.policy_curve(mdl, batches, rng, frontier.Curve('kl', [0.0, mid, 1e9]), R)
  # eps = 0: never exits, equals A0 at R; eps huge: everyone exits at the first check (2)
  assert c['mean_loops'][0] == R and c['share_max_depth'][0] == 1.0
  np.testing.assert_allclose(c['loss'][0], a0['loss'][-1], rtol=1e-5)
  assert c['mean_loops'][2] == 2
  np.testing.assert_allclose(c['loss'][2], a0['loss'][1], rtol=1e-5)
  # the masked engine's core attention (jax.nn.dot_product_attention) multiplies all L keys
  # its prelude and coda run the chunked causal attention (model.causal_keys)
  f = model_lib.flops_per_token(mdl.cfg, 0, L, core_keys=L, outer_keys=model_lib.causal_keys(L))
  assert f['loop'] > model_lib.flops_per_token(mdl.cfg, 0, L)['loop']  # model FLOPs: L / 2
  assert c['flops'][0] == pytest.approx(f['prelude'] + R * f['loop'] + (R + 1) * f['coda_head'])
  assert c['flops'][2] == pytest.approx(f['prelude'] + 2 * f['loop'] + 3 * f['coda_head'])
  assert a0['flops'][R - 1] == pytest.approx(
      model_lib.flops_per_token(mdl.cfg, R, L, core_keys=L,
                                outer_keys=model_lib.causal_keys(L))['total'])
  # the middle point against a separate run and a per-token hand count
  nll, depth = _score(mdl, batches, rng, config.ExitConfig(policy='kl', eps=mid, max_loops=R))
  assert 2 < c['mean_loops'][1] < R
  assert c['mean_loops'][1] == pytest.approx(np.sum(depth * mask) / np.sum(mask))
  assert np.sum((depth == R - 1) * mask) > 0  # a token one loop short of the cap counts not
  assert c['share_max_depth'][1] == pytest.approx(np.sum((depth == R) * mask) / np.sum(mask))
  # per-sequence sums (what the gap's bootstrap resamples), row by row
  assert c['row_tokens'] == pytest.approx(mask.sum(1))
  assert c['row_loops'][1] == pytest.approx(np.sum(depth * mask, 1))
  np.testing.assert_allclose(c['row_loss'][1], np.sum(nll * mask, 1), rtol=1e-5)
  for d in (1, R):
    np.testing.assert_allclose(a0['row_loss'][d - 1],
                               np.sum(trace.stats['nll'][d - 1] * mask, 1), rtol=1e-6)
    assert a0['row_loops'][d - 1] == pytest.approx(d * mask.sum(1))
  np.testing.assert_allclose(c['loss'][1], np.sum(nll * mask) / np.sum(mask), rtol=1e-5)
  # active tokens: a readout at each of their loops (every loop is a check or precedes
  # one) and the final readout; the masked engine runs each batch's deepest loops
  hand = 0.0
  for d, m in zip(depth.ravel(), mask.ravel()):
    hand += m * (f['prelude'] + d * f['loop'] + f['coda_head'] + d * f['coda_head'])
  assert c['flops_active'][1] == pytest.approx(hand / mask.sum())
  passes = depth.reshape(len(batches), -1).max(axis=1)
  masked = [f['prelude'] + p * f['loop'] + (p + 1) * f['coda_head'] for p in passes]
  assert c['flops'][1] == pytest.approx(np.mean(masked))
  assert c['mean_core_passes'][1] == pytest.approx(np.mean(passes))
  assert c['mean_readouts'][1] == pytest.approx(c['mean_loops'][1] + 1)


def test_router_curve(setup):
  mdl, batches, rng, _ = setup
  dm = mdl.cfg.d_model
  router = policies.Router(jnp.zeros(dm), jnp.float32(0.0), jnp.zeros(dm), jnp.ones(dm))
  c = frontier.policy_curve(mdl, batches, rng, frontier.Curve('router', [0.4, 0.6], router), R)
  assert c['mean_loops'] == [R, 1]  # p_change = 0.5 everywhere
  f = model_lib.flops_per_token(mdl.cfg, 1, L, core_keys=L, outer_keys=model_lib.causal_keys(L))
  assert c['flops'][1] == pytest.approx(f['total'])


def test_sweep_wires_curves_and_headlines(setup):
  mdl, batches, rng, trace = setup
  res = frontier.sweep(mdl, batches, rng, R, ref_depth=3, eps_grid=[0.0, 1e9], delta=0.05,
                       curves=('kl', 'state_delta'), state_delta_grid=[1e9], trace=trace)
  assert set(res['curves']) == set(res['headline']) == {'kl', 'state_delta'}
  assert res['curves']['kl']['threshold'] == [0.0, 1e9]
  assert res['curves']['state_delta']['mean_loops'] == [2.0]
  assert res['a0']['loss'] == analysis.elasticity(trace)['loss']
  # gated_kl's default gate: the median relative state change at loop 2 (s_2 against s_1)
  assert res['gate'] == pytest.approx(float(np.median(trace.stats['delta'][1][trace.mask > 0])))
  assert res['gate'] != pytest.approx(float(np.median(trace.stats['delta'][0][trace.mask > 0])))
  wc = res['headline']['kl']['best']['wall_clock']  # timed by default, against A0 at 3
  assert wc['a0_depth'] == 3 and wc['a0_s'] > 0 and wc['policy_s'] > 0
  assert wc['saving'] == pytest.approx(1 - wc['policy_s'] / wc['a0_s'])
  with pytest.raises(ValueError, match='unknown curve'):
    frontier.sweep(mdl, batches, rng, R, 3, curves=('nope',), trace=trace)
  # '/' and '@' belong to the variants and semantics the sweep names: an extra curve
  # named so would be grouped or judged as one of them
  for bad in ('mine/min2', 'mine@cached', 'kl'):
    with pytest.raises(ValueError, match=f'extra curve name {bad!r}'):
      frontier.sweep(mdl, batches, rng, R, 3, curves=('kl',), trace=trace,
                     extra_curves={bad: frontier.Curve('kl', [1e9])})


def test_cached_semantics_curve(setup):
  """Token by token through decode_step: everyone exits at the first check (loop 2)."""
  mdl, batches, rng, _ = setup
  c = frontier.policy_curve(mdl, batches, rng,
                            frontier.Curve('kl', [1e9], semantics='cached'), R)
  assert c['mean_loops'] == [2] and c['mean_core_passes'] == [2]
  # the paired check reads loops 1 and 2 (two readouts) and its logits are the output;
  # a decode step's core attention multiplies every slot of its cache: L + 1 slots (the
  # inputs and the last target, whose step cached_outputs drops), as do its prelude and coda
  f = model_lib.flops_per_token(mdl.cfg, 0, L, core_keys=L + 1, outer_keys=L + 1)
  assert c['flops_active'][0] == pytest.approx(f['prelude'] + 2 * f['loop'] + 2 * f['coda_head'])
  cfg = config.ExitConfig(policy='kl', eps=1e9, max_loops=R)
  # jitted once (eager, the scan over decode steps compiles again for every batch)
  score = jax.jit(lambda t, key: decoding.score_cached(mdl, t, 1, cfg, key))
  nll, mask = [], []
  for k, b in enumerate(batches):
    toks = jnp.concatenate([jnp.asarray(b['inputs']), jnp.asarray(b['targets'])[:, -1:]], 1)
    with jax.default_matmul_precision('highest'):
      logits, _, _ = score(toks, analysis.batch_key(rng, k))
    nll.append(np.asarray(losses.nll(logits, jnp.asarray(b['targets']))))
    mask.append(b['mask'])
  nll, mask = np.concatenate(nll), np.concatenate(mask)
  np.testing.assert_allclose(c['loss'][0], np.sum(nll * mask) / np.sum(mask), rtol=1e-5)
  with pytest.raises(ValueError, match='sideways'):
    frontier.sweep(mdl, batches, rng, R, 2, semantics=('sideways',), curves=())


def test_cached_curves_are_judged_against_a0_in_cached_semantics(setup):
  """sweep(semantics=cached): a0_cached is uniform depth 1..R scored token by token (each
  depth against a separate score_cached run, float64 NLL), and the @cached curves' frontier
  reads it, not the parallel A0."""
  mdl, batches, rng, trace = setup
  res = frontier.sweep(mdl, batches, rng, R, ref_depth=2, eps_grid=[1e9], curves=('kl',),
                       semantics=('parallel', 'cached'), trace=trace, timing_repeats=0)
  a0c = res['a0_cached']
  assert a0c['threshold'] == list(range(1, R + 1)) and a0c['mean_loops'] == list(range(1, R + 1))
  for d in (1, R):
    cfg = config.ExitConfig(policy='uniform', depth=d)
    score = jax.jit(lambda t, key: decoding.score_cached(mdl, t, 1, cfg, key))
    tot = n = 0.0
    for k, b in enumerate(batches):
      toks = jnp.concatenate([jnp.asarray(b['inputs']), jnp.asarray(b['targets'])[:, -1:]], 1)
      with jax.default_matmul_precision('highest'):
        logits, _, _ = score(toks, analysis.batch_key(rng, k))
      m = np.asarray(b['mask'], np.float64)
      rows = np.sum(nll_np(np.asarray(logits), np.asarray(b['targets'])) * m, 1)
      np.testing.assert_allclose(a0c['row_loss'][d - 1][k * B:(k + 1) * B], rows, rtol=1e-5)
      tot += rows.sum()
      n += m.sum()
    assert a0c['loss'][d - 1] == pytest.approx(tot / n, rel=1e-5)
    assert a0c['row_loops'][d - 1] == pytest.approx(d * np.asarray(a0c['row_tokens']))
  assert res['curves']['kl@cached']['schedule'] == dict(
      semantics='cached', min_loops=1, eps_growth=1.0, check_every=1, patience=1)
  assert res['curves']['kl']['schedule']['semantics'] == 'parallel'
  # kl at eps 1e9 exits every token at loop 2: in cached semantics it is uniform depth 2
  fr = res['headline']['kl@cached']['frontier']
  assert fr['a0_loss_same_loops'][0] == pytest.approx(a0c['loss'][1])
  assert res['curves']['kl@cached']['loss'][0] == pytest.approx(a0c['loss'][1], rel=1e-5)
  assert res['headline']['kl']['frontier']['a0_loss_same_loops'][0] == pytest.approx(
      res['a0']['loss'][1])


def test_wall_clock_times_a0_at_the_rounded_reference_depth(setup):
  """A0's timed depth is the reference depth rounded to the nearest loop, not truncated."""
  mdl, batches, rng, _ = setup
  for ref_depth in (2.6, 3.4):  # both round to 3 (truncation would give 2 and 3)
    wc = frontier.wall_clock(mdl, batches, rng, frontier.Curve('kl', [1e9]), 1e9, ref_depth, R,
                             repeats=1)
    assert wc['a0_depth'] == 3 and wc['repeats'] == 1
    assert wc['a0_s'] > 0 and wc['policy_s'] > 0


def test_counted_means_are_over_the_masked_tokens(setup):
  """mean_loops_counted, mean_readouts and mean_heads weigh tokens by the mask (parallel:
  every position counted), against a separate run's depths at a ragged threshold."""
  mdl, batches, rng, trace = setup
  mask = np.concatenate([b['mask'] for b in batches]).astype(np.float64)
  assert 0 < mask.mean() < 1  # some tokens unscored: a real test
  mid = float(np.median(trace.stats['kl'][1:]))
  c = frontier.policy_curve(mdl, batches, rng, frontier.Curve('kl', [mid]), R)
  _, depth = _score(mdl, batches, rng, config.ExitConfig(policy='kl', eps=mid, max_loops=R))
  want = np.sum(depth * mask) / np.sum(mask)
  assert want != pytest.approx(np.mean(depth))  # the mask changes the mean
  assert c['mean_loops_counted'][0] == pytest.approx(want)
  # a readout and a head product at each loop (a check or the loop before one) + the final
  assert c['mean_readouts'][0] == pytest.approx(want + 1)
  assert c['mean_heads'][0] == pytest.approx(want + 1)
