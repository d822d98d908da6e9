"""The KL probe: its estimate against float64 numpy, the harvest against uniform-depth runs,
the fit against a planted probe, and its exits against a brute-force loop in both semantics."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import exit_model_config, kl_logits_np, safe_eps
from decoding_test import brute_cached
from elastic_depth import books, config, decoding, inference, kl_probe, model as model_lib
from elastic_depth import policies

B, L, R = 2, 8, 5


def probe_np(probe, s_new, s_old, i=2):
  """The probe's KL estimate at loop i in float64 (gelu: the tanh form jax.nn.gelu
  computes), with the parameter set of loop i: i - 2, the last one beyond."""
  g = min(max(i - 2, 0), probe.a_RxDxK.shape[0] - 1)
  p = {k: np.asarray(v, np.float64)[g] for k, v in probe._asdict().items()}
  s = np.asarray(s_new, np.float64)
  d = s - np.asarray(s_old, np.float64)
  q = d @ p['a_RxDxK']
  x = (s - p['mu_RxD']) / p['sd_RxD']
  out = p['alpha_R'] * np.log(np.sum(q * q, -1) + 1e-12) + x @ p['w_RxD'] + p['b_R']
  z = np.concatenate([x, d / p['sd_RxD']], -1) @ p['w1_Rx2DxH'] + p['b1_RxH']
  gelu = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
  return np.exp(out + gelu @ p['w2_RxH'])


def random_probe(d, k=4, seed=0, scale=1.0, hidden=3, loops=1):
  """A probe with `loops` random parameter sets."""
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.normal(size=(loops,) + s), jnp.float32)
  return policies.KLProbe(scale * f(d, k), 0.3 * f(d), 0.5 + f(), 0.1 * f(d),
                          jnp.asarray(0.5 + r.random((loops, d)), jnp.float32),
                          0.8 + 0.1 * f(), 0.3 * f(2 * d, hidden), 0.1 * f(hidden),
                          0.5 * f(hidden))


def test_estimate_matches_float64_numpy():
  """Every loop reads its own parameter set; loops beyond the last set read the last."""
  r = np.random.default_rng(1)
  s_new, s_old = r.normal(size=(2, 3, 16)), r.normal(size=(2, 3, 16))
  for loops in (1, 3):
    probe = random_probe(16, 4, loops=loops)
    for i in (2, 3, 4, 7):
      got = np.exp(np.asarray(policies.kl_probe_log(probe, jnp.asarray(s_new, jnp.float32),
                                                    jnp.asarray(s_old, jnp.float32), i)))
      np.testing.assert_allclose(got, probe_np(probe, s_new, s_old, i), rtol=2e-4)
  other = [np.asarray(policies.kl_probe_log(probe, jnp.asarray(s_new, jnp.float32),
                                            jnp.asarray(s_old, jnp.float32), i)) for i in (2, 3)]
  assert np.abs(other[0] - other[1]).max() > 0.1  # the sets differ, so the test can fail


@pytest.mark.parametrize('hidden,loops', [(0, 1), (8, 1), (8, 4)])
def test_probe_flops_match_xla_count(hidden, loops):
  """policies.probe_flops against XLA's compiled FLOP count of the estimate (15%: XLA
  counts the log, exp and gelu its own way); per-loop sets cost no more per check."""
  d, k, n = 64, 16, 256
  probe = random_probe(d, k, hidden=hidden, loops=loops)
  x = jnp.ones((1, n, d), jnp.float32)
  cost = jax.jit(lambda a, b: policies.kl_probe_log(probe, a, b, 2)).lower(x, x).compile()
  xla = cost.cost_analysis()
  xla = (xla[0] if isinstance(xla, list) else xla)['flops'] / n
  assert policies.probe_size(probe) == (k, hidden)
  assert policies.probe_flops((k, hidden), d) == pytest.approx(xla, rel=0.15)
  assert policies.probe_flops(None, d) == 0


def _planted(truth, n, seed, loops_N):
  """Harvest pairs whose log KL is the planted probe's at each pair's loop, plus noise."""
  r = np.random.default_rng(seed)
  d = truth.a_RxDxK.shape[1]
  x = r.normal(size=(n, d)).astype(np.float32)
  delta = (r.normal(size=(n, d)) * np.exp(r.normal(size=(n, 1)))).astype(np.float32)
  y = np.concatenate([np.log(probe_np(truth, x[j:j + 1], x[j:j + 1] - delta[j:j + 1], i))
                      for j, i in enumerate(loops_N)]) + 0.05 * r.normal(size=n)
  return kl_probe.Harvest(delta, x, y.astype(np.float32), np.asarray(loops_N))


def test_fit_recovers_a_planted_probe():
  """Pairs whose log KL is a planted probe's estimate (plus noise): the fit predicts held-out
  pairs to the noise level and orders them as the truth does."""
  truth = random_probe(12, 3, seed=3, hidden=0)
  fit_h, test_h = (_planted(truth, 4000, s, np.full(4000, 2)) for s in (4, 5))
  for hidden in (0, 4):  # the hidden units must not spoil a fit the quadratic form makes
    probe = kl_probe.fit(fit_h, rank=3, hidden=hidden, steps=1500, lr=1e-2)
    ev = kl_probe.evaluate(probe, test_h)
    assert ev['rmse_log_kl'] < 0.15
    assert ev['spearman_probe'] > 0.99


def test_evaluate_against_float64_numpy_and_scipy():
  """Every figure evaluate() reports, on hand-made pairs (a fifth at the floor): the
  estimate by probe_np, the state change ||s_i - s_{i-1}|| / ||s_i||, Spearman by scipy."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  r = np.random.default_rng(11)
  n, d = 300, 8
  probe = random_probe(d, 3, seed=2, loops=2)
  x = r.normal(size=(n, d)).astype(np.float32)
  delta = (r.normal(size=(n, d)) * np.exp(r.normal(size=(n, 1)))).astype(np.float32)
  loops = r.choice([2, 3, 4], n)
  y = r.normal(size=n) * 2 - 3
  y[r.random(n) < 0.2] = kl_probe.LOG_FLOOR
  h = kl_probe.Harvest(delta, x, y.astype(np.float32), loops)
  ev = kl_probe.evaluate(probe, h)
  x64, d64, y64 = x.astype(np.float64), delta.astype(np.float64), h.log_kl_N.astype(np.float64)
  pred = np.array([np.log(probe_np(probe, x64[j], x64[j] - d64[j], loops[j])) for j in range(n)])
  change = np.linalg.norm(d64, axis=1) / np.linalg.norm(x64, axis=1)
  above = h.log_kl_N > np.float32(kl_probe.LOG_FLOOR)  # the floor as stored, in float32
  assert ev['n'] == n and ev['share_floored'] == pytest.approx(1 - above.mean())
  assert ev['rmse_log_kl'] == pytest.approx(np.sqrt(np.mean((pred - y64)[above] ** 2)), rel=1e-4)
  assert ev['spearman_probe'] == pytest.approx(
      stats.spearmanr(np.maximum(pred, kl_probe.LOG_FLOOR), y64)[0], abs=1e-6)
  assert ev['spearman_state_change'] == pytest.approx(stats.spearmanr(change, y64)[0], abs=1e-6)
  err = np.where(above, pred - y64, np.maximum(pred - y64, 0))
  assert ev['mse_censored'] == pytest.approx(np.mean(err ** 2), rel=1e-4)
  assert (ev['rank'], ev['hidden'], ev['loops']) == (3, 3, 2)


