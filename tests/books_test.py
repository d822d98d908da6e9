"""Exit-check books (elastic_depth.books) against brute force and the compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import exit_model_config, jaxpr_dots

from elastic_depth import books, config, decoding, frontier
from elastic_depth import model as model_lib


def _pareto_brute(m, l):
  """Points no other point beats at fewer-or-equal loops: O(n^2)."""
  keep = [i for i in range(len(m))
          if not any(m[j] <= m[i] and l[j] < l[i] for j in range(len(m)) if j != i)]
  keep = sorted(set((m[i], l[i]) for i in keep))
  return np.array([k[0] for k in keep]), np.array([k[1] for k in keep])


def test_frontier_gap_matches_a_dense_brute_force_grid():
  rs = np.random.default_rng(0)
  for _ in range(20):
    me, mc = rs.uniform(1, 8, 9), rs.uniform(1.5, 9, 7)
    le, lc = 2 + 1 / me + rs.normal(0, 0.01, 9), 2 + 1 / mc + rs.normal(0, 0.01, 7)
    g = books.frontier_gap({'mean_loops': me, 'loss': le}, {'mean_loops': mc, 'loss': lc})
    pe, pc = _pareto_brute(me, le), _pareto_brute(mc, lc)
    lo, hi = max(pe[0][0], pc[0][0]), min(pe[0][-1], pc[0][-1])
    assert g['range'] == pytest.approx([lo, hi])
    grid = np.linspace(lo, hi, 20001)
    dense = np.interp(grid, *pc) - np.interp(grid, *pe)
    # piecewise linear: the maximum sits on a breakpoint, which the dense grid brackets
    assert g['max_gap'] >= dense.max() - 1e-12
    assert g['max_gap'] == pytest.approx(dense.max(), abs=2e-3 * (hi - lo))
    assert np.interp(g['at_mean_loops'], *pc) - np.interp(g['at_mean_loops'], *pe) == (
        pytest.approx(g['max_gap']))


def test_family_gap_matches_a_dense_brute_force_grid():
  """A family's frontier is, at each mean loops, the best member's there (which can peak
  between breakpoints, where two members cross)."""
  rs = np.random.default_rng(1)
  for _ in range(20):
    me = rs.uniform(1, 8, 9)
    exact = {'mean_loops': me, 'loss': 2 + 1 / me + rs.normal(0, 0.01, 9)}
    members = []
    for _ in range(int(rs.integers(2, 4))):
      m = rs.uniform(rs.uniform(1, 4), 9, 6)
      members.append({'mean_loops': m, 'loss': 2 + 1 / m + rs.normal(0, 0.03, 6)})
    g = books.frontier_gap(exact, members)
    pe, envs = _pareto_brute(exact['mean_loops'], exact['loss']), [
        _pareto_brute(c['mean_loops'], c['loss']) for c in members]
    lo = max(pe[0][0], min(e[0][0] for e in envs))
    hi = min(pe[0][-1], max(e[0][-1] for e in envs))
    assert g['range'] == pytest.approx([lo, hi])
    grid = np.linspace(lo, hi, 200001)
    # a member holds its last loss beyond its last point, and is absent before its first
    best = np.min([np.where(grid >= e[0][0], np.interp(grid, *e), np.inf) for e in envs], axis=0)
    dense = best - np.interp(grid, *pe)
    assert g['max_gap'] >= dense.max() - 1e-12
    assert g['max_gap'] == pytest.approx(dense.max(), abs=1e-4)
  one = books.frontier_gap(exact, members[0])
  assert books.frontier_gap(exact, [members[0]]) == one


def test_frontier_gap_of_a_shifted_curve_is_the_shift():
  m = [1.0, 2.0, 3.0, 5.0]
  loss = [3.0, 2.5, 2.2, 2.1]
  exact = {'mean_loops': m, 'loss': loss}
  assert books.frontier_gap(exact, exact)['max_gap'] == 0.0
  worse = {'mean_loops': m, 'loss': [x + 0.003 for x in loss]}
  assert books.frontier_gap(exact, worse)['max_gap'] == pytest.approx(0.003)
  # a dominated point does not count: it is off the frontier
  extra = {'mean_loops': m + [2.5], 'loss': loss + [9.0]}
  assert books.frontier_gap(exact, extra)['max_gap'] == pytest.approx(0.0)
  assert books.frontier_gap(exact, {'mean_loops': [6.0, 7.0], 'loss': [2, 2]}) is None


def _rows_curve(loops_P, loss_PxN, tokens_N):
  """A curve from per-sequence mean losses at fixed per-point mean loops."""
  t = np.asarray(tokens_N, np.float64)
  loss = np.asarray(loss_PxN, np.float64) * t
  loops = np.outer(loops_P, t)
  return {'mean_loops': list(loops.sum(1) / t.sum()), 'loss': list(loss.sum(1) / t.sum()),
          'row_loss': loss.tolist(), 'row_loops': loops.tolist(), 'row_tokens': t.tolist()}


def _brute_gap(exact, cheap, cap=np.inf, n=200_001):
  """Max of cheap - exact Pareto frontiers (linear between points) on a dense grid of the
  shared mean-loop range where the exact frontier's loss is at most cap."""
  def pareto(c):
    pts = sorted(zip(c['mean_loops'], c['loss']))
    keep = [p for i, p in enumerate(pts) if all(p[1] < q[1] for q in pts[:i])]
    return np.array([p[0] for p in keep]), np.array([p[1] for p in keep])
  (me, le), (mc, lc) = pareto(exact), pareto(cheap)
  x = np.linspace(max(me[0], mc[0]), min(me[-1], mc[-1]), n)
  ex = np.interp(x, me, le)
  return float(np.max((np.interp(x, mc, lc) - ex)[ex <= cap]))


