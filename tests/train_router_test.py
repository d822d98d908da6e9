"""experiments.train_router (the A2 router and the KL probe) end to end."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import mains_opts, report_results
from elastic_depth import config as config_lib
from elastic_depth import books, kl_probe, model as model_lib, policies, router as router_lib
from experiments import common, sweep_eps, train_router

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"


def test_router_is_fitted_on_batches_the_sweep_refuses_to_score(workdir):
  out = train_router.run(mains_opts(workdir), train_router.RouterOptions(
      steps=5, lr=1e-2, max_pairs=1000, fit_from=2, fit_batches=1))
  fit = report_results(out['paths']['json'])['fit']
  assert fit['batches'] == [2]
  with open(out['router'], encoding='utf-8') as f:
    assert json.load(f)['fit']['tokens'] == fit['tokens']
  ok = sweep_eps.run(mains_opts(workdir), sweep_eps.SweepOptions(
      eps_grid=[1e-3], router=True, router_grid=[0.5]))['results']
  assert 'router' in ok['curves']  # batches 0..1: held out
  # a tagged fit names its probe as it names its report, and the untagged probe stays
  before = open(out['router'], 'rb').read()
  tagged = train_router.run(mains_opts(workdir, tag='t1'), train_router.RouterOptions(
      steps=5, lr=1e-2, max_pairs=1000, fit_from=3, fit_batches=1))
  assert tagged['router'] == os.path.join(workdir, 'router_t1.json')
  assert open(out['router'], 'rb').read() == before
  with open(tagged['router'], encoding='utf-8') as f:
    assert json.load(f)['fit']['batches'] == [3]
  assert report_results(tagged['paths']['json'])['fit']['batches'] == [3]
  with pytest.raises(common.SetupError,
                     match='no .*router_t2.json; run .*train_router --tag=t2 --workdir='):
    sweep_eps.run(mains_opts(workdir, tag='t2'),
                  sweep_eps.SweepOptions(eps_grid=[1e-3], router=True))
  with pytest.raises(common.SetupError, match='in-sample'):
    sweep_eps.run(common.Options(workdir=workdir, batches=3, progress=False),
                  sweep_eps.SweepOptions(eps_grid=[1e-3], router=True))
  # a router of another checkpoint, or of another width (another model), is refused
  with open(out['router'], encoding='utf-8') as f:
    doc = json.load(f)
  step = doc['fit']['checkpoint_step']
  assert isinstance(step, int) and step > 0  # the checkpoint it was fitted on
  stale = {**doc, 'fit': {**doc['fit'], 'checkpoint_step': step + 1}}
  with open(out['router'], 'w', encoding='utf-8') as f:
    json.dump(stale, f)
  with pytest.raises(common.SetupError, match=f'fitted on the checkpoint of step {step + 1}'):
    sweep_eps.run(mains_opts(workdir), sweep_eps.SweepOptions(eps_grid=[1e-3], router=True))
  for k in ('w_D', 'mu_D', 'sd_D'):
    doc[k] = doc[k] + [0.0 if k != 'sd_D' else 1.0]
  with open(out['router'], 'w', encoding='utf-8') as f:
    json.dump(doc, f)
  with pytest.raises(common.SetupError, match='fitted on another model'):
    sweep_eps.run(mains_opts(workdir), sweep_eps.SweepOptions(eps_grid=[1e-3], router=True))


def test_kl_probe_is_fitted_then_swept_with_its_cost_in_the_books(workdir):
  """train_router --probe=kl_probe then sweep_eps --kl_probe: the curve is scored in both
  semantics, its books count the probe, and in-sample batches or a missing file are refused."""
  with pytest.raises(common.SetupError, match='--kl_probe: no .*--probe=kl_probe'):
    sweep_eps.run(mains_opts(workdir), sweep_eps.SweepOptions(eps_grid=[1e-3], kl_probe=True))
  for bad in (dict(exit_eps=(0.1,)), dict(loops=3), dict(objective='crossings')):
    with pytest.raises(common.SetupError, match="the KL probe's"):
      train_router.run(mains_opts(workdir), train_router.RouterOptions(**bad))
  for sem, loops in (('parallel', 0), ('cached', 3)):
    out = train_router.run(mains_opts(workdir), train_router.RouterOptions(
        steps=5, lr=1e-2, max_pairs=1000, fit_from=2, fit_batches=1, probe='kl_probe',
        rank=4, hidden=2, semantics=sem, loops=loops))
    res = report_results(out['paths']['json'])
    assert res['fit']['batches'] == [2] and res['semantics'] == sem
    assert res['r_max'] > 2 and res['heldout']['loops'] == min(loops or 99, res['r_max'] - 1)
    assert kl_probe.load(out['router']).a_RxDxK.shape[0] == res['heldout']['loops']
    assert out['router'].endswith({'parallel': 'kl_probe.json',
                                   'cached': 'kl_probe_cached.json'}[sem])
    assert -1 <= res['heldout']['spearman_probe'] <= 1
  # --fit_seed: another seed, another fit; the same seed, the same fit; --probe_objective
  # reaches the fit
  fits = {'first': kl_probe.load(out['router'])}  # the cached fit above: seed 0
  for seed, obj in ((1, 'squares'), (0, 'squares'), (0, 'crossings')):
    out = train_router.run(mains_opts(workdir), train_router.RouterOptions(
        steps=5, lr=1e-2, max_pairs=1000, fit_from=2, fit_batches=1, probe='kl_probe',
        rank=4, hidden=2, semantics='cached', loops=3, fit_seed=seed, objective=obj))
    fits[seed, obj] = kl_probe.load(out['router'])
  assert not np.allclose(fits[1, 'squares'].a_RxDxK, fits[0, 'squares'].a_RxDxK)
  assert not np.allclose(fits[0, 'crossings'].a_RxDxK, fits[0, 'squares'].a_RxDxK)
  np.testing.assert_array_equal(fits[0, 'squares'].a_RxDxK, fits['first'].a_RxDxK)
  ok = sweep_eps.run(mains_opts(workdir), sweep_eps.SweepOptions(
      eps_grid=[1e-3, 1.0], curves=('kl',), kl_probe=True, semantics=('parallel', 'cached'),
      timing_repeats=0))['results']
  big = config_lib.ModelConfig(**config_lib.BLOCKS_135M)
  probe_per_loop = policies.probe_flops((4, 2), big.d_model) / model_lib.flops_per_token(
      big, 0, books.SEQ_135M)['loop']
  for name in ('kl_probe', 'kl_probe@cached'):
    c = ok['curves'][name]
    assert tuple(c['probe_size']) == (4, 2)
    # the books charge the probe at every loop: its cost per loop on top of the same
    # counts' cost without it
    bare = books.curve_costs({**c, 'probe_size': None}, big, books.SEQ_135M)
    np.testing.assert_allclose(np.subtract(ok['check_books'][name]['cost_135m'], bare),
                               probe_per_loop, rtol=1e-9)
  assert probe_per_loop > 0
  assert ok['curves']['kl']['probe_size'] is None
  with pytest.raises(common.SetupError, match='kl_probe was fitted .* in-sample'):
    sweep_eps.run(common.Options(workdir=workdir, batches=3, progress=False),
                  sweep_eps.SweepOptions(eps_grid=[1e-3], kl_probe=True))
  # fitted on training text, the probe has seen no validation batch: all may be scored
  out = train_router.run(mains_opts(workdir), train_router.RouterOptions(
      steps=5, max_pairs=1000, fit_from=2, fit_batches=2, fit_split='train', probe='kl_probe',
      rank=4, loops=1))
  assert report_results(out['paths']['json'])['fit']['split'] == 'train'
  ok = sweep_eps.run(common.Options(workdir=workdir, batches=3, progress=False),
                     sweep_eps.SweepOptions(eps_grid=[1e-3], curves=('kl',), kl_probe=True,
                                            timing_repeats=0))['results']
  assert tuple(ok['curves']['kl_probe']['probe_size']) == (4, 0)


def test_router_overlap_by_brute_force_over_windows():
  """Batches overlap iff they share a target position, whatever the batch shapes."""
  def targets(first, n, b, l):  # every target position of the windows, enumerated
    return {w * l + t for w in range(first * b, (first + n) * b) for t in range(1, l + 1)}
  cfg = {'seed': 0}
  for (f1, n1, b1, l1), (f2, n2, b2, l2) in [((2, 1, 4, 16), (0, 2, 4, 16)),
                                             ((2, 1, 4, 16), (0, 3, 4, 16)),
                                             ((1, 2, 8, 8), (0, 1, 4, 16)),
                                             ((1, 2, 8, 8), (1, 1, 4, 16)),
                                             ((3, 1, 2, 5), (0, 1, 6, 5))]:
    fit = {'batches': list(range(f1, f1 + n1)), 'batch_size': b1, 'seq_len': l1,
           'tokens': router_lib.batch_tokens(f1, n1, b1, l1), 'data_config': cfg}
    why = router_lib.overlap_error(fit, cfg, router_lib.batch_tokens(f2, n2, b2, l2))
    assert (why is not None) == bool(targets(f1, n1, b1, l1) & targets(f2, n2, b2, l2))
    assert router_lib.overlap_error(fit, {'seed': 1}, [0, 10 ** 9]) is None
  assert 'no record' in router_lib.overlap_error(None, cfg, [0, 1])


def test_a_diverged_probe_fit_leaves_the_saved_probe_alone(tmp_path):
  path = tmp_path / 'kl_probe.json'
  path.write_text('{"good": 1}')
  probe = router_lib.Router(w_D=np.array([1.0, np.nan]), b=np.array(0.0), mu_D=np.zeros(2),
                           sd_D=np.ones(2))
  with pytest.raises(common.SetupError, match='diverged .* left as it was'):
    train_router._refuse_non_finite(probe, str(path))  # pylint: disable=protected-access
  assert path.read_text() == '{"good": 1}'


def test_train_router_needs_a_held_out_batch(tmp_path):
  """--fit_from=0 leaves no batch to evaluate on (and none for sweep_eps): refused before
  the workdir is read."""
  missing = mains_opts(str(tmp_path / 'no_such_workdir'))
  with pytest.raises(common.SetupError, match='--fit_from=0 and --fit_batches=1 must be >= 1'):
    train_router.run(missing, train_router.RouterOptions(fit_from=0, fit_batches=1))


def test_router_report_scores_the_fit_batches_and_the_held_out_ones(workdir):
  """The saved probe, evaluated on pairs harvested from batches fit_from.. (train) and
  0..fit_from - 1 (held out), gives the report's figures; the markdown rows are those."""
  x = train_router.RouterOptions(steps=5, lr=1e-2, max_pairs=1000, fit_from=1, fit_batches=1)
  out = train_router.run(mains_opts(workdir, tag='split'), x)
  res = report_results(out['paths']['json'])
  ld = common.load(mains_opts(workdir))
  probe, key = router_lib.load(out['router']), jax.random.key(0)
  want = {split: router_lib.evaluate(probe, router_lib.harvest(ld.model, batches, ld.r_max, key,
                                                               x.max_pairs))
          for split, batches in (('train', ld.batches[1:2]), ('heldout', ld.batches[:1]))}
  for split in ('train', 'heldout'):
    for k in ('n', 'base_rate', 'accuracy', 'balanced_accuracy', 'ece'):
      assert res[split][k] == pytest.approx(want[split][k], rel=1e-5, abs=1e-6), (split, k)
  assert want['train'] != want['heldout']  # two different batches
  with open(out['paths']['md'], encoding='utf-8') as f:
    rows = {l.split('|')[1].strip(): l for l in f if l.startswith('| ')}
  h = want['heldout']
  assert rows['held-out'].startswith(f"| held-out | {h['n']} | {h['base_rate']:.3f} | "
                                     f"{h['accuracy']:.3f} | {h['balanced_accuracy']:.3f} |")
