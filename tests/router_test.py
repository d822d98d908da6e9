"""A2 router: harvested oracle labels against a brute-force loop over uniform depths; the
fit, its logit and its evaluation against planted laws and float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from elastic_depth import config, inference, model as model_lib, policies, router

B, L, R = 2, 8, 5


@pytest.fixture(scope='module')
def setup(make_config, make_batch):
  """A tiny random model (one core block) and two batches with padded positions."""
  cfg = make_config(model=dict(n_core=1, init_std=0.1), train=dict(batch_size=B, seq_len=L))
  mdl = model_lib.LoopedLM(cfg.model, nnx.Rngs(5))
  batches = [make_batch(cfg, seed, mask_frac=0.25) for seed in (1, 2)]
  assert min(b['mask'].mean() for b in batches) < 1  # padding is exercised
  return mdl, batches, jax.random.key(2)


@pytest.fixture(scope='module')
def brute_force(setup):
  """Per loop d = 1..R: (states [N, D], labels [N]) of the unpadded tokens.

  Every depth is a separate uniform-depth run; the label of a token at loop i is 1 when
  its argmax at some loop j in (i, R] differs from its argmax at loop i.
  """
  mdl, batches, rng = setup
  score = [jax.jit(lambda t, d=d: inference.score(
      mdl, t, config.ExitConfig(policy='uniform', depth=d), rng)) for d in range(1, R + 1)]
  states, labels = [[] for _ in range(R)], [[] for _ in range(R)]
  for b in batches:
    runs = [fn(b['inputs']) for fn in score]
    am = [np.argmax(np.asarray(r.logits), -1) for r in runs]
    keep = b['mask'] > 0
    for i in range(R):
      change = np.zeros(keep.shape, bool)
      for j in range(i + 1, R):
        change |= am[j] != am[i]
      states[i].append(np.asarray(runs[i].state, np.float32)[keep])
      labels[i].append(change[keep])
  return [(np.concatenate(s), np.concatenate(l)) for s, l in zip(states, labels)]


def match(h_states, want_states):
  """Index into want_states of each harvested state (nearest; must be ~exact)."""
  dist = np.linalg.norm(h_states[:, None] - want_states[None], axis=-1)
  idx = dist.argmin(1)
  scale = np.abs(want_states).max()
  assert dist[np.arange(len(idx)), idx].max() < 1e-5 * scale
  return idx


def test_harvest_labels_match_brute_force(setup, brute_force):
  mdl, batches, rng = setup
  h = router.harvest(mdl, batches, R, rng)
  want = brute_force
  n_tokens = sum(int(b['mask'].sum()) for b in batches)
  assert len(h.labels_N) == R * n_tokens == len(h.states_NxD) == len(h.loops_N)
  assert sorted(set(h.loops_N.tolist())) == list(range(1, R + 1))
  for i, (w_states, w_labels) in enumerate(want):
    sel = h.loops_N == i + 1
    assert sel.sum() == n_tokens
    idx = match(h.states_NxD[sel], w_states)
    assert sorted(idx.tolist()) == list(range(n_tokens))  # one-to-one
    np.testing.assert_array_equal(h.labels_N[sel], w_labels[idx].astype(np.float32))
  assert not h.labels_N[h.loops_N == R].any()  # nothing comes after the last loop
  labels = np.concatenate([w[1] for w in want[:-1]])
  assert 0.1 < labels.mean() < 0.9, labels.mean()  # the test sees both classes


def test_harvest_subsample_is_a_labelled_subset(setup, brute_force):
  mdl, batches, rng = setup
  h = router.harvest(mdl, batches, R, rng, max_pairs=20, seed=3)
  want = brute_force
  assert len(h.labels_N) == 20
  for i in np.unique(h.loops_N):
    sel = h.loops_N == i
    w_states, w_labels = want[i - 1]
    idx = match(h.states_NxD[sel], w_states)
    np.testing.assert_array_equal(h.labels_N[sel], w_labels[idx].astype(np.float32))


def _random_router(d: int, seed: int) -> policies.Router:
  g = np.random.default_rng(seed)
  return policies.Router(jnp.asarray(g.normal(size=d), jnp.float32), jnp.float32(g.normal()),
                         jnp.asarray(g.normal(size=d), jnp.float32),
                         jnp.asarray(g.uniform(0.5, 2.0, d), jnp.float32))


def test_router_logit_is_the_standardised_linear_form():
  """((s - mu) / sd) . w + b per token, against float64."""
  r = _random_router(6, 0)
  s = np.random.default_rng(1).normal(size=(2, 5, 6)) * 3
  want = ((s - np.asarray(r.mu_D, np.float64)) / np.asarray(r.sd_D, np.float64)
          ) @ np.asarray(r.w_D, np.float64) + float(r.b)
  got = policies.router_logit(r, jnp.asarray(s, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _planted(w, b, n: int, seed: int):
  """States N(mu, sd^2) whose labels are Bernoulli(sigmoid(((x - mu) / sd) . w + b))."""
  g = np.random.default_rng(seed)
  mu, sd = np.linspace(-1, 1, len(w)), np.linspace(0.5, 2, len(w))
  z = g.normal(size=(n, len(w)))
  y = g.uniform(size=n) < 1 / (1 + np.exp(-(z @ w + b)))
  return router.Harvest((mu + sd * z).astype(np.float32), y.astype(np.float32),
                        np.full(n, 2)), z @ w + b


def _auc(score, y):
  """P(score of a positive > score of a negative), by ranks."""
  ranks = np.argsort(np.argsort(score)) + 1
  n_pos = int(y.sum())
  return (ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * (len(y) - n_pos))


def test_fit_recovers_a_planted_router_with_balanced_classes():
  """Class-balanced logistic regression on a planted logistic law (25% positives): the
  weights come back, the intercept shifted by log((1 - pi) / pi) (the balancing), and the
  held-out ranking is as good as the truth's."""
  w, b = np.array([1.5, -1.0, 0.5, 0.0, 2.0, -0.5]), -1.6
  fit_h, _ = _planted(w, b, 20000, 2)
  test_h, true_logit = _planted(w, b, 20000, 3)
  pi = float(fit_h.labels_N.mean())
  assert 0.15 < pi < 0.35
  r = router.fit(fit_h, steps=1500, lr=5e-2)
  # the fit standardises with the sample's mean and sd (float64 numpy): map its weights back
  x = fit_h.states_NxD.astype(np.float64)
  np.testing.assert_allclose(np.asarray(r.mu_D), x.mean(0), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(r.sd_D), x.std(0) + 1e-6, rtol=1e-4)
  sd = x.std(0) / np.linspace(0.5, 2, len(w))
  np.testing.assert_allclose(np.asarray(r.w_D) / sd, w, atol=0.1)
  assert abs(float(r.b) - (b + np.log((1 - pi) / pi))) < 0.15
  y = test_h.labels_N > 0.5
  fitted = np.asarray(policies.router_logit(r, jnp.asarray(test_h.states_NxD)[None])[0])
  assert _auc(fitted, y) > _auc(true_logit, y) - 0.005