def test_gap_interval_collapses_when_every_sequence_agrees():
  m, loss = [2.0, 3.0, 4.0, 6.0], np.array([0.5, 0.1, 0.05, 0.04])
  tokens = [7, 3, 12, 5, 9]
  exact = _rows_curve(m, np.repeat(loss[:, None], 5, 1), tokens)
  cheap = _rows_curve(m, np.repeat(loss[:, None] + [[0.0], [0.02], [0.001], [0.0]], 5, 1), tokens)
  ci = books.frontier_gap_interval(exact, cheap, boots=50)
  assert ci['interval'] == pytest.approx([0.02, 0.02]) and ci['sequences'] == 5
  assert books.frontier_gap(exact, cheap)['max_gap'] == pytest.approx(0.02)
  # a family of one is the curve; the operating cap applies as in frontier_gap
  assert books.frontier_gap_interval(exact, [cheap], boots=50) == ci
  op = books.frontier_gap_interval(exact, cheap, loss_cap=0.06, boots=50)
  # the range starts where the exact frontier crosses 0.06 (3.8 loops), and the gap
  # peaks there: 0.0648 - 0.06 (the grid of breakpoints alone gave 0.001)
  want = _brute_gap(exact, cheap, 0.06)
  assert want == pytest.approx(0.0048, abs=1e-5)
  assert op['interval'] == pytest.approx([want, want], abs=1e-5)
  # no per-sequence sums, or other sequences: no interval
  assert books.frontier_gap_interval({k: exact[k] for k in ('mean_loops', 'loss')}, cheap) is None
  assert books.frontier_gap_interval(exact, _rows_curve(m, np.repeat(
      loss[:, None], 4, 1), tokens[:4])) is None
  assert books.frontier_gap_interval(exact, cheap, boots=0) is None


