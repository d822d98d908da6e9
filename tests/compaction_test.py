"""Compacted early exit (exit.engine=compacted, and pooled: one buffer for the whole batch)
against the masked engine it must equal."""

import dataclasses
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from elastic_depth import (compaction, config, decoding, inference, model as model_lib, policies,
                           recurrence)

B, L, R = 2, 8, 6
STAT = {'kl': 'kl', 'reverse_kl': 'rkl', 'state_delta': 'delta', 'router': 'p_change',
        'confidence': 'conf', 'kl_probe': 'kl_hat'}


def _model(n_coda, attention='all'):
  cfg = config.ModelConfig(vocab_size=48, d_model=32, num_heads=4, num_kv_heads=2,
                           head_dim=8, mlp_dim=64, n_prelude=1, n_core=2, n_coda=n_coda,
                           max_len=64, init_std=0.1, attention=attention)
  return model_lib.LoopedLM(cfg, nnx.Rngs(3))


@pytest.fixture(scope='module')
def setup():
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 48, (B, L)), jnp.int32)
  r = np.random.default_rng(1)
  router = policies.Router(jnp.asarray(r.normal(size=32), jnp.float32), jnp.float32(0.3),
                           jnp.zeros(32), jnp.ones(32))
  models = {n: _model(n) for n in (1, 2)}
  traces = {n: inference.score(m, toks, config.ExitConfig(policy='uniform', depth=R),
                               jax.random.key(0), router=router, trace=True).traces
            for n, m in models.items()}
  f = lambda *shape: jnp.asarray(0.3 * r.normal(size=shape), jnp.float32)
  kl_probe = policies.KLProbe(f(2, 32, 4), f(2, 32), 0.5 + f(2), jnp.zeros((2, 32)),
                              jnp.ones((2, 32)), 1.0 + f(2), f(2, 64, 3), f(2, 3), f(2, 3))
  for n, m in models.items():  # the KL probe's estimate beside the router's statistics
    traces[n] = dict(traces[n], kl_hat=inference.score(
        m, toks, config.ExitConfig(policy='uniform', depth=R), jax.random.key(0),
        router=kl_probe, trace=True).traces['kl_hat'])
  return models, toks, {'router': router, 'kl_probe': kl_probe}, traces


def _ragged_eps(trace, policy, min_loops):
  """An eps at the median of the policy's statistic over the loops it may exit at."""
  return float(np.median(np.asarray(trace[STAT[policy]])[max(min_loops, 2) - 1:]))


def _both(mdl, toks, cfg, router=None, **kw):
  """(masked, compacted) forwards; two-step capacities keep compilation short."""
  loops = (inference.exit_loop(cfg, router=router, **kw),
           inference.compact_exit_loop(dataclasses.replace(cfg, compact_steps=2), router=router,
                                       **kw))
  return [jax.jit(lambda t, f=f: mdl.forward(t, jax.random.key(0), f))(toks) for f in loops]


def _assert_same(ref, got):
  np.testing.assert_array_equal(np.asarray(got.aux.depth), np.asarray(ref.aux.depth))
  np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), atol=2e-5)
  np.testing.assert_allclose(np.asarray(got.state), np.asarray(ref.state), atol=2e-5)
  for (k1, v1), (k2, v2) in zip(ref.aux.kv, got.aux.kv):
    np.testing.assert_allclose(np.asarray(k2), np.asarray(k1), atol=2e-5)
    np.testing.assert_allclose(np.asarray(v2), np.asarray(v1), atol=2e-5)


@pytest.mark.parametrize('policy,n_coda,min_loops,check_every', [
    ('kl', 2, 2, 2), ('reverse_kl', 1, 3, 1), ('state_delta', 1, 1, 2), ('router', 2, 2, 1),
    ('confidence', 1, 1, 1), ('kl_probe', 1, 1, 2)])
def test_compacted_equals_masked(setup, policy, n_coda, min_loops, check_every):
  models, toks, probes, traces = setup
  eps = _ragged_eps(traces[n_coda], policy, min_loops)
  cfg = config.ExitConfig(policy=policy, eps=eps, min_loops=min_loops, max_loops=R,
                          check_every=check_every)
  ref, got = _both(models[n_coda], toks, cfg, probes.get(policy))
  depth = np.asarray(ref.aux.depth)
  assert len(np.unique(depth)) > 1 and depth.max() > min_loops  # ragged exits
  _assert_same(ref, got)


