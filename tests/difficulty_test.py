"""A reduced main job: on the chain task, trained for a couple of minutes, answers that
need more permutations exit later, by a margin no depth-independent model could show."""

import jax
import numpy as np
import pytest

from conftest import traced_setup

from elastic_depth import config as config_lib, difficulty, train
from experiments import common


STEPS = 300
R_MAX = 6


def _config() -> config_lib.Config:
  return config_lib.Config(
      model=config_lib.ModelConfig(vocab_size=32, d_model=128, num_heads=4, num_kv_heads=4,
                                   head_dim=32, mlp_dim=256, n_prelude=1, n_core=1,
                                   n_coda=1, attention='core', max_len=128),
      depth=config_lib.DepthConfig(mean=4, r_max=R_MAX, buckets=tuple(range(1, R_MAX + 1))),
      data=config_lib.DataConfig(synth_task='chain', synth_examples=4000, synth_max_hops=2,
                                 val_fraction=0.1, loss_on='answers'),
      train=config_lib.TrainConfig(steps=STEPS, batch_size=8, seq_len=128, lr=1e-3,
                                   warmup_steps=50, eval_every=STEPS, ckpt_every=STEPS,
                                   eval_batches=1, eval_depths=(1, 4)))


def _report(root) -> dict:
  """difficulty.report of the chain model trained in root."""
  wd = str(root)
  train.run(_config(), wd, quiet=True)
  ld = common.load(common.Options(workdir=wd, batches=4, progress=False))
  return difficulty.report(ld.model, ld.batches, jax.random.key(0), R_MAX, 4.0,
                           eps_grid=[1e-4, 1e-3, 1e-2, 1e-1])


@pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"
def test_exit_depth_rises_with_k_and_depth_is_used_by_the_hard_answers(tmp_path):
  """One test over one training run (a module fixture would be rebuilt on each xdist worker)."""
  report = _report(tmp_path)
  exit_k = report['a1']['kl_answers']['exit_depth_a1']
  assert report['k'] == list(range(1, len(exit_k) + 1)) and len(exit_k) >= 2
  assert all(a < b for a, b in zip(exit_k, exit_k[1:])), exit_k
  # a model whose output does not depend on depth exits every token at loop 2 (the
  # first KL check): its exit depths cannot differ by k
  assert exit_k[-1] - exit_k[0] >= 0.5, exit_k
  # depth is used by the hard answers
  r1, ref = report['loss_depth1'], report['loss_train_mean']
  assert r1[-1] - ref[-1] >= 0.5, (r1, ref)  # no recurrence: r1 == ref
  assert ref[0] < 0.5, ref  # the easiest level is learned


def test_an_undefined_rank_correlation_is_said_not_shown_as_zero():
  """One class of k (or a constant exit depth): Spearman is undefined, written as JSON null
  and 'undefined' in the text, not 0.00 (which reads as 'exit depth ignores k')."""
  from elastic_depth import reports  # pylint: disable=g-import-not-at-top
  k = np.array([1, 1, 2, 2, 3, 3])
  assert np.isnan(difficulty.spearman_exit_k(np.full(6, 2), k))  # constant exit depth
  assert np.isnan(difficulty.spearman_exit_k(np.arange(6), np.ones(6)))  # one class of k
  depth = np.array([1, 2, 2, 3, 5, 4])  # against the ranks by hand: ties take mean ranks
  rank = lambda x: np.array([np.mean(np.flatnonzero(np.sort(x) == v)) for v in x])
  want = np.corrcoef(rank(depth), rank(k))[0, 1]
  assert difficulty.spearman_exit_k(depth, k) == pytest.approx(want)
  v = {'a1_eps': 1e-3, 'a1_mean_loops': 2.0, 'a1_loss': 0.1, 'best_gain_same_loops': 0.0,
       'loops_share_within_delta': 0.5, 'spearman_exit_k': float('nan')}
  line = difficulty._summary_line('kl', v, {'ref_depth': 4.0, 'ref_loss': 0.1, 'delta': 0.01})
  assert line.endswith('Spearman(exit depth, k) = undefined'), line
  assert reports.clean(v)['spearman_exit_k'] is None
  v['spearman_exit_k'] = 0.4
  assert difficulty._summary_line('kl', v, {'ref_depth': 4.0, 'ref_loss': 0.1,
                                            'delta': 0.01}).endswith('= 0.40')


def test_report_fields_against_the_trace_and_the_frontier():
  """On a random model: the losses by k at depth 1 and at the training mean are the
  uniform trace's, and each variant's gain over A0 is max(A0 at equal loops - loss)."""
  r_max, ref_depth = 6, 3.4
  mdl, batches, rng, trace = traced_setup(r_max, 8, 2)
  res = difficulty.report(mdl, batches, rng, r_max, ref_depth, eps_grid=[1e-2, 1e-1, 1.0])
  diff, sel = trace.difficulty, (trace.mask > 0) & (trace.difficulty > 0)
  nll = trace.stats['nll'].astype(np.float64)
  assert res['k'] == [1, 2, 3]
  for i, k in enumerate(res['k']):
    s = sel & (diff == k)
    assert res['tokens_by_k'][i] == s.sum()
    assert res['loss_depth1'][i] == pytest.approx(nll[0][s].mean(), rel=1e-6)
    assert res['loss_train_mean'][i] == pytest.approx(nll[3 - 1][s].mean(), rel=1e-6)
  a0 = res['a0']
  for name, v in res['a1'].items():
    c = v['curve']
    gain = max(np.interp(m, a0['mean_loops'], a0['loss']) - x
               for m, x in zip(c['mean_loops'], c['loss']))
    if name != 'confidence_answers':  # its own grid reaches full depth: a gain of ~0
      assert abs(gain) > 1e-4, name  # a flipped sign could not pass
    assert v['best_gain_same_loops'] == pytest.approx(gain, rel=1e-6, abs=1e-7), name


def test_report_losses_by_k_at_every_depth_and_a_mean_that_rounds_up():
  """ref_depth 3.6 rounds to depth 4: the training-mean loss by k is the uniform trace's at
  depth 4, and loss_by_k_r holds every depth r = 1..R (float64 means over each k's answers)."""
  r_max = 5
  mdl, batches, rng, trace = traced_setup(r_max, 8, 2)
  res = difficulty.report(mdl, batches, rng, r_max, 3.6, eps_grid=[1e-1])
  diff, sel = trace.difficulty, (trace.mask > 0) & (trace.difficulty > 0)
  nll = trace.stats['nll'].astype(np.float64)
  by_k = lambda nll_NxL: [nll_NxL[sel & (diff == k)].mean() for k in res['k']]
  np.testing.assert_allclose(res['loss_train_mean'], by_k(nll[4 - 1]), rtol=1e-6)
  assert len(res['loss_by_k_r']) == r_max
  for r in range(r_max):
    np.testing.assert_allclose(res['loss_by_k_r'][r], by_k(nll[r]), rtol=1e-6)


def test_a1_point_is_the_headline_else_the_best_gap_to_a0():
  """The A1 point on a curve: its headline's index, else the point furthest below A0 at
  equal loops (the smallest gap, loss minus A0's)."""
  gaps = [0.3, -0.02, 0.1, -0.2, 0.0]
  h = {'best': None, 'frontier': {'gap_same_loops': gaps}}
  assert difficulty._a1_point(h) == min(range(len(gaps)), key=gaps.__getitem__) == 3
  h['best'] = {'index': 2}
  assert difficulty._a1_point(h) == 2
