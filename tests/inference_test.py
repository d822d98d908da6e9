"""Early-exit scoring (parallel semantics) against brute-force per-token references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import (attend_list, exit_model_config, jaxpr_dots, kl_np, median_kl_cfg,
                      safe_eps)
from elastic_depth import config, decoding, inference, losses, model as model_lib
from elastic_depth.kernels import kl_halting

B, L, R = 2, 10, 10


@pytest.fixture(scope='module')
def setup():
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(3))
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 48, (B, L)), jnp.int32)
  return mdl, toks


def brute_parallel(mdl, toks, eps, min_loops, max_loops, rng, stat='kl', patience=1,
                   growth=1.0, check_every=1, exit_mask=None, active0=None):
  """Parallel semantics with plain Python loops over loops, blocks and tokens.

  stat 'kl' exits where KL(p_i || p_{i-1}) < eps; 'rkl' where KL(p_{i-1} || p_i) < eps;
  'delta' where the relative state change
  (float64) has been below eps at `patience` consecutive loops from loop 2; at loop i the
  threshold is eps * growth^(i - 2). Exits are decided at loops max(min_loops, 2) +
  k check_every only, and only where exit_mask (None: everywhere); tokens not in active0
  (padding) never run: their state stays initial and they offer zero keys/values.
  Returns the logits, depths and the per-loop statistic of the active tokens.
  """
  pos = model_lib.positions(toks)
  e, _ = mdl.encode(toks, pos)
  s = mdl.initial_state(e, rng, pos)
  b, l = toks.shape
  depth = np.zeros((b, l), int)
  active = np.ones((b, l), bool) if active0 is None else np.array(active0, bool)
  g, kd = mdl.cfg.num_kv_heads, mdl.cfg.head_dim
  zero = jnp.zeros((b, 1, g, kd), s.dtype)  # what padding offers (the engines' kv0)
  frozen = [[(zero, zero)] * l for _ in mdl.core]  # per block, per token: (k, v) [B,1,G,K]
  h_prev = mdl.decode_state(s, pos)[0]
  kls, run = [], np.zeros((b, l), int)
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
          a = jnp.asarray(active[:, t])[:, None, None, None]  # exited rows: frozen kv
          k = jnp.where(a, k, frozen[j][t][0])
          v = jnp.where(a, v, frozen[j][t][1])
          own.append((k, v))
          return attend_list(ks, vs)(k, v)
        y, _ = block(x[:, t:t + 1], pos[:, t:t + 1], kv_fn)
        used.append(own[0])
        outs.append(y)
      for t in range(l):
        frozen[j][t] = used[t]
      x = jnp.concatenate(outs, axis=1)
    s_old, s = s, jnp.where(jnp.asarray(active)[..., None], x, s)
    depth += active
    h = mdl.decode_state(s, pos)[0]
    eps_i = eps * growth ** max(i - 2, 0)
    if stat in ('kl', 'rkl'):
      pair = (h, h_prev) if stat == 'kl' else (h_prev, h)
      kl = kl_np(*(x.reshape(b * l, -1) for x in pair), mdl.head_weight()).reshape(b, l)
      fire = kl < eps_i
    else:
      a, o = np.asarray(s, np.float64), np.asarray(s_old, np.float64)
      kl = np.linalg.norm(a - o, axis=-1) / np.linalg.norm(a, axis=-1)
      run = np.where(active, np.where((kl < eps_i) & (i >= 2), run + 1, 0), run)
      fire = run >= patience
    kls.append(np.where(active, kl, np.nan))
    if i >= max(min_loops, 2) and (i - min_loops) % check_every == 0:
      active &= ~(fire if exit_mask is None else fire & np.asarray(exit_mask))
    h_prev = h
  logits = mdl.logits(mdl.decode_state(s, pos)[0])
  return np.asarray(logits), depth, kls


def test_parallel_exit_matches_brute_force(setup):
  mdl, toks = setup
  rng = jax.random.key(7)
  _, _, kls = brute_parallel(mdl, toks, eps=-1.0, min_loops=1, max_loops=R, rng=rng)
  eps = safe_eps(kls)
  ref_logits, ref_depth, _ = brute_parallel(mdl, toks, eps, 1, R, rng)
  assert len(np.unique(ref_depth)) > 2, ref_depth  # the test exercises varied depths
  cfg = config.ExitConfig(policy='kl', eps=eps, min_loops=1, max_loops=R)
  out = jax.jit(lambda t: inference.score(mdl, t, cfg, rng))(toks)
  np.testing.assert_array_equal(np.asarray(out.depth), ref_depth)
  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)


def _direction_eps(mdl, toks, rng, tries=4):
  """An eps between KL(p_i || p_{i-1}) and KL(p_{i-1} || p_i) of some token of a full-depth
  run, as far (in log space) as can be from every reverse KL, at which the two directions
  exit some token at different loops; with the brute-force run and the statistics."""
  rkl = brute_parallel(mdl, toks, -1.0, 1, R, rng, stat='rkl')[2]
  kl = brute_parallel(mdl, toks, -1.0, 1, R, rng, stat='kl')[2]
  a, b = np.concatenate([x.ravel() for x in rkl[1:]]), np.concatenate([x.ravel() for x in kl[1:]])
  cands = np.sqrt(a * b)  # between the two directions of each token and loop
  margin = np.min(np.abs(np.log(cands)[:, None] - np.log(a)[None]), axis=1)
  for j in np.argsort(margin)[::-1][:tries]:
    ref = brute_parallel(mdl, toks, float(cands[j]), 1, R, rng, 'rkl')
    if np.any(ref[1] != brute_parallel(mdl, toks, float(cands[j]), 1, R, rng, 'kl')[1]):
      return float(cands[j]), ref, rkl
  raise AssertionError('no eps separates the two KL directions on this model')


@pytest.fixture(scope='module')
def direction(setup):
  return _direction_eps(*setup, jax.random.key(7))


def test_reverse_kl_statistic_is_the_reverse_direction(setup, direction):
  """The trace's rkl is KL(p_{i-1} || p_i) in float64, not the forward KL."""
  mdl, toks = setup
  rkl = direction[2]
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=R),
                       jax.random.key(7), trace=True).traces
  np.testing.assert_allclose(np.asarray(tr['rkl']), np.stack(rkl), rtol=1e-4, atol=1e-6)
  fwd = np.stack(brute_parallel(mdl, toks, -1.0, 1, R, jax.random.key(7))[2])
  assert np.max(np.abs(fwd - np.stack(rkl)) / np.stack(rkl)) > 1e-2  # directions differ


