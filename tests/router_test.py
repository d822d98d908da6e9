"""A2 router: harvested oracle labels against a brute-force loop over uniform depths."""

import jax
import numpy as np
import pytest
from flax import nnx

from elastic_depth import config, inference, model as model_lib, router

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