def test_gap_interval_covers_a_known_gap():
  """Simulated sweeps: the cheap curve loses `shift` nats in expectation at every point
  (plus per-sequence noise); the 90% interval covers it in about 90% of the sweeps, and
  is narrow because the draw is paired."""
  rs = np.random.default_rng(0)
  m, loss, shift, n = [2.0, 3.0, 4.0, 6.0], np.array([0.9, 0.5, 0.3, 0.2]), 0.003, 40
  covered = []
  for _ in range(100):
    tokens = rs.integers(50, 150, n)
    noise = rs.normal(0, 0.05, (4, n))  # shared by both curves: pairing cancels it
    u = rs.normal(0, 0.005, n)  # the cheap check's own per-sequence loss, at every point
    exact = _rows_curve(m, loss[:, None] + noise, tokens)
    cheap = _rows_curve(m, loss[:, None] + noise + shift + u, tokens)
    ci = books.frontier_gap_interval(exact, cheap, boots=200, seed=int(rs.integers(1 << 30)))
    covered.append(ci['interval'][0] <= shift <= ci['interval'][1])
    assert ci['interval'][1] - ci['interval'][0] < 0.006  # unpaired: ~0.035
  assert 0.78 <= np.mean(covered) <= 0.98


def test_same_loops_gap_interval_against_a_brute_force_bootstrap():
  """The headline's gap at equal mean loops, resampled: identical sequences give the
  point gap; otherwise each replicate equals a brute-force recomputation from the drawn
  sequences (np.repeat of the rows, then the pooled means)."""
  rs = np.random.default_rng(1)
  n, tokens = 12, rs.integers(5, 20, 12)
  depths = [1.0, 2.0, 3.0, 4.0]
  a0 = _rows_curve(depths, np.array([[0.9], [0.5], [0.3], [0.25]]) + rs.normal(0, 0.05, (4, n)),
                   tokens)
  depth_NxL = [rs.integers(1, 5, t) for t in tokens]  # a policy's per-token loops
  nll_NxL = [rs.uniform(0.1, 0.6, t) for t in tokens]
  curve = {'row_loss': [[x.sum() for x in nll_NxL]], 'row_loops': [[x.sum() for x in depth_NxL]],
           'row_tokens': tokens.tolist(), 'mean_loops': [np.concatenate(depth_NxL).mean()],
           'loss': [np.concatenate(nll_NxL).mean()], 'flops': [1.0], 'threshold': [0.1]}
  a0['flops'] = [1.0, 2.0, 3.0, 4.0]
  h = books.headline(a0, curve, ref_depth=4.0, delta=10.0)
  ci = h['best']['gap_same_loops_interval']
  assert ci['sequences'] == n and ci['boots'] == 1000
  gaps = []
  for w in books._draws(n, 1000, 0):  # the same draws, recomputed from the tokens
    pick = np.repeat(np.arange(n), w.astype(int))
    d = np.concatenate([depth_NxL[k] for k in pick])
    l = np.concatenate([nll_NxL[k] for k in pick])
    t = sum(tokens[k] for k in pick)
    a0_loss = [sum(np.asarray(a0['row_loss'])[j, k] for k in pick) / t for j in range(4)]
    gaps.append(l.mean() - np.interp(d.mean(), depths, a0_loss))
  assert ci['interval'] == pytest.approx(list(np.quantile(gaps, [0.05, 0.95])), rel=1e-9)
  assert ci['interval'][0] < h['best']['gap_same_loops'] < ci['interval'][1]
  same = _rows_curve(depths, np.repeat([[0.9], [0.5], [0.3], [0.25]], n, 1), tokens)
  same['flops'], same['threshold'] = a0['flops'], depths
  pt = {k: [v[2]] for k, v in same.items() if k != 'row_tokens'}
  pt['row_tokens'] = same['row_tokens']
  ci = books.headline(same, pt, 3.0)['best']['gap_same_loops_interval']
  assert ci['interval'] == pytest.approx([0.0, 0.0], abs=1e-12)


def _compiled_flops(fn, *args):
  return jax.jit(fn).lower(*args).compile().cost_analysis()['flops']