def test_compacted_equals_masked_with_attention_in_the_core_only(setup):
  """model.attention=core (the main job's model): the coda block has no attention, so the
  compacted readout keeps its (unused) key/value buffers as they are."""
  _, toks, _, _ = setup
  mdl = _model(1, attention='core')
  trace = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R),
                          jax.random.key(0), trace=True).traces
  cfg = config.ExitConfig(policy='kl', eps=_ragged_eps(trace, 'kl', 1), max_loops=R)
  ref, got = _both(mdl, toks, cfg)
  assert len(np.unique(np.asarray(ref.aux.depth))) > 1
  _assert_same(ref, got)


def test_uniform_equals_masked(setup):
  models, toks, _, _ = setup
  ref, got = _both(models[1], toks, config.ExitConfig(policy='uniform', depth=3))
  assert np.all(np.asarray(got.aux.depth) == 3)
  _assert_same(ref, got)


def test_padding_and_executed_slots(setup):
  """Tokens inactive from the start (padding) stay at depth 0 and offer their initial kv."""
  models, toks, _, traces = setup
  active = jnp.asarray(np.random.default_rng(2).random((B, L)) < 0.7)
  cfg = config.ExitConfig(policy='kl', eps=_ragged_eps(traces[1], 'kl', 1), max_loops=R)
  ref, got = _both(models[1], toks, cfg, active_BxL=active)
  _assert_same(ref, got)
  assert np.all(np.asarray(ref.aux.depth)[~np.asarray(active)] == 0)
  # every loop holds at least the active tokens, and fewer than all when rows shrink
  slots, loops, depth = int(got.aux.slots), int(got.aux.loops), np.asarray(got.aux.depth)
  assert depth.sum() <= slots < loops * B * L
  per_loop = [(depth >= i).sum(axis=1).max() for i in range(1, loops + 1)]
  caps = recurrence.capacities(L, 2)
  assert slots == B * sum(min(c for c in caps if c >= n) for n in per_loop)


def test_prefill_with_compacted_engine_fills_the_same_cache(setup):
  """score and prefill pick the engine from exit.engine (a 4-token prompt: 4 capacities)."""
  models, toks, _, traces = setup
  eps = _ragged_eps(traces[1], 'kl', 1)
  caches = []
  for engine in ('masked', 'compacted', 'pooled'):
    cfg = config.ExitConfig(policy='kl', eps=eps, max_loops=R, engine=engine)
    caches.append(jax.jit(lambda t, c=cfg: decoding.prefill(
        models[1], t, c, jax.random.key(0), 8))(toks[:, :4]))
  c1, last1, d1 = caches[0]
  for c2, last2, d2 in caches[1:]:
    np.testing.assert_array_equal(np.asarray(d2), np.asarray(d1))
    np.testing.assert_allclose(np.asarray(last2), np.asarray(last1), atol=2e-5)
    chex.assert_trees_all_close(c2, c1, atol=2e-5, rtol=1e-7)


def test_scheduled_exits_follow_the_schedule(setup):
  models, toks, _, _ = setup
  sched = jnp.asarray(np.random.default_rng(3).integers(1, 6, (B, L)), jnp.int32)
  cfg = config.ExitConfig(policy='state_delta', eps=0.0, min_loops=2, max_loops=R)
  for out in _both(models[1], toks, cfg, schedule_BxL=sched):
    np.testing.assert_array_equal(np.asarray(out.aux.depth), np.maximum(np.asarray(sched), 2))


def test_capacities_and_bad_engine():
  caps = recurrence.capacities(256)
  assert caps == (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256)
  assert recurrence.capacities(12, 4) == (1, 2, 3, 6, 9, 12)
  with pytest.raises(config.ConfigError, match='exit.engine'):
    config.validate(config.Config(exit=config.ExitConfig(engine='sparse')))
  for make in (inference.compact_exit_loop, inference.pooled_exit_loop):
    with pytest.raises(ValueError, match='traces need exit.engine=masked'):
      make(config.ExitConfig(), trace=True)


