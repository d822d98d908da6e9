"""Tests for elastic_depth.recurrence: bucketed/fixed scans on the real core, early exit on toys."""

import dataclasses
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from elastic_depth import config as config_lib
from elastic_depth import model as model_lib
from elastic_depth import recurrence

BUCKETS = (1, 2, 3, 5)
BACKPROP_DEPTH = 2

# ----------------------------------------------------------------------------
# Bucketed / fixed depth on the model's core step.


@pytest.fixture(scope='module')
def core(model_cfg):
  """(graphdef, params, loss_of(params, run)) on a tiny model; run(step_fn, s0) -> s."""
  # A single-block core keeps compile times down; the loop structure is what matters.
  mdl = model_lib.LoopedLM(dataclasses.replace(model_cfg, n_core=1, n_coda=0), nnx.Rngs(0))
  graphdef, state = nnx.split(mdl, nnx.Param)
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, model_cfg.vocab_size, (2, 8)), jnp.int32)
  proj = jnp.asarray(rng.normal(size=(2, 8, model_cfg.d_model)), jnp.float32)

  def loss_of(params, run):
    mdl = model_lib.bind(graphdef, params)
    pos = model_lib.positions(tokens)
    e, _ = mdl.encode(tokens, pos)
    s0 = mdl.initial_state(e, jax.random.key(1), pos)
    s = run(lambda s: mdl.core_step(s, mdl.inject(e), pos)[0], s0)
    return jnp.sum(s * proj)  # a random linear read-out of the final state

  return graphdef, params, loss_of


@pytest.fixture(scope='module')
def bucketed_vg(core):
  """Jitted (params, idx) -> (value, grad) through bucketed_depth; idx is traced."""
  _, _, loss_of = core

  def make(backprop_depth):
    def f(params, idx):
      run = lambda step, s0: recurrence.bucketed_depth(
          step, s0, idx, BUCKETS, backprop_depth=backprop_depth)
      return jax.value_and_grad(loss_of)(params, run)
    return jax.jit(f)
  return {0: make(0), BACKPROP_DEPTH: make(BACKPROP_DEPTH)}


@pytest.fixture(scope='module')
def unrolled_vg(core):
  """Reference: a Python loop of n steps, the first `frozen` under stop_gradient.

  Run op by op (not jitted): compiling unrolled loops costs far more than running them.
  """
  _, _, loss_of = core

  def f(params, n, frozen):
    def run(step, s):
      for _ in range(frozen):
        s = step(s)
      s = jax.lax.stop_gradient(s) if frozen else s
      for _ in range(n - frozen):
        s = step(s)
      return s
    return jax.value_and_grad(loss_of)(params, run)
  return f


def assert_tree_close(a, b, tol=1e-5):
  """Leaf-wise closeness; the absolute tolerance is relative to each leaf's scale."""
  chex.assert_trees_all_equal_structs(a, b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    y = np.asarray(y)
    np.testing.assert_allclose(np.asarray(x), y, rtol=tol,
                               atol=tol * max(float(np.abs(y).max()), 1e-30),
                               err_msg=jax.tree_util.keystr(path))


def max_tree_diff(a, b):
  chex.assert_trees_all_equal_structs(a, b)
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize('idx', range(len(BUCKETS)))
def test_bucketed_depth_equals_unrolled_loop(core, bucketed_vg, unrolled_vg, idx):
  _, params, _ = core
  val, grad = bucketed_vg[0](params, jnp.int32(idx))
  want_val, want_grad = unrolled_vg(params, BUCKETS[idx], 0)
  np.testing.assert_allclose(float(val), float(want_val), rtol=1e-5)
  assert_tree_close(grad, want_grad)


@pytest.mark.parametrize('idx', range(len(BUCKETS)))
def test_backprop_depth_truncates_gradient(core, bucketed_vg, unrolled_vg, idx):
  _, params, _ = core
  b = BUCKETS[idx]
  val, grad = bucketed_vg[BACKPROP_DEPTH](params, jnp.int32(idx))
  frozen = max(b - BACKPROP_DEPTH, 0)
  want_val, want_grad = unrolled_vg(params, b, frozen)
  full_val, full_grad = unrolled_vg(params, b, 0)
  np.testing.assert_allclose(float(val), float(want_val), rtol=1e-5)
  np.testing.assert_allclose(float(val), float(full_val), rtol=1e-5)  # forward unchanged
  assert_tree_close(grad, want_grad)
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(full_grad))
  if b > BACKPROP_DEPTH:
    assert max_tree_diff(grad, full_grad) > 1e-3 * scale
  else:
    assert_tree_close(grad, full_grad)