@pytest.mark.parametrize('engine', ['masked', 'compacted', 'pooled'])
def test_reverse_kl_matches_brute_force(setup, direction, engine):
  """reverse_kl's depths and logits, at an eps where the two directions exit differently."""
  mdl, toks = setup
  eps, (ref_logits, ref_depth, _), _ = direction
  assert len(np.unique(ref_depth)) > 1, ref_depth
  cfg = config.ExitConfig(policy='reverse_kl', eps=eps, max_loops=R, engine=engine,
                          compact_steps=2)
  out = jax.jit(lambda t: inference.score(mdl, t, cfg, jax.random.key(7)))(toks)
  np.testing.assert_array_equal(np.asarray(out.depth), ref_depth)
  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)


def test_reverse_kl_kernel_branch_matches_brute_force(setup, direction, monkeypatch):
  """The fused-kernel branch (the kernel's reference standing in for it on CPU) reads the
  reverse direction too."""
  mdl, toks = setup
  eps, (ref_logits, ref_depth, _), _ = direction
  monkeypatch.setattr(kl_halting, 'kernel_active', lambda use: use)
  monkeypatch.setattr(kl_halting, 'kl_halting_auto',
                      lambda h, hp, w, use_kernel=True: kl_halting.reference_kl_halting(h, hp, w))
  cfg = config.ExitConfig(policy='reverse_kl', eps=eps, max_loops=R, use_kernel=True)
  out = inference.score(mdl, toks, cfg, jax.random.key(7))
  np.testing.assert_array_equal(np.asarray(out.depth), ref_depth)
  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)