def test_right_aligned_slots():
  """Each row's active positions, increasing, in the last slots; padding slots hold L."""
  active = np.random.default_rng(5).random((3, 11)) < 0.4
  active[2] = False
  for cap in (5, 11):
    got = np.asarray(recurrence.right_aligned(jnp.asarray(active), cap))
    for b in range(3):
      pos = np.flatnonzero(active[b])[-cap:]
      want = np.concatenate([np.full(cap - len(pos), 11), pos])
      np.testing.assert_array_equal(got[b], want)
      assert np.all(got[b][got[b] < 11] <= 11 - cap + np.arange(cap)[got[b] < 11])


@pytest.mark.parametrize('c', [32, 40])
def test_compact_attention_equals_float64_reference(c):
  """Buffer queries over their rows (grouped heads; a partial buffer in one masked chunk, a
  full one in 2 query chunks) vs a numpy loop."""
  b, l, h, g, k = 2, 40, 4, 2, 8
  r = np.random.default_rng(6)
  active = r.random((b, l)) < 0.6
  active[0, -c:] = True  # row 0 fills the buffer: its early slots see few keys
  idx = recurrence.right_aligned(jnp.asarray(active), c)
  pos = model_lib.positions(jnp.zeros((b, l), jnp.int32))
  qpos = recurrence.gather_rows(pos, idx)
  q, kk, vv = (r.normal(size=s).astype(np.float32) for s in ((b, c, h, k), (b, g, l, k),
                                                             (b, g, l, k)))
  got = np.asarray(compaction.compact_attention(jnp.asarray(q), jnp.asarray(kk),
                                                jnp.asarray(vv), qpos, pos))
  idx, checked = np.asarray(idx), 0
  for bi, s, hi in itertools.product(range(b), range(c), range(h)):
    p = idx[bi, s]
    if p >= l:  # padding slot
      continue
    logit = kk[bi, hi // (h // g), :p + 1].astype(np.float64) @ q[bi, s, hi] / np.sqrt(k)
    w = np.exp(logit - logit.max())
    want = (w / w.sum()) @ vv[bi, hi // (h // g), :p + 1].astype(np.float64)
    np.testing.assert_allclose(got[bi, s, hi], want, atol=1e-5)
    checked += 1
  assert checked == h * min(c, active[1].sum()) + h * c


def test_scheduled_exits_keep_the_checks_work(setup):
  """A benchmark's synthetic schedule must not let XLA compile the KL check away: the
  compiled engines still evaluate exp over every token's vocabulary at a check."""
  models, toks, _, _ = setup
  mdl = models[1]
  sched = jnp.full((B, L), 3, jnp.int32)
  v = mdl.cfg.vocab_size
  for make in (inference.exit_loop, inference.compact_exit_loop):
    cost = {}
    for policy in ('kl', 'state_delta'):
      cfg = config.ExitConfig(policy=policy, eps=-1.0, max_loops=R)
      f = jax.jit(lambda t, c=cfg: mdl.forward(t, jax.random.key(0), make(c, schedule_BxL=sched)))
      ca = f.lower(toks).compile().cost_analysis()
      ca = ca[0] if isinstance(ca, (list, tuple)) else ca
      cost[policy] = ca.get('transcendentals', 0.0)
      out = f(toks)
      np.testing.assert_array_equal(np.asarray(out.aux.depth), np.full((B, L), 3))
    assert cost['kl'] - cost['state_delta'] >= B * L * v, (make.__name__, cost)


def test_a_ragged_schedule_exits_at_allowed_loops_alike_in_both_engines(setup):
  """check_every=2, one coda block (compacted coda): a scheduled token exits at the first
  allowed loop (min_loops + k check_every) at or after its schedule, loop 1 included,
  where no readout runs; the logits (the coda on the final states) equal the masked
  engine's."""
  models, toks, _, _ = setup
  sched = jnp.asarray(np.random.default_rng(2).integers(1, R + 1, (B, L)), jnp.int32)
  cfg = config.ExitConfig(policy='kl', eps=-1.0, max_loops=R, check_every=2, min_loops=1)
  masked, compacted = _both(models[1], toks, cfg, schedule_BxL=sched)
  allowed = [i for i in range(1, R + 1) if (i - 1) % 2 == 0]  # loops 1, 3, 5
  want = [[next((c for c in allowed if c >= s), R) for s in row] for row in np.asarray(sched)]
  assert 1 in np.asarray(want)  # an exit at a loop without a readout
  np.testing.assert_array_equal(np.asarray(masked.aux.depth), want)
  np.testing.assert_array_equal(np.asarray(compacted.aux.depth), want)
  np.testing.assert_allclose(compacted.logits, masked.logits, atol=2e-5)


@pytest.mark.parametrize('cap', [16, 32, 64, 96, 128])
def test_compact_keys_is_what_the_compiled_attention_multiplies(cap):
  """compact_keys(C, L) x 4 H K FLOPs per buffer slot against XLA's own count."""
  b, h, g, k, l = 1, 2, 1, 64, 128
  q, kv = jnp.zeros((b, cap, h, k)), jnp.zeros((b, g, l, k))
  qpos, kpos = jnp.zeros((b, cap), jnp.int32), jnp.zeros((b, l), jnp.int32)
  ca = jax.jit(compaction.compact_attention).lower(q, kv, kv, qpos, kpos).compile()
  ca = ca.cost_analysis()
  got = float((ca if isinstance(ca, dict) else ca[0])['flops']) / (4 * b * h * cap * k)
  want = compaction.compact_keys(cap, l)
  assert want <= got <= 1.05 * want
  assert l / 2 < want <= l  # the right-aligned slots' static key ranges


def _pooled(mdl, toks, cfg, router=None, **kw):
  """(masked, pooled) forwards; two-step capacities over the pool keep compilation short."""
  loops = (inference.exit_loop(cfg, router=router, **kw),
           inference.pooled_exit_loop(cfg, router=router, steps=2, **kw))
  return [jax.jit(lambda t, f=f: mdl.forward(t, jax.random.key(0), f))(toks) for f in loops]


@pytest.mark.parametrize('policy,n_coda,attention', [
    ('kl', 2, 'all'), ('reverse_kl', 1, 'all'), ('state_delta', 1, 'all'), ('router', 2, 'all'),
    ('kl_probe', 2, 'all'), ('kl', 1, 'core')])
def test_pooled_equals_masked(setup, policy, n_coda, attention):
  """Rows of different lengths of exit in one pool: a coda run on all tokens (two coda
  blocks), a compacted coda with attention (one), and a coda without attention."""
  models, toks, probes, traces = setup
  mdl = models[n_coda] if attention == 'all' else _model(n_coda, attention=attention)
  trace = traces[n_coda] if attention == 'all' else inference.score(
      mdl, toks, config.ExitConfig(policy='uniform', depth=R), jax.random.key(0),
      trace=True).traces
  cfg = config.ExitConfig(policy=policy, eps=_ragged_eps(trace, policy, 1), max_loops=R)
  ref, got = _pooled(mdl, toks, cfg, probes.get(policy))
  assert len(np.unique(np.asarray(ref.aux.depth))) > 1
  _assert_same(ref, got)
  np.testing.assert_array_equal(np.asarray(got.aux.counts.depth), np.asarray(ref.aux.depth))


def test_pooled_padding_per_row_eps_and_slots(setup):
  """Padding, a threshold per row (serving's per-request eps) and the pool's executed
  slots: at each loop the smallest capacity over B x L that holds the batch's active
  tokens."""
  models, toks, _, traces = setup
  active = jnp.asarray(np.random.default_rng(2).random((B, L)) < 0.7)
  base = _ragged_eps(traces[1], 'kl', 1)
  eps_Bx1 = jnp.asarray([[base], [base * 3]], jnp.float32)
  cfg = config.ExitConfig(policy='kl', eps=eps_Bx1, max_loops=R)
  ref, got = _pooled(models[1], toks, cfg, active_BxL=active)
  _assert_same(ref, got)
  depth = np.asarray(got.aux.depth)
  assert np.all(depth[~np.asarray(active)] == 0)
  caps = recurrence.capacities(B * L, 2)
  per_loop = [(depth >= i).sum() for i in range(1, int(got.aux.loops) + 1)]
  assert int(got.aux.slots) == sum(min(c for c in caps if c >= n) for n in per_loop)


def test_pooled_attention_equals_float64_reference():
  """A pool's queries (flat indices of any rows) over their own rows' keys vs a numpy loop."""
  b, l, h, g, k, c = 3, 8, 4, 2, 8, 10
  r = np.random.default_rng(7)
  flat = np.sort(r.choice(b * l, c - 2, replace=False))
  idx = np.concatenate([np.full(2, b * l), flat])[None]  # two padding slots first
  pos = model_lib.positions(jnp.zeros((b, l), jnp.int32))
  q, kk, vv = (r.normal(size=s).astype(np.float32) for s in ((1, c, h, k), (b, g, l, k),
                                                             (b, g, l, k)))
  got = np.asarray(compaction.pooled_attention(jnp.asarray(q), jnp.asarray(kk), jnp.asarray(vv),
                                               jnp.asarray(idx, jnp.int32), pos))
  for s, hi in itertools.product(range(2, c), range(h)):
    bi, p = divmod(int(idx[0, s]), l)
    logit = kk[bi, hi // (h // g), :p + 1].astype(np.float64) @ q[0, s, hi] / np.sqrt(k)
    w = np.exp(logit - logit.max())
    want = (w / w.sum()) @ vv[bi, hi // (h // g), :p + 1].astype(np.float64)
    np.testing.assert_allclose(got[0, s, hi], want, atol=1e-5)


@pytest.mark.parametrize('c', [16, 48])
def test_pooled_keys_is_what_the_compiled_attention_multiplies(c):
  """pooled_keys(C, B, L) x 4 H K FLOPs per buffer slot against XLA's own count."""
  b, l, h, g, k = 4, 16, 2, 1, 64
  q, kv = jnp.zeros((1, c, h, k)), jnp.zeros((b, g, l, k))
  idx, pos = jnp.zeros((1, c), jnp.int32), model_lib.positions(jnp.zeros((b, l), jnp.int32))
  ca = jax.jit(compaction.pooled_attention).lower(q, kv, kv, idx, pos).compile().cost_analysis()
  got = float((ca if isinstance(ca, dict) else ca[0])['flops']) / (4 * h * c * k)
  want = compaction.pooled_keys(c, b, l)
  # XLA also counts the elementwise work (max, exp and sum per score, one division per
  # output element): a few percent at 16 keys of 64 dims
  assert want <= got <= 1.08 * want
  assert want == b * l * l / c  # every row's queries over all its keys


def test_compacted_coda_passes_with_two_coda_blocks():
  """with n_coda = 2 the compacted engine runs the coda over all B x L tokens at
  every read: its coda passes equal the masked engine's."""
  mdl = _model(2)
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 8)), jnp.int32)
  rng = jax.random.key(0)
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=6), rng,
                       trace=True).traces
  eps = float(np.median(np.asarray(tr['kl'])[1:]))
  cfg = config.ExitConfig(policy='kl', eps=eps, max_loops=6)
  ref = inference.score(mdl, toks, cfg, rng).counts
  got = inference.score(mdl, toks, dataclasses.replace(cfg, engine='compacted',
                                                         compact_steps=2), rng).counts
  assert len(np.unique(np.asarray(ref.depth))) > 1
  assert float(got.coda_passes) == float(ref.coda_passes)
  assert float(got.head_passes) <= float(ref.head_passes)  # the head is compacted