def test_evaluate_against_numpy():
  """Accuracy, balanced accuracy, base rate, ECE and the reliability bins, by brute force."""
  r = _random_router(5, 4)
  g = np.random.default_rng(5)
  h = router.Harvest(g.normal(size=(3000, 5)).astype(np.float32) * 2,
                     (g.uniform(size=3000) < 0.3).astype(np.float32), np.full(3000, 2))
  ev = router.evaluate(r, h, bins=10)
  x = (h.states_NxD.astype(np.float64) - np.asarray(r.mu_D)) / np.asarray(r.sd_D)
  p = 1 / (1 + np.exp(-(x @ np.asarray(r.w_D, np.float64) + float(r.b))))
  y = h.labels_N > 0.5
  assert ev['n'] == 3000 and ev['base_rate'] == pytest.approx(y.mean())
  assert ev['accuracy'] == pytest.approx(np.mean((p > 0.5) == y))
  tpr, tnr = np.mean(p[y] > 0.5), np.mean(p[~y] <= 0.5)
  assert ev['balanced_accuracy'] == pytest.approx((tpr + tnr) / 2)
  ece, rows = 0.0, []
  for k in range(10):
    sel = (p >= k / 10) & ((p < (k + 1) / 10) | (k == 9))
    if sel.any():
      ece += sel.mean() * abs(p[sel].mean() - y[sel].mean())
      rows.append((k, int(sel.sum())))
  assert ev['ece'] == pytest.approx(ece, abs=1e-6)
  assert [(row['bin'], row['n']) for row in ev['reliability']] == rows
  assert len(rows) > 3  # the bins are exercised


def test_batch_tokens_span_exactly_the_targets_of_the_batches():
  """[start, end) is the first target position of batch `first` and one past the last of
  batch first + count - 1, enumerated window by window (window i predicts i*L+1..i*L+L)."""
  for first, count, b, l in [(0, 1, 4, 16), (2, 3, 2, 5), (1, 1, 1, 1), (3, 2, 6, 7)]:
    targets = [w * l + t for w in range(first * b, (first + count) * b) for t in range(1, l + 1)]
    start, end = router.batch_tokens(first, count, b, l)
    assert list(range(start, end)) == targets, (first, count, b, l)