def test_state_change_patience_matches_brute_force(setup):
  """state_delta exits after `patience` consecutive loops below eps (masked and compacted)."""
  mdl, toks = setup
  rng = jax.random.key(7)
  eps = safe_eps(brute_parallel(mdl, toks, -1.0, 1, R, rng, stat='delta')[2])
  depths = {}
  for patience in (1, 2, 3):
    cfg = config.ExitConfig(policy='state_delta', eps=eps, min_loops=2, max_loops=R,
                            patience=patience)
    score = lambda engine: jax.jit(lambda t: inference.score(
        mdl, t, dataclasses.replace(cfg, engine=engine), rng))(toks)
    outs = {'masked': score('masked')}
    depths[patience] = np.asarray(outs['masked'].depth)
    if patience == 1:
      continue
    if patience == 2:  # the compacted engine carries the run through its buffers
      outs['compacted'] = score('compacted')
    ref_logits, ref_depth, _ = brute_parallel(mdl, toks, eps, 2, R, rng, 'delta', patience)
    for engine, out in outs.items():
      np.testing.assert_array_equal(np.asarray(out.depth), ref_depth, err_msg=engine)
      np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)
  assert len(np.unique(depths[2])) > 2, depths[2]  # varied depths
  with pytest.raises(ValueError, match='exit.patience=1'):
    inference.score(mdl, toks, cfg, rng, trace=True)
  assert depths[3].mean() > depths[2].mean() > depths[1].mean()  # patience waits longer


@pytest.mark.parametrize('policy,stat', [('kl', 'kl'), ('state_delta', 'delta')])
def test_eps_growth_matches_brute_force(setup, policy, stat):
  """exit.eps_growth: the threshold at loop i is eps * growth^(i - 2), in every engine."""
  mdl, toks = setup
  rng = jax.random.key(7)
  eps = safe_eps(brute_parallel(mdl, toks, -1.0, 1, R, rng, stat=stat)[2]) / 8
  ref_logits, ref_depth, _ = brute_parallel(mdl, toks, eps, 1, R, rng, stat, growth=2.0)
  flat_depth = brute_parallel(mdl, toks, eps, 1, R, rng, stat)[1]
  assert len(np.unique(ref_depth)) > 2 and ref_depth.mean() < flat_depth.mean()
  cfg = config.ExitConfig(policy=policy, eps=eps, max_loops=R, eps_growth=2.0,
                          compact_steps=2)
  for engine in ('masked', 'compacted', 'pooled'):
    out = jax.jit(lambda t, e=engine: inference.score(
        mdl, t, dataclasses.replace(cfg, engine=e), rng))(toks)
    np.testing.assert_array_equal(np.asarray(out.depth), ref_depth, err_msg=engine)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope='module')
def kl_eps(setup):
  """A KL threshold far from every statistic of a full-depth run (key 7)."""
  mdl, toks = setup
  return safe_eps(brute_parallel(mdl, toks, -1.0, 1, R, jax.random.key(7))[2])


@pytest.mark.parametrize('engine,stat', [('masked', 'kl'), ('compacted', 'kl'),
                                         ('masked', 'delta')])
def test_check_every_and_exit_mask_match_brute_force(setup, kl_eps, engine, stat):
  """exit.check_every=2 (checks at loops 3, 5, ... from min_loops 1) and an exit mask (the
  other tokens run max_loops) against the brute force (policies kl and state_delta)."""
  mdl, toks = setup
  rng = jax.random.key(7)
  eps = kl_eps if stat == 'kl' else safe_eps(
      brute_parallel(mdl, toks, -1.0, 1, R, rng, stat='delta')[2])
  mask_BxL = np.random.default_rng(3).random((B, L)) < 0.6
  ref_logits, ref_depth, _ = brute_parallel(mdl, toks, eps, 1, R, rng, stat, check_every=2,
                                            exit_mask=mask_BxL)
  assert np.all(ref_depth[~mask_BxL] == R) and len(np.unique(ref_depth[mask_BxL])) > 1
  assert np.all(ref_depth[ref_depth < R] % 2 == 1), ref_depth  # exits at check loops only
  cfg = config.ExitConfig(policy={'kl': 'kl', 'delta': 'state_delta'}[stat], eps=eps,
                          min_loops=1, max_loops=R, check_every=2, engine=engine,
                          compact_steps=2)
  out = jax.jit(lambda t, m: inference.score(mdl, t, cfg, rng, exit_mask_BxL=m))(
      toks, jnp.asarray(mask_BxL))
  np.testing.assert_array_equal(np.asarray(out.depth), ref_depth)
  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('engine', ['masked', 'compacted'])
