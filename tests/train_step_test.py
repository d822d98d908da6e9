"""Tests for the jitted randomised-depth train step, validation and the learning-rate schedules."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from elastic_depth import distributed
from elastic_depth import model as model_lib
from elastic_depth import policies
from elastic_depth import train_step


@pytest.fixture(scope='module')
def mesh():
  return distributed.make_mesh(jax.devices()[:1])


@pytest.fixture(scope='module')
def setup(make_config, mesh):
  """(cfg, graphdef, step_fn): one compiled step shared by the [1, 4, 8] batch tests."""
  cfg = make_config(train=dict(nan_policy='skip'))
  graphdef, _ = train_step.init_state(cfg, seed=0)
  return cfg, graphdef, train_step.make_train_step(graphdef, cfg, mesh)


def fresh_state(cfg, mesh, seed=0):
  _, state = train_step.init_state(cfg, seed)
  return train_step.place_state(state, mesh)


def host_copy(tree):
  """A numpy copy (the step donates its input state)."""
  return jax.tree.map(np.array, tree)


def trees_max_diff(a, b):
  chex.assert_trees_all_equal_structs(a, b)
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def np_masked_nll(logits_BxLxV, targets_BxL, mask_BxL):
  x = np.asarray(logits_BxLxV, np.float64)
  m = x.max(-1, keepdims=True)
  logp = x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))
  nll = -np.take_along_axis(logp, targets_BxL[..., None], axis=-1)[..., 0]
  return float((nll * mask_BxL).sum() / max(mask_BxL.sum(), 1.0))


def test_memorises_a_fixed_batch(setup, mesh, make_batch):
  cfg, _, step_fn = setup
  state = fresh_state(cfg, mesh)
  batch = distributed.shard_batch([make_batch(cfg, 0)], mesh, 1)
  losses = []
  for _ in range(30):
    state, m = step_fn(state, batch)
    assert bool(m['finite'])
    losses.append(float(m['loss']))
  assert losses[0] == pytest.approx(math.log(cfg.model.vocab_size), abs=0.3)
  assert np.mean(losses[-5:]) < 0.5 * losses[0], losses


def test_loss_equals_independent_recomputation(setup, mesh, make_batch):
  cfg, graphdef, step_fn = setup
  state = fresh_state(cfg, mesh)
  seed_key = jax.random.key(cfg.train.seed)
  seen, opt_state = set(), host_copy(state.opt_state)
  for step in range(6):
    host = make_batch(cfg, 100 + step, mask_frac=0.3)
    params = host_copy(state.params)
    state, m = step_fn(state, distributed.shard_batch([host], mesh, 1))
    depth = int(m['bucket'])
    seen.add(depth)
    r, idx = policies.draw_bucket(seed_key, step, cfg.depth)
    assert int(m['depth']) == int(r) and depth == cfg.depth.buckets[int(idx)]
    assert float(m['tokens']) == host['mask'].sum()
    # Forward at that depth, a Python loop, from the same initial-state key.
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(seed_key, 0x1a17), step), 0)  # micro 0
    logits = _python_loop_logits(jax.tree.map(jnp.asarray, params), graphdef, host, key, depth)
    want = np_masked_nll(logits, host['targets'], host['mask'])
    assert float(m['loss']) == pytest.approx(want, rel=2e-5)
    if step < 2:  # the gradient of that mean, and the AdamW update it makes
      g_ref = jax.grad(_python_loop_loss)(jax.tree.map(jnp.asarray, params), graphdef, host,
                                          key, depth)
      assert float(m['grad_norm']) == pytest.approx(float(optax.tree.norm(g_ref)), rel=1e-4)
      tx = train_step.make_optimizer(cfg)
      updates, _ = tx.update(g_ref, opt_state, params)
      assert trees_max_diff(state.params, optax.apply_updates(params, updates)) < 1e-6
    opt_state = host_copy(state.opt_state)
  assert len(seen) >= 2


def _python_loop_logits(params, graphdef, host, key, depth):
  """The logits at a fixed depth, by a Python loop over core steps."""
  mdl = model_lib.bind(graphdef, params)
  tokens = jnp.asarray(host['inputs'])
  pos = model_lib.positions(tokens)
  e, _ = mdl.encode(tokens, pos)
  s, inj = mdl.initial_state(e, key, pos), mdl.inject(e)
  for _ in range(depth):
    s, _ = mdl.core_step(s, inj, pos)
  return mdl.logits(mdl.decode_state(s, pos)[0])


def _python_loop_loss(params, graphdef, host, key, depth):
  """The masked mean NLL of _python_loop_logits (differentiable: jax.grad's reference)."""
  logits = _python_loop_logits(params, graphdef, host, key, depth)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  nll = -jnp.take_along_axis(logp, jnp.asarray(host['targets'])[..., None], -1)[..., 0]
  mask = jnp.asarray(host['mask'], jnp.float32)
  return jnp.sum(nll * mask) / jnp.sum(mask)


def test_validation_loss_is_token_weighted_over_batches(setup, mesh, make_batch):
  """evaluate: NLL per scored token over all batches (a batch with 3 tokens weighs 3),
  against a Python-loop forward."""
  cfg, graphdef, _ = setup
  _, state = train_step.init_state(cfg, seed=0)
  small, big = make_batch(cfg, 7), make_batch(cfg, 8)
  small['mask'][:] = 0.0
  small['mask'][0, :3] = 1.0
  eval_step = train_step.make_eval_step(graphdef, cfg)
  got = train_step.evaluate(eval_step, state.params, [small, big], [1, 2], mesh)
  key = jax.random.fold_in(jax.random.key(cfg.train.seed), 0xe7a1)
  for depth in (1, 2):
    sums = [_python_loop_loss(state.params, graphdef, b, key, depth) * b['mask'].sum()
            for b in (small, big)]
    want = float(sum(sums)) / (small['mask'].sum() + big['mask'].sum())
    assert got[depth] == pytest.approx(want, rel=2e-5)
    means = [float(x) / b['mask'].sum() for x, b in zip(sums, (small, big))]
    assert abs(np.mean(means) - want) > 1e-3  # a mean of batch means would fail


def test_step_compiles_once_across_depths(setup, mesh, make_batch):
  cfg, _, step_fn = setup
  state = fresh_state(cfg, mesh)
  depths = set()
  for step in range(8):
    state, m = step_fn(state, distributed.shard_batch([make_batch(cfg, step)], mesh, 1))
    depths.add(int(m['bucket']))
  assert len(depths) >= 2
  assert int(state.step) == 8
  assert step_fn._cache_size() == 1  # pylint: disable=protected-access


def test_nan_skip_keeps_params_and_optimizer_state(setup, mesh, make_batch):
  cfg, _, step_fn = setup
  state = fresh_state(cfg, mesh)
  good = make_batch(cfg, 1)
  state, m = step_fn(state, distributed.shard_batch([good], mesh, 1))
  assert bool(m['finite'])
  bad = dict(good, mask=good['mask'].copy())
  bad['mask'][1, 3] = np.nan
  params, opt_state = host_copy(state.params), host_copy(state.opt_state)
  state, m = step_fn(state, distributed.shard_batch([bad], mesh, 1))
  assert not bool(m['finite'])
  assert not np.isfinite(float(m['loss']))
  assert int(state.step) == 2
  chex.assert_trees_all_equal(host_copy(state.params), params)
  chex.assert_trees_all_equal(host_copy(state.opt_state), opt_state)
  # Skipping is not sticky: the next good batch updates the parameters again.
  state, m = step_fn(state, distributed.shard_batch([good], mesh, 1))
  assert bool(m['finite'])
  assert trees_max_diff(host_copy(state.params), params) > 1e-4
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host_copy(state.params)))