def test_cost_parts_match_the_compiled_loop_and_readout():
  """coda/loop and head/loop from model.flops_per_token against XLA's own FLOP count."""
  cfg = config.ModelConfig(vocab_size=2048, d_model=64, num_heads=4, num_kv_heads=2,
                           head_dim=16, mlp_dim=192, n_prelude=1, n_core=2, n_coda=2,
                           max_len=64)
  mdl = model_lib.LoopedLM(cfg, nnx.Rngs(0))
  b, l = 2, 64
  s = jnp.ones((b, l, cfg.d_model), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(l), (b, l))
  graphdef, state = nnx.split(mdl)

  def loop(state, s):
    m = nnx.merge(graphdef, state)
    return m.core_step(s, s, pos, [None] * cfg.n_core)[0]

  def coda(state, s):
    return nnx.merge(graphdef, state).decode_state(s, pos)[0]

  def head(state, h):
    return nnx.merge(graphdef, state).logits(h)
  f = model_lib.flops_per_token(cfg, 0, l)
  xla = {k: _compiled_flops(fn, state, s) / (b * l)
         for k, fn in (('loop', loop), ('coda', coda), ('head', head))}
  # XLA also counts elementwise work (norms, softmax, SwiGLU): a few percent
  assert xla['coda'] / xla['loop'] == pytest.approx(
      (f['coda_head'] - f['head']) / f['loop'], rel=0.15)
  assert xla['head'] / xla['loop'] == pytest.approx(f['head'] / f['loop'], rel=0.15)


def _dot_flops(fn, *args) -> float:
  """2 x the multiply-adds of every dot_general fn's jaxpr runs (an independent count)."""
  total = 0.0
  for e in jaxpr_dots(jax.make_jaxpr(fn)(*args).jaxpr):
    (lc, _), (lb, _) = e.params['dimension_numbers']
    a, b = e.invars[0].aval.shape, e.invars[1].aval.shape
    total += 2 * np.prod(a) * np.prod(b) / np.prod([a[i] for i in lc + lb] or [1])
  return total


@pytest.mark.parametrize('l', [64, 128])
def test_outer_attention_books_count_the_keys_the_chunked_attention_runs(l):
  """With attention in every block, the prelude and the readout (coda) as executed in
  parallel scoring: their dot FLOPs per token equal flops_per_token's at OUTER_KEYS."""
  cfg = config.ModelConfig(vocab_size=97, d_model=32, num_heads=4, num_kv_heads=2,
                           head_dim=8, mlp_dim=48, n_prelude=1, n_core=2, n_coda=1,
                           max_len=256, attention='all')
  mdl = model_lib.build_model(cfg)
  b = 2
  toks = jnp.zeros((b, l), jnp.int32)
  pos = model_lib.positions(toks)
  s = jnp.zeros((b, l, cfg.d_model))
  prelude = _dot_flops(lambda t: mdl.inject(mdl.encode(t, pos)[0]), toks) / (b * l)
  coda = _dot_flops(lambda s: mdl.decode_state(s, pos)[0], s) / (b * l)
  keys = books.OUTER_KEYS[config.Semantics.PARALLEL](l, l)
  assert keys == model_lib.causal_keys(l) > l / 2  # more than model FLOPs' l / 2
  f = model_lib.flops_per_token(cfg, 0, l, outer_keys=keys)
  assert prelude == pytest.approx(f['prelude'], rel=1e-12)
  assert coda == pytest.approx(f['coda_head'] - f['head'], rel=1e-12)
  assert books.executed_flops(cfg, 0, 1, 0, l, outer_keys=keys) == pytest.approx(
      prelude + coda, rel=1e-12)


R, B, L = 6, 2, 8