def test_bucketed_depth_compiles_once_for_every_bucket(core, bucketed_vg):
  _, params, _ = core
  f = bucketed_vg[0]
  vals = [float(f(params, jnp.int32(i))[0]) for i in range(len(BUCKETS))]
  assert len(set(vals)) == len(BUCKETS)  # every branch really ran a different depth
  assert f._cache_size() == 1  # pylint: disable=protected-access


@pytest.mark.parametrize('remat', [True, False])
def test_scan_unroll_equals_the_rolled_scan(core, unrolled_vg, remat):
  """depth.unroll: 2 loops per scan iteration (5 loops: a remainder) give the same value
  and gradient as the Python loop."""
  _, params, loss_of = core
  f = jax.jit(lambda p, i: jax.value_and_grad(loss_of)(p, lambda st, s0: (
      recurrence.bucketed_depth(st, s0, i, (2, 5), remat=remat, unroll=2))))
  for idx, n in enumerate((2, 5)):
    val, grad = f(params, jnp.int32(idx))
    want_val, want_grad = unrolled_vg(params, n, 0)
    np.testing.assert_allclose(float(val), float(want_val), rtol=1e-5)
    assert_tree_close(grad, want_grad)


def test_single_bucket_skips_switch(core, unrolled_vg):
  _, params, loss_of = core
  f = jax.jit(lambda p, i: loss_of(p, lambda st, s0: recurrence.bucketed_depth(
      st, s0, i, (3,))))
  np.testing.assert_allclose(float(f(params, jnp.int32(0))),
                             float(unrolled_vg(params, 3, 0)[0]), rtol=1e-5)


@pytest.mark.parametrize('policy', list(config_lib.RematPolicy))
def test_fixed_depth_remat_matches_plain(core, unrolled_vg, policy):
  _, params, loss_of = core
  vg = lambda remat: jax.jit(jax.value_and_grad(lambda p: loss_of(
      p, lambda st, s0: recurrence.fixed_depth(
          st, s0, 3, remat=remat, policy=model_lib.REMAT_POLICIES[policy]))))(params)
  (v1, g1), (v2, g2) = vg(True), vg(False)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-6)
  assert_tree_close(g1, g2)
  want_v, want_g = unrolled_vg(params, 3, 0)
  np.testing.assert_allclose(float(v1), float(want_v), rtol=1e-5)
  assert_tree_close(g1, want_g)


def test_fixed_and_dynamic_depth_toy():
  a = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)) * 0.5, jnp.float32)
  step = lambda s: jnp.tanh(s @ a + 0.1)
  s0 = jnp.linspace(-1.0, 1.0, 4)
  for n in (0, 1, 4):
    want = np.asarray(s0, np.float64)
    for _ in range(n):
      want = np.tanh(want @ np.asarray(a, np.float64) + 0.1)
    np.testing.assert_allclose(np.asarray(recurrence.fixed_depth(step, s0, n)), want,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(recurrence.dynamic_depth(step, s0, jnp.int32(n))), want, rtol=1e-5,
        atol=1e-6)


# ----------------------------------------------------------------------------
# Early exit with toy closures (no model).
#
# Each token's state grows by 1 per loop until its first channel (a counter)
# reaches a per-token convergence step c; from then on the state no longer
# changes. The criterion "state did not change" thus first fires at loop c + 1.
# All values are small integers, so float32 arithmetic is exact and the frozen
# states can be compared bitwise.

B, L, D = 3, 5, 4


def toy_problem(seed, c_max=6):
  rng = np.random.default_rng(seed)
  conv = rng.integers(0, c_max + 1, (B, L)).astype(np.float32)
  s0 = rng.integers(-50, 50, (B, L, D)).astype(np.float32)
  s0[..., 0] = 0.0
  return conv, s0


def toy_closures(conv, want_fn=None):
  conv = jnp.asarray(conv)

  def masked_step(s, kv, active):
    grow = (s[..., :1] < conv[..., None]).astype(s.dtype)
    return s + grow, kv + active.astype(jnp.int32)  # kv counts the loops run as active

  def check(s_new, s_old, carry, i, active):
    if want_fn is None:
      want = jnp.all(s_new == s_old, axis=-1)
    else:
      want = want_fn(s_new, i)
    stats = {'counter': s_new[..., 0], 'loop': jnp.full((B, L), i), 'active': active}
    return want, carry + 1, stats

  return masked_step, check


def reference_early_exit(conv, s0, want_fn, min_loops, max_loops, check_every, active0):
  """Brute-force per-token simulation of the documented semantics; want_fn(new, old, i,
  (b, t)) says whether token (b, t) wants to exit at loop i."""
  depth = np.zeros((B, L), np.int64)
  final = s0.copy()
  for bi, ti in itertools.product(range(B), range(L)):
    if not active0[bi, ti]:
      continue
    s = s0[bi, ti].copy()
    for i in range(1, max_loops + 1):
      new = s + (1.0 if s[0] < conv[bi, ti] else 0.0)
      depth[bi, ti] = i
      want = want_fn(new, s, i, (bi, ti))
      s = new
      consult = i >= min_loops and (i - min_loops) % check_every == 0
      if consult and want:
        break
    final[bi, ti] = s
  return depth, final