def test_fit_recovers_planted_per_loop_sets():
  """Two planted sets (loop 2; loops 3 and later): a two-set fit recovers both, each from
  its loops' pairs; one set for all loops cannot."""
  truth = random_probe(12, 3, seed=6, hidden=0, loops=2)
  loops = np.random.default_rng(7).choice([2, 3, 5], 6000)
  fit_h, test_h = _planted(truth, 6000, 8, loops), _planted(truth, 6000, 9, loops)
  two = kl_probe.evaluate(kl_probe.fit(fit_h, rank=3, steps=1500, loops=2), test_h)
  one = kl_probe.evaluate(kl_probe.fit(fit_h, rank=3, steps=1500, loops=1), test_h)
  assert two['loops'] == 2 and one['loops'] == 1
  assert two['rmse_log_kl'] < 0.15 and two['spearman_probe'] > 0.99
  assert one['rmse_log_kl'] > 2 * two['rmse_log_kl']
  only2 = kl_probe.fit(test_h._replace(loops_N=np.full(6000, 2)), steps=1, loops=2)
  assert only2.a_RxDxK.shape[0] == 1  # no deeper pairs: one set, which serves every loop
  with pytest.raises(ValueError, match='no pairs from loop 3'):
    kl_probe.fit(test_h._replace(loops_N=np.where(loops == 3, 4, loops)), steps=1, loops=3)