def test_sweep_books_from_the_engines_counts():
  cfg = exit_model_config()
  mdl = model_lib.LoopedLM(cfg, nnx.Rngs(3))
  rs = np.random.default_rng(0)
  batches = [dict(inputs=rs.integers(0, 48, (B, L)).astype(np.int32),
                  targets=rs.integers(0, 48, (B, L)).astype(np.int32),
                  mask=np.ones((B, L), np.float32)) for _ in range(2)]
  res = frontier.sweep(mdl, batches, jax.random.key(5), R, 4.0, eps_grid=[0.0, 1e9],
                       curves=('kl', 'state_delta'), state_delta_grid=[0.0, 1e9],
                       timing_repeats=0, check_every=(1, 3))
  bk = res['check_books']
  assert set(bk) == {'kl', 'state_delta', 'kl/every3', 'state_delta/every3'}
  f = model_lib.flops_per_token(cfg, 0, L)
  coda, head, delta = f['coda_head'] - f['head'], f['head'], 5 * cfg.d_model
  # state change: no readout beyond the output, the norm at every loop
  assert bk['state_delta']['cost'] == pytest.approx([delta / f['loop']] * 2)
  # kl at eps = 0 never exits: R loops, a readout at loops 1..R (p_1 for the loop-2
  # check), then the output readout
  assert bk['kl']['cost'][0] == pytest.approx((R * (coda + head) + R * delta) / (R * f['loop']))
  # every 3 loops from min_loops = 1: checks at 4 (7 is past the R = 6 cap), reads at 3, 4
  assert bk['kl/every3']['cost'][0] == pytest.approx((2 * (coda + head) + R * delta) / (R * f['loop']))
  assert bk['kl']['frontier_vs_exact'] is None  # the exact curve itself
  assert bk['kl/every3']['frontier_vs_exact'] is not None
  big = config.ModelConfig(**config.BLOCKS_135M)
  fb = model_lib.flops_per_token(big, 0, books.SEQ_135M)
  assert bk['kl']['cost_135m'][0] == pytest.approx(
      (R * fb['coda_head'] + R * 5 * big.d_model) / (R * fb['loop']))


def test_sweep_min_loops_curves_and_their_family():
  """--min_loops adds '<curve>/min<m>' (no exit before loop m), and the books judge the
  check over all its min_loops as '<curve>/min*'; --patience adds 'state_delta/pat<k>'."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(3))
  rs = np.random.default_rng(0)
  batches = [dict(inputs=rs.integers(0, 48, (B, L)).astype(np.int32),
                  targets=rs.integers(0, 48, (B, L)).astype(np.int32),
                  mask=np.ones((B, L), np.float32))]
  res = frontier.sweep(mdl, batches, jax.random.key(5), 4, 3.0, eps_grid=[0.0, 1e9],
                       curves=('kl', 'state_delta'), state_delta_grid=[0.0, 1e9],
                       timing_repeats=0, min_loops=(1, 3), patience=(1, 2))
  c = res['curves']
  assert 'kl/pat2' not in c  # patience is the state change's only
  # a huge threshold holds from loop 2, so patience 2 exits at loop 3 (and 3 from min 3)
  assert c['state_delta/pat2']['mean_loops'] == pytest.approx([4.0, 3.0])
  assert c['state_delta/pat2/min3']['mean_loops'] == pytest.approx([4.0, 3.0])
  # eps 0 never exits (R = 4 loops); a huge eps exits at the first check: loop 2, or m
  assert c['state_delta']['mean_loops'] == pytest.approx([4.0, 2.0])
  assert c['state_delta/min3']['mean_loops'] == pytest.approx([4.0, 3.0])
  assert c['kl/min3']['mean_loops'] == pytest.approx([4.0, 3.0])
  bk = res['check_books']
  assert bk['state_delta/min*']['members'] == ['state_delta', 'state_delta/min3']
  assert bk['state_delta/min*']['frontier_vs_exact'] == books.frontier_gap(
      c['kl'], [c['state_delta'], c['state_delta/min3']])
  assert bk['kl/min*']['frontier_vs_exact'] is None  # the exact curve is a member


def test_sweep_eps_growth_curves_and_their_family():
  """--eps_growth adds '<curve>/g<g>' (threshold eps g^(i - 2) at loop i), and the books
  judge each check over all its growths as '<curve>/g*'."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(3))
  rs = np.random.default_rng(0)
  batches = [dict(inputs=rs.integers(0, 48, (B, L)).astype(np.int32),
                  targets=rs.integers(0, 48, (B, L)).astype(np.int32),
                  mask=np.ones((B, L), np.float32))]
  grid = [0.0, 1e-30, 1e9]
  res = frontier.sweep(mdl, batches, jax.random.key(5), 4, 3.0, eps_grid=grid,
                       curves=('kl', 'state_delta'), state_delta_grid=grid,
                       timing_repeats=0, eps_growth=(1.0, 1e35))
  c = res['curves']
  # 1e-30 never fires at loop 2, but 1e-30 x 1e35 at loop 3 always does; 0 never; 1e9 at 2
  for name in ('kl', 'state_delta'):
    assert c[name]['mean_loops'] == pytest.approx([4.0, 4.0, 2.0])
    assert c[f'{name}/g1e+35']['mean_loops'] == pytest.approx([4.0, 3.0, 2.0])
  bk = res['check_books']
  assert bk['state_delta/g*']['members'] == ['state_delta', 'state_delta/g1e+35']
  assert bk['state_delta/g*']['frontier_vs_exact'] == books.frontier_gap(
      c['kl'], [c['state_delta'], c['state_delta/g1e+35']])
  assert bk['kl/g*']['frontier_vs_exact'] is None  # the exact curve is a member