@pytest.fixture(scope='module')
def accum_setup(make_config, mesh):
  """Zero initial state, so micro-batch splits see the same inputs as one big batch."""
  cfg = make_config(model=dict(init_state='zeros'), train=dict(batch_size=2),
                    depth=dict(mean=1.5, r_max=2, buckets=(1, 2)))  # 2 branches: faster
  graphdef, _ = train_step.init_state(cfg, seed=0)
  return cfg, train_step.make_train_step(graphdef, cfg, mesh)


def run_accum_pair(cfg, mesh, step_fn, big_batches):
  """Trains from the same init on [2, B/2, L] micro-batches and on [1, B, L] batches."""
  results = []
  for accum in (2, 1):
    state = fresh_state(cfg, mesh)
    losses = []
    for big in big_batches:
      if accum == 2:
        half = big['inputs'].shape[0] // 2
        parts = [{k: v[:half] for k, v in big.items()}, {k: v[half:] for k, v in big.items()}]
      else:
        parts = [big]
      state, m = step_fn(state, distributed.shard_batch(parts, mesh, accum))
      losses.append((float(m['loss']), float(m['grad_norm']), float(m['tokens'])))
    results.append((np.array(losses), host_copy(state.params)))
  return results


def test_grad_accumulation_equals_big_batch(accum_setup, mesh, make_batch):
  cfg, step_fn = accum_setup
  bigs = [make_batch(cfg, 10 + i, batch_size=4) for i in range(2)]
  (l2, p2), (l1, p1) = run_accum_pair(cfg, mesh, step_fn, bigs)
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  assert trees_max_diff(p2, p1) < 1e-5
  assert trees_max_diff(p1, host_copy(fresh_state(cfg, mesh).params)) > 1e-3  # it trained


