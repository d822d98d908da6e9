"""Cached decoding (generation, cached scoring) against brute-force per-token references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import (attend_list, exit_model_config, gumbel_pick_np, kl_np, median_kl_cfg,
                      nll_np, safe_eps)
from elastic_depth import config, decoding, inference, model as model_lib

R = 10


def brute_cached(mdl, toks, prompt_len, eps, max_loops, rng, gate=None, probe=None,
                 probe_stat=None, record=None):
  """Cached semantics per token: earlier tokens offer their last-loop kv in every block.

  With a gate (policy gated_kl) a token exits only where also ||s_i - s_{i-1}|| / ||s_i|| < gate.
  With a KL probe (policy kl_probe, which also prefills the prompt) the statistic is
  probe_stat(s_i, s_{i-1}, i) in float64 instead of the KL. record (a dict) collects each
  token's per-loop KL and state: record['kl'][t] [R], record['state'][t] [R, D].
  """
  b, l = toks.shape
  cfg = config.ExitConfig(policy='kl' if gate is None else 'gated_kl', eps=eps,
                          max_loops=max_loops, gate=gate or 0.0)
  if probe is not None:
    cfg = config.ExitConfig(policy='kl_probe', eps=eps, max_loops=max_loops)
  cache, _, _ = decoding.prefill(mdl, toks[:, :prompt_len], cfg, rng, prompt_len, probe)
  slots = lambda caches: [[tuple(decoding.token_slots(x, t) for x in c) for t in range(prompt_len)]
                          for c in caches]  # per block, per token: (k, v) [B, 1, G, K]
  pre, core, coda = slots(cache.prelude), slots(cache.core), slots(cache.coda)
  depths, logits = [], []
  w = mdl.head_weight()

  def run(blocks, lists, x, p, write):
    kvs = []
    for j, blk in enumerate(blocks):
      ks = [u[0] for u in lists[j]]
      vs = [u[1] for u in lists[j]]
      x, (kk, vv) = blk(x, p, attend_list(ks, vs))
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
    kls, states = [], []
    for i in range(1, max_loops + 1):
      x = jnp.einsum('BLC,CD->BLD', jnp.concatenate([s, e], -1), mdl.adapter_2DxD[...])
      s_old = np.asarray(s, np.float64)
      s, last_kv = run(mdl.core, core, x, p, False)
      d = i
      h = mdl.final_norm(run(mdl.coda, coda, s, p, False)[0])
      kl = kl_np(h[:, 0], h_prev[:, 0], w)[0]
      sn = np.asarray(s, np.float64)
      kls.append(kl)
      states.append(sn[0, 0])
      if probe is not None:
        kl = probe_stat(sn[:, 0], s_old[:, 0], i)[0]
      delta = np.linalg.norm(sn - s_old) / np.linalg.norm(sn)
      if i >= 2 and kl < eps and (gate is None or delta < gate):
        break
      h_prev = h
    if record is not None:
      record.setdefault('kl', []).append(np.asarray(kls))
      record.setdefault('state', []).append(np.stack(states))
    for j, kv in enumerate(last_kv):
      core[j].append(kv)
    hf, _ = run(mdl.coda, coda, s, p, True)
    logits.append(np.asarray(mdl.logits(mdl.final_norm(hf)))[:, 0])
    depths.append(d)
  return np.stack(logits, 1), np.asarray(depths)[None]


def test_generation_matches_brute_force_and_teacher_forced_scoring():
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(11))
  rng = jax.random.key(0)
  prompt = jnp.asarray([[3, 17, 5, 9]], jnp.int32)
  cfg = median_kl_cfg(mdl, prompt, rng, R)
  toks, depth = jax.jit(lambda p: decoding.generate(mdl, p, 6, cfg, rng))(prompt)
  logits_tf, depth_tf, _ = jax.jit(
      lambda t: decoding.score_cached(mdl, t, 4, cfg, rng))(toks)
  np.testing.assert_array_equal(np.asarray(depth), np.asarray(depth_tf))
  # greedy: every generated token is the argmax of the scoring logits before it
  np.testing.assert_array_equal(np.asarray(toks[:, 4:]),
                                np.argmax(np.asarray(logits_tf), -1))
  ref_logits, ref_depth = brute_cached(mdl, toks, 4, cfg.eps, R, rng)
  np.testing.assert_array_equal(np.asarray(depth_tf), ref_depth)
  # logits_tf[:, k] predicts token 4 + k and comes from decoding token 3 + k
  np.testing.assert_allclose(np.asarray(logits_tf[:, 1:]), ref_logits[:, :-1],
                             atol=1e-5, rtol=1e-5)


def test_cache_size_independent_of_loops():
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(0))
  c8 = decoding.init_cache(mdl, 1, 32)
  leaves = jax.tree.leaves(c8)
  n_blocks = mdl.cfg.n_prelude + mdl.cfg.n_core + mdl.cfg.n_coda
  assert len(leaves) == 2 * n_blocks
  assert all(x.shape == (1, 2, 32, 8) for x in leaves)  # [B, G, S, K]


def _two_rows():
  """(model, rng, two prompts, a KL config whose exits are ragged on them)."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(5))
  rng = jax.random.key(0)
  prompts = jnp.asarray([[3, 17, 5, 9], [40, 2, 2, 31]], jnp.int32)
  return mdl, rng, prompts, median_kl_cfg(mdl, prompts, rng, R)


