"""Tests for depth sampling (policies.sample_depth / draw_bucket / bucket_index) and helpers."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import kl_logits_np
from elastic_depth import config as config_lib
from elastic_depth import policies

N_DRAWS = 20_000


def numpy_depths(rng, n, mean, sigma, r_max):
  """Monte-Carlo of the documented law: r = Poisson(e^tau) + 1, tau ~ N(mu, sigma)."""
  mu = math.log(mean - 1.0) - sigma ** 2 / 2
  tau = rng.normal(mu, sigma, n)
  return np.clip(rng.poisson(np.exp(tau)) + 1, 1, r_max)


def nearest_bucket(r, buckets):
  """Brute force: the bucket at minimal |b - r|, the deeper one on a tie."""
  best = None
  for b in buckets:
    d = abs(float(b) - float(r))
    if best is None or d < best[0] or (d == best[0] and b > best[1]):
      best = (d, b)
  return best[1]


@pytest.fixture(scope='module')
def wide_cfg():
  """mean 8, sigma 0.5, no clipping in practice (r_max far in the tail)."""
  return config_lib.DepthConfig(mean=8.0, sigma=0.5, r_max=10_000,
                                buckets=(1, 2, 4, 6, 8, 12, 16, 24, 32, 10_000))


@pytest.fixture(scope='module')
def wide_draws(wide_cfg):
  return policies.bucket_frequencies(0, N_DRAWS, wide_cfg)


def test_empirical_mean_matches_config(wide_cfg, wide_draws):
  r, _ = wide_draws
  m, s = wide_cfg.mean, wide_cfg.sigma
  # r - 1 ~ Poisson(lam), lam log-normal with E[lam] = m - 1:
  # Var r = E[lam] + Var lam = (m - 1) + (m - 1)^2 (e^{s^2} - 1).
  var = (m - 1) + (m - 1) ** 2 * math.expm1(s ** 2)
  se = math.sqrt(var / len(r))
  assert r.max() < wide_cfg.r_max  # no clipping happened
  assert abs(r.mean() - m) < 5 * se, (r.mean(), m, se)
  assert abs(r.var() / var - 1) < 0.1  # loose: the 4th moment of a log-normal is heavy


@pytest.mark.parametrize('mean,sigma,r_max', [(8.0, 0.5, 10_000), (4.0, 0.0, 10_000),
                                              (3.0, 1.0, 6)])
def test_distribution_matches_numpy_monte_carlo(mean, sigma, r_max):
  cfg = config_lib.DepthConfig(mean=mean, sigma=sigma, r_max=r_max,
                               buckets=tuple(range(1, r_max + 1)) if r_max < 100
                               else (1, r_max))
  r, _ = policies.bucket_frequencies(1, N_DRAWS, cfg)
  ref = numpy_depths(np.random.default_rng(0), 10 * N_DRAWS, mean, sigma, r_max)
  assert r.min() >= 1 and r.max() <= r_max
  support = np.arange(1, max(r.max(), ref.max()) + 1)
  cdf = np.searchsorted(np.sort(r), support, side='right') / len(r)
  cdf_ref = np.searchsorted(np.sort(ref), support, side='right') / len(ref)
  # Two-sample Kolmogorov-Smirnov at alpha = 0.001 (conservative for discrete laws).
  n, m = len(r), len(ref)
  crit = 1.95 * math.sqrt((n + m) / (n * m))
  assert np.abs(cdf - cdf_ref).max() < crit
  if r_max < 100:  # the clipped mass piles up at r_max
    p_top = np.mean(ref == r_max)
    assert p_top > 0.05
    assert abs(np.mean(r == r_max) - p_top) < 5 * math.sqrt(p_top * (1 - p_top) / n)


def test_mean_at_most_one_is_depth_one():
  cfg = config_lib.DepthConfig(mean=1.0, sigma=0.5, r_max=8, buckets=(1, 2, 4, 8))
  r, depth = policies.bucket_frequencies(0, 100, cfg)
  np.testing.assert_array_equal(r, 1)
  np.testing.assert_array_equal(depth, 1)


@pytest.mark.parametrize('buckets', [(1, 2, 4, 8, 16, 32), (1, 2, 3, 4, 5, 6, 7, 8, 10, 12,
                                                            14, 16, 20, 24, 32), (3, 9)])
def test_bucket_frequencies_are_nearest_rounding(buckets):
  cfg = config_lib.DepthConfig(mean=8.0, sigma=0.7, r_max=32, buckets=buckets)
  r, depth = policies.bucket_frequencies(2, 5000, cfg)
  want = np.array([nearest_bucket(x, buckets) for x in r])
  np.testing.assert_array_equal(depth, want)  # draw by draw
  for b in buckets:  # hence also the frequencies
    assert np.mean(depth == b) == np.mean(want == b)
  ties = [x for x in set(r.tolist()) if any(abs(b1 - x) == abs(b2 - x)
                                            for b1 in buckets for b2 in buckets if b1 < b2)]
  if buckets[0] == 1 and len(buckets) == 6:
    assert ties  # powers of two: r = 3, 6, 12, 24 are ties; the test covers them


def test_bucket_index_against_brute_force():
  rng = np.random.default_rng(3)
  for buckets in [(1,), (1, 2, 4, 8, 16, 32), (1, 3, 4, 10, 11, 30), (2, 5, 6, 50)]:
    rs = np.concatenate([np.arange(0, 60), rng.uniform(0, 60, 50)])
    got = jax.vmap(lambda r: policies.bucket_index(r, buckets))(jnp.asarray(rs))
    for r, i in zip(rs, np.asarray(got)):
      assert buckets[i] == nearest_bucket(np.float32(r), buckets), (r, buckets)
    assert got.dtype == jnp.int32


def test_draw_is_a_pure_function_of_seed_and_step(wide_cfg, wide_draws):
  key = jax.random.key(0)
  r, depth = wide_draws
  jitted = jax.jit(lambda s: policies.draw_bucket(key, s, wide_cfg))
  for step in (0, 1, 17, 4321, N_DRAWS - 1):
    r1, i1 = policies.draw_bucket(key, step, wide_cfg)
    r2, i2 = policies.draw_bucket(jax.random.key(0), jnp.int32(step), wide_cfg)
    r3, i3 = jitted(jnp.int32(step))
    assert int(r1) == int(r2) == int(r3) == r[step]  # the vmapped draw is the same draw
    assert int(i1) == int(i2) == int(i3)
    assert wide_cfg.buckets[int(i1)] == depth[step]
  r_again, depth_again = policies.bucket_frequencies(0, N_DRAWS, wide_cfg)
  np.testing.assert_array_equal(r_again, r)
  np.testing.assert_array_equal(depth_again, depth)
  assert len(np.unique(r[:50])) > 3  # different steps differ
  r_other, _ = policies.bucket_frequencies(1, N_DRAWS, wide_cfg)
  assert np.mean(r_other != r) > 0.5  # a different seed gives different draws
  # Consecutive steps are not correlated (the step is folded in, not added to a counter).
  assert abs(np.corrcoef(r[:-1], r[1:])[0, 1]) < 5 / math.sqrt(N_DRAWS)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_relative_change_against_numpy(dtype):
  rng = np.random.default_rng(4)
  new = jnp.asarray(rng.normal(size=(3, 5, 16)), dtype)
  old = jnp.asarray(rng.normal(size=(3, 5, 16)) * np.array([0.0, 1e-3, 1.0])[:, None, None]
                    + np.asarray(new, np.float64), dtype)
  a, b = np.asarray(new, np.float64), np.asarray(old, np.float64)
  want = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(a, axis=-1)
  got = policies.relative_change(new, old)
  assert got.dtype == jnp.float32 and got.shape == (3, 5)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(got)[0], 0.0)  # identical states
  assert float(policies.relative_change(jnp.zeros((1, 1, 4)), jnp.zeros((1, 1, 4)))[0, 0]) == 0.0


def test_state_delta_check_fn():
  """The STATE_DELTA criterion fires where relative_change < eps, never at loop 1."""
  check, carry0 = policies.make_check_fn('state_delta', eps=1e-2)
  rng = np.random.default_rng(5)
  new = rng.normal(size=(2, 4, 8))
  scale = np.array([[0.0, 1e-4, 0.5, 2.0], [1e-1, 1e-3, 0.0, 1.0]])[..., None]
  old = new + scale * rng.normal(size=(2, 4, 8))
  s_new, s_old = jnp.asarray(new, jnp.float32), jnp.asarray(old, jnp.float32)
  rel = np.linalg.norm(new - old, axis=-1) / np.linalg.norm(new, axis=-1)
  carry = carry0(s_new)
  want_exit, _, stats = check(s_new, s_old, carry, jnp.int32(2))
  np.testing.assert_array_equal(np.asarray(want_exit), rel < 1e-2)
  assert stats == {}
  assert 0 < np.sum(rel < 1e-2) < rel.size
  first, _, _ = check(s_new, s_old, carry, jnp.int32(1))
  assert not np.any(np.asarray(first))


def test_confidence_check_fn_against_float64_softmax():
  """CONFIDENCE fires where 1 - max_v p(v) < eps (p from the readout and head), from loop
  min_loops on (loop 1 included: it needs no previous loop), and reads nothing elsewhere."""
  rng = np.random.default_rng(6)
  h = rng.normal(size=(2, 5, 8))
  w = rng.normal(size=(11, 8)) * np.array([[3.0], [0.1]] * 5 + [[0.5]])  # peaked and flat
  logits = h @ w.T
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  conf = 1.0 - p.max(-1)
  eps = float(np.median(conf))
  for min_loops, check_every, i, checks in ((1, 1, 1, True), (2, 2, 3, False), (2, 2, 4, True)):
    check, carry0 = policies.make_check_fn(
        'confidence', eps=eps, readout=lambda s: s, w_VxD=jnp.asarray(w, jnp.float32),
        min_loops=min_loops, check_every=check_every)
    s = jnp.asarray(h, jnp.float32)
    carry = carry0(s)
    want, carry, _ = check(s, s, carry, jnp.int32(i))
    np.testing.assert_array_equal(np.asarray(want), (conf < eps) if checks else False)
    assert int(carry.coda) == int(carry.head) == int(checks)  # a readout only at checks
  assert 0 < np.sum(conf < eps) < conf.size


def test_threshold_grows_geometrically_from_loop_2():
  """exit.eps_growth: eps at loops 1 and 2, then eps * g^(i - 2); per-row eps broadcast."""
  eps_B = jnp.asarray([0.1, 0.01])
  for i in range(1, 7):
    got = np.asarray(policies.threshold(eps_B, 3.0, jnp.int32(i)))
    np.testing.assert_allclose(got, np.asarray([0.1, 0.01]) * 3.0 ** max(i - 2, 0), rtol=1e-6)
  assert policies.threshold(0.5, 1.0, 7) == 0.5  # no growth: the threshold itself
  per_row = np.asarray(policies.threshold(eps_B, 2.0, jnp.asarray([1, 4])))
  np.testing.assert_allclose(per_row, [0.1, 0.04], rtol=1e-6)


@pytest.mark.parametrize('mean,sigma,r_max,buckets', [
    (8.0, 0.5, 32, (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32)),  # the default
    (5.0, 0.5, 10, (1, 2, 3, 4, 5, 6, 7, 8, 10)),  # the main job: a clipped tail
    (3.0, 1.0, 6, (1, 3, 6)),                      # ties go deeper, heavy clipping
    (1.0, 0.5, 8, (2, 4))])                        # mean <= 1: always one loop
def test_bucket_probabilities_match_the_samplers_draws(mean, sigma, r_max, buckets):
  cfg = config_lib.DepthConfig(mean=mean, sigma=sigma, r_max=r_max, buckets=buckets)
  p = policies.bucket_probabilities(cfg)
  assert p.shape == (len(buckets),) and p.sum() == pytest.approx(1.0, abs=1e-9)
  n = 100_000
  _, depth = policies.bucket_frequencies(3, n, cfg)
  freq = np.array([np.mean(depth == b) for b in buckets])
  se = np.sqrt(np.maximum(p * (1 - p), 1e-12) / n)
  np.testing.assert_array_less(np.abs(freq - p), 5 * se + 1e-4)


@pytest.mark.parametrize('r_max', [1, 4, 9, 10, 11, 17, 32])
def test_trained_buckets_keep_every_bucket_a_draw_can_round_to(r_max):
  """The step's switch has a branch for every bucket some r in 1..r_max rounds to (brute
  force, ties deeper), and none past the first bucket at or above r_max."""
  cfg = config_lib.DepthConfig(r_max=r_max)  # the default buckets (1, ..., 32)
  trained = config_lib.trained_buckets(cfg)
  assert trained == cfg.buckets[:len(trained)] and trained[-1] >= r_max
  assert len(trained) == 1 or trained[-2] < r_max
  reached = {nearest_bucket(r, cfg.buckets) for r in range(1, r_max + 1)}
  assert reached <= set(trained), (reached, trained)
  _, depth = policies.bucket_frequencies(0, 2000, cfg)  # the sampler's own draws too
  assert set(depth.tolist()) <= set(trained)


def test_kl_equal_to_eps_does_not_exit():
  """A check exits where KL < eps, strictly: with a readout that ignores the state,
  KL(p_i || p_{i-1}) = 0 exactly, so eps = 0 never exits and any eps > 0 exits at loop 2."""
  r = np.random.default_rng(0)
  h = jnp.asarray(r.normal(size=(1, 3, 8)), jnp.float32)
  w = jnp.asarray(r.normal(size=(16, 8)), jnp.float32)
  s = [jnp.asarray(r.normal(size=(1, 3, 8)), jnp.float32) for _ in range(3)]
  for eps, want in ((0.0, False), (1e-6, True)):
    fn, c0 = policies.make_check_fn('kl', eps=eps, readout=lambda _: h, w_VxD=w)
    c = c0(s[0])
    _, c, _ = fn(s[1], s[0], c, jnp.int32(1))
    ex, _, _ = fn(s[2], s[1], c, jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(ex), want)


def _np_gelu(x):
  """The tanh approximation (jax.nn.gelu's default), float64."""
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize('hidden', [0, 3])
def test_kl_probe_log_against_float64_numpy(hidden):
  """KLProbe's log KL estimate per loop vs the documented formula in float64: set
  min(i - 2, R - 1) at loop i, alpha log ||d A||^2 + x.w + b + w2.gelu([x, d / sd] W1 + b1)."""
  r = np.random.default_rng(8)
  n_r, d, k = 3, 6, 4
  f = lambda *shape: r.normal(size=shape)
  prm = dict(a_RxDxK=0.5 * f(n_r, d, k), w_RxD=f(n_r, d), b_R=f(n_r), mu_RxD=f(n_r, d),
             sd_RxD=0.5 + r.random((n_r, d)), alpha_R=0.5 + r.random(n_r),
             w1_Rx2DxH=f(n_r, 2 * d, hidden), b1_RxH=f(n_r, hidden), w2_RxH=f(n_r, hidden))
  probe = policies.KLProbe(**{n: jnp.asarray(v, jnp.float32) for n, v in prm.items()})
  s_old_BxLxD = f(2, 3, d)
  s_new_BxLxD = s_old_BxLxD + 0.3 * f(2, 3, d)  # ||d A||^2 ~ 0.1..1: log and log1p differ
  for i in range(2, 7):
    p = {n: v[min(i - 2, n_r - 1)] for n, v in prm.items()}
    dd = s_new_BxLxD - s_old_BxLxD
    x = (s_new_BxLxD - p['mu_RxD']) / p['sd_RxD']
    q = dd @ p['a_RxDxK']
    want = p['alpha_R'] * np.log((q * q).sum(-1) + 1e-12) + x @ p['w_RxD'] + p['b_R']
    if hidden:
      z = np.concatenate([x, dd / p['sd_RxD']], -1)
      want = want + _np_gelu(z @ p['w1_Rx2DxH'] + p['b1_RxH']) @ p['w2_RxH']
    got = policies.kl_probe_log(probe, jnp.asarray(s_new_BxLxD, jnp.float32),
                                jnp.asarray(s_old_BxLxD, jnp.float32), jnp.int32(i))
    assert got.shape == (2, 3) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('policy', ['kl', 'reverse_kl', 'confidence'])
def test_check_schedule_reads_against_brute_force(policy):
  """Checks from max(min_loops, 2) (confidence: min_loops) every check_every loops; KL-type
  checks also read the loop before each check, but not for a check beyond max_loops."""
  for min_loops, check_every, max_loops in itertools.product((1, 2, 3), (1, 2, 3),
                                                             (None, 4, 5, 6)):
    first = min_loops if policy == 'confidence' else max(min_loops, 2)
    checks = {i for i in range(1, 12) if i >= first and (i - min_loops) % check_every == 0}
    reads = set(checks) if policy == 'confidence' else checks | {
        c - 1 for c in checks if max_loops is None or c <= max_loops}
    is_check, reads_fn = policies.check_schedule(policy, min_loops, check_every, max_loops)
    for i in range(1, 11):
      assert bool(is_check(jnp.int32(i))) == (i in checks), (min_loops, check_every, i)
      assert bool(reads_fn(jnp.int32(i))) == (i in reads), (min_loops, check_every,
                                                            max_loops, i)


@pytest.mark.parametrize('patience', [2, 3])
def test_state_delta_patience_against_a_python_loop(patience):
  """patience: exit once relative_change < eps at `patience` consecutive loops counted from
  loop 2 (loop 1's change never counts), per token, in an engine-like loop."""
  r = np.random.default_rng(9)
  small = np.array([[1, 1, 1, 0, 1, 1, 1],   # loops 1..7; 1: a step far below eps
                    [1, 1, 0, 1, 1, 0, 1],
                    [0, 1, 1, 1, 1, 1, 1],
                    [1, 0, 1, 1, 0, 1, 1],
                    [0, 0, 0, 0, 0, 0, 0]], bool)
  n_tok, loops = small.shape
  s = [r.normal(size=(1, n_tok, 8))]
  for i in range(loops):
    scale = np.where(small[:, i], 1e-4, 1.0)[None, :, None]
    s.append(s[-1] + scale * r.normal(size=(1, n_tok, 8)))
  check, carry0 = policies.make_check_fn('state_delta', eps=1e-2, patience=patience)
  carry = carry0(jnp.asarray(s[0], jnp.float32))
  active = np.ones(n_tok, bool)
  got = np.zeros(n_tok, int)
  run = np.zeros(n_tok, int)
  want = np.zeros(n_tok, int)
  for i in range(1, loops + 1):
    ex, carry, _ = check(jnp.asarray(s[i], jnp.float32), jnp.asarray(s[i - 1], jnp.float32),
                         carry, jnp.int32(i), jnp.asarray(active[None]))
    a, b = s[i][0], s[i - 1][0]
    rel = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(a, axis=-1)
    run = np.where((rel < 1e-2) & (i >= 2), run + 1, 0)
    want = np.where((want == 0) & (run >= patience), i, want)
    ex = np.asarray(ex)[0] & active
    got[ex] = i
    active &= ~ex
  np.testing.assert_array_equal(got, want)
  assert len(set(want.tolist())) > 2  # tokens exit at different loops (0: never)


def test_readout_counts_per_token_follow_the_active_mask():
  """CheckCarry's per-token coda/head counts add a read loop's readout only where the token
  is active; the batch counts add one per read loop (kl: the checks and the loops before)."""
  r = np.random.default_rng(10)
  w = jnp.asarray(r.normal(size=(12, 8)), jnp.float32)
  check, carry0 = policies.make_check_fn('kl', eps=1e-3, readout=lambda s: s, w_VxD=w,
                                         min_loops=3, check_every=3)
  states = [jnp.asarray(r.normal(size=(2, 3, 8)), jnp.float32) for _ in range(8)]
  active = r.random((8, 2, 3)) < 0.6
  reads = {2, 3, 5, 6}  # checks at 3 and 6, each with the loop before it
  carry = carry0(states[0])
  for i in range(1, 8):
    _, carry, _ = check(states[i], states[i - 1], carry, jnp.int32(i), jnp.asarray(active[i]))
  want_BxL = sum(active[i].astype(int) for i in sorted(reads))
  np.testing.assert_array_equal(np.asarray(carry.coda_BxL), want_BxL)
  np.testing.assert_array_equal(np.asarray(carry.head_BxL), want_BxL)
  assert int(carry.coda) == int(carry.head) == len(reads)
  assert 0 < want_BxL.min() < want_BxL.max() < len(reads) + 1


def test_reverse_kl_check_is_kl_of_the_previous_distribution_from_the_new():
  """reverse_kl exits where KL(p_{i-1} || p_i) < eps (float64 numpy), and a trace records
  both directions, which differ here."""
  r = np.random.default_rng(11)
  w = r.normal(size=(10, 8))
  s = [r.normal(size=(2, 6, 8)) * np.array([0.3, 1.5])[:, None, None] for _ in range(3)]
  logits = [x @ w.T for x in s]
  fwd, rev = kl_logits_np(logits[2], logits[1]), kl_logits_np(logits[1], logits[2])
  assert np.median(np.abs(fwd - rev) / rev) > 0.05
  gap = np.where(rev < np.median(rev) * 2, np.abs(fwd - rev) / rev, 0.0)
  j = np.unravel_index(np.argmax(gap), gap.shape)
  eps = float(fwd[j] + rev[j]) / 2  # the two directions fall either side of eps here
  assert 0 < np.sum(rev < eps) < rev.size
  w32 = jnp.asarray(w, jnp.float32)
  sj = [jnp.asarray(x, jnp.float32) for x in s]
  check, carry0 = policies.make_check_fn('reverse_kl', eps=eps, readout=lambda x: x, w_VxD=w32)
  carry = carry0(sj[0])
  _, carry, _ = check(sj[1], sj[0], carry, jnp.int32(1))
  ex, _, _ = check(sj[2], sj[1], carry, jnp.int32(2))
  np.testing.assert_array_equal(np.asarray(ex), rev < eps)
  assert np.any((rev < eps) != (fwd < eps))  # the forward direction decides otherwise
  check, carry0 = policies.make_check_fn('reverse_kl', eps=eps, readout=lambda x: x, w_VxD=w32,
                                         trace=True)
  _, carry, st = check(sj[1], sj[0], carry0(sj[0]), jnp.int32(1))
  _, _, st = check(sj[2], sj[1], carry, jnp.int32(2))
  np.testing.assert_allclose(np.asarray(st['rkl']), rev, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(st['kl']), fwd, rtol=1e-4, atol=1e-6)