@pytest.mark.parametrize('min_loops,max_loops,check_every', [
    (1, 10, 1), (3, 10, 1), (1, 10, 3), (2, 9, 2), (2, 4, 1), (1, 1, 1)])
def test_early_exit_matches_brute_force(min_loops, max_loops, check_every):
  conv, s0 = toy_problem(min_loops * 100 + max_loops * 10 + check_every)
  active0 = np.ones((B, L), bool)
  active0[0, -2:] = False  # e.g. padding
  masked_step, check = toy_closures(conv)
  out = jax.jit(lambda s, kv: recurrence.early_exit(
      masked_step, check, s, kv, jnp.int32(0), min_loops=min_loops, max_loops=max_loops,
      check_every=check_every, active0=jnp.asarray(active0), trace=True,
      return_check=True))(
          jnp.asarray(s0), jnp.zeros((B, L), jnp.int32))
  want_depth, want_state = reference_early_exit(
      conv, s0, lambda new, old, i, _: np.all(new == old), min_loops, max_loops, check_every,
      active0)
  np.testing.assert_array_equal(np.asarray(out.depth), want_depth)
  np.testing.assert_array_equal(np.asarray(out.state), want_state)  # bitwise
  np.testing.assert_array_equal(np.asarray(out.kv), want_depth)  # active mask seen by step
  assert int(out.loops) == want_depth.max()
  assert int(out.check) == want_depth.max()  # check_fn's carry went through every loop
  assert want_depth.max() <= max_loops
  # Traces: row i-1 holds the counters after loop i; rows past the last loop are zeros.
  traces = np.asarray(out.traces['counter'])
  assert traces.shape == (max_loops, B, L)
  counters = np.zeros((B, L), np.float32)
  for i in range(1, int(out.loops) + 1):
    counters = np.where((want_depth >= i) & (counters < conv), counters + 1, counters)
    np.testing.assert_array_equal(traces[i - 1], counters)
    # check_fn sees the tokens that ran loop i as active
    np.testing.assert_array_equal(np.asarray(out.traces['active'])[i - 1], want_depth >= i)
  np.testing.assert_array_equal(np.asarray(out.traces['loop'])[int(out.loops):], 0)


def test_early_exit_really_exits_early():
  """The brute-force comparison is not vacuous: depths vary across tokens."""
  conv, s0 = toy_problem(0)
  masked_step, check = toy_closures(conv)
  out = recurrence.early_exit(masked_step, check, jnp.asarray(s0),
                              jnp.zeros((B, L), jnp.int32), jnp.int32(0), min_loops=1,
                              max_loops=20)
  np.testing.assert_array_equal(np.asarray(out.depth), conv.astype(np.int64) + 1)
  assert len(np.unique(np.asarray(out.depth))) > 2
  np.testing.assert_array_equal(np.asarray(out.traces['counter']).shape, (0, B, L))
  assert out.check is None  # return_check=False


@pytest.mark.parametrize('check_every', [1, 3])
def test_early_exit_never_and_always(check_every):
  conv, s0 = toy_problem(1)
  never = toy_closures(conv, lambda s, i: jnp.zeros((B, L), bool))
  always = toy_closures(conv, lambda s, i: jnp.ones((B, L), bool))
  args = (jnp.asarray(s0), jnp.zeros((B, L), jnp.int32), jnp.int32(0))
  out = recurrence.early_exit(*never, *args, min_loops=2, max_loops=7,
                              check_every=check_every)
  np.testing.assert_array_equal(np.asarray(out.depth), 7)
  assert int(out.loops) == 7
  out = recurrence.early_exit(*always, *args, min_loops=4, max_loops=9,
                              check_every=check_every)
  np.testing.assert_array_equal(np.asarray(out.depth), 4)
  assert int(out.loops) == 4
  # the state of every token ran exactly min_loops loops
  _, want_state = reference_early_exit(conv, s0, lambda *_: True, 4, 9, check_every,
                                       np.ones((B, L), bool))
  np.testing.assert_array_equal(np.asarray(out.state), want_state)


def test_early_exit_all_inactive_runs_nothing():
  conv, s0 = toy_problem(2)
  out = recurrence.early_exit(*toy_closures(conv), jnp.asarray(s0),
                              jnp.zeros((B, L), jnp.int32), jnp.int32(0), min_loops=1,
                              max_loops=5, active0=jnp.zeros((B, L), bool))
  assert int(out.loops) == 0
  np.testing.assert_array_equal(np.asarray(out.depth), 0)
  np.testing.assert_array_equal(np.asarray(out.state), s0)


