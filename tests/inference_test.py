"""Early-exit scoring and cached generation against brute-force per-token references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from elastic_depth import config, inference, losses, model as model_lib

B, L, R = 2, 10, 10


def tiny_cfg(init_state='random'):  # the default of every config
  return config.ModelConfig(vocab_size=48, d_model=32, num_heads=4, num_kv_heads=2,
                            head_dim=8, mlp_dim=64, n_prelude=1, n_core=2, n_coda=1,
                            max_len=64, init_state=init_state, init_std=0.1)


@pytest.fixture(scope='module')
def setup():
  mdl = model_lib.LoopedLM(tiny_cfg(), nnx.Rngs(3))
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 48, (B, L)), jnp.int32)
  return mdl, toks


def _kl_np(h_new, h_old, w):
  """KL(p_new || p_old) per row in float64."""
  a = np.asarray(h_new, np.float64) @ np.asarray(w, np.float64).T
  b = np.asarray(h_old, np.float64) @ np.asarray(w, np.float64).T
  la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
  lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
  return np.sum(np.exp(la) * (la - lb), axis=-1)


def _attend_list(ks, vs):
  """kv_fn attending to an explicit list of earlier (k, v) plus the new one."""
  def fn(k, v):
    kk = jnp.concatenate(ks + [k], axis=1)
    vv = jnp.concatenate(vs + [v], axis=1)
    return kk, vv, jnp.ones((1, 1, 1, kk.shape[1]), bool)
  return fn


def brute_parallel(mdl, toks, eps, min_loops, max_loops, rng):
  """Parallel semantics with plain Python loops over loops, blocks and tokens."""
  pos = model_lib.positions(toks)
  e, _ = mdl.encode(toks, pos)
  s = mdl.initial_state(e, rng, pos)
  b, l = toks.shape
  depth = np.zeros((b, l), int)
  active = np.ones((b, l), bool)
  frozen = [[None] * l for _ in mdl.core]  # per block, per token: (k, v) [B,1,G,K]
  h_prev = mdl.decode_state(s, pos)[0]
  kls = []
  for i in range(1, max_loops + 1):
    if not active.any():
      break
    x = jnp.einsum('BLC,CD->BLD', jnp.concatenate([s, e], -1), mdl.adapter_2DxD[...])
    for j, block in enumerate(mdl.core):
      outs, used = [], []
      for t in range(l):
        ks = [u[0] for u in used]
        vs = [u[1] for u in used]
        own = []

        def kv_fn(k, v, t=t, ks=ks, vs=vs, own=own):
          if frozen[j][t] is not None:  # rows that exited offer their frozen kv
            a = jnp.asarray(active[:, t])[:, None, None, None]
            k = jnp.where(a, k, frozen[j][t][0])
            v = jnp.where(a, v, frozen[j][t][1])
          own.append((k, v))
          return _attend_list(ks, vs)(k, v)
        y, _ = block(x[:, t:t + 1], pos[:, t:t + 1], kv_fn)
        used.append(own[0])
        outs.append(y)
      for t in range(l):
        frozen[j][t] = used[t]
      x = jnp.concatenate(outs, axis=1)
    s = jnp.where(jnp.asarray(active)[..., None], x, s)
    depth += active
    h = mdl.decode_state(s, pos)[0]
    kl = _kl_np(h.reshape(b * l, -1), h_prev.reshape(b * l, -1),
                mdl.head_weight()).reshape(b, l)
    kls.append(np.where(active, kl, np.nan))
    if i >= max(min_loops, 2):
      active &= ~(kl < eps)
    h_prev = h
  logits = mdl.logits(mdl.decode_state(s, pos)[0])
  return np.asarray(logits), depth, kls


def _safe_eps(kls):
  """A threshold far (in log space) from every observed KL, near their median."""
  v = np.sort(np.concatenate([k[np.isfinite(k)] for k in kls[1:]]))
  logs = np.log(v)
  mid = len(v) // 2
  window = range(max(mid - len(v) // 4, 0), min(mid + len(v) // 4, len(v) - 1))
  j = max(window, key=lambda i: logs[i + 1] - logs[i])
  return float(np.exp(0.5 * (logs[j] + logs[j + 1])))


def test_parallel_exit_matches_brute_force(setup):
  mdl, toks = setup
  rng = jax.random.key(7)
  _, _, kls = brute_parallel(mdl, toks, eps=-1.0, min_loops=1, max_loops=R, rng=rng)
  eps = _safe_eps(kls)
  ref_logits, ref_depth, _ = brute_parallel(mdl, toks, eps, 1, R, rng)
  assert len(np.unique(ref_depth)) > 2, ref_depth  # the test exercises varied depths
  cfg = config.ExitConfig(policy='kl', eps=eps, min_loops=1, max_loops=R)
  out = jax.jit(lambda t: inference.score(mdl, t, cfg, rng))(toks)
  np.testing.assert_array_equal(np.asarray(out.depth), ref_depth)
  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)


def test_eps_zero_equals_full_depth_and_never_firing_equals_uniform(setup):
  mdl, toks = setup
  rng = jax.random.key(1)
  full = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R), rng)
  never = inference.score(mdl, toks, config.ExitConfig(policy='kl', eps=0.0,
                                                       max_loops=R), rng)
  np.testing.assert_array_equal(np.asarray(never.depth), R)
  np.testing.assert_array_equal(np.asarray(never.logits), np.asarray(full.logits))
  # uniform depth through the exit engine equals the plain training forward pass
  pos = model_lib.positions(toks)
  e, _ = mdl.encode(toks, pos)
  s = mdl.initial_state(e, rng, pos)
  for _ in range(R):
    s = mdl.core_step(s, e, pos)[0]
  ref = mdl.logits(mdl.decode_state(s, pos)[0])
  np.testing.assert_allclose(np.asarray(full.logits), np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize('policy', ['kl', 'state_delta', 'reverse_kl'])
def test_always_firing_stops_at_min_loops(setup, policy):
  mdl, toks = setup
  rng = jax.random.key(2)
  cfg = config.ExitConfig(policy=policy, eps=1e9, min_loops=3, max_loops=R)
  out = inference.score(mdl, toks, cfg, rng)
  np.testing.assert_array_equal(np.asarray(out.depth), 3)
  ref = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=3), rng)
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=1e-6)


def test_exited_states_are_frozen(setup):
  mdl, toks = setup
  rng = jax.random.key(4)
  trace = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R), rng,
                          trace=True)
  eps = float(np.median(np.asarray(trace.traces['kl'][2:])))
  cfg = config.ExitConfig(policy='kl', eps=eps, max_loops=R)
  out = inference.score(mdl, toks, cfg, rng)
  depth = np.asarray(out.depth)
  assert depth.min() < R
  # state of a token equals the state after exactly `depth` loops of a run capped there
  for d in np.unique(depth):
    capped = inference.score(mdl, toks, config.ExitConfig(policy='kl', eps=eps,
                                                          max_loops=int(d)), rng)
    sel = depth == d
    np.testing.assert_array_equal(np.asarray(out.state)[sel],
                                  np.asarray(capped.state)[sel])


def test_trace_nll_equals_uniform_depth_losses(setup):
  mdl, toks = setup
  rng = jax.random.key(5)
  tgt = jnp.roll(toks, -1, axis=1)
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=6), rng,
                       targets_BxL=tgt, trace=True).traces
  for d in (1, 3, 6):
    out = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=d), rng)
    ref = losses.nll(out.logits, tgt)
    np.testing.assert_allclose(np.asarray(tr['nll'][d - 1]), np.asarray(ref), atol=1e-5)


def brute_cached(mdl, toks, prompt_len, eps, max_loops, rng, gate=None):
  """Cached semantics per token: earlier tokens offer their last-loop kv in every block.

  With a gate (policy gated_kl) a token exits only where also ||s_i - s_{i-1}|| / ||s_i|| < gate.
  """
  b, l = toks.shape
  cfg = config.ExitConfig(policy='kl' if gate is None else 'gated_kl', eps=eps,
                          max_loops=max_loops, gate=gate or 0.0)
  cache, _, _ = inference.prefill(mdl, toks[:, :prompt_len], cfg, rng, prompt_len)
  pre = [[(c[0][:, t:t + 1], c[1][:, t:t + 1]) for t in range(prompt_len)]
         for c in cache.prelude]
  core = [[(c[0][:, t:t + 1], c[1][:, t:t + 1]) for t in range(prompt_len)]
          for c in cache.core]
  coda = [[(c[0][:, t:t + 1], c[1][:, t:t + 1]) for t in range(prompt_len)]
          for c in cache.coda]
  depths, logits = [], []
  w = mdl.head_weight()

  def run(blocks, lists, x, p, write):
    kvs = []
    for j, blk in enumerate(blocks):
      ks = [u[0] for u in lists[j]]
      vs = [u[1] for u in lists[j]]
      x, (kk, vv) = blk(x, p, _attend_list(ks, vs))
      kvs.append((kk[:, -1:], vv[:, -1:]))
    if write:
      for j, kv in enumerate(kvs):
        lists[j].append(kv)
    return x, kvs

  for t in range(prompt_len, l):
    assert b == 1
    p = jnp.full((1, 1), t, jnp.int32)
    x = jnp.take(mdl.embed_VxD[...], toks[:, t:t + 1], axis=0)
    e, _ = run(mdl.prelude, pre, x, p, True)
    s = mdl.initial_state(e, rng, p)
    h_prev = mdl.final_norm(run(mdl.coda, coda, s, p, False)[0])
    d = 0
    for i in range(1, max_loops + 1):
      x = jnp.einsum('BLC,CD->BLD', jnp.concatenate([s, e], -1), mdl.adapter_2DxD[...])
      s_old = np.asarray(s, np.float64)
      s, last_kv = run(mdl.core, core, x, p, False)
      d = i
      h = mdl.final_norm(run(mdl.coda, coda, s, p, False)[0])
      kl = _kl_np(h[:, 0], h_prev[:, 0], w)[0]
      sn = np.asarray(s, np.float64)
      delta = np.linalg.norm(sn - s_old) / np.linalg.norm(sn)
      if i >= 2 and kl < eps and (gate is None or delta < gate):
        break
      h_prev = h
    for j, kv in enumerate(last_kv):
      core[j].append(kv)
    hf, _ = run(mdl.coda, coda, s, p, True)
    logits.append(np.asarray(mdl.logits(mdl.final_norm(hf)))[:, 0])
    depths.append(d)
  return np.stack(logits, 1), np.asarray(depths)[None]


def test_generation_matches_brute_force_and_teacher_forced_scoring():
  mdl = model_lib.LoopedLM(tiny_cfg(), nnx.Rngs(11))
  rng = jax.random.key(0)
  prompt = jnp.asarray([[3, 17, 5, 9]], jnp.int32)
  probe = config.ExitConfig(policy='uniform', depth=R)
  tr = inference.score(mdl, prompt, probe, rng, trace=True).traces
  eps = float(np.median(np.asarray(tr['kl'][2:])))
  cfg = config.ExitConfig(policy='kl', eps=eps, max_loops=R)
  toks, depth = jax.jit(lambda p: inference.generate(mdl, p, 6, cfg, rng))(prompt)
  logits_tf, depth_tf, _ = jax.jit(
      lambda t: inference.score_cached(mdl, t, 4, cfg, rng))(toks)
  np.testing.assert_array_equal(np.asarray(depth), np.asarray(depth_tf))
  # greedy: every generated token is the argmax of the scoring logits before it
  np.testing.assert_array_equal(np.asarray(toks[:, 4:]),
                                np.argmax(np.asarray(logits_tf), -1))
  ref_logits, ref_depth = brute_cached(mdl, toks, 4, eps, R, rng)
  np.testing.assert_array_equal(np.asarray(depth_tf), ref_depth)
  # logits_tf[:, k] predicts token 4 + k and comes from decoding token 3 + k
  np.testing.assert_allclose(np.asarray(logits_tf[:, 1:]), ref_logits[:, :-1],
                             atol=1e-5, rtol=1e-5)


def test_cache_size_independent_of_loops():
  mdl = model_lib.LoopedLM(tiny_cfg(), nnx.Rngs(0))
  c8 = inference.init_cache(mdl, 1, 32)
  leaves = jax.tree.leaves(c8)
  n_blocks = mdl.cfg.n_prelude + mdl.cfg.n_core + mdl.cfg.n_coda
  assert len(leaves) == 2 * n_blocks
  assert all(x.shape == (1, 32, 2, 8) for x in leaves)


def test_batched_generation_equals_per_row_generation():
  """Rows exit at different loops; each row must equal its batch-1 generation."""
  mdl = model_lib.LoopedLM(tiny_cfg(), nnx.Rngs(5))
  rng = jax.random.key(0)
  prompts = jnp.asarray([[3, 17, 5, 9], [40, 2, 2, 31]], jnp.int32)
  tr = inference.score(mdl, prompts, config.ExitConfig(policy='uniform', depth=R), rng,
                       trace=True).traces
  eps = float(np.median(np.asarray(tr['kl'][2:])))
  cfg = config.ExitConfig(policy='kl', eps=eps, max_loops=R)
  gen = jax.jit(lambda p: inference.generate(mdl, p, 6, cfg, rng))
  toks, depth = gen(prompts)
  assert np.any(np.asarray(depth[0]) != np.asarray(depth[1]))  # rows exit apart
  for row in range(2):
    t1, d1 = gen(prompts[row:row + 1])
    np.testing.assert_array_equal(np.asarray(depth[row:row + 1]), np.asarray(d1))
    np.testing.assert_array_equal(np.asarray(toks[row:row + 1]), np.asarray(t1))


def test_batched_cached_scoring_equals_per_row_scoring():
  """Logits, not only greedy tokens: inactive rows must keep their cache slots."""
  mdl = model_lib.LoopedLM(tiny_cfg(), nnx.Rngs(5))
  rng = jax.random.key(0)
  toks = jnp.asarray(np.random.default_rng(3).integers(0, 48, (2, 12)), jnp.int32)
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R), rng,
                       trace=True).traces
  eps = float(np.median(np.asarray(tr['kl'][2:])))
  cfg = config.ExitConfig(policy='kl', eps=eps, max_loops=R)
  sc = jax.jit(lambda t: inference.score_cached(mdl, t, 3, cfg, rng))
  logits, depth, _ = sc(toks)
  assert np.any(np.asarray(depth[0]) != np.asarray(depth[1]))
  for row in range(2):
    l1, d1, _ = sc(toks[row:row + 1])
    np.testing.assert_array_equal(np.asarray(depth[row:row + 1]), np.asarray(d1))
    np.testing.assert_allclose(np.asarray(logits[row:row + 1]), np.asarray(l1),
                               atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# One semantics: a token's initial state depends on (seed, position, its prefix) only.


def _kl_cfg(mdl, toks, rng):
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R), rng,
                       trace=True).traces
  return config.ExitConfig(policy='kl', eps=float(np.median(np.asarray(tr['kl'][2:]))),
                           max_loops=R)


def test_parallel_scoring_batched_equals_per_row_and_prefix_equals_whole(setup):
  mdl, toks = setup
  rng = jax.random.key(4)
  cfg = _kl_cfg(mdl, toks, rng)
  run = jax.jit(lambda t: inference.score(mdl, t, cfg, rng))
  full = run(toks)
  assert len(np.unique(np.asarray(full.depth))) > 1  # ragged exits
  for row in range(B):
    one = run(toks[row:row + 1])
    np.testing.assert_array_equal(np.asarray(one.depth), np.asarray(full.depth[row:row + 1]))
    np.testing.assert_allclose(np.asarray(one.logits), np.asarray(full.logits[row:row + 1]),
                               atol=1e-5, rtol=1e-5)
  p = L // 2
  pre = run(toks[:, :p])  # a prefix exits and reads out as inside the whole sequence
  np.testing.assert_array_equal(np.asarray(pre.depth), np.asarray(full.depth[:, :p]))
  np.testing.assert_allclose(np.asarray(pre.logits), np.asarray(full.logits[:, :p]),
                             atol=1e-5, rtol=1e-5)
  # a row's initial states do not depend on the rows beside it
  pos = model_lib.positions(toks)
  e, _ = mdl.encode(toks, pos)
  s0 = mdl.initial_state(e, rng, pos)
  s1 = mdl.initial_state(e[::-1], rng, pos)
  np.testing.assert_array_equal(np.asarray(s0), np.asarray(s1[::-1]))
  assert not np.allclose(np.asarray(s0[:, 0]), np.asarray(s0[:, 1]))  # positions differ


def test_cached_scoring_starts_from_the_parallel_initial_states(setup):
  """At one loop both semantics attend to the same keys/values: equal only if s0 is."""
  mdl, toks = setup
  rng = jax.random.key(6)
  one = config.ExitConfig(policy='uniform', depth=1)
  par = inference.score(mdl, toks, one, rng).logits
  cached, _, _ = jax.jit(lambda t: inference.score_cached(mdl, t, 3, one, rng))(toks)
  # cached logits k predict token 3 + k: parallel outputs at positions 2..L-2
  np.testing.assert_allclose(np.asarray(cached), np.asarray(par[:, 2:-1]), atol=1e-5,
                             rtol=1e-5)


def test_gated_check_matches_brute_force_in_cached_and_parallel_semantics():
  """gated_kl: exit where KL < eps and the relative state change < gate, in both engines."""
  mdl = model_lib.LoopedLM(tiny_cfg(), nnx.Rngs(11))
  rng = jax.random.key(0)
  toks = jnp.asarray([[3, 17, 5, 9, 30, 2, 44, 8, 12]], jnp.int32)
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R), rng,
                       trace=True).traces
  eps, gate = _safe_eps(list(np.asarray(tr['kl']))), _safe_eps(list(np.asarray(tr['delta'])))
  cfg = config.ExitConfig(policy='gated_kl', eps=eps, max_loops=R, gate=gate)
  logits, depth, _ = jax.jit(lambda t: inference.score_cached(mdl, t, 3, cfg, rng))(toks)
  ref_logits, ref_depth = brute_cached(mdl, toks, 3, eps, R, rng, gate=gate)
  np.testing.assert_array_equal(np.asarray(depth), ref_depth)
  assert len(np.unique(ref_depth)) > 1
  np.testing.assert_allclose(np.asarray(logits[:, 1:]), ref_logits[:, :-1], atol=1e-5, rtol=1e-5)
  # parallel: until the first exit every state is the uniform run's, so the trace
  # decides exactly which tokens exit first (at the first loop >= 2 where any may)
  ok = (np.asarray(tr['kl']) < eps) & (np.asarray(tr['delta']) < gate)
  ok[0] = False
  k = int(np.argmax(ok.reshape(R, -1).any(1)))  # 0-based loop index of the first exits
  assert ok[k].any() and not ok[k].all()
  par = np.asarray(inference.score(mdl, toks, cfg, rng).depth)
  np.testing.assert_array_equal(par == k + 1, ok[k])
  assert np.all(par[~ok[k]] > k + 1)
