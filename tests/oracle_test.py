"""Decode-depth rules and oracles against brute-force per-token decoding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import exit_model_config, nll_np, safe_eps
from elastic_depth import config, decoding, model as model_lib, oracle

R = 5
P = 4  # prompt tokens
N = 5  # decoded tokens


@functools.lru_cache(maxsize=1)
def _setup():
  """A random exit model, two rows of random tokens, the key, and the model's `_step`."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(3))
  toks = np.random.default_rng(0).integers(0, 48, (2, P + N)).astype(np.int32)
  rng = jax.random.key(5)
  return mdl, toks, rng, _step(mdl, rng)


def _uni(d):
  return config.ExitConfig(policy='uniform', depth=int(d))


def _softmax64(logits):
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _kl64(p, q):
  return float(np.sum(p * (np.log(p) - np.log(q))))


def _step(mdl, rng):
  """decode_step at uniform depth d, jitted once per depth (op-by-op dispatch of the many
  small steps would compile an executable per op)."""
  fns = {}

  def step(cache, tok, t, init, d):
    if d not in fns:
      fns[d] = jax.jit(lambda c, x, i, s: decoding.decode_step(mdl, c, x, i, _uni(d), rng,
                                                               init_table=s)[:2])
    return fns[d](cache, tok, t, init)
  return step


def _brute_row(mdl, row, rng, choose, prefill_depth=3):
  """One row decoded token by token, each token at uniform depth choose(j, cache, tok):
  (nll [N] float64, depth [N]); `decode_step` at a uniform depth is the reference step."""
  toks = jnp.asarray(row[None])
  cache, logits, _ = decoding.prefill(mdl, toks[:, :P], _uni(prefill_depth), rng, P + N)
  init = decoding.initial_states(mdl, rng, P + N)
  nll, depth = [], []
  step = _setup()[3]
  for j in range(N):
    t = P + j
    tok = toks[:, t]
    nll.append(nll_np(logits[:, None], row[None, t:t + 1])[0, 0])
    d = choose(j, cache, tok, t, init)
    logits, cache = step(cache, tok, t, init, int(d))
    depth.append(d)
  return np.array(nll), np.array(depth)


def test_given_depths_equal_per_token_uniform_steps():
  """generate(depth_BxN=...) decodes each token at its own depth: per row and token, the
  same NLL as a Python loop of uniform-depth decode steps, and exactly those depths."""
  mdl, toks, rng, _ = _setup()
  depth = np.random.default_rng(1).integers(1, R + 1, (2, N)).astype(np.int32)
  _, got_d, got_nll = decoding.generate(
      mdl, jnp.asarray(toks[:, :P]), N, config.ExitConfig(policy='uniform', depth=R), rng,
      forced_BxN=jnp.asarray(toks[:, P:]), prefill_cfg=_uni(3), depth_BxN=jnp.asarray(depth))
  np.testing.assert_array_equal(np.asarray(got_d), depth)
  for b in range(2):
    nll, d = _brute_row(mdl, toks[b], rng, lambda j, *_: depth[b, j])
    np.testing.assert_array_equal(d, depth[b])
    np.testing.assert_allclose(np.asarray(got_nll[b]), nll, rtol=1e-4, atol=1e-5)


def _lookahead_chooser(mdl, rng, eps, kls):
  """The lookahead rule by brute force: p_i from separate uniform-depth steps (float64)."""
  def choose(j, cache, tok, t, init):
    step = _setup()[3]
    p = [_softmax64(step(cache, tok, t, init, i)[0][0]) for i in range(1, R + 1)]
    kl = [_kl64(p[i], p[i - 1]) for i in range(1, R)]  # kl[i - 1] = KL(p_(i+1) || p_i)
    kls.extend(kl)
    return next((i for i in range(1, R) if kl[i - 1] < eps), R)
  return choose


def test_lookahead_oracle_equals_brute_force_over_depths():
  """The lookahead oracle stops each token at the first loop i with KL(p_(i+1) || p_i) <
  eps, read from uniform-depth steps run separately, and commits that depth's state: same
  depths and NLL per row, at a threshold far from every KL the reference saw."""
  mdl, toks, rng, _ = _setup()
  eps = 1e-2
  for _ in range(6):  # until no KL the reference reads lies within 5% of eps
    kls, ref = [], []
    for b in range(2):
      ref.append(_brute_row(mdl, toks[b], rng, _lookahead_chooser(mdl, rng, eps, kls)))
    if min(abs(np.log(k / eps)) for k in kls) > 0.05:
      break
    eps = safe_eps([np.array([]), np.array(kls)])  # the widest log gap near their median
  else:
    pytest.fail('no threshold far from the observed KLs')
  depths = np.stack([r[1] for r in ref])
  assert 1 < len(np.unique(depths))  # the rule stops tokens at different loops
  nll, depth = oracle.lookahead_decode(mdl, jnp.asarray(toks[:, :P]), jnp.asarray(toks[:, P:]),
                                       eps, R, rng, _uni(3))
  np.testing.assert_array_equal(np.asarray(depth), depths)
  np.testing.assert_allclose(np.asarray(nll), np.stack([r[0] for r in ref]), rtol=1e-4,
                             atol=1e-5)