def test_crossings_count_wrong_exit_decisions():
  """The crossings objective per pair, against a brute-force count of the thresholds (a
  fine log-uniform grid over [LOG_FLOOR, LOG_CEIL]) where the estimate and the truth take
  different exit decisions, times the grid's width."""
  r = np.random.default_rng(11)
  pred, y = r.uniform(-25, 6, 500), r.uniform(-25, 6, 500)
  y[:50] = kl_probe.LOG_FLOOR  # censored pairs: only an estimate above the floor counts
  grid = np.linspace(kl_probe.LOG_FLOOR, kl_probe.LOG_CEIL, 200_001)
  wrong = ((pred[:, None] < grid) != (y[:, None] < grid)).mean(1)
  got = np.asarray(kl_probe._OBJECTIVES[kl_probe.Objective.CROSSINGS](jnp.asarray(pred),
                                                                      jnp.asarray(y)))
  np.testing.assert_allclose(got, wrong * (kl_probe.LOG_CEIL - kl_probe.LOG_FLOOR), atol=1e-3)


def test_crossings_fit_resists_outliers():
  """A planted probe with 10% of the pairs' log KL thrown far off: the crossings fit still
  predicts the clean pairs closely; least squares is pulled away by the outliers."""
  truth = random_probe(12, 3, seed=3, hidden=0)
  fit_h, test_h = (_planted(truth, 4000, s, np.full(4000, 2)) for s in (4, 5))
  r = np.random.default_rng(12)
  bad = r.random(4000) < 0.1
  fit_h = fit_h._replace(log_kl_N=np.where(bad, fit_h.log_kl_N + r.choice([-8.0, 8.0], 4000),
                                           fit_h.log_kl_N).astype(np.float32))
  ev = {o: kl_probe.evaluate(kl_probe.fit(fit_h, rank=3, steps=1500, objective=o), test_h)
        for o in kl_probe.Objective}
  assert ev[kl_probe.Objective.CROSSINGS]['rmse_log_kl'] < 0.15
  assert ev[kl_probe.Objective.SQUARES]['rmse_log_kl'] > 2 * ev[
      kl_probe.Objective.CROSSINGS]['rmse_log_kl']


@pytest.fixture(scope='module')
def setup(make_config, make_batch):
  cfg = make_config(model=dict(n_core=1, init_std=0.1), train=dict(batch_size=B, seq_len=L))
  mdl = model_lib.LoopedLM(cfg.model, nnx.Rngs(5))
  batches = [make_batch(cfg, seed, mask_frac=0.25) for seed in (1, 2)]
  return mdl, batches, jax.random.key(2)


def test_harvest_equals_the_engines_per_loop_trace(setup):
  """The harvest's (change, state, log KL) at loops 2..R against the masked engine's trace of
  a uniform run (its own KL and relative state change per loop), unpadded tokens only."""
  mdl, batches, rng = setup
  h = kl_probe.harvest(mdl, batches, R, rng)
  kls, deltas, loops = [], [], []  # per batch: loops 2..R, then its unpadded tokens
  for b in batches:
    tr = inference.score(mdl, jnp.asarray(b['inputs']), config.ExitConfig(
        policy='uniform', depth=R), rng, trace=True).traces
    keep = b['mask'] > 0
    kls.append(np.asarray(tr['kl'])[1:, keep].ravel())
    deltas.append(np.asarray(tr['delta'])[1:, keep].ravel())
    loops.append(np.repeat(np.arange(2, R + 1), keep.sum()))
  want = np.maximum(np.log(np.concatenate(kls)), kl_probe.LOG_FLOOR)
  np.testing.assert_allclose(h.log_kl_N, want, atol=1e-3, rtol=1e-3)
  change = np.linalg.norm(h.delta_NxD, axis=-1) / np.linalg.norm(h.states_NxD, axis=-1)
  np.testing.assert_allclose(change, np.concatenate(deltas), rtol=1e-4)
  np.testing.assert_array_equal(h.loops_N, np.concatenate(loops))


