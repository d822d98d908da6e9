"""Executed-work counts (inference.Counts) against a brute-force count of what ran.

Every core loop, readout (coda + final norm) and LM-head product logs an event from
inside the compiled program (an ordered jax.debug.callback), so the log is what
actually executed; the expected per-token counts are rebuilt from the log and the
tokens' depths alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from elastic_depth import compaction, config, decoding, inference, policies, recurrence
from elastic_depth import model as model_lib
from elastic_depth.kernels import kl_halting

B, L, R = 2, 6, 9
MIN_LOOPS, CHECK_EVERY = 3, 3  # checks at loops 3, 6, 9: readouts at 2, 3, 5, 6, 8, 9


@pytest.fixture(scope='module')
def mdl():
  cfg = config.ModelConfig(vocab_size=40, d_model=16, num_heads=2, num_kv_heads=1,
                           head_dim=8, mlp_dim=32, n_prelude=1, n_core=1, n_coda=1,
                           max_len=32, init_std=0.3)
  return model_lib.LoopedLM(cfg, nnx.Rngs(2))


@pytest.fixture()
def events(monkeypatch):
  """Installs logging wrappers; returns the (kind, rows per batch row) event log."""
  log = []

  def logged(kind, fn, width_of):
    def wrapped(*args, **kw):
      out = fn(*args, **kw)
      w = width_of(*args)
      jax.debug.callback(lambda: log.append((kind, w)), ordered=True)
      return out
    return wrapped
  cls = model_lib.LoopedLM
  monkeypatch.setattr(cls, 'core_step', logged('core', cls.core_step, lambda *a: 1))
  # a readout of [B, L, D] in scoring is one pass; decode reads [B, 1 or 2, D]
  width = lambda self, x, *a: 1 if x.shape[1] > 2 else x.shape[1]
  monkeypatch.setattr(cls, 'decode_state', logged('coda', cls.decode_state, width))
  monkeypatch.setattr(cls, 'logits', logged('head', cls.logits, width))
  monkeypatch.setattr(kl_halting, 'head_logits',
                      logged('head', kl_halting.head_logits, lambda *a: 1))
  # marks the end of the exit loop: later readouts are the final ones
  monkeypatch.setattr(recurrence, 'early_exit',
                      logged('end', recurrence.early_exit, lambda *a: 0))
  return log


def brute_counts(log, depth):
  """(core, coda, head) batch totals and per-token coda/head from the event log."""
  loop, ended, total = 0, False, {'core': 0, 'coda': 0, 'head': 0, 'end': 0}
  coda_tok, head_tok = np.zeros(depth.shape, int), np.zeros(depth.shape, int)
  for kind, w in log:
    total[kind] += w
    if kind == 'core':
      loop += 1
    elif kind == 'end':
      ended = True
    elif ended:  # a final readout: every token
      (coda_tok if kind == 'coda' else head_tok)[...] += w
    else:  # a check's readout at `loop`: the tokens still active there
      (coda_tok if kind == 'coda' else head_tok)[...] += w * (depth >= loop)
  return total, coda_tok, head_tok


def assert_counts(counts, log, depth):
  total, coda_tok, head_tok = brute_counts(log, depth)
  assert int(counts.core_passes) == total['core'] == depth.max()
  assert int(counts.coda_passes) == total['coda']
  assert int(counts.head_passes) == total['head']
  np.testing.assert_array_equal(np.asarray(counts.depth), depth)
  np.testing.assert_array_equal(np.asarray(counts.coda), coda_tok)
  np.testing.assert_array_equal(np.asarray(counts.head), head_tok)


def exit_cfg(policy, eps, **kw):
  return config.ExitConfig(policy=policy, eps=eps, min_loops=MIN_LOOPS, max_loops=R,
                           check_every=CHECK_EVERY, **kw)


def _router(d, policy='router'):
  """The state probe a policy reads: the A2 router, or a KL probe for kl_probe."""
  rs = np.random.default_rng(1)
  if policy == 'kl_probe':
    f = lambda scale, *shape: jnp.asarray(scale * rs.normal(size=shape), jnp.float32)
    one = policies.KLProbe(f(0.5, d, 3), f(0.2, d), jnp.float32(0.0), jnp.zeros(d),
                           jnp.ones(d), jnp.float32(1.0), f(0.3, 2 * d, 2), f(0.1, 2), f(0.3, 2))
    return jax.tree.map(lambda a: a[None], one)  # one parameter set for every loop
  return policies.Router(jnp.asarray(rs.normal(size=d), jnp.float32), jnp.float32(0.0),
                         jnp.zeros(d), jnp.ones(d))




def _between(x):
  """A threshold near the median, at the widest gap between observed values (no ties)."""
  v = np.sort(np.asarray(x, np.float64).ravel())
  lo, hi = len(v) // 4, 3 * len(v) // 4
  j = lo + int(np.argmax(v[lo + 1:hi + 1] - v[lo:hi]))
  return float(0.5 * (v[j] + v[j + 1]))


@pytest.mark.parametrize('policy', ['kl', 'gated_kl', 'reverse_kl', 'state_delta', 'router',
                                    'confidence', 'kl_probe'])
def test_scoring_counts_match_executed_work(mdl, events, policy):
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 40, (B, L)), jnp.int32)
  rng = jax.random.key(0)
  router = _router(mdl.cfg.d_model, policy)
  probe = config.ExitConfig(policy='uniform', depth=R, max_loops=R)
  tr = jax.device_get(inference.score(mdl, toks, probe, rng, router=router, trace=True).traces)
  gate = _between(tr['delta'][MIN_LOOPS - 1:])
  stat = {'kl': tr['kl'], 'reverse_kl': tr['rkl'], 'state_delta': tr['delta'],
          'router': tr.get('p_change'), 'gated_kl': np.where(tr['delta'] < gate, tr['kl'], np.inf),
          'confidence': tr['conf'], 'kl_probe': tr.get('kl_hat')}[policy]
  # some tokens exit at each check (gated: where both the KL and the gate allow it)
  eps = _between((tr['kl'] if policy == 'gated_kl' else stat)[MIN_LOOPS - 1:])
  jax.effects_barrier()
  events.clear()
  res = inference.score(mdl, toks, exit_cfg(policy, eps, gate=gate), rng, router=router)
  jax.effects_barrier()
  depth = np.asarray(res.depth)
  # exits only at checks; until the first exit every state is the uniform run's, so the
  # trace decides the first check (loop 3) exactly (p_{i-1} from the carry changes nothing)
  assert set(np.unique(depth)) <= {3, 6, 9} and len(np.unique(depth)) > 1
  np.testing.assert_array_equal(depth == MIN_LOOPS, stat[MIN_LOOPS - 1] < eps)
  assert_counts(res.counts, list(events), depth)
  head_policy = policy in ('kl', 'gated_kl', 'reverse_kl', 'confidence')
  # KL-type: no readout before loop 2 and none at loops 1, 4, 7; confidence: only at the
  # checks (3, 6, 9); one head product per readout
  reads = (3, 6, 9) if policy == 'confidence' else (2, 3, 5, 6, 8, 9)
  expect = len([i for i in reads if i <= depth.max()]) if head_policy else 0
  assert int(res.counts.coda_passes) == expect + 1
  assert int(res.counts.head_passes) == expect + 1


@pytest.mark.parametrize('policy,gate', [('kl', 0.0), ('gated_kl', 0.3), ('reverse_kl', 0.0)])
def test_decode_counts_match_executed_work(mdl, events, policy, gate):
  toks = jnp.asarray(np.random.default_rng(2).integers(0, 40, (B, 5)), jnp.int32)
  rng = jax.random.key(1)
  cfg = exit_cfg(policy, 1e-3, gate=gate)
  cache, _, _ = decoding.prefill(mdl, toks[:, :3], cfg, rng, 8)
  seen = set()
  for eps in (1e-4, 1e-1):
    cfg = exit_cfg(policy, eps, gate=gate)
    jax.effects_barrier()
    events.clear()
    _, _, depth, counts = decoding.decode_step(mdl, cache, toks[:, 3], 3, cfg, rng,
                                               with_counts=True)
    jax.effects_barrier()
    depth = np.asarray(depth)[:, None]
    seen.update(depth.ravel().tolist())
    assert_counts(counts, list(events), depth)
    if policy != 'reverse_kl':  # the paired check reads two states per check
      end = events.index(('end', 0))
      assert all(w == 2 for k, w in events[:end] if k in ('coda', 'head'))
  assert len(seen) > 1


@pytest.mark.parametrize('policy', ['kl', 'reverse_kl'])
def test_kernel_path_carries_the_hidden_state_and_counts_two_head_products(
    mdl, events, monkeypatch, policy):
  """The fused-kernel branch (emulated on CPU by the reference): same exits, 2 heads a check."""
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 40, (B, L)), jnp.int32)
  rng = jax.random.key(0)
  cfg = exit_cfg(policy, 1e-3)
  plain = inference.score(mdl, toks, cfg, rng)
  monkeypatch.setattr(kl_halting, 'kernel_active', lambda use: use)
  monkeypatch.setattr(kl_halting, 'kl_halting_auto',
                      lambda h, hp, w, use_kernel=True: kl_halting.reference_kl_halting(h, hp, w))
  jax.effects_barrier()
  events.clear()
  res = inference.score(mdl, toks, exit_cfg(policy, 1e-3, use_kernel=True), rng)
  jax.effects_barrier()
  depth = np.asarray(res.depth)
  np.testing.assert_array_equal(depth, np.asarray(plain.depth))
  assert_counts(res.counts, list(events), depth)
  checks = len([i for i in (3, 6, 9) if i <= depth.max()])
  assert int(res.counts.head_passes) == 2 * checks + 1


@pytest.mark.parametrize('policy', ['kl', 'gated_kl', 'reverse_kl', 'state_delta', 'router',
                                    'confidence', 'kl_probe'])
def test_compacted_counts_are_the_slots_it_ran(mdl, policy):
  """Compacted engine: per-token work equals the masked engine's; batch work is the slots.

  A readout (or head product) at loop i runs over B x cap_i slots, cap_i the smallest
  capacity holding the fullest row's active tokens (depth >= i); the final readout
  runs over all B x L tokens.
  """
  toks = jnp.asarray(np.random.default_rng(4).integers(0, 40, (B, L)), jnp.int32)
  rng, router = jax.random.key(0), _router(mdl.cfg.d_model, policy)
  tr = jax.device_get(inference.score(mdl, toks, config.ExitConfig(
      policy='uniform', depth=R, max_loops=R), rng, router=router, trace=True).traces)
  stat = {'kl': tr['kl'], 'gated_kl': tr['kl'], 'reverse_kl': tr['rkl'],
          'state_delta': tr['delta'], 'router': tr.get('p_change'), 'confidence': tr['conf'],
          'kl_probe': tr.get('kl_hat')}[policy]
  eps, gate = _between(stat[MIN_LOOPS - 1:]), _between(tr['delta'][MIN_LOOPS - 1:])
  out = {e: inference.score(mdl, toks, exit_cfg(policy, eps, gate=gate, engine=e), rng,
                            router=router).counts for e in ('masked', 'compacted')}
  ref, got = out['masked'], out['compacted']
  depth = np.asarray(ref.depth)
  assert len(np.unique(depth)) > 1
  for name in ('depth', 'coda', 'head'):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(ref, name)))
  caps = recurrence.capacities(L)
  cap = lambda i: min(c for c in caps if c >= (depth >= i).sum(axis=1).max())
  loops = range(1, depth.max() + 1)
  reads = [i for i in ((3, 6, 9) if policy == 'confidence' else (2, 3, 5, 6, 8, 9))
           if i <= depth.max()]
  head_policy = policy in ('kl', 'gated_kl', 'reverse_kl', 'confidence')
  expect = lambda ls: (B * sum(cap(i) for i in ls) + B * L) / (B * L)
  assert float(got.core_passes) == pytest.approx(B * sum(cap(i) for i in loops) / (B * L))
  # the keys a core query met: the masked engine's attention multiplies all L, a buffer's
  # slots those of their capacity's static ranges (compaction.compact_keys), slot-weighted
  assert float(ref.core_keys) == L
  keys = sum(cap(i) * compaction.compact_keys(cap(i), L) for i in loops)
  assert float(got.core_keys) == pytest.approx(keys / sum(cap(i) for i in loops))
  assert float(got.coda_passes) == pytest.approx(expect(reads if head_policy else []))
  assert float(got.head_passes) == pytest.approx(expect(reads if head_policy else []))
  assert float(got.core_passes) <= int(ref.core_passes)