def test_pow2_capacities_against_brute_force():
  """0 (skip), the powers of two below b, then b: increasing, from 0 to b."""
  for b in range(1, 40):
    want = [0] + [2 ** j for j in range(b.bit_length()) if 2 ** j < b] + [b]
    assert compaction.pow2_capacities(b) == tuple(want), b
    assert list(compaction.pow2_capacities(b)) == sorted(set(want))


@pytest.mark.parametrize('b', [5, 6, 8])
def test_on_rows_runs_the_smallest_buffer_and_keeps_the_other_rows(b):
  """on_rows against a Python loop: the pass changes the masked rows only (padding slots
  and, in a full buffer, the unmasked rows untouched), in the smallest capacity that holds
  them (0: skip, no run)."""
  caps = compaction.pow2_capacities(b)
  x_BxD = jnp.asarray(np.random.default_rng(b).normal(size=(b, 3)), jnp.float32)
  masks = [np.zeros(b, bool), np.ones(b, bool)] + [
      np.random.default_rng(100 * b + n).permutation(b) < n for n in range(1, b)]
  masks += [np.arange(b) < n for n in range(1, b)]  # the last row unmasked
  run = lambda rows, x: rows.put(x, 10.0 * rows.take(x) + 1.0)
  skip = lambda x: x
  for mask in masks:
    got, cap = compaction.on_rows(jnp.asarray(mask), caps, run, skip, x_BxD)
    want = np.where(mask[:, None], 10.0 * np.asarray(x_BxD) + 1.0, np.asarray(x_BxD))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert int(cap) == min(c for c in caps if c >= mask.sum()), (mask, int(cap))