def test_exit_harvest_keeps_the_loops_each_token_ran(setup):
  """exit_eps: pairs from a run under the KL exit (masked engine) are its tokens' loops
  2..depth, after the uniform run's, each with the token's state and change at that loop
  and the float64 KL of its readouts: the same exit run capped at i and at i - 1 loops."""
  mdl, batches, rng = setup
  b = batches[0]
  toks = jnp.asarray(b['inputs'])
  base = kl_probe.harvest(mdl, [b], R, rng)
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R), rng,
                       trace=True).traces
  eps = safe_eps(list(np.asarray(tr['kl'])))
  h = kl_probe.harvest(mdl, [b], R, rng, exit_eps=[eps])
  capped = [inference.score(mdl, toks, config.ExitConfig(policy='kl', eps=eps, max_loops=i),
                            rng) for i in range(1, R + 1)]  # capped[i - 1]: at most i loops
  depth = np.asarray(capped[-1].depth)
  keep = b['mask'] > 0
  assert len(np.unique(depth[keep])) > 1
  ran = [(i, r, c) for i in range(2, R + 1) for r, c in zip(*np.nonzero(keep))
         if depth[r, c] >= i]
  n0 = len(base.log_kl_N)
  np.testing.assert_array_equal(h.log_kl_N[:n0], base.log_kl_N)
  np.testing.assert_array_equal(h.loops_N[n0:], [i for i, _, _ in ran])
  state = lambda i, r, c: np.asarray(capped[i - 1].state[r, c], np.float64)
  np.testing.assert_allclose(h.states_NxD[n0:], [state(i, r, c) for i, r, c in ran],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h.delta_NxD[n0:], [state(i, r, c) - state(i - 1, r, c)
                                                for i, r, c in ran], rtol=1e-4, atol=1e-5)
  kl = [kl_logits_np(capped[i - 1].logits[r, c], capped[i - 2].logits[r, c])
        for i, r, c in ran]
  want = np.maximum(np.log(kl), kl_probe.LOG_FLOOR)
  np.testing.assert_allclose(h.log_kl_N[n0:], want, atol=1e-3, rtol=1e-3)


def test_cached_harvest_equals_brute_force_cached_decoding(setup):
  """Cached semantics: each token's per-loop KL and state, decoded after the tokens before
  it ran R loops, against the brute-force cached loop (float64 KL of its readouts)."""
  mdl, batches, rng = setup
  b = dict(batches[0], inputs=batches[0]['inputs'][:1], mask=np.ones((1, L), np.float32))
  h = kl_probe.harvest(mdl, [b], R, rng, semantics='cached')
  rec = {}
  brute_cached(mdl, jnp.asarray(b['inputs']), 1, -1.0, R, rng, record=rec)
  kl = np.stack(rec['kl'], 1)  # [R, L - 1]: tokens 1..L-1 (token 0 is prefilled)
  states = np.stack(rec['state'], 1)  # [R, L - 1, D]
  np.testing.assert_allclose(h.log_kl_N, np.maximum(np.log(kl[1:].ravel()),
                                                    kl_probe.LOG_FLOOR), atol=2e-3, rtol=1e-3)
  np.testing.assert_allclose(h.states_NxD, states[1:].reshape(-1, states.shape[-1]),
                             atol=1e-4)
  np.testing.assert_allclose(h.delta_NxD, (states[1:] - states[:-1]).reshape(
      -1, states.shape[-1]), atol=1e-4)