@pytest.mark.parametrize('order', ['padding_first', 'padding_last'])
def test_scatter_rows_drops_out_of_range_slots(order):
  """scatter_rows' contract: padding slots (index >= L) write nothing. Reference: a numpy
  loop that skips them. (With mode='clip' they land on position L - 1.)"""
  b, l, d = 2, 5, 3
  x = np.arange(b * l * d, dtype=np.float32).reshape(b, l, d)
  idx = np.array([[l, 1, 3], [l, l, 0]]) if order == 'padding_first' else \
      np.array([[1, 3, l], [0, l, l]])
  y = -1.0 - np.arange(b * 3 * d, dtype=np.float32).reshape(b, 3, d)
  want = x.copy()
  for r in range(b):
    for c in range(idx.shape[1]):
      if idx[r, c] < l:
        want[r, idx[r, c]] = y[r, c]
  got = recurrence.scatter_rows(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(y))
  np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_array_equal(np.asarray(got)[:, l - 1], x[:, l - 1])  # untouched


# ----------------------------------------------------------------------------
# Compacted early exit (phases of buffers) on the same toys.


def toy_phase_fn(conv, exit_at):
  """phase_fn for early_exit_compacted: a slot's state grows while its counter is below
  its token's conv (the step updates every slot, exited ones included), it wants to exit
  once the counter reaches exit_at, and the carry counts the loops each token ran live."""
  conv, exit_at = jnp.asarray(conv), jnp.asarray(exit_at)

  def phase(idx, s):
    del s
    conv_c, exit_c = (recurrence.gather_rows(x, idx) for x in (conv, exit_at))

    def step(live, s_c, carry, i):
      del i
      s_new = s_c + (s_c[..., :1] < conv_c[..., None]).astype(s_c.dtype)
      put = jnp.where(live, idx, L)  # only live slots write into the carry
      carry = carry.at[jnp.arange(B)[:, None], put].add(1, mode='drop')
      return s_new, s_new[..., 0] >= exit_c, carry
    return step
  return phase


@pytest.mark.parametrize('min_loops,max_loops,check_every', [(1, 10, 1), (3, 10, 2), (2, 9, 3)])
def test_early_exit_compacted_matches_brute_force(min_loops, max_loops, check_every):
  """Depths, frozen states, the live-only carry and the executed slots of the phased run
  against a per-token simulation (slots: B x the smallest capacity holding the fullest
  row's active tokens, at every loop)."""
  conv, s0 = toy_problem(min_loops * 100 + max_loops * 10 + check_every + 7, c_max=9)
  exit_at = np.random.default_rng(check_every).integers(1, 8, (B, L)).astype(np.float32)
  active0 = np.ones((B, L), bool)
  active0[0, :2] = False  # e.g. left padding
  active0[2, 1] = False
  caps = recurrence.capacities(L, 2)
  assert len(caps) > 2, caps  # several phases
  out = jax.jit(lambda s: recurrence.early_exit_compacted(
      toy_phase_fn(conv, exit_at), s, jnp.zeros((B, L), jnp.int32), caps=caps,
      min_loops=min_loops, max_loops=max_loops, check_every=check_every,
      active0=jnp.asarray(active0)))(jnp.asarray(s0))
  want_depth, want_state = reference_early_exit(  # the toy's own criterion
      conv, s0, lambda new, old, i, bt: new[0] >= exit_at[bt], min_loops, max_loops,
      check_every, active0)
  assert len(np.unique(want_depth[active0])) > 2, want_depth
  assert np.any(exit_at < conv), 'exited tokens would not change state: frozen untested'
  np.testing.assert_array_equal(np.asarray(out.depth), want_depth)
  np.testing.assert_array_equal(np.asarray(out.state), want_state)  # bitwise
  np.testing.assert_array_equal(np.asarray(out.carry), want_depth)
  assert int(out.loops) == want_depth.max()
  per_loop = [(want_depth >= i).sum(axis=1).max() for i in range(1, want_depth.max() + 1)]
  assert int(out.slots) == B * sum(min(c for c in caps if c >= n) for n in per_loop)
  assert int(np.sum(np.asarray(out.phase_slots))) == int(out.slots)


@pytest.mark.parametrize('cap', [2, 3, 5])
def test_right_aligned_matches_a_python_loop(cap):
  """Per row: the active positions in increasing order in the last slots, L before them."""
  active = np.random.default_rng(cap).random((4, 5)) < 0.4
  active[:, :5 - cap] = False  # at most cap active tokens per row
  got = np.asarray(recurrence.right_aligned(jnp.asarray(active), cap))
  for row, a in zip(got, active):
    pos = [t for t in range(5) if a[t]]
    np.testing.assert_array_equal(row, [5] * (cap - len(pos)) + pos)