def test_lookahead_depth_by_brute_force():
  rs = np.random.default_rng(2)
  kl = np.exp(rs.uniform(-8, 0, (6, 40)))
  for eps in (1e-4, 1e-2, 0.3):
    want = [next((i for i in range(1, 6) if kl[i, b] < eps), 6) for b in range(40)]
    np.testing.assert_array_equal(np.asarray(oracle.lookahead_depth(jnp.asarray(kl), eps)),
                                  want)


def test_label_rules_and_their_alignment():
  """split/difficulty set a token's depth by the target it predicts: the token decoded at
  step j predicts forced token j + 1, so its class is weight[:, j + 1] (and k[:, j + 1])."""
  ans = np.array([[1, 0, 0, 1], [0, 1, 1, 0]])
  k = np.array([[3, -1, -1, 1], [-1, 2, 9, -1]])
  np.testing.assert_array_equal(oracle.given_depths(oracle.parse('split:3,1'), ans, k, 8),
                                [[3, 1, 1, 3], [1, 3, 3, 1]])
  np.testing.assert_array_equal(oracle.given_depths(oracle.parse('difficulty:1,2'), ans, k, 8),
                                [[4, 2, 2, 2], [2, 3, 8, 2]])  # k + 1 = 10 clipped to 8
  np.testing.assert_array_equal(oracle.given_depths(oracle.parse('uniform:9'), ans, k, 8),
                                np.full((2, 4), 8))
  mdl, toks, rng, _ = _setup()
  w = np.zeros((2, N))
  w[0, [1, 3]] = 1
  w[1, [2, 4]] = 1
  pool = dict(prompt=toks[:, :P], forced=toks[:, P:], weight=w)
  got = oracle.measure(mdl, pool, oracle.parse('split:4,1'), R, rng, prefill_depth=3)
  nll, depth = [], []
  for b in range(2):
    choose = lambda j, *_, b=b: 4 if j + 1 < N and w[b, j + 1] > 0 else 1
    n_, d_ = _brute_row(mdl, toks[b], rng, choose)
    nll.append(n_)
    depth.append(d_)
  nll, depth = np.stack(nll), np.stack(depth)
  assert got['loss'] == pytest.approx((nll * w).sum() / w.sum(), rel=1e-4)
  assert got['mean_loops'] == pytest.approx(depth.mean())
  assert got['loops_answer'] == 4 and got['loops_other'] == 1
  assert got['answer_share'] == pytest.approx(4 / 10)


def test_parse_names_the_problem():
  assert oracle.parse('lookahead:1e-3') == oracle.Schedule(oracle.Rule.LOOKAHEAD, (1e-3,))
  assert oracle.parse('split:3,2').name == 'split:3,2'
  assert oracle.parse('difficulty:-1,1').args == (-1, 1)  # C offsets k; only B is a depth
  for bad, words in [('deep:3', 'unknown depth rule'), ('split:3', 'takes 2'),
                     ('uniform:2.5', 'integers'), ('kl:x', 'numbers'), ('uniform', 'takes 1'),
                     ('uniform:0', 'at least 1'), ('split:3,0', 'at least 1'),
                     ('difficulty:0,0', 'at least 1'), ('lookahead:0', 'positive'),
                     ('state_delta:-1', 'positive'), ('uniform:inf', 'finite'),
                     ('kl:nan', 'finite'), ('lookahead:inf', 'finite')]:
    with pytest.raises(ValueError, match=words):
      oracle.parse(bad)
  with pytest.raises(ValueError, match='difficulty'):
    oracle.given_depths(oracle.parse('difficulty:1,2'), np.ones((1, 2)), None, 8)


def test_frontier_gaps_interpolate_uniform_depth():
  pts = [dict(rule='uniform', mean_loops=1.0, loss=1.0), dict(rule='uniform', mean_loops=2.0,
                                                               loss=0.5),
         dict(rule='uniform', mean_loops=4.0, loss=0.1), dict(rule='split', mean_loops=3.0,
                                                              loss=0.2),
         dict(rule='kl', mean_loops=5.0, loss=0.05)]
  out = oracle.frontier_gaps(pts)
  assert out[3]['uniform_loss'] == pytest.approx(0.3) and out[3]['gap'] == pytest.approx(-0.1)
  assert out[4]['gap'] is None and out[0]['gap'] == 0


def test_difficulty_depths_are_clipped_to_at_least_one_loop():
  """difficulty:C,B with a negative offset: k + C below 1 is clipped up to 1 (no token runs
  zero loops), above r_max down to r_max; the rest run B. Reference: the rule by hand."""
  ans = np.array([[1, 1, 0, 1, 1]])
  k = np.array([[1, 3, 7, 4, 20]])
  s = oracle.parse('difficulty:-3,2')
  r_max = 8
  want = [[max(1, min(r_max, kk - 3)) if a else 2 for a, kk in zip(ans[0], k[0])]]
  assert want == [[1, 1, 2, 1, 8]]
  got = oracle.given_depths(s, ans, k, r_max)
  np.testing.assert_array_equal(got, want)
  assert got.min() >= 1