def test_cached_exit_harvest_equals_brute_force_cached_exits(setup):
  """Cached semantics under the exact KL exit at eps: each token's loops 2..depth, after
  earlier tokens exited and offer their exit loop's keys/values, against the brute-force
  cached loop with the same exits."""
  mdl, batches, rng = setup
  b = dict(batches[0], inputs=batches[0]['inputs'][:1], mask=np.ones((1, L), np.float32))
  rec = {}
  brute_cached(mdl, jnp.asarray(b['inputs']), 1, -1.0, R, rng, record=rec)
  eps = safe_eps(list(np.stack(rec['kl'], 1)[:2]))  # near loop 2's median: ragged exits
  rec = {}
  _, depth = brute_cached(mdl, jnp.asarray(b['inputs']), 1, eps, R, rng, record=rec)
  assert len(np.unique(depth)) > 1
  h = kl_probe.harvest(mdl, [b], R, rng, semantics='cached', exit_eps=[eps])
  n0 = (L - 1) * (R - 1)  # the uniform run's pairs come first
  want = [(i, t) for i in range(2, R + 1) for t in range(L - 1) if len(rec['kl'][t]) >= i]
  np.testing.assert_array_equal(h.loops_N[n0:], [i for i, _ in want])
  np.testing.assert_allclose(h.log_kl_N[n0:], np.maximum(np.log(
      [rec['kl'][t][i - 1] for i, t in want]), kl_probe.LOG_FLOOR), atol=2e-3, rtol=1e-3)
  np.testing.assert_allclose(h.states_NxD[n0:], [rec['state'][t][i - 1] for i, t in want],
                             atol=1e-4)


def test_save_load_and_bad_files(tmp_path):
  probe = random_probe(8, 2, loops=3)
  path = str(tmp_path / 'kl_probe.json')
  kl_probe.save(probe, path, {'tokens': [1, 9]})
  back = kl_probe.load(path, 8)
  for a, b in zip(probe, back):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match='8-wide states, the model has d_model=16'):
    kl_probe.load(path, 16)
  with pytest.raises(FileNotFoundError, match='--probe=kl_probe'):
    kl_probe.load(str(tmp_path / 'none.json'))
  # a one-set file of the earlier format (no loop axis, its own names) loads as one set
  one = {old: np.asarray(v)[0].tolist() for old, v in zip(kl_probe._ONE_SET.values(), probe)}
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(one, f)
  back = kl_probe.load(path, 8)
  for a, b in zip(probe, back):
    np.testing.assert_array_equal(np.asarray(a)[:1], np.asarray(b))
  for bad in ({'w_D': [1.0]}, {k: np.asarray(v)[0].tolist() for k, v in probe._asdict().items()}):
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(bad, f)
    with pytest.raises(ValueError, match='not a KL probe'):
      kl_probe.load(path)


def test_policy_needs_its_probe():
  with pytest.raises(ValueError, match='kl_probe needs a policies.KLProbe'):
    policies.make_check_fn('kl_probe', eps=0.1)
  router = policies.Router(jnp.ones(4), jnp.float32(0), jnp.zeros(4), jnp.ones(4))
  with pytest.raises(ValueError, match='kl_probe needs a policies.KLProbe, got Router'):
    policies.make_check_fn('kl_probe', eps=0.1, router=router)


