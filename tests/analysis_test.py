"""Measurements (elastic_depth.analysis) against independent computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import nll_np, traced_setup

from elastic_depth import analysis, config, decoding, losses
from elastic_depth import model as model_lib

R, B, L = 6, 2, 8


@pytest.fixture(scope='module')
def setup():
  return traced_setup(R, L, B)


def test_trace_shapes_and_determinism(setup):
  mdl, batches, rng, trace = setup
  assert trace.stats['nll'].shape == (R, 2 * B, L)
  assert trace.mask.shape == trace.difficulty.shape == (2 * B, L)
  again = analysis.trace_batches(mdl, batches, R, rng)
  for k, v in trace.stats.items():
    np.testing.assert_array_equal(v, again.stats[k])


def test_elasticity_equals_separate_uniform_runs(setup):
  mdl, batches, rng, trace = setup
  el = analysis.elasticity(trace)
  assert el['depths'] == list(range(1, R + 1))
  assert len(set(np.round(el['loss'], 4))) > 1  # the depths differ: a real test
  # independent path: the training forward pass at a traced depth (one compilation)
  graphdef, state = nnx.split(mdl)
  fwd = jax.jit(lambda st, x, d, key: nnx.merge(graphdef, st).forward(
      x, key, model_lib.dynamic(d)).logits)
  mask = np.concatenate([b['mask'] for b in batches]).astype(np.float64)
  for d in (1, 3, R):
    nll = []
    with jax.default_matmul_precision('highest'):
      for k, b in enumerate(batches):
        logits = fwd(state, jnp.asarray(b['inputs']), jnp.int32(d), analysis.batch_key(rng, k))
        nll.append(np.asarray(losses.nll(logits, jnp.asarray(b['targets']))))
    nll = np.concatenate(nll)
    ref = np.sum(nll * mask) / np.sum(mask)
    np.testing.assert_allclose(el['loss'][d - 1], ref, rtol=1e-5, atol=1e-5)


def _brute_argmax_conv(am):
  r, n, l = am.shape
  out = np.zeros((n, l), int)
  for a in range(n):
    for t in range(l):
      for i in range(1, r + 1):  # first loop after which the argmax never changes
        if all(am[j, a, t] == am[i - 1, a, t] for j in range(i - 1, r)):
          out[a, t] = i
          break
  return out


def _brute_kl_conv(kl, eps):
  r, n, l = kl.shape
  out = np.full((n, l), r + 1)
  for a in range(n):
    for t in range(l):
      for i in range(2, r + 1):
        if all(kl[j - 1, a, t] < eps for j in range(i, r + 1)):
          out[a, t] = i
          break
  return out


def test_convergence_depths_vs_brute_force(setup):
  _, _, _, trace = setup
  rs = np.random.default_rng(1)
  synthetic = rs.integers(0, 3, (7, 5, 9))  # many changes, incl. late ones
  for am in (trace.stats['argmax'], synthetic):
    np.testing.assert_array_equal(analysis.argmax_convergence(am), _brute_argmax_conv(am))
  eps = float(np.median(trace.stats['kl'][1:]))
  for kl in (trace.stats['kl'], rs.random((7, 5, 9))):
    np.testing.assert_array_equal(analysis.kl_convergence(kl, eps), _brute_kl_conv(kl, eps))
  np.testing.assert_array_equal(analysis.kl_convergence(np.zeros((4, 1, 1)), 1.0), 2)
  # a NaN KL never converges (the exit policies never exit on one): brute force agrees
  kl = rs.random((6, 3, 4)) * 1e-3
  kl[2, 0, :2] = np.nan
  kl[5, 1, 0] = np.nan
  got = analysis.kl_convergence(kl, 1.0)
  np.testing.assert_array_equal(got, _brute_kl_conv(kl, 1.0))
  assert got[0, 0] == 4 and got[1, 0] == 7 and got[2, 0] == 2


def test_masked_mean_of_no_tokens_is_nan_not_zero():
  x = np.array([[1.0, 3.0], [5.0, 7.0]])
  assert analysis.masked_mean(x, np.array([[1, 0], [1, 1]])) == pytest.approx(13 / 3)
  assert np.isnan(analysis.masked_mean(x, np.zeros((2, 2))))


def test_convergence_summary(setup):
  _, _, _, trace = setup
  groups = {'difficulty': analysis.difficulty_groups(trace.difficulty)}
  res = analysis.convergence(trace, ref_depth=2.6, eps_conv=1e-3, groups=groups)
  valid = trace.mask > 0
  conv = _brute_argmax_conv(trace.stats['argmax'])[valid]
  a = res['argmax_depth']
  assert res['ref_depth'] == 3 and a['count'] == valid.sum() == res['tokens']
  assert a['median'] == np.median(conv) and a['p90'] == np.quantile(conv, 0.9)
  assert a['histogram'] == [int(np.sum(conv == d)) for d in range(1, R + 1)]
  assert a['share_changing_after_ref'] == np.mean(conv > 3)
  assert len(res['kl_depth']['histogram']) == R + 1
  # breakdown groups partition the valid tokens
  rows = res['by_difficulty']
  assert sum(r['count'] for r in rows.values()) == valid.sum()
  sel = (trace.difficulty == 2) & valid
  np.testing.assert_allclose(rows['hops=2']['loss_final'], trace.stats['nll'][-1][sel].mean(),
                             rtol=1e-6)
  pl = res['per_loop']
  ch = trace.stats['argmax'][1] != trace.stats['argmax'][0]
  np.testing.assert_allclose(pl['mean_argmax_changed'][1], ch[valid].mean())
  assert pl['mean_argmax_changed'][0] == 0


def test_convergence_fields_on_a_synthetic_trace_vs_brute_force():
  """Every field convergence() derives, on a hand-made trace where argmaxes change late and
  some tokens converge only at loop R or never, against loops written out by hand."""
  rs = np.random.default_rng(4)
  r, n, l = 6, 5, 9
  kl = rs.random((r, n, l)) * 2e-3  # eps 1e-3: converges anywhere from loop 2 to never
  kl[-1, 0, :3] = 0.0  # ... and some at loop R exactly
  kl[-2, 0, :3] = 1.0
  stats = {'kl': kl, 'rkl': rs.random((r, n, l)), 'delta': rs.random((r, n, l)),
           'nll': rs.random((r, n, l)) * 3, 'argmax': rs.integers(0, 3, (r, n, l))}
  mask = (rs.random((n, l)) < 0.8).astype(np.float32)
  difficulty = rs.integers(-1, 3, (n, l))
  trace = analysis.Trace(stats, np.zeros((n, l), np.int32), np.zeros((n, l), np.int32), mask,
                         difficulty)
  groups = {'difficulty': analysis.difficulty_groups(difficulty)}
  res = analysis.convergence(trace, ref_depth=3.2, eps_conv=1e-3, groups=groups)
  valid = mask > 0
  am = stats['argmax']
  for i in range(r):  # the share of tokens whose argmax changed from loop i to i + 1
    want = 0.0 if i == 0 else np.mean([am[i][t] != am[i - 1][t] for t in zip(*np.nonzero(valid))])
    assert res['per_loop']['mean_argmax_changed'][i] == pytest.approx(want)
  conv = _brute_kl_conv(kl, 1e-3)
  assert np.sum(conv[valid] == r) > 0 and np.sum(conv[valid] > r) > 0  # both cases present
  assert res['kl_depth']['share_not_converged'] == pytest.approx(np.mean(conv[valid] > r))
  for name, row in res['by_difficulty'].items():
    sel = groups['difficulty'][name] & valid
    assert row['loss_ref'] == pytest.approx(np.mean(stats['nll'][3 - 1][sel]))  # depth 3
    assert row['loss_final'] == pytest.approx(np.mean(stats['nll'][r - 1][sel]))
    assert row['kl_depth_median'] == np.median(conv[sel])


@pytest.mark.parametrize('rows,chunk', [(10, 4), (8, 4), (3, 64)])
def test_in_row_chunks_equals_one_call_on_all_rows(rows, chunk):
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(rows, 5)), rng.integers(0, 9, size=(rows, 2, 3))
  shapes = []

  def fn(x, y):
    shapes.append((x.shape, y.shape))
    return x * 2.0 + y.sum(axis=(1, 2))[:, None], jnp.cumsum(y, axis=2)

  got = analysis.in_row_chunks(fn, [a, b], chunk)
  c = min(chunk, rows)
  assert set(shapes) == {((c, 5), (c, 2, 3))}  # one shape: one compile under jit
  assert len(shapes) == -(-rows // c)
  np.testing.assert_allclose(got[0], a * 2.0 + b.sum(axis=(1, 2))[:, None], rtol=1e-6)
  np.testing.assert_array_equal(got[1], np.cumsum(b, axis=2))
  assert got[0].dtype == np.float64 and got[1].shape == (rows, 2, 3)


def test_cached_outputs_cover_positions_0_to_l_minus_1(setup):
  """cached_outputs appends the last target and drops its decode step: its NLL, depths and
  counts equal score_cached of the inputs alone (positions 0..L-1), at a threshold where
  tokens exit at different loops."""
  mdl, batches, rng, trace = setup
  eps = float(np.median(trace.stats['kl'][1:]))
  cfg = config.ExitConfig(policy='kl', eps=eps, max_loops=R)
  ref_fn = jax.jit(lambda t: decoding.score_cached(mdl, t, 1, cfg, rng, with_counts=True))
  for b in batches:
    x, y = jnp.asarray(b['inputs']), jnp.asarray(b['targets'])
    with jax.default_matmul_precision('highest'):
      nll, n = analysis.RUNS[config.Semantics.CACHED](
          mdl, x, y, rng, jnp.float32(eps), None, jnp.asarray(b['mask']),
          policy=config.ExitPolicy.KL, min_loops=1, r_max=R)
      logits, depth, depth0, m = ref_fn(x)  # predicts tokens 1..L-1 from positions 0..L-2
    want_depth = np.concatenate([np.asarray(depth0), np.asarray(depth)], 1)
    assert len(np.unique(want_depth)) > 2  # tokens exit at different loops: a real test
    np.testing.assert_array_equal(np.asarray(n.depth), want_depth)
    for name in ('coda', 'head', 'core_passes', 'coda_passes', 'head_passes'):
      np.testing.assert_array_equal(np.asarray(getattr(n, name)), np.asarray(getattr(m, name)),
                                    err_msg=name)
    np.testing.assert_allclose(np.asarray(nll)[:, :-1],
                               nll_np(np.asarray(logits), np.asarray(b['targets'])[:, :-1]),
                               rtol=1e-5, atol=1e-5)