def test_operating_range_compares_only_where_the_exact_loss_is_low():
  exact = {'mean_loops': [2.0, 3.0, 4.0, 6.0], 'loss': [0.5, 0.1, 0.05, 0.04]}
  cheap = {'mean_loops': [2.0, 3.0, 4.0, 6.0], 'loss': [0.5, 0.3, 0.051, 0.04]}
  assert books.frontier_gap(exact, cheap)['max_gap'] == pytest.approx(0.2)
  for cap in (0.06, 0.045, 0.2, 0.5, 1.0):
    g = books.frontier_gap(exact, cheap, loss_cap=cap)
    assert g['max_gap'] == pytest.approx(_brute_gap(exact, cheap, cap), abs=1e-5), cap
  g = books.frontier_gap(exact, cheap, loss_cap=0.06)
  assert g['range'] == pytest.approx([3.8, 6.0])  # from where the exact loss crosses 0.06
  assert g['max_gap'] == pytest.approx(0.1008 - 0.06)
  assert books.frontier_gap(exact, cheap, loss_cap=0.01) is None


def _brute_headline(d0, l0, ml, loss, ref_depth, delta):
  ref = np.interp(ref_depth, d0, l0)
  best = None
  for i in range(len(ml)):
    if loss[i] <= ref + delta and (best is None or (ml[i], loss[i]) < (ml[best], loss[best])):
      best = i
  return ref, best