def test_exits_match_brute_force_in_cached_and_parallel_semantics():
  """kl_probe: exit where the float64 estimate < eps, token by token (cached) and, at the
  first loop any token may exit, in parallel scoring (until then every state is the
  uniform run's)."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(11))
  rng = jax.random.key(0)
  toks = jnp.asarray([[3, 17, 5, 9, 30, 2, 44, 8, 12]], jnp.int32)
  probe = random_probe(mdl.cfg.d_model, 4, seed=7, scale=0.3, loops=3)
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R), rng,
                       router=probe, trace=True).traces
  eps = safe_eps(list(np.asarray(tr['kl_hat'])))
  cfg = config.ExitConfig(policy='kl_probe', eps=eps, max_loops=R)
  logits, depth, _ = jax.jit(lambda t: decoding.score_cached(mdl, t, 3, cfg, rng, probe))(toks)
  ref_logits, ref_depth = brute_cached(mdl, toks, 3, eps, R, rng, probe=probe,
                                       probe_stat=lambda s, s_old, i: probe_np(probe, s, s_old, i))
  np.testing.assert_array_equal(np.asarray(depth), ref_depth)
  assert len(np.unique(ref_depth)) > 1
  np.testing.assert_allclose(np.asarray(logits[:, 1:]), ref_logits[:, :-1], atol=1e-5, rtol=1e-5)
  ok = np.asarray(tr['kl_hat']) < eps
  ok[0] = False
  k = int(np.argmax(ok.reshape(R, -1).any(1)))
  assert ok[k].any() and not ok[k].all()
  par = np.asarray(inference.score(mdl, toks, cfg, rng, router=probe).depth)
  np.testing.assert_array_equal(par == k + 1, ok[k])
  assert np.all(par[~ok[k]] > k + 1)


def test_books_count_the_probe_every_loop():
  """check_cost adds the probe's FLOPs once per loop: the difference from no probe is
  probe_flops / loop FLOPs, whatever the loops and readouts."""
  mcfg = exit_model_config()
  base = books.check_cost(mcfg, 4.0, 1.0, 1.0, 16)
  with_probe = books.check_cost(mcfg, 4.0, 1.0, 1.0, 16, probe_size=(8, 16))
  loop = model_lib.flops_per_token(mcfg, 0, 16)['loop']
  assert with_probe - base == pytest.approx(policies.probe_flops((8, 16), mcfg.d_model) / loop)


def test_squares_censor_the_pairs_at_the_floor():
  """The squares objective per pair, in float64: (estimate - log KL)^2 above the floor; at
  the floor (float32, as a harvest stores it) only an estimate above the floor counts."""
  r = np.random.default_rng(13)
  pred = r.uniform(-25, 6, 400).astype(np.float32)
  y = r.uniform(-15, 6, 400).astype(np.float32)
  floored = r.random(400) < 0.3
  y[floored] = kl_probe.LOG_FLOOR
  floor = np.float64(np.float32(kl_probe.LOG_FLOOR))
  p64 = pred.astype(np.float64)
  want = np.where(floored, np.maximum(p64 - floor, 0.0), p64 - y) ** 2
  got = np.asarray(kl_probe._OBJECTIVES[kl_probe.Objective.SQUARES](jnp.asarray(pred),
                                                                    jnp.asarray(y)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert (got[floored] == 0).any() and (got[floored] > 0).any()  # estimates on both sides


def test_harvest_pairs_each_token_loop_from_its_run_records(monkeypatch):
  """The pairs harvest assembles from a run's records (faked: states, KL and the loops each
  token ran): each token's loops 2..depth, loop by loop, with s_i - s_{i-1}, s_i and
  log KL_i, which the floor censors (KL < 1e-7, zero included, reads LOG_FLOOR) and leaves
  exact above it (float64)."""
  r_max, b, l, d = 4, 2, 3, 5
  r = np.random.default_rng(17)
  s = r.normal(size=(r_max, b, l, d)).astype(np.float32)
  kl = np.exp(r.uniform(np.log(1e-10), 0, (r_max, b, l))).astype(np.float32)
  kl[1, 0, 0] = 0.0
  depth = np.array([[4, 2, 3], [1, 4, 4]])
  ran = np.stack([depth >= i for i in range(1, r_max + 1)])
  monkeypatch.setattr(kl_probe, '_parallel_run', lambda mdl, r_max, rng: lambda batch: (s, kl, ran))
  h = kl_probe.harvest(None, [{}], r_max, None)
  want = [(i, row, col) for i in range(2, r_max + 1) for row in range(b) for col in range(l)
          if depth[row, col] >= i]
  np.testing.assert_array_equal(h.loops_N, [i for i, _, _ in want])
  np.testing.assert_array_equal(h.states_NxD, [s[i - 1, row, col] for i, row, col in want])
  np.testing.assert_allclose(h.delta_NxD, [s[i - 1, row, col] - s[i - 2, row, col]
                                           for i, row, col in want], rtol=1e-6)
  k = np.array([kl[i - 1, row, col] for i, row, col in want], np.float64)
  with np.errstate(divide='ignore'):
    np.testing.assert_allclose(h.log_kl_N, np.maximum(np.log(k), kl_probe.LOG_FLOOR),
                               rtol=1e-6)
  assert (k == 0).any() and (k < 1e-7).sum() > 1 and ((k > 1e-7) & (k < 1e-5)).any()