def test_batched_generation_equals_per_row_generation():
  """Rows exit at different loops; each row must equal its batch-1 generation."""
  mdl, rng, prompts, cfg = _two_rows()
  gen = jax.jit(lambda p: decoding.generate(mdl, p, 6, cfg, rng))
  toks, depth = gen(prompts)
  assert np.any(np.asarray(depth[0]) != np.asarray(depth[1]))  # rows exit apart
  for row in range(2):
    t1, d1 = gen(prompts[row:row + 1])
    np.testing.assert_array_equal(np.asarray(depth[row:row + 1]), np.asarray(d1))
    np.testing.assert_array_equal(np.asarray(toks[row:row + 1]), np.asarray(t1))


def test_batched_cached_scoring_equals_per_row_scoring():
  """Logits, not only greedy tokens: inactive rows must keep their cache slots."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(5))
  rng = jax.random.key(0)
  toks = jnp.asarray(np.random.default_rng(3).integers(0, 48, (2, 12)), jnp.int32)
  cfg = median_kl_cfg(mdl, toks, rng, R)
  sc = jax.jit(lambda t: decoding.score_cached(mdl, t, 3, cfg, rng))
  logits, depth, _ = sc(toks)
  assert np.any(np.asarray(depth[0]) != np.asarray(depth[1]))
  for row in range(2):
    l1, d1, _ = sc(toks[row:row + 1])
    np.testing.assert_array_equal(np.asarray(depth[row:row + 1]), np.asarray(d1))
    np.testing.assert_allclose(np.asarray(logits[row:row + 1]), np.asarray(l1),
                               atol=1e-5, rtol=1e-5)


def test_cached_scoring_starts_from_the_parallel_initial_states():
  """At one loop both semantics attend to the same keys/values: equal only if s0 is."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(3))
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 10)), jnp.int32)
  rng = jax.random.key(6)
  one = config.ExitConfig(policy='uniform', depth=1)
  par = inference.score(mdl, toks, one, rng).logits
  cached, _, _ = jax.jit(lambda t: decoding.score_cached(mdl, t, 3, one, rng))(toks)
  # cached logits k predict token 3 + k: parallel outputs at positions 2..L-2
  np.testing.assert_allclose(np.asarray(cached), np.asarray(par[:, 2:-1]), atol=1e-5,
                             rtol=1e-5)