def test_padding_starts_inactive_and_matches_brute_force(setup, kl_eps, engine):
  """active_BxL: left padding (row 0) and right padding (row 1) run no loop, keep their
  initial states and offer zero core keys/values; the other tokens' depths and logits
  equal the brute force's."""
  mdl, toks = setup
  rng = jax.random.key(7)
  active_BxL = np.ones((B, L), bool)
  active_BxL[0, :3] = False
  active_BxL[1, -2:] = False
  ref_logits, ref_depth, _ = brute_parallel(mdl, toks, kl_eps, 1, R, rng, active0=active_BxL)
  assert np.all(ref_depth[~active_BxL] == 0) and len(np.unique(ref_depth[active_BxL])) > 2
  make = {'masked': inference.exit_loop, 'compacted': inference.compact_exit_loop}[engine]
  kw = {} if engine == 'masked' else dict(steps=2)
  loop = make(config.ExitConfig(policy='kl', eps=kl_eps, max_loops=R),
              active_BxL=jnp.asarray(active_BxL), **kw)
  out = jax.jit(lambda t: mdl.forward(t, rng, loop))(toks)
  np.testing.assert_array_equal(np.asarray(out.aux.depth), ref_depth)
  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)
  pos = model_lib.positions(toks)
  s0 = mdl.initial_state(mdl.encode(toks, pos)[0], rng, pos)
  np.testing.assert_allclose(np.asarray(out.state)[~active_BxL], np.asarray(s0)[~active_BxL],
                             atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize('n_coda,pad', [(1, 4), (2, 0)])
def test_compacted_equals_masked_at_every_threshold(setup, n_coda, pad):
  """At every eps between two of the brute force's per-loop KLs (0.2% apart or more), the
  compacted engine exits every token where the masked one does: with left padding (its
  compacted coda reads the padding's coda keys/values of their initial states, as the
  masked engine's full readout does), and with two coda blocks (its full readout reads
  the frozen states of the tokens that exited inside a phase)."""
  mdl, toks = setup
  if n_coda != 1:
    mdl = model_lib.LoopedLM(dataclasses.replace(exit_model_config(), n_coda=n_coda),
                             nnx.Rngs(3))
  rng = jax.random.key(7)
  active_BxL = np.ones((B, L), bool)
  active_BxL[:, :pad] = False
  cfg = config.ExitConfig(policy='kl', eps=0.0, max_loops=R)
  run = lambda make, **kw: jax.jit(lambda t, e: mdl.forward(t, rng, make(
      dataclasses.replace(cfg, eps=e), active_BxL=jnp.asarray(active_BxL), **kw)).aux.depth)
  masked, compacted = run(inference.exit_loop), run(inference.compact_exit_loop, steps=2)
  kls = brute_parallel(mdl, toks, -1.0, 1, R, rng, active0=active_BxL)[2]
  v = np.sort(np.concatenate([k[np.isfinite(k)] for k in kls[1:]]))
  mids = [np.sqrt(a * b) for a, b in zip(v[:-1], v[1:]) if b > a * 1.002]
  assert len(mids) > 20
  for eps in mids[::max(len(mids) // 24, 1)]:
    want = np.asarray(masked(toks, jnp.float32(eps)))
    np.testing.assert_array_equal(np.asarray(compacted(toks, jnp.float32(eps))), want,
                                  err_msg=f'eps={eps}')


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
    s = mdl.core_step(s, mdl.inject(e), pos)[0]
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


# ----------------------------------------------------------------------------
# One semantics: a token's initial state depends on (seed, position, its prefix) only.


def test_parallel_scoring_batched_equals_per_row_and_prefix_equals_whole(setup):
  mdl, toks = setup
  rng = jax.random.key(4)
  cfg = median_kl_cfg(mdl, toks, rng, R)
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


def test_score_refuses_ids_out_of_the_vocabulary_and_a_nan_eps():
  """An id >= V made every logit of its row NaN (and no token exited): named instead."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(0))
  toks = jnp.array([[1, 2, 48, 4]])
  with pytest.raises(ValueError,
                     match=r'ids must lie in \[0, 48\) \(model.vocab_size\), got 1\.\.48'):
    inference.score(mdl, toks, config.ExitConfig(max_loops=3), jax.random.key(0))
  with pytest.raises(config.ConfigError, match='exit.eps=nan'):
    inference.score(mdl, toks.at[0, 2].set(3), config.ExitConfig(eps=float('nan')),
                    jax.random.key(0))


def _head_dots(jaxpr, v: int, d: int) -> list:
  """Operand dtypes of every dot in a jaxpr (sub-jaxprs included) with a [V, D] operand."""
  return [tuple(str(x.aval.dtype) for x in e.invars) for e in jaxpr_dots(jaxpr)
          if {(v, d), (d, v)} & {tuple(x.aval.shape) for x in e.invars}]


@pytest.mark.parametrize('policy', ['kl', 'reverse_kl', 'confidence'])
def test_bf16_checks_multiply_the_head_in_the_compute_dtype(policy):
  """Under bf16 every head product (the checks' and the output's) is bf16 x bf16 with fp32
  accumulation, so the exit statistic reads the same p_i as the output logits."""
  mcfg = dataclasses.replace(exit_model_config(), dtype='bfloat16')
  mdl = model_lib.LoopedLM(mcfg, nnx.Rngs(3))
  toks = jnp.zeros((B, L), jnp.int32)
  cfg = config.ExitConfig(policy=policy, eps=1e-3, max_loops=4)
  for engine in ('masked', 'compacted'):
    jpr = jax.make_jaxpr(lambda t, e=engine: inference.score(
        mdl, t, dataclasses.replace(cfg, engine=e), jax.random.key(0)))(toks).jaxpr
    dots = _head_dots(jpr, mcfg.vocab_size, mcfg.d_model)
    assert len(dots) >= 2, dots  # the checks' products and the final readout's
    assert all(dt == ('bfloat16', 'bfloat16') for dt in dots), (engine, dots)
  cache = decoding.init_cache(mdl, B, 16)  # decode_step's general check path (traced)
  jpr = jax.make_jaxpr(lambda t: decoding.decode_step(
      mdl, cache, t, 3, cfg, jax.random.key(0), trace=True))(toks[:, 0]).jaxpr
  dots = _head_dots(jpr, mcfg.vocab_size, mcfg.d_model)
  assert len(dots) >= 2 and all(dt == ('bfloat16', 'bfloat16') for dt in dots), dots


def test_forward_kl_kernel_branch_matches_brute_force(monkeypatch):
  """the fused-kernel branch of policy kl (the reference standing in for the kernel on
  CPU) reads KL(p_i || p_{i-1}): at an eps separating the directions, depths equal the
  brute force's forward-KL run."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(3))
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 10)), jnp.int32)
  rng = jax.random.key(7)
  eps, _, _ = _direction_eps(mdl, toks, rng)
  ref_logits, ref_depth, _ = brute_parallel(mdl, toks, eps, 1, R, rng, 'kl')
  monkeypatch.setattr(kl_halting, 'kernel_active', lambda use: use)
  monkeypatch.setattr(kl_halting, 'kl_halting_auto',
                      lambda h, hp, w, use_kernel=True: kl_halting.reference_kl_halting(h, hp, w))
  out = inference.score(mdl, toks, config.ExitConfig(policy='kl', eps=eps, max_loops=R,
                                                     use_kernel=True), rng)
  np.testing.assert_array_equal(np.asarray(out.depth), ref_depth)
  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-5, rtol=1e-5)