def test_grad_accumulation_equals_big_batch_with_uneven_masks(accum_setup, mesh,
                                                              make_batch):
  """Masked tokens differ across micro-batches: the loss must still be the token mean."""
  cfg, step_fn = accum_setup
  bigs = [make_batch(cfg, 20 + i, batch_size=4) for i in range(2)]
  for big in bigs:
    big['mask'][:2, 2:] = 0.0  # first micro-batch: 4 targets, second: 16
  (l2, p2), (l1, p1) = run_accum_pair(cfg, mesh, step_fn, bigs)
  np.testing.assert_allclose(l2[:, 2], l1[:, 2])  # same token counts
  np.testing.assert_allclose(l2[:, 0], l1[:, 0], rtol=1e-5,
                             err_msg='accumulated loss is not the mean over all tokens')
  assert trees_max_diff(p2, p1) < 1e-5


def test_remat_policy_and_fused_loss_train_like_plain_autodiff(make_config, mesh, make_batch):
  """depth.remat_policy=dots and train.loss_chunk (the fused head + cross-entropy, chunks
  that do not divide the tokens) reach the step (every policy's gradient: recurrence_test;
  head_nll's: losses_test) and give the losses and parameters of remat off."""
  base = dict(mean=3.0, sigma=0.0, r_max=3, buckets=(3,))  # one branch: a fast compile
  batches = [distributed.shard_batch([make_batch(make_config(), 40 + i, mask_frac=0.2)],
                                     mesh, 1) for i in range(2)]
  runs = {}
  for name, depth, train in [('off', dict(remat=False), {}),
                             ('dots', dict(remat_policy='dots'), {}),
                             ('loss_chunk', {}, dict(loss_chunk=7))]:
    cfg = make_config(depth={**base, **depth}, train=train)
    graphdef, _ = train_step.init_state(cfg, seed=0)
    step_fn = train_step.make_train_step(graphdef, cfg, mesh)
    state, losses = fresh_state(cfg, mesh), []
    for b in batches:
      state, m = step_fn(state, b)
      losses.append((float(m['loss']), float(m['grad_norm'])))
    runs[name] = (np.array(losses), host_copy(state.params))
  want_l, want_p = runs.pop('off')
  assert trees_max_diff(want_p, host_copy(fresh_state(cfg, mesh).params)) > 1e-4  # it trained
  for name, (l, p) in runs.items():
    np.testing.assert_allclose(l, want_l, rtol=2e-5, err_msg=name)
    assert trees_max_diff(p, want_p) < 2e-5, name


# ----------------------------------------------------------------------------
# Learning-rate schedules.


def test_lr_schedule_warmup_cosine(make_config):
  cfg = make_config(train=dict(lr=2e-3, min_lr_ratio=0.1, warmup_steps=10, steps=100,
                               schedule='cosine'))
  sched = train_step.lr_schedule(cfg)
  lr, floor = 2e-3, 2e-4
  for t in range(0, 121):
    if t < 10:
      want = lr * t / 10
    elif t <= 100:
      want = floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * (t - 10) / 90))
    else:
      want = floor
    assert float(sched(t)) == pytest.approx(want, rel=1e-5, abs=1e-9), t


@pytest.mark.parametrize('warmup,steps,decay_frac', [(10, 100, 0.2), (5, 40, 0.5)])
def test_lr_schedule_wsd(make_config, warmup, steps, decay_frac):
  cfg = make_config(train=dict(lr=1e-3, min_lr_ratio=0.1, warmup_steps=warmup,
                               steps=steps, schedule='wsd', decay_frac=decay_frac))
  sched = train_step.lr_schedule(cfg)
  lr, floor = 1e-3, 1e-4
  decay = int(decay_frac * steps)
  decay_start = steps - decay
  for t in range(0, steps + 10):
    if t < warmup:
      want = lr * t / warmup
    elif t < decay_start:
      want = lr
    elif t < steps:
      want = lr - (lr - floor) * (t - decay_start) / decay
    else:
      want = floor
    assert float(sched(t)) == pytest.approx(want, rel=1e-5, abs=1e-9), t


@pytest.mark.parametrize('backprop_depth', [0, 2])
def test_train_flops_per_token_expects_the_executed_loops(make_config, backprop_depth):
  """Against the sampler's own draws: the forward runs the drawn bucket's loops, the
  backward (2x a forward) the last backprop_depth of them."""
  cfg = make_config()
  cfg = dataclasses.replace(cfg, depth=dataclasses.replace(
      cfg.depth, mean=5.0, r_max=10, buckets=(1, 2, 3, 5, 8, 10),
      backprop_depth=backprop_depth))
  _, depth = policies.bucket_frequencies(0, 100_000, cfg.depth)
  back = np.minimum(depth, backprop_depth) if backprop_depth else depth
  f = lambda r: model_lib.flops_per_token(cfg.model, r, cfg.train.seq_len)['total']
  per_step = np.array([f(a) + 2 * f(b) for a, b in zip(depth, back)], np.float64)
  got = train_step.train_flops_per_token(cfg)
  assert got == pytest.approx(per_step.mean(), rel=6 * per_step.std() / per_step.mean()
                              / np.sqrt(len(per_step)))
  if backprop_depth:  # 3 forwards at depth.mean would be far off
    assert abs(3 * f(cfg.depth.mean) / got - 1) > 0.2