def test_headline_on_hand_built_curve():
  d0 = np.arange(1, 9, dtype=float)
  l0 = 2.0 + 1.0 / d0  # loss 3, 2.5, 2.33, ..., 2.125
  a0 = {'mean_loops': d0.tolist(), 'loss': l0.tolist(), 'flops': (100 + 10 * d0).tolist()}
  ml = [7.5, 5.5, 4.2, 3.1, 2.0]
  loss = [2.126, 2.13, 2.131, 2.2, 2.6]
  curve = {'policy': 'kl', 'threshold': [1e-5, 1e-4, 1e-3, 1e-2, 1e-1], 'mean_loops': ml,
           'loss': loss, 'flops': [100 + 10 * m + 7 for m in ml]}
  for ref_depth, delta in ((8, 0.01), (6.5, 0.01), (8, 0.08), (8, 1e-4)):
    h = books.headline(a0, curve, ref_depth, delta)
    ref, best = _brute_headline(d0, l0, ml, loss, ref_depth, delta)
    assert h['ref_loss'] == pytest.approx(ref)
    if best is None:
      assert h['best'] is None
      continue
    b = h['best']
    assert b['index'] == best and b['mean_loops'] == ml[best]
    assert b['loop_saving'] == pytest.approx(1 - ml[best] / ref_depth)
    lo = int(np.floor(ml[best]))  # A0 interpolated between the neighbouring depths
    w = ml[best] - lo
    a0_at = (1 - w) * l0[lo - 1] + w * l0[min(lo, 7)]
    assert b['a0_loss_same_loops'] == pytest.approx(a0_at)
    assert b['gap_same_loops'] == pytest.approx(loss[best] - a0_at)
    # equal FLOPs: 7 extra FLOPs = 0.7 loops of A0
    assert b['a0_loss_same_flops'] == pytest.approx(np.interp(ml[best] + 0.7, d0, l0))
  h = books.headline(a0, curve, 8, 0.01)
  assert h['best']['index'] == 2 and h['uniform_depth_within_delta'] == 8.0
  # two points at the fewest loops within delta: the lower loss is the headline
  tied = dict(curve, mean_loops=ml[:3] + [4.2, 2.0], loss=loss[:3] + [2.129, 2.6])
  h = books.headline(a0, tied, 8, 0.01)
  assert h['best']['index'] == _brute_headline(d0, l0, tied['mean_loops'], tied['loss'], 8,
                                               0.01)[1] == 3
  assert h['points_beating_a0_same_loops'] == sum(
      x < np.interp(m, d0, l0) for m, x in zip(ml, loss))


@pytest.mark.parametrize('attention', ['all', 'core'])
def test_decode_flops_match_the_compiled_decode_step(attention):
  """One decode step at depth 1 (one pass of everything) against XLA's FLOP count: every
  pass attends over all cache slots."""
  cfg = config.ModelConfig(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2,
                           head_dim=16, mlp_dim=192, n_prelude=1, n_core=2, n_coda=2,
                           max_len=256, attention=attention)
  mdl = model_lib.LoopedLM(cfg, nnx.Rngs(0))
  b, slots = 4, 128
  ecfg = config.ExitConfig(policy='uniform', depth=1)
  graphdef, state = nnx.split(mdl)

  def step(state, cache, tok):
    m = nnx.merge(graphdef, state)
    return decoding.decode_step(m, cache, tok, 5, ecfg, jax.random.key(0))[0]
  xla = _compiled_flops(step, state, decoding.init_cache(mdl, b, slots),
                        jnp.zeros((b,), jnp.int32)) / b
  # XLA also counts elementwise work (norms, softmax, SwiGLU): a few percent
  assert xla == pytest.approx(books.decode_flops(cfg, 1, 1, 1, 1, 0, slots), rel=0.1)
  # doubling the slots adds the attention over them in every block with attention
  per_key = 2 * 2 * cfg.num_heads * cfg.head_dim
  blocks = cfg.n_core + (cfg.n_prelude + cfg.n_coda) * (attention == 'all')
  assert (books.decode_flops(cfg, 1, 1, 1, 1, 0, 2 * slots)
          - books.decode_flops(cfg, 1, 1, 1, 1, 0, slots)) == pytest.approx(
              blocks * per_key * slots)


def test_exact_curve_is_found_by_the_recorded_semantics():
  """The exact check's curve in a curve's own semantics, from its recorded schedule
  (whatever the curve's name)."""
  exact, cached = {'loss': [1.0]}, {'loss': [2.0]}
  res = {'curves': {'kl': exact, 'kl@cached': cached}}
  sched = lambda sem: {'schedule': {'semantics': sem}}
  assert books._exact_curve(res, sched('cached'), 'kl') is cached
  assert books._exact_curve(res, sched('parallel'), 'kl') is exact
  assert books._exact_curve({'curves': {'kl': exact}}, sched('cached'), 'kl') is None