def test_gated_check_matches_brute_force_in_cached_and_parallel_semantics():
  """gated_kl: exit where KL < eps and the relative state change < gate, in both engines."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(11))
  rng = jax.random.key(0)
  toks = jnp.asarray([[3, 17, 5, 9, 30, 2, 44, 8, 12]], jnp.int32)
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R), rng,
                       trace=True).traces
  eps, gate = safe_eps(list(np.asarray(tr['kl']))), safe_eps(list(np.asarray(tr['delta'])))
  cfg = config.ExitConfig(policy='gated_kl', eps=eps, max_loops=R, gate=gate)
  logits, depth, _ = jax.jit(lambda t: decoding.score_cached(mdl, t, 3, cfg, rng))(toks)
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


def test_generation_counts_every_rows_deepest_loops():
  """Lockstep generation's counts: each step runs all rows to the batch's deepest row."""
  mdl, rng, prompts, cfg = _two_rows()
  toks, depth = jax.jit(lambda p: decoding.generate(mdl, p, 6, cfg, rng))(prompts)
  toks_c, depth_c, counts = jax.jit(
      lambda p: decoding.generate(mdl, p, 6, cfg, rng, with_counts=True))(prompts)
  np.testing.assert_array_equal(np.asarray(toks_c), np.asarray(toks))
  np.testing.assert_array_equal(np.asarray(depth_c), np.asarray(depth))
  deepest = np.asarray(depth).max(0)
  assert np.any(np.asarray(depth).min(0) < deepest)  # some step carries a shallower row
  np.testing.assert_array_equal(np.asarray(counts.core_passes), deepest)
  np.testing.assert_array_equal(np.asarray(counts.depth)[..., 0].T, np.asarray(depth))
  uni = config.ExitConfig(policy='uniform', depth=3)
  _, d3, c3 = jax.jit(lambda p: decoding.generate(mdl, p, 6, uni, rng, with_counts=True))(prompts)
  assert np.all(np.asarray(d3) == 3) and np.all(np.asarray(c3.core_passes) == 3)
  assert np.all(np.asarray(c3.coda_passes) == 1) and np.all(np.asarray(c3.head_passes) == 1)


@pytest.mark.parametrize('over', ['positions', 'seeds'])
def test_sampling_draws_from_the_softmax(over):
  """pick at temperature t: each row's token is a draw from softmax(logits / t), over n
  positions of one request (seed) or over n requests (seeds) at one position."""
  v, n, t = 300, 20000, 0.7
  logits = np.full(v, -4.0, np.float32)
  logits[[0, 150, 299]] = [1.0, 0.5, 0.0]
  pos, seed = ((jnp.arange(n), jnp.full((n,), 7)) if over == 'positions'
               else (jnp.full((n,), 7), jnp.arange(n)))
  toks = jax.jit(lambda x: decoding.pick(x, pos, jax.random.key(3), t, seed))(
      jnp.broadcast_to(jnp.asarray(logits), (n, v)))
  freq = np.bincount(np.asarray(toks), minlength=v) / n
  p = np.exp(logits.astype(np.float64) / t)
  p /= p.sum()
  se = np.sqrt(p * (1 - p) / n)
  assert np.all(np.abs(freq - p) < 5 * se + 1e-9)
  assert abs(freq[[0, 150, 299]].sum() - p[[0, 150, 299]].sum()) < 5 * np.sqrt(0.25 / n)


def test_sampled_token_is_the_gumbel_max_of_its_seed_and_position():
  """pick's token is argmax(logits / t + g), g drawn from the key (rng, seed, position) of
  its row alone (numpy, row by row); half the rows share one prompt's logits and position."""
  v, b, t, rng = 64, 16, 0.8, jax.random.key(2)
  logits = np.random.default_rng(0).normal(size=(b, v)).astype(np.float32)
  logits[b // 2:] = logits[0]
  pos = np.asarray([3, 4, 5, 6] + [7] * (b - 4), np.int32)
  seed = np.arange(b, dtype=np.int32)[::-1] * 3 + 100
  got = jax.jit(lambda x, p, s: decoding.pick(x, p, rng, t, s))(logits, pos, seed)
  np.testing.assert_array_equal(np.asarray(got), gumbel_pick_np(logits, pos, rng, t, seed))
  assert len(set(np.asarray(got)[b // 2:].tolist())) > 1  # one prompt, its requests apart


def test_sampled_continuations_follow_the_request_seed():
  """Temperature 1 on a near-uniform model, ragged KL exits: one prompt samples apart in
  two rows with two seeds (and with none: seeds arange(B)) and alike with one seed; a
  request's continuation is the same alone and at another row of a larger batch."""
  mdl, rng, (a, other), cfg = _two_rows()
  gen = jax.jit(lambda p, s: decoding.generate(mdl, p, 6, cfg, rng, temperature=1.0,
                                               seed_B=s))
  prompts = jnp.stack([a, a, other])
  toks = np.asarray(gen(prompts, jnp.asarray([4, 9, 4]))[0][:, 4:])
  assert np.any(toks[0] != toks[1])  # one prompt, two seeds (agree: ~0.025 a token)
  twin = np.asarray(gen(prompts, jnp.asarray([9, 9, 2]))[0][:, 4:])
  np.testing.assert_array_equal(twin[0], twin[1])
  np.testing.assert_array_equal(twin[1], toks[1])
  for seed, row in ((9, 1), (4, 0)):
    np.testing.assert_array_equal(np.asarray(gen(a[None], jnp.asarray([seed]))[0][0, 4:]),
                                  toks[row])
  default = np.asarray(jax.jit(lambda p: decoding.generate(mdl, p, 6, cfg, rng,
                                                           temperature=1.0))(prompts)[0])
  np.testing.assert_array_equal(default, np.asarray(gen(prompts, jnp.arange(3))[0]))
  assert np.any(default[0, 4:] != default[1, 4:])


def test_forced_decoding_equals_cached_scoring_with_float64_nll():
  """Forced decoding: the given tokens, cached scoring's depths, and each token's NLL
  under the logits before it (float64 log-softmax of score_cached's logits)."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(11))
  rng = jax.random.key(0)
  toks = jax.random.randint(jax.random.key(3), (2, 10), 0, mdl.cfg.vocab_size)
  cfg = median_kl_cfg(mdl, toks[:, :4], rng, R)
  out, depth, nll = jax.jit(lambda t: decoding.generate(
      mdl, t[:, :4], 6, cfg, rng, forced_BxN=t[:, 4:]))(toks)
  logits, depth_tf, _ = jax.jit(lambda t: decoding.score_cached(mdl, t, 4, cfg, rng))(toks)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(toks))
  np.testing.assert_array_equal(np.asarray(depth), np.asarray(depth_tf))
  assert len(np.unique(np.asarray(depth))) > 1  # ragged exits
  np.testing.assert_allclose(np.asarray(nll), nll_np(logits, toks[:, 4:]), rtol=1e-5, atol=1e-5)


def test_prefill_cfg_prefills_the_prompt_with_its_own_depth():
  """generate(cfg, prefill_cfg=...): the prompt in parallel semantics at prefill_cfg's depth,
  every new token decoded at cfg's; against a Python loop of decode_step after prefill
  (float64 NLL), and unlike the prompt prefilled at cfg's depth."""
  mdl, rng, prompts, _ = _two_rows()
  deep, shallow = (config.ExitConfig(policy='uniform', depth=d) for d in (6, 2))
  forced = jax.random.randint(jax.random.key(4), (2, 5), 0, mdl.cfg.vocab_size)
  gen = lambda pc: jax.jit(lambda p, f: decoding.generate(mdl, p, 5, shallow, rng,
                                                          forced_BxN=f, prefill_cfg=pc))
  _, depth, nll = gen(deep)(prompts, forced)
  cache, logits, _ = decoding.prefill(mdl, prompts, deep, rng, 9)
  init = decoding.initial_states(mdl, rng, 9)
  ref = []
  for j in range(5):
    ref.append(nll_np(logits[:, None], np.asarray(forced)[:, j:j + 1])[:, 0])
    logits, cache, d = decoding.decode_step(mdl, cache, forced[:, j], 4 + j, shallow, rng,
                                            init_table=init)
    assert np.all(np.asarray(d) == 2) and np.all(np.asarray(depth)[:, j] == 2)
  np.testing.assert_allclose(np.asarray(nll), np.stack(ref, 1), rtol=1e-5, atol=1e-5)
  _, _, nll_shallow = gen(shallow)(prompts, forced)
  assert np.abs(np.asarray(nll_shallow) - np.asarray(nll)).max() > 1e-3


def test_forcing_the_greedy_tokens_reproduces_greedy_generation():
  mdl, rng, prompts, cfg = _two_rows()
  toks, depth = jax.jit(lambda p: decoding.generate(mdl, p, 6, cfg, rng))(prompts)
  out, d2, nll = jax.jit(lambda p, f: decoding.generate(mdl, p, 6, cfg, rng, forced_BxN=f))(
      prompts, toks[:, 4:])
  np.testing.assert_array_equal(np.asarray(d2), np.asarray(depth))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(toks))
  assert np.all(np.isfinite(np.asarray(nll))) and np.all(np.asarray(nll) >= 0)


def test_generation_arguments_are_checked_before_any_work():
  """Silent wrong answers before: NaN temperature (every token 0), short forced or depth
  rows (the last column reused), a position past the cache (the write clamped), a cache
  shorter than the prompt, a prompt_len past the sequence."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(0))
  rng, p = jax.random.key(0), jnp.array([[1, 2, 3], [4, 5, 6]])
  cfg = config.ExitConfig(eps=1e-2, max_loops=3)
  for kw, words in [(dict(temperature=float('nan')), 'temperature=nan'),
                    (dict(temperature=-1.0), 'temperature=-1'),
                    (dict(forced_BxN=jnp.ones((2, 2), jnp.int32)), r'forced_BxN .*\(2, 3\)'),
                    (dict(depth_BxN=jnp.ones((2, 4), jnp.int32)), r'depth_BxN .*\(2, 3\)'),
                    (dict(seed_B=jnp.ones((3,), jnp.int32)), r'seed_B .*\(2,\)'),
                    (dict(seed_B=jnp.ones((2,))), r'integer seed per row')]:
    with pytest.raises(ValueError, match=words):
      decoding.generate(mdl, p, 3, cfg, rng, **kw)
  with pytest.raises(ValueError, match='ids must lie in'):
    decoding.generate(mdl, p.at[0, 1].set(48), 3, cfg, rng)
  with pytest.raises(ValueError, match='exceed model.max_len=64'):
    decoding.generate(mdl, p, 62, cfg, rng)
  with pytest.raises(ValueError, match='n_new=-1'):
    decoding.generate(mdl, p, -1, cfg, rng)
  with pytest.raises(ValueError, match='cannot hold the 3-token prompt'):
    decoding.prefill(mdl, p, cfg, rng, 2)
  with pytest.raises(ValueError, match=r'prompt_len=3 must be in \[1, 3\)'):
    decoding.score_cached(mdl, p, 3, cfg, rng)
  cache = decoding.init_cache(mdl, 2, 8)
  with pytest.raises(ValueError, match='pos=8 lies outside the cache of 8'):
    decoding.decode_step(mdl, cache, p[:, 0], 8, cfg, rng)
  with pytest.raises(config.ConfigError, match='max_loops=0'):
    decoding.decode_step(mdl, cache, p[:, 0], 0, config.ExitConfig(max_loops=0), rng)


def _gated_setup(kl_percentile, delta_percentile):
  """(model, loops r, new tokens n, rng, prompts [2, 4], gated_kl config) with eps and gate
  at percentiles of the model's own per-loop KL and state change at uniform depth r."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(0))
  r, n, rng = 7, 6, jax.random.key(0)
  p = jnp.asarray([[3, 17, 5, 9], [40, 2, 31, 0]], jnp.int32)
  tr = inference.score(mdl, p, config.ExitConfig(policy='uniform', depth=r), rng,
                       trace=True).traces
  cfg = config.ExitConfig(policy='gated_kl',
                          eps=float(np.percentile(tr['kl'][1:], kl_percentile)),
                          gate=float(np.percentile(tr['delta'][1:], delta_percentile)),
                          max_loops=r)
  return mdl, r, n, rng, p, cfg


def test_gated_check_keeps_its_gate_on_every_decode_path():
  """gated_kl through decode_step's general path (given depths, trace) honours exit.gate as
  its fast path does: a no-op depth cap changes no depth."""
  mdl, r, n, rng, p, cfg = _gated_setup(70, 70)
  _, fast = decoding.generate(mdl, p, n, cfg, rng)
  _, capped = decoding.generate(mdl, p, n, cfg, rng, depth_BxN=jnp.full((2, n), r, jnp.int32))
  assert np.asarray(fast).min() < r  # tokens exit
  np.testing.assert_array_equal(np.asarray(capped), np.asarray(fast))


def test_cached_kl_never_exits_at_loop_one():
  """decode_step's paired KL check has no p_0 at loop 1: with min_loops = 1 and an eps
  every KL is below, every decoded token runs exactly 2 loops (as parallel scoring)."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(5))
  rng = jax.random.key(0)
  cfg = config.ExitConfig(policy='kl', eps=1e9, min_loops=1, max_loops=6)
  toks = jnp.asarray([[3, 17, 5, 9, 1, 2]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(inference.score(mdl, toks, cfg, rng).depth), 2)
  _, depth, _ = decoding.score_cached(mdl, toks, 2, cfg, rng)
  np.testing.assert_array_equal(np.asarray(depth), 2)


def test_cached_kl_direction_matches_brute_force():
  """The cached fast path's statistic is KL(p_i || p_{i-1}), not the reverse: at an eps
  between the two directions of some token's loop, depths equal the float64 brute force."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(11))
  rng = jax.random.key(0)
  toks = jnp.asarray([[3, 17, 5, 9, 1, 2, 30, 7]], jnp.int32)
  r = 8
  uni = config.ExitConfig(policy='uniform', depth=r)
  cache, _, _ = decoding.prefill(mdl, toks[:, :4], uni, rng, toks.shape[1])
  kl, rkl = [], []
  for t in range(4, toks.shape[1]):
    *_, tr = decoding.decode_step(mdl, cache, toks[:, t], t, uni, rng, trace=True)
    cache = decoding.decode_step(mdl, cache, toks[:, t], t, uni, rng)[1]
    kl.append(np.asarray(tr['kl'])[1:, 0, 0])
    rkl.append(np.asarray(tr['rkl'])[1:, 0, 0])
  kl, rkl = np.concatenate(kl), np.concatenate(rkl)
  ratio = np.abs(np.log(kl / rkl))
  assert ratio.max() > 0.1  # the two directions differ at some loop
  for j in np.argsort(ratio)[::-1][:6]:  # eps between them, where they differ the most
    eps = float(np.sqrt(kl[j] * rkl[j]))
    _, ref_depth = brute_cached(mdl, toks, 4, eps, r, rng)
    cfg = config.ExitConfig(policy='kl', eps=eps, max_loops=r)
    _, depth, _ = decoding.score_cached(mdl, toks, 4, cfg, rng)
    np.testing.assert_array_equal(np.asarray(depth), ref_depth)


def test_generation_counts_two_readouts_per_check_of_active_rows():
  """The paired KL check reads loops i-1 and i (two readouts, two head products) at every
  loop 2..d of a token that exits at d, the check's logits are the output (no final
  readout), and the batch counts follow each step's deepest row."""
  mdl, rng, prompts, cfg = _two_rows()
  _, depth, counts = jax.jit(
      lambda p: decoding.generate(mdl, p, 6, cfg, rng, with_counts=True))(prompts)
  depth = np.asarray(depth)  # [B, N]
  assert np.any(depth.min(0) < depth.max(0)) and depth.min() >= 2  # ragged, no exit at 1
  for name in ('coda', 'head'):
    np.testing.assert_array_equal(np.asarray(getattr(counts, name))[..., 0].T, 2 * (depth - 1),
                                  err_msg=name)
  for name in ('coda_passes', 'head_passes'):
    np.testing.assert_array_equal(np.asarray(getattr(counts, name)), 2 * (depth.max(0) - 1),
                                  err_msg=name)


def test_given_depths_stop_the_kl_policy():
  """depth_BxN on a KL policy whose check never fires (eps 0): each token runs exactly its
  given depth, with the NLL of uniform decoding capped at the same given depths."""
  mdl, rng, prompts, _ = _two_rows()
  n = 5
  given = jnp.asarray(np.random.default_rng(1).integers(1, 7, (2, n)), jnp.int32)
  forced = jax.random.randint(jax.random.key(4), (2, n), 0, mdl.cfg.vocab_size)
  gen = lambda cfg: jax.jit(lambda p, f, g: decoding.generate(
      mdl, p, n, cfg, rng, forced_BxN=f, depth_BxN=g, prefill_cfg=config.ExitConfig(
          policy='uniform', depth=6)))(prompts, forced, given)
  _, ref_depth, ref_nll = gen(config.ExitConfig(policy='uniform', depth=6))
  np.testing.assert_array_equal(np.asarray(ref_depth), np.asarray(given))
  _, depth, nll = gen(config.ExitConfig(policy='kl', eps=0.0, max_loops=6))
  np.testing.assert_array_equal(np.asarray(depth), np.asarray(given))
  np.testing.assert_allclose(np.asarray(nll), np.asarray(ref_nll), rtol=1e-5, atol=1e-5)


def test_pick_refuses_an_infinite_temperature():
  """temperature=inf would sample uniformly (logits / inf = 0): refused like NaN."""
  logits, pos = jnp.zeros((2, 5)), jnp.arange(2)
  for t in (float('inf'), -float('inf')):
    with pytest.raises(ValueError, match='must be a finite number >= 0'):
      decoding.pick(logits, pos, jax.random.key(0), t)
  assert decoding.pick(logits.at[:, 3].set(1.0), pos, jax.random.key(0), 0.0).tolist() == [3, 3]


def test_batched_gated_generation_equals_per_row_generation():
  """gated_kl in a batch: a row whose state still changes (delta >= gate) does not exit on
  a check that another row's gate opened; each row equals its batch-1 generation."""
  mdl, r, n, rng, p, cfg = _gated_setup(80, 30)
  gen = jax.jit(lambda x: decoding.generate(mdl, x, n, cfg, rng))
  toks, depth = gen(p)
  assert np.any(np.asarray(depth) < r)  # tokens exit
  for row in range(2):
    t1, d1 = gen(p[row:row + 1])
    np.testing.assert_array_equal(np.asarray(depth[row:row + 1]), np.asarray(d1))
    np.testing.assert_array_equal(np.asarray(toks[row:row + 1]), np.asarray(t1))
