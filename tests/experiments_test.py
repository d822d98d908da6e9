"""The measurement experiments end to end on a tiny trained workdir."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import built_once, nll_np
from elastic_depth import calibrate, checkpoint, config as config_lib, decoding, frontier
from elastic_depth import train, train_step
from elastic_depth.data import synthetic
from elastic_depth import books, kl_probe, model as model_lib, oracle, policies, router as router_lib
from experiments import (bench_generate_quality, calibrate_eps, common, convergence, depth_oracle,
                         eval_depth, flags_util, sweep_eps, train_router)
from elastic_depth.config import ExitPolicy
from experiments import difficulty as difficulty_main

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def workdir(tmp_path_factory, make_config, worker_id):
  """A trained tiny workdir: trained once for both xdist workers, copied for this module."""
  cfg = make_config(train=dict(steps=20, eval_every=20, ckpt_every=20, log_every=10,
                               eval_batches=1, seq_len=16, eval_depths=(1, 4)),
                    depth=dict(buckets=(2, 4)))
  cfg = dataclasses.replace(cfg, data=config_lib.DataConfig(synth_examples=100,
                                                           val_fraction=0.5))
  shared = built_once(tmp_path_factory, worker_id, 'experiments_tiny',
                      lambda wd: train.run(cfg, wd, quiet=True))
  wd = str(tmp_path_factory.mktemp('tiny'))
  shutil.copytree(shared, wd, dirs_exist_ok=True)  # the tests write reports into it
  return wd


def _opts(wd, **kw):
  return common.Options(workdir=wd, batches=2, progress=False, **kw)


def _numbers(path):
  with open(path, encoding='utf-8') as f:
    doc = json.load(f)
  assert {'date', 'command', 'flags', 'checkpoint', 'results'} <= set(doc)
  return doc['results']


def test_config_round_trip(make_config):
  cfg = make_config()
  assert common.config_from_dict(train_step.config_dict(cfg)) == cfg
  assert common.config_from_dict({'depth': {'buckets': [1, 2]}, 'zzz': 1}).depth.buckets == (1, 2)


def test_three_reports_exist_parse_and_repeat_bit_identically(workdir):
  runs = [
      (eval_depth, _opts(workdir), (), 'eval_depth'),
      (convergence, _opts(workdir), (convergence.ConvergenceOptions(eps_conv=1e-3),),
       'convergence'),
      (sweep_eps, _opts(workdir), (sweep_eps.SweepOptions(
          eps_grid=[0.0, 1e-3, 1e9], delta=0.01, curves=('kl', 'state_delta'),
          state_delta_grid=[1e-2, 1e9], timing_repeats=0),), 'sweep_eps'),  # no clocks
  ]
  for mod, opts, x, name in runs:
    first = mod.run(opts, *x)
    for ext in ('json', 'md', 'png'):
      path = os.path.join(workdir, 'reports', f'{name}.{ext}')
      assert os.path.getsize(path) > 0, path
    res = _numbers(os.path.join(workdir, 'reports', f'{name}.json'))
    mod.run(opts, *x)
    assert _numbers(os.path.join(workdir, 'reports', f'{name}.json')) == res
    assert first['paths']['json'].endswith(f'{name}.json')
  el = _numbers(os.path.join(workdir, 'reports', 'eval_depth.json'))
  assert el['depths'] == [1, 2, 3, 4] and el['train_mean'] == 2.5
  sw = _numbers(os.path.join(workdir, 'reports', 'sweep_eps.json'))
  kl = sw['curves']['kl']
  assert kl['mean_loops'][0] == 4 and kl['mean_loops'][-1] == 2
  assert kl['loss'][0] == pytest.approx(el['loss'][-1], rel=1e-5)
  assert 'by_difficulty' in _numbers(os.path.join(workdir, 'reports', 'convergence.json'))


def test_missing_workdir_and_checkpoint_are_clear_errors(workdir, tmp_path):
  with pytest.raises(common.SetupError, match='does not exist'):
    common.load(_opts(str(tmp_path / 'nope')))
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(common.SetupError, match='no config.json'):
    common.load(_opts(str(empty)))
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    (empty / 'config.json').write_text(f.read())
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoints'):
    common.load(_opts(str(empty)))
  # the command line prints one line, no traceback
  out = subprocess.run([sys.executable, '-m', 'experiments.eval_depth',
                        f'--workdir={tmp_path / "nope"}'], cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=False)
  assert out.returncode == 2 and 'error:' in out.stderr and 'Traceback' not in out.stderr
  # a flag of the wrong type: absl's parse error as one line, exit 2 (was FATAL..., exit 1)
  out = subprocess.run([sys.executable, '-m', 'experiments.convergence', f'--workdir={workdir}',
                        '--step=abc'], cwd=REPO, capture_output=True, text=True, timeout=120,
                       check=False)
  assert out.returncode == 2 and out.stderr.startswith('error: flag --step=abc'), out.stderr
  assert len(out.stderr.strip().splitlines()) == 1
  # a tag that cannot end a file name is refused before any work (it crashed at the end)
  out = subprocess.run([sys.executable, '-m', 'experiments.eval_depth', f'--workdir={workdir}',
                        '--tag=a/b'], cwd=REPO, capture_output=True, text=True, timeout=120,
                       check=False)
  assert out.returncode == 2 and out.stderr.startswith("error: --tag='a/b'"), out.stderr
  # a data error written for pretrain names these mains' own --data_* flags (common.own_flags)
  out = subprocess.run([sys.executable, '-m', 'experiments.eval_depth', f'--workdir={workdir}',
                        '--data_source=text', f'--data_tokenizer={workdir}/tok.json'],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 2 and out.stderr.startswith('error: '), out.stderr
  assert '--config.data.' not in out.stderr and ' --data_' in out.stderr, out.stderr
  # a tag that would name the cached probe's files (kl_probe + _cached) is refused too
  out = subprocess.run([sys.executable, '-m', 'experiments.train_router', f'--workdir={workdir}',
                        '--probe=kl_probe', '--tag=cached'], cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=False)
  assert out.returncode == 2, out.stderr
  assert out.stderr.startswith("error: --tag='cached' would name"), out.stderr


def test_settings_the_model_cannot_score_are_refused_before_any_work(workdir):
  """--seq_len above max_len; --max_depth below the training mean where a report
  compares with uniform depth at that mean (the headline was mislabelled)."""
  cfg = common.load_config(workdir)
  with pytest.raises(common.SetupError, match=f'exceeds the model.s max_len={cfg.model.max_len}'):
    common.load(dataclasses.replace(_opts(workdir), seq_len=cfg.model.max_len + 1))
  low = int(cfg.depth.mean) - 1 if cfg.depth.mean == int(cfg.depth.mean) else int(cfg.depth.mean)
  assert 1 <= low < cfg.depth.mean
  opts = dataclasses.replace(_opts(workdir), max_depth=low, batches=1)
  for run in (lambda: sweep_eps.run(opts, sweep_eps.SweepOptions(eps_grid=(0.1,))),
              lambda: difficulty_main.run(opts),
              lambda: convergence.run(opts)):  # its "loss @mean" column held loss @R
    with pytest.raises(common.SetupError, match=f'--max_depth={low} is below the training '
                                                'mean depth'):
      run()


def test_data_overrides_keep_the_model_tokenizer(workdir, tmp_path):
  cfg = common.load_config(workdir)
  d, _ = common.resolve_data(cfg, workdir, {'synth_max_hops': '4'})
  assert d.synth_max_hops == 4 and d.source == 'synthetic'
  with pytest.raises(common.SetupError, match='synthetic vocabulary'):
    common.resolve_data(cfg, workdir, {'source': 'text', 'paths': 'x.txt'})
  with pytest.raises(common.SetupError, match='unknown data override'):
    common.resolve_data(cfg, workdir, {'nope': '1'})
  text_cfg = dataclasses.replace(cfg, data=config_lib.DataConfig(source='text', paths='a.txt'))
  with pytest.raises(common.SetupError, match='no tokenizer.json'):
    common.resolve_data(text_cfg, str(tmp_path), {'paths': 'b.txt'})
  (tmp_path / 'tokenizer.json').write_text('{}')
  d, _ = common.resolve_data(text_cfg, str(tmp_path), {'paths': 'b.txt'})
  assert d.tokenizer == str(tmp_path / 'tokenizer.json') and d.paths == 'b.txt'
  # another corpus while the checkpoint names its own validation files: refused unless the
  # text to score is named (before, the old validation files were scored in silence)
  held = dataclasses.replace(text_cfg, data=dataclasses.replace(text_cfg.data, val_paths='v.txt'))
  with pytest.raises(common.SetupError, match=r"data.val_paths \(v.txt\) would still"):
    common.resolve_data(held, str(tmp_path), {'paths': 'b.txt'})
  for val, want in (('b.txt', 'b.txt'), ('', '')):
    d, _ = common.resolve_data(held, str(tmp_path), {'paths': 'b.txt', 'val_paths': val})
    assert (d.paths, d.val_paths) == ('b.txt', want)
  # another vocabulary than the checkpoint's is refused (tokenizer fingerprint in the meta)
  with pytest.raises(checkpoint.CheckpointError, match='another tokenizer'):
    common.load(_opts(workdir, data={'synth_num_vars': '20'}))


def test_command_line_matches_in_process_run_bit_identically(workdir):
  ref = eval_depth.run(_opts(workdir, tag='inproc'))['results']
  out = subprocess.run([sys.executable, '-m', 'experiments.eval_depth', f'--workdir={workdir}',
                        '--quiet', '--batches=2', '--tag=cli', '--data_set=synth_max_hops=6'],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert _numbers(os.path.join(workdir, 'reports', 'eval_depth_cli.json')) == json.loads(
      json.dumps(ref))


def test_calibrate_eps_end_to_end_and_marked_on_the_sweep(workdir):
  x = calibrate_eps.CalibrateOptions(
      delta=0.5, alpha=0.2, risk=calibrate.Risk.LOSS, bound=4.0, cal_batches=1,
      pvalue=calibrate.PValue.HOEFFDING_BENTKUS, eps_grid=[1e-6, 1e-3, 1e9])
  out = calibrate_eps.run(_opts(workdir), x)
  res = _numbers(out['paths']['json'])
  assert res['cal_batches'] == [0] and res['test_batches'] == [1]  # disjoint splits
  # the p-values are the Hoeffding-Bentkus bound of each eps's mean calibration risk over
  # the calibration sequences, in grid order until the first above alpha; the chosen eps
  # is the last of the certified prefix
  n, risks = res['units'], res['calibration_risk_by_eps']
  assert n == 4 and len(risks) == 3  # one batch of 4 sequences
  ps = [calibrate.p_hoeffding_bentkus(r / 4.0, n, 0.5 / 4.0) for r in risks]
  stop = next((i for i, p in enumerate(ps) if p > 0.2), len(ps) - 1)
  np.testing.assert_allclose(res['p_values'], ps[:stop + 1], rtol=1e-12)
  j = next((i - 1 for i, p in enumerate(ps) if p > 0.2), len(ps) - 1)
  assert res['index'] == (None if j < 0 else j)
  assert res['eps'] == (None if j < 0 else x.eps_grid[j])
  assert risks[0] <= risks[-1]  # eps 1e9 exits every token at its first check
  if res['eps'] is not None:
    assert 1 <= res['heldout']['mean_loops'] <= res['r_max']
  sw = sweep_eps.run(_opts(workdir), sweep_eps.SweepOptions(
      eps_grid=[1e-3], delta=0.01, calibrated=True))['results']
  assert ('calibrated' in sw['curves']) == (res['eps'] is not None)
  with pytest.raises(common.SetupError, match='alpha'):
    calibrate_eps.run(_opts(workdir), dataclasses.replace(x, alpha=1.5))
  with pytest.raises(common.SetupError, match='--bound=inf must be finite'):
    calibrate_eps.run(_opts(workdir), dataclasses.replace(x, risk='loss', bound=float('inf')))
  with pytest.raises(common.SetupError, match='held out'):
    calibrate_eps.run(_opts(workdir), dataclasses.replace(x, cal_batches=2))


def test_router_is_fitted_on_batches_the_sweep_refuses_to_score(workdir):
  out = train_router.run(_opts(workdir), train_router.RouterOptions(
      steps=5, lr=1e-2, max_pairs=1000, fit_from=2, fit_batches=1))
  fit = _numbers(out['paths']['json'])['fit']
  assert fit['batches'] == [2]
  with open(out['router'], encoding='utf-8') as f:
    assert json.load(f)['fit']['tokens'] == fit['tokens']
  ok = sweep_eps.run(_opts(workdir), sweep_eps.SweepOptions(
      eps_grid=[1e-3], router=True, router_grid=[0.5]))['results']
  assert 'router' in ok['curves']  # batches 0..1: held out
  # a tagged fit names its probe as it names its report, and the untagged probe stays
  before = open(out['router'], 'rb').read()
  tagged = train_router.run(_opts(workdir, tag='t1'), train_router.RouterOptions(
      steps=5, lr=1e-2, max_pairs=1000, fit_from=3, fit_batches=1))
  assert tagged['router'] == os.path.join(workdir, 'router_t1.json')
  assert open(out['router'], 'rb').read() == before
  with open(tagged['router'], encoding='utf-8') as f:
    assert json.load(f)['fit']['batches'] == [3]
  assert _numbers(tagged['paths']['json'])['fit']['batches'] == [3]
  with pytest.raises(common.SetupError,
                     match='no .*router_t2.json; run .*train_router --tag=t2 --workdir='):
    sweep_eps.run(_opts(workdir, tag='t2'), sweep_eps.SweepOptions(eps_grid=[1e-3], router=True))
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
    sweep_eps.run(_opts(workdir), sweep_eps.SweepOptions(eps_grid=[1e-3], router=True))
  for k in ('w_D', 'mu_D', 'sd_D'):
    doc[k] = doc[k] + [0.0 if k != 'sd_D' else 1.0]
  with open(out['router'], 'w', encoding='utf-8') as f:
    json.dump(doc, f)
  with pytest.raises(common.SetupError, match='fitted on another model'):
    sweep_eps.run(_opts(workdir), sweep_eps.SweepOptions(eps_grid=[1e-3], router=True))


def test_kl_probe_is_fitted_then_swept_with_its_cost_in_the_books(workdir):
  """train_router --probe=kl_probe then sweep_eps --kl_probe: the curve is scored in both
  semantics, its books count the probe, and in-sample batches or a missing file are refused."""
  with pytest.raises(common.SetupError, match='--kl_probe: no .*--probe=kl_probe'):
    sweep_eps.run(_opts(workdir), sweep_eps.SweepOptions(eps_grid=[1e-3], kl_probe=True))
  for bad in (dict(exit_eps=(0.1,)), dict(loops=3), dict(objective='crossings')):
    with pytest.raises(common.SetupError, match="the KL probe's"):
      train_router.run(_opts(workdir), train_router.RouterOptions(**bad))
  for sem, loops in (('parallel', 0), ('cached', 3)):
    out = train_router.run(_opts(workdir), train_router.RouterOptions(
        steps=5, lr=1e-2, max_pairs=1000, fit_from=2, fit_batches=1, probe='kl_probe',
        rank=4, hidden=2, semantics=sem, loops=loops))
    res = _numbers(out['paths']['json'])
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
    out = train_router.run(_opts(workdir), train_router.RouterOptions(
        steps=5, lr=1e-2, max_pairs=1000, fit_from=2, fit_batches=1, probe='kl_probe',
        rank=4, hidden=2, semantics='cached', loops=3, fit_seed=seed, objective=obj))
    fits[seed, obj] = kl_probe.load(out['router'])
  assert not np.allclose(fits[1, 'squares'].a_RxDxK, fits[0, 'squares'].a_RxDxK)
  assert not np.allclose(fits[0, 'crossings'].a_RxDxK, fits[0, 'squares'].a_RxDxK)
  np.testing.assert_array_equal(fits[0, 'squares'].a_RxDxK, fits['first'].a_RxDxK)
  ok = sweep_eps.run(_opts(workdir), sweep_eps.SweepOptions(
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
  out = train_router.run(_opts(workdir), train_router.RouterOptions(
      steps=5, max_pairs=1000, fit_from=2, fit_batches=2, fit_split='train', probe='kl_probe',
      rank=4, loops=1))
  assert _numbers(out['paths']['json'])['fit']['split'] == 'train'
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


def test_bench_exit_on_a_checkpoint_matches_quality_then_times(workdir, tmp_path):
  """bench_exit --workdir: A1's eps is the most aggressive within 0.01 nats of A0."""
  out = tmp_path / 'exit.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.bench_exit', f'--workdir={workdir}',
       '--min_tokens=32', '--repeats=1', f'--out={out}'],
      cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  [r] = json.loads(out.read_text())['runs'].values()
  q = r['quality']
  assert q['loss'] <= q['a0_loss'] + 0.01 and q['mean_loops'] <= r['depth']
  assert r['eps'] == q['eps'] and r['fake_exit_fraction'] == 0.0
  assert r['tokens'] >= 32 and 'matched within' in (tmp_path / 'exit.md').read_text()



def test_bench_generate_forced_decoding_reports_the_timed_calls_loss(workdir, tmp_path):
  """bench_generate --decode_tokens=forced: every engine decodes the validation text after
  its prompt; A0's loss equals cached scoring of those windows at uniform depth (float64
  NLL here), and the A1 engines, which run the same tokens to the same depths, agree."""
  out = tmp_path / 'forced.json'
  cmd = [sys.executable, '-m', 'experiments.bench_generate', '--batch_sizes=2',
         f'--workdir={workdir}', '--batches=1', '--new_tokens=4', '--prompt_len=4',
         '--repeats=1', '--exit_policy=state_delta', '--decode_tokens=forced', f'--out={out}',
         '--quality_tol=0.2']  # wide enough that a uniform depth below A0's matches
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  doc = json.loads(out.read_text())
  rows = doc['batches']['2']
  assert doc['decode_tokens'] == 'forced' and 'Forced decoding' in (tmp_path / 'forced.md').read_text()
  a1 = [rows[k]['forced_loss'] for k in ('a1_depthwise', 'a1_waiting', 'a1_allrows', 'a1_lockstep')]
  assert max(a1) - min(a1) < 1e-5
  loaded = common.load(common.Options(workdir=workdir, batches=1, progress=False))
  val = list(loaded.data.val_batches())
  toks = np.concatenate([np.asarray(b['inputs']) for b in val])[:2, :8]
  w = np.concatenate([np.asarray(b['mask'], np.float64) for b in val])[:2, 3:7]
  a0 = config_lib.ExitConfig(policy='uniform', depth=doc['a0_depth'])
  logits, _, _ = decoding.score_cached(loaded.model, jnp.asarray(toks), 4, a0, jax.random.key(0))
  nll = nll_np(logits, toks[:, 4:])
  assert rows['a0']['forced_loss'] == pytest.approx((nll * w).sum() / w.sum(), rel=1e-4)
  assert rows['a0']['forced_tokens'] == w.sum() > 0
  # quality in the timed calls' semantics: forced decoding of every validation window (the
  # 4-token prompt prefilled, then a Python loop of decode_step; float64 NLL here), for A0,
  # A1's eps and the frontier's baseline: the smallest uniform decode depth within
  # --quality_tol of A0, its prompt prefilled at A0's depth
  q = doc['quality']
  every = np.concatenate([np.asarray(b['inputs']) for b in val])[:, :8]
  w_all = np.concatenate([np.asarray(b['mask'], np.float64) for b in val])[:, 3:7]
  key = jax.random.key(0)

  def forced_loss(cfg, prefill_cfg=None, rows=None):
    t, w_ = every[:rows], w_all[:rows]
    cache, logits, _ = decoding.prefill(loaded.model, jnp.asarray(t[:, :4]),
                                        prefill_cfg or cfg, key, 8)
    init, tot = decoding.initial_states(loaded.model, key, 8), 0.0
    for j in range(4):
      tot += (nll_np(logits[:, None], t[:, 4 + j:5 + j])[:, 0] * w_[:, j]).sum()
      logits, cache, _ = decoding.decode_step(loaded.model, cache, jnp.asarray(t[:, 4 + j]),
                                              4 + j, cfg, key, init_table=init)
    return tot / w_.sum()
  uni = lambda d: config_lib.ExitConfig(policy='uniform', depth=d)
  a0_depth = doc['a0_depth']
  ref = {d: forced_loss(uni(d), uni(a0_depth)) for d in range(1, a0_depth + 1)}
  want = min(d for d in ref if ref[d] <= ref[a0_depth] + q['tol'])
  assert q['match_depth'] == want and q['match_loss'] == pytest.approx(ref[want], rel=1e-4)
  assert q['a0_loss'] == pytest.approx(ref[a0_depth], rel=1e-4)
  a1 = config_lib.ExitConfig(policy='state_delta', eps=q['eps'], max_loops=doc['r_max'])
  assert q['a1_loss'] == pytest.approx(forced_loss(a1), rel=1e-4)
  assert q['quality_on'].startswith(f'forced decoding of {len(every)} validation windows')
  assert want < a0_depth and doc['match_key'] == 'a0_match'  # timed beside the others
  assert rows['a0_match']['forced_loss'] == pytest.approx(
      forced_loss(uni(want), uni(a0_depth), rows=2), rel=1e-4)
  u = rows[doc['match_key']]
  assert u['mean_loops'] == want and 'The frontier' in (tmp_path / 'forced.md').read_text()
  for k in ('a1_depthwise', 'a1_waiting', 'a1_lockstep'):
    assert rows[k]['speed_vs_match'] == pytest.approx(u['seconds'] / rows[k]['seconds'])
  bad = subprocess.run(cmd[:4] + ['--serve_shape=nano', '--decode_tokens=forced'], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)
  assert bad.returncode != 0 and 'needs --workdir' in bad.stderr

def test_generate_cli_streams_the_tokens_and_depths_of_generate(workdir):
  """experiments.generate prints decoding.generate's greedy tokens with their depths (its
  prompt prefilled by the pooled engine, decoding.generate's by the masked one)."""
  cmd = [sys.executable, '-m', 'experiments.generate', f'--workdir={workdir}',
         '--prompt=? 3 1 4 =', '--max_new_tokens=4', '--eps=1e-3', '--show_depths',
         '--prefill_engine=pooled']
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  pieces = re.findall(r'(\S+)\[(\d+)\]', out.stdout.splitlines()[0])
  cfg, mdl, _, _ = common.load_model(workdir)
  vocab = synthetic.SyntheticVocab(cfg.data.synth_num_vars)
  prompt = jnp.asarray(vocab.encode_batch(['? 3 1 4 ='])[0][None])
  ecfg = config_lib.ExitConfig(policy='kl', eps=1e-3, max_loops=cfg.depth.r_max)
  toks, depth = decoding.generate(mdl, prompt, 4, ecfg, jax.random.key(0))
  assert [p[0] for p in pieces] == [vocab.id_to_token(t) for t in toks[0, 5:]]
  assert [int(p[1]) for p in pieces] == [int(d) for d in depth[0]]
  bad = subprocess.run(cmd[:5] + ['--max_new_tokens=0'], cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=False)
  assert bad.returncode == 2 and bad.stderr.startswith('error: --max_new_tokens')
  # two prompts, the state-change check, exited rows waiting for each other: each row's
  # tokens and depths are its own decoding.generate's
  texts = ['? 3 1 4 =', '? 2 =']
  two = subprocess.run(cmd[:4] + [f'--prompt={x}' for x in texts] + [
      '--max_new_tokens=3', '--eps=0.3', '--show_depths', '--exit_policy=state_delta',
      '--wait_rows=2'], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert two.returncode == 0, two.stderr[-3000:]
  rows = re.findall(r'^(\d): (\S+)\[(\d+)\]$', two.stdout, re.M)
  sd = config_lib.ExitConfig(policy='state_delta', eps=0.3, max_loops=cfg.depth.r_max)
  for r, text in enumerate(texts):
    p = jnp.asarray(vocab.encode_batch([text])[0][None])
    toks, depth = decoding.generate(mdl, p, 3, sd, jax.random.key(0))
    got = [(t, int(d)) for row, t, d in rows if int(row) == r]
    assert got == [(vocab.id_to_token(t), int(d)) for t, d in zip(toks[0, p.shape[1]:], depth[0])]


def test_generate_cli_samples_each_prompt_with_its_own_seed(workdir):
  """--temperature > 0: prompt i samples with the seed --seed + i (under the key of --seed),
  so one prompt given twice prints two continuations, each decoding.generate's (ids the
  tokenizer lacks, which the barely trained model samples, as <id:i>)."""
  text = '? 3 1 4 ='
  cmd = [sys.executable, '-m', 'experiments.generate', f'--workdir={workdir}',
         f'--prompt={text}', f'--prompt={text}', '--max_new_tokens=4', '--eps=1e-3',
         '--temperature=2', '--seed=3']
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = re.findall(r'^(\d): (\S+)$', out.stdout, re.M)
  cfg, mdl, _, _ = common.load_model(workdir)
  vocab = synthetic.SyntheticVocab(cfg.data.synth_num_vars)
  prompt = jnp.asarray(vocab.encode_batch([text] * 2))
  ecfg = config_lib.ExitConfig(policy='kl', eps=1e-3, max_loops=cfg.depth.r_max)
  toks, _ = decoding.generate(mdl, prompt, 4, ecfg, jax.random.key(3), temperature=2.0,
                              seed_B=jnp.asarray([3, 4]))
  piece = lambda t: vocab.id_to_token(t) if t < vocab.vocab_size else f'<id:{t}>'
  want = [[piece(int(t)) for t in row[prompt.shape[1]:]] for row in toks]
  assert [[t for r, t in rows if int(r) == i] for i in range(2)] == want
  assert want[0] != want[1]


def test_sweep_list_flags_name_a_bad_value():
  assert sweep_eps._positive_ints(['1', '3'], 'min_loops') == (1, 3)
  for bad in (['0'], ['x'], ['2', '-1']):
    with pytest.raises(common.SetupError, match='--min_loops: want positive integers'):
      sweep_eps._positive_ints(bad, 'min_loops')
  assert sweep_eps._growths(['1', '2.5']) == (1.0, 2.5)
  for bad in (['0'], ['-2']):
    with pytest.raises(common.SetupError, match='--eps_growth: want positive numbers'):
      sweep_eps._growths(bad)


def test_sweep_refuses_an_unknown_curve_before_loading_anything(tmp_path):
  missing = str(tmp_path / 'no_such_workdir')  # the curve is named first: nothing is read
  with pytest.raises(common.SetupError, match=r"--curves: unknown \['klx'\]; choose from kl, "):
    sweep_eps.run(_opts(missing), sweep_eps.SweepOptions(curves=('kl', 'klx')))
  # an empty list flag is refused too (it crashed after scoring, or wrote an empty report)
  for field in ('eps_grid', 'state_delta_grid', 'router_grid', 'semantics'):
    with pytest.raises(common.SetupError, match=f'--{field} is empty'):
      sweep_eps.run(_opts(missing), sweep_eps.SweepOptions(**{field: ()}))
  assert set(frontier.BUILTIN_CURVES) == set(frontier._grids((), None, None))


def test_sweep_in_cached_semantics_reports_its_own_a0(workdir):
  """sweep_eps --semantics=cached: the report carries A0 in cached semantics (a table in
  the markdown) and judges the @cached curve against it; state_delta at a huge threshold
  exits every token at loop 2, so its loss is cached A0's at depth 2."""
  out = sweep_eps.run(_opts(workdir, tag='cached'), sweep_eps.SweepOptions(
      curves=('state_delta',), state_delta_grid=[1e9], semantics=('parallel', 'cached'),
      timing_repeats=0))
  sw = _numbers(out['paths']['json'])
  a0c = sw['a0_cached']
  assert a0c['threshold'] == list(range(1, sw['r_max'] + 1))
  c = sw['curves']['state_delta@cached']
  assert c['mean_loops'] == [2.0] and c['loss'][0] == pytest.approx(a0c['loss'][1], rel=1e-5)
  fr = sw['headline']['state_delta@cached']['frontier']
  assert fr['a0_loss_same_loops'][0] == pytest.approx(a0c['loss'][1])
  with open(out['paths']['md'], encoding='utf-8') as f:
    assert 'cached semantics' in f.read()


def test_depth_oracle_pool_has_difficulty_only_where_the_data_labels_it():
  """Text windows carry difficulty -1 everywhere: no 'k', so label rules cannot run on
  them (they once ran every answer at depth max(-1 + 1, 1))."""
  rng = np.random.default_rng(0)
  batch = lambda diff: {'inputs': rng.integers(0, 9, (2, 12)), 'mask': np.ones((2, 12)),
                        'difficulty': diff}
  text = depth_oracle.pool_of([batch(np.full((2, 12), -1))], 4, 6)
  assert 'k' not in text
  labels = np.full((2, 12), -1)
  labels[0, 5] = 2
  synth = depth_oracle.pool_of([batch(labels)], 4, 6)
  np.testing.assert_array_equal(synth['k'], labels[:, 3:9])


def test_depth_oracle_reports_rules_beside_uniform_depth(workdir):
  """experiments.depth_oracle: a uniform:d point is the forced decoding of the validation
  windows at depth d (a Python loop of decode_step, float64 NLL, the prompt at the prefill
  depth); the split rule's loops by class are its depths; bad rules and a too-long window
  are one-line errors before any decoding."""
  x = depth_oracle.OracleOptions(schedules=('uniform:1', 'uniform:3', 'split:3,1',
                                            'lookahead:0.01'),
                                 prompt_len=4, new_tokens=4, prefill_depth=2)
  out = depth_oracle.run(common.Options(workdir=workdir, batches=1, progress=False, tag='oracle'), x)
  pts = {p['schedule']: p for p in out['results']['points']}
  loaded = common.load(common.Options(workdir=workdir, batches=1, progress=False))
  b = loaded.batches[0]
  toks, w = np.asarray(b['inputs'])[:, :8], np.asarray(b['mask'], np.float64)[:, 3:7]
  key, uni = jax.random.key(0), lambda d: config_lib.ExitConfig(policy='uniform', depth=d)
  for d in (1, 3):
    cache, logits, _ = decoding.prefill(loaded.model, jnp.asarray(toks[:, :4]), uni(2), key, 8)
    init, tot = decoding.initial_states(loaded.model, key, 8), 0.0
    for j in range(4):
      tot += (nll_np(logits[:, None], toks[:, 4 + j:5 + j])[:, 0] * w[:, j]).sum()
      logits, cache, _ = decoding.decode_step(loaded.model, cache, jnp.asarray(toks[:, 4 + j]),
                                              4 + j, uni(d), key, init_table=init)
    assert pts[f'uniform:{d}']['loss'] == pytest.approx(tot / w.sum(), rel=1e-4)
    assert pts[f'uniform:{d}']['mean_loops'] == d and pts[f'uniform:{d}']['gap'] == 0
  split = pts['split:3,1']
  assert split['loops_answer'] == 3 and split['loops_other'] == 1
  share = (w[:, 1:] > 0).sum() / w.size  # the last decoded token predicts no scored target
  assert split['mean_loops'] == pytest.approx(1 + 2 * share)
  # the lookahead point is oracle.lookahead_decode's (its rule brute-forced in oracle_test)
  nll, depth = oracle.lookahead_decode(loaded.model, jnp.asarray(toks[:, :4]),
                                       jnp.asarray(toks[:, 4:8]), 0.01, loaded.r_max, key,
                                       uni(2))
  look = pts['lookahead:0.01']
  assert look['loss'] == pytest.approx((np.asarray(nll, np.float64) * w).sum() / w.sum(),
                                       rel=1e-4)
  assert look['mean_loops'] == pytest.approx(float(np.mean(depth)))
  assert os.path.exists(out['paths']['png']) and 'lookahead:0.01' in open(
      out['paths']['md'], encoding='utf-8').read()
  for bad, words in [(dict(schedules=('deep:2',)), 'unknown depth rule'),
                     (dict(new_tokens=100), 'must fit the validation windows'),
                     (dict(prefill_depth=-1), 'prefill_depth must be >= 0')]:
    with pytest.raises(common.SetupError, match=words):
      depth_oracle.run(_opts(workdir), dataclasses.replace(x, **bad))


@pytest.mark.parametrize('text, words', [
    ('{"model": {"d_model": 8', 'not readable JSON'),
    (b'\xa8\xff\x00', 'not readable JSON'),
    ('', 'not readable JSON'),
    ('[1, 2]', 'holds a list'),
    ('{"model": null}', 'not a valid run config'),
    ('{"model": {"init_state": "bogus"}}', "'bogus' is not a valid InitState"),
    ('{"model": {"d_model": -5}}', 'model.d_model=-5 must be an integer >= 1'),
])
def test_a_bad_config_json_is_named_before_the_checkpoint_is_read(tmp_path, text, words):
  (tmp_path / 'config.json').write_bytes(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(common.SetupError, match=words):
    common.load(_opts(str(tmp_path)))


def test_bad_numbers_are_refused_before_any_work(workdir, tmp_path):
  """NaN, infinities and out-of-range settings: a SetupError before the workdir is read
  (a missing one here), or, for what needs the model's loop cap, right after loading."""
  missing = _opts(str(tmp_path / 'no_such_workdir'))
  with pytest.raises(common.SetupError, match='--eps_conv=nan must be a finite'):
    convergence.run(missing, convergence.ConvergenceOptions(eps_conv=float('nan')))
  for kw in (dict(lr=float('nan')), dict(steps=0), dict(max_pairs=-1)):
    with pytest.raises(common.SetupError, match='router_steps=.* and --max_pairs'):
      train_router.run(missing, train_router.RouterOptions(**kw))
  with pytest.raises(common.SetupError, match='< 1 for --risk=argmax'):
    calibrate_eps.check(calibrate_eps.CalibrateOptions(risk=calibrate.Risk.ARGMAX, delta=5.0))
  for xs in (['nan'], ['1e-3', 'inf'], ['-1']):
    with pytest.raises(common.SetupError, match='--eps_grid: want finite numbers >= 0'):
      sweep_eps._floats(xs, 'eps_grid')
  with pytest.raises(common.SetupError, match='--eps_growth: want finite'):
    sweep_eps._growths(['nan'])
  with pytest.raises(common.SetupError, match=r'loop cap 4 .*uniform:9, --prefill_depth=7'):
    depth_oracle.run(_opts(workdir), depth_oracle.OracleOptions(
        schedules=('uniform:2', 'uniform:9'), prompt_len=4, new_tokens=4, prefill_depth=7))


def test_a_diverged_probe_fit_leaves_the_saved_probe_alone(tmp_path):
  path = tmp_path / 'kl_probe.json'
  path.write_text('{"good": 1}')
  probe = router_lib.Router(w_D=np.array([1.0, np.nan]), b=np.array(0.0), mu_D=np.zeros(2),
                           sd_D=np.ones(2))
  with pytest.raises(common.SetupError, match='diverged .* left as it was'):
    train_router._refuse_non_finite(probe, str(path))  # pylint: disable=protected-access
  assert path.read_text() == '{"good": 1}'


def test_saturation_reads_eval_depth_reports_and_refuses_bad_ones(tmp_path):
  """The saturation depth is the smallest depth within delta of the best loss (brute force
  here); an empty or non-finite loss list, or a stray argument, is one line, exit 2."""
  from elastic_depth import reports  # pylint: disable=g-import-not-at-top
  good, bad = str(tmp_path / 'good'), str(tmp_path / 'bad')
  loss = [3.0, 2.5, 2.31, 2.30, 2.305]
  reports.write(good, 'eval_depth', dict(depths=[1, 2, 3, 4, 5], loss=loss, train_mean=4),
                flags={}, checkpoint={}, markdown='')
  reports.write(bad, 'eval_depth', dict(depths=[1, 2], loss=[2.0, float('nan')], train_mean=2),
                flags={}, checkpoint={}, markdown='')
  run = lambda *a: subprocess.run([sys.executable, '-m', 'experiments.saturation', *a],
                                  cwd=REPO, capture_output=True, text=True, timeout=120,
                                  check=False)
  out = run(f'--workdirs={good}', f'--out={tmp_path / "sat"}', '--delta=0.02')
  assert out.returncode == 0, out.stderr[-3000:]
  got = _numbers(str(tmp_path / 'sat' / 'reports' / 'saturation.json'))[good]['saturation']
  assert got == min(d for d, l in zip(range(1, 6), loss) if l <= min(loss) + 0.02) == 3
  # a tagged run reads and writes tagged files, beside the untagged ones (it overwrote them)
  reports.write(good, 'eval_depth_fw', dict(depths=[1, 2], loss=[2.0, 1.0], train_mean=2),
                flags={}, checkpoint={}, markdown='')
  out = run(f'--workdirs={good}', f'--out={tmp_path / "sat"}', '--tag=fw')
  assert out.returncode == 0, out.stderr[-3000:]
  assert _numbers(str(tmp_path / 'sat' / 'reports' / 'saturation_fw.json'))[good]['saturation'] == 2
  assert _numbers(str(tmp_path / 'sat' / 'reports' / 'saturation.json'))[good]['saturation'] == 3
  md = (tmp_path / 'sat' / 'reports' / 'saturation_fw.md').read_text()
  assert 'reports/eval_depth_fw.json' in md
  for args, words in (([f'--workdirs={bad}'], 'empty, missing or not finite'),
                      ([f'--workdirs={good}', 'stray'], "unexpected arguments ['stray']")):
    out = run(*args, f'--out={tmp_path / "sat2"}')
    assert out.returncode == 2 and words in out.stderr, out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1


def test_data_errors_name_the_measurement_mains_own_flags():
  """A DataError written for pretrain (--config.data.X) names --data_X or --data_set=X,
  flags these mains define, for every --config.data.* hint the data package gives."""
  import glob as glob_lib  # pylint: disable=g-import-not-at-top
  from absl import flags as absl_flags  # pylint: disable=g-import-not-at-top
  hints = set()
  for path in glob_lib.glob(os.path.join(REPO, 'elastic_depth', 'data', '*.py')):
    with open(path, encoding='utf-8') as f:
      hints |= set(re.findall(r'--config\.data\.(\w+)', f.read()))
  assert {'paths', 'source', 'loss_on', 'hf_name'} <= hints
  fields = {f.name for f in dataclasses.fields(config_lib.DataConfig)}
  for field in sorted(hints):
    got = common.own_flags(f'needs --config.data.{field}=X')
    flag = re.search(r'--(\w+)', got).group(1)
    assert flag in absl_flags.FLAGS, got
    if flag == 'data_set':
      assert got.endswith(f'--data_set={field}=X') and field in fields
    else:
      assert flag == f'data_{field}', got


@pytest.mark.parametrize('module', [calibrate_eps, convergence, depth_oracle, eval_depth,
                                    sweep_eps, train_router, difficulty_main])
def test_measurement_mains_show_the_shared_flags_in_helpshort(module):
  """--helpshort (what a parse error points to) lists --workdir, --max_depth, --data_*."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  names = {f.name for f in flags.FLAGS.get_key_flags_for_module(module.__name__)}
  assert {'workdir', 'max_depth', 'batches', 'data_paths', 'data_val_paths'} <= names, names


def test_report_plots_show_what_their_data_holds():
  """depth_oracle without uniform schedules: no empty 'uniform depth' legend entry, and the
  table says why its gaps are empty; calibrate_eps keeps eps = 0 on its axis (a log axis
  dropped the only eps a grid may certify)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  pts = [dict(rule='kl', schedule=f'kl:{e}', mean_loops=m, loss=l, loops_answer=m,
              loops_other=m, uniform_loss=None, gap=None) for e, m, l in
         ((0.01, 2.0, 0.5), (0.1, 1.5, 0.7))]
  res = dict(points=pts, workdir='w', step=1, windows=2, prompt_len=4, prefill_depth=2,
             new_tokens=4, answer_share=0.5)
  fig = figure.Figure()
  depth_oracle.plot(res)(fig)
  labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert labels == ['kl'], labels
  assert 'at least two uniform schedules' in depth_oracle.markdown(res)
  grid = [0.0, 1e-4, 1e-3, 1e-2]
  fig = figure.Figure()
  calibrate_eps._plot(dict(eps_grid=grid, calibration_risk_by_eps=[0.0, 0.01, 0.02, 0.2],
                           delta=0.05, eps=1e-3, risk='loss'))(fig)
  ax = fig.axes[0]
  x = ax.lines[0].get_xdata()
  lo, hi = ax.get_xlim()
  assert list(x) == grid and ax.get_xscale() == 'symlog' and lo <= 0.0 <= hi


def test_a_calibrated_eps_is_starred_only_where_it_was_certified(workdir):
  """sweep_eps marks calibrate_eps's eps only for the step, depth cap and data it was
  certified on (its guarantee is about those); else a clear refusal (it starred it)."""
  from elastic_depth import reports  # pylint: disable=g-import-not-at-top
  opts = _opts(workdir, tag='starcheck')
  ld = common.load(opts)
  info = ld.checkpoint_info()

  def report(step_shift=0, r_max_shift=0, data=None):
    reports.write(workdir, 'calibrate_eps_starcheck', {'eps': 1e-3},
                  flags={'r_max': ld.r_max + r_max_shift},
                  checkpoint={**info, 'step': ld.step + step_shift,
                              'data_config': data or info['data_config']}, markdown='')
  report()
  got = sweep_eps._calibrated(opts, ld)
  assert got['calibrated'].policy == 'kl' and list(got['calibrated'].thresholds) == [1e-3]
  for kw, words in ((dict(step_shift=1), f'another step .step {ld.step + 1} vs {ld.step}'),
                    (dict(r_max_shift=1), 'another max depth'),
                    (dict(data={**info['data_config'], 'seed': 99}),
                     'another data .other data settings')):
    report(**kw)
    with pytest.raises(common.SetupError, match=words):
      sweep_eps._calibrated(opts, ld)


def _uniform_losses(by_depth):
  """A quality function: uniform depth d -> by_depth[d]; exit eps -> by_eps[eps]."""
  def make(by_eps):
    def loss(policy, eps, depth, prefill_depth=None):
      if policy == ExitPolicy.UNIFORM:
        return by_depth[depth]
      return by_eps[eps]
    return loss
  return make


def test_cheapest_uniform_takes_a_depth_exactly_at_the_tolerance():
  """Within tol means <= a0 + tol: a depth at exactly a0 + tol matches (brute force)."""
  by_depth = {1: 3.0, 2: 2.5, 3: 2.25, 4: 2.0}
  loss = _uniform_losses(by_depth)({})
  want = min(d for d in range(1, 5) if by_depth[d] <= by_depth[4] + 0.5)
  assert want == 2
  got = bench_generate_quality.cheapest_uniform(loss, 4, 2.0, 0.5)
  assert got['match_depth'] == want and got['match_loss'] == 2.5
  none = bench_generate_quality.cheapest_uniform(loss, 4, 2.0, 0.1)
  assert none['match_depth'] == 4 and none['match_loss'] == 2.0


def test_matched_eps_is_the_most_aggressive_within_tol_else_the_safest():
  by_depth = {1: 3.0, 2: 2.5, 3: 2.25, 4: 2.0}
  grid = [1e-3, 1e-1, 1e-2]  # any order
  # two thresholds within tol: the larger (most aggressive) one
  by_eps = {1e-1: 2.5, 1e-2: 2.005, 1e-3: 2.001}
  got = bench_generate_quality.matched(_uniform_losses(by_depth)(by_eps), 4, 8, 'kl', grid, 0.01)
  want = max(e for e in grid if by_eps[e] <= 2.0 + 0.01)
  assert got['eps'] == want == 1e-2 and got['matched'] is True
  assert got['a1_loss'] == 2.005 and got['a0_loss'] == 2.0
  # none within tol: the smallest eps of the grid (closest to full depth), flagged unmatched
  by_eps = {1e-1: 2.5, 1e-2: 2.3, 1e-3: 2.2}
  got = bench_generate_quality.matched(_uniform_losses(by_depth)(by_eps), 4, 8, 'kl', grid, 0.01)
  assert got['eps'] == min(grid) and got['matched'] is False and got['a1_loss'] == 2.2


def test_check_reaches_mean_allows_a_cap_equal_to_the_training_mean():
  cfg = config_lib.Config(depth=config_lib.DepthConfig(mean=2.0, r_max=4, buckets=(1, 2, 4)))
  ld = types.SimpleNamespace(cfg=cfg, r_max=2)
  common.check_reaches_mean(ld, 'x')  # r_max == mean: reached
  with pytest.raises(common.SetupError, match='below the training mean depth 2'):
    common.check_reaches_mean(types.SimpleNamespace(cfg=cfg, r_max=1), 'x')
  # r_max clips the draws: the mean training ran at is r_max, min(mean, r_max)
  clipped = config_lib.Config(depth=config_lib.DepthConfig(mean=6.0, r_max=4, buckets=(1, 2, 4)))
  assert common.train_mean(clipped) == 4
  common.check_reaches_mean(types.SimpleNamespace(cfg=clipped, r_max=4), 'x')


def test_calibration_split_must_leave_a_held_out_batch():
  x = calibrate_eps.CalibrateOptions()
  assert calibrate_eps.check(x, 4) == 2 and calibrate_eps.check(x, 3) == 1
  assert calibrate_eps.check(calibrate_eps.CalibrateOptions(cal_batches=3), 4) == 3
  for n_cal, n in ((4, 4), (5, 4), (0, 1)):
    with pytest.raises(common.SetupError, match='held out'):
      calibrate_eps.check(calibrate_eps.CalibrateOptions(cal_batches=n_cal), n)


def test_float_flags_accept_their_lower_bound():
  """eps = 0 (every check exits at once) is a valid grid point: lower is inclusive."""
  assert flags_util.floats(['0', '1e-3'], 'eps_grid', ValueError, lower=0.0) == [0.0, 1e-3]
  with pytest.raises(ValueError, match='>= 0'):
    flags_util.floats(['-1e-9'], 'eps_grid', ValueError, lower=0.0)


def _with_mean(workdir, tmp_path, mean: float):
  """A copy of the workdir whose config.json says depth.mean = mean: (its path, that config)."""
  wd = str(tmp_path / f'mean{mean}')
  shutil.copytree(workdir, wd)
  path = os.path.join(wd, 'config.json')
  with open(path, encoding='utf-8') as f:
    cfg = json.load(f)
  cfg['depth']['mean'] = mean
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(cfg, f)
  return wd, cfg


def test_eval_depth_reference_depth_is_the_rounded_training_mean(workdir, tmp_path):
  """ref_depth rounds the training mean (3.6 -> 4), as convergence's and difficulty's do;
  the fixture's 2.5 cannot tell rounding from truncation."""
  wd, _ = _with_mean(workdir, tmp_path, 3.6)
  res = eval_depth.run(_opts(wd))['results']
  assert res['train_mean'] == 3.6 and res['ref_depth'] == round(3.6) == 4


def test_saturation_depth_and_table_by_brute_force_over_each_runs_losses(tmp_path, main_cases):
  """The saturation depth is the smallest depth within delta of the run's best loss (not its
  deepest one's), delta = 0 included; the table's loss @d and best columns are the report's;
  a report whose losses and depths differ in length is refused."""
  from elastic_depth import reports  # pylint: disable=g-import-not-at-top
  run, bad = str(tmp_path / 'run'), str(tmp_path / 'bad')
  depths, loss = [1, 2, 4, 8], [3.0, 2.15, 2.0, 2.1]  # the best is not the deepest
  reports.write(run, 'eval_depth', dict(depths=depths, loss=loss, train_mean=4), flags={},
                checkpoint={}, markdown='')
  reports.write(bad, 'eval_depth', dict(depths=[1, 2], loss=[2.0, 1.0, 0.5], train_mean=2),
                flags={}, checkpoint={}, markdown='')
  deltas = (0.1, 0.0)
  cases = [[f'--workdirs={run}', f'--delta={d}', f'--out={tmp_path / str(d)}'] for d in deltas]
  res = main_cases('experiments.saturation', cases + [[f'--workdirs={bad}', '--out={tmp}']])
  for delta, r in zip(deltas, res):
    assert r['rc'] == 0, r['stderr'][-3000:]
    want = min(d for d, l in zip(depths, loss) if l <= min(loss) + delta)
    out = tmp_path / str(delta) / 'reports'
    assert _numbers(str(out / 'saturation.json'))[run]['saturation'] == want
    md = (out / 'saturation.md').read_text().splitlines()
    [row] = [l for l in md if l.startswith(f'| {run} ')]
    cells = [c.strip() for c in row.strip('|').split('|')]
    at = dict(zip(depths, loss))
    assert cells[2:] == [str(want)] + [f'{at[d]:.4f}' for d in (1, 2, 4, 8)] + [f'{min(loss):.4f}']
  assert res[2]['rc'] == 2 and 'empty, missing or not finite' in res[2]['stderr'], res[2]['stderr']


def test_eval_depth_counts_the_scored_tokens_and_prints_the_best_depth(workdir, capsys):
  """tokens counts the targets the loss weighs (mask > 0: answers only here), not every
  position; the printed best depth is the one of least loss."""
  opts = _opts(workdir, tag='answers', data={'loss_on': 'answers'})
  res = eval_depth.run(opts)['results']
  mask = np.concatenate([np.asarray(b['mask']) for b in common.load(opts).batches])
  assert 0 < res['tokens'] == int((mask > 0).sum()) < mask.size
  best = int(np.argmin(np.asarray(res['loss'], np.float64)))
  assert (f"best depth {res['depths'][best]} ({res['loss'][best]:.4f})"
          in capsys.readouterr().out)


def test_depth_oracle_pool_weighs_each_forced_token_by_the_mask_that_predicts_it():
  """pool_of by brute force: forced token j sits at position p + j of its window and is
  predicted at position p + j - 1 (its weight that position's mask); a prompt and text that
  fill the window exactly fit; text whose only scored token is predicted by the prefill
  measures no decoding and is refused."""
  rng = np.random.default_rng(1)
  batches = [{'inputs': rng.integers(0, 9, (2, 12)), 'mask': rng.integers(0, 2, (2, 12))}
             for _ in range(2)]
  p, n = 4, 8  # p + n = the window's 12 tokens
  pool = depth_oracle.pool_of(batches, p, n)
  rows = [(b['inputs'][i], b['mask'][i]) for b in batches for i in range(2)]
  for r, (toks, mask) in enumerate(rows):
    assert list(pool['prompt'][r]) == [toks[t] for t in range(p)]
    for j in range(n):
      assert pool['forced'][r, j] == toks[p + j] and pool['weight'][r, j] == mask[p + j - 1]
  first_only = [{'inputs': b['inputs'], 'mask': np.zeros((2, 12))} for b in batches]
  first_only[0]['mask'][:, p - 1] = 1  # scores forced token 0, predicted by the prefill
  with pytest.raises(common.SetupError, match='holds no scored token'):
    depth_oracle.pool_of(first_only, p, n)


def test_depth_oracle_markdown_is_cheapest_first_and_gaps_need_two_uniform_points():
  pts = [dict(rule=r, schedule=s, mean_loops=m, loss=1.0, loops_answer=m, loops_other=m,
              uniform_loss=None, gap=None)
         for r, s, m in (('kl', 'kl:0.1', 3.0), ('uniform', 'uniform:2', 2.0),
                         ('split', 'split:3,1', 2.5))]
  res = dict(points=pts, workdir='w', step=1, windows=2, prompt_len=4, prefill_depth=2,
             new_tokens=4, answer_share=0.5)
  md = depth_oracle.markdown(res)
  named = [l.split('|')[1].strip() for l in md.splitlines() if l.startswith('| ')][1:]
  assert named == [p['schedule'] for p in sorted(pts, key=lambda p: p['mean_loops'])]
  assert 'at least two uniform schedules' in md  # one uniform point: nothing to interpolate
  pts.append(dict(pts[1], schedule='uniform:3', mean_loops=3.0))
  assert 'at least two uniform schedules' not in depth_oracle.markdown(res)


def test_depth_oracle_prefills_at_the_rounded_mean_and_may_decode_at_the_loop_cap(workdir,
                                                                                    tmp_path):
  """--prefill_depth=0 prefills at the training mean rounded (3.6 -> 4, not 3), and depths
  equal to the loop cap (4 here) are allowed, for schedules and the prefill alike."""
  wd, _ = _with_mean(workdir, tmp_path, 3.6)
  opts = common.Options(workdir=wd, batches=1, progress=False)
  r_max = common.load(opts).r_max
  res = depth_oracle.run(opts, depth_oracle.OracleOptions(
      schedules=(f'uniform:{r_max}',), prompt_len=4, new_tokens=2, prefill_depth=0))['results']
  assert res['prefill_depth'] == round(3.6) == r_max == 4
  assert res['points'][0]['mean_loops'] == r_max


def test_convergence_refuses_a_kl_threshold_no_token_can_meet_or_every_token_meets(tmp_path):
  """eps_conv = 0 (no KL is below it) and inf (every KL is) measure nothing: refused before
  the workdir is read (a missing one here)."""
  missing = _opts(str(tmp_path / 'no_such_workdir'))
  for eps in (0.0, float('inf'), -1e-3):
    with pytest.raises(common.SetupError, match=f'--eps_conv={eps} must be a finite KL'):
      convergence.run(missing, convergence.ConvergenceOptions(eps_conv=eps))


def test_convergence_reference_depth_is_the_depth_training_ran_at(workdir, tmp_path):
  """A training mean above r_max ran every draw at r_max (common.train_mean): the report's
  reference depth is r_max, not the configured mean."""
  wd, cfg = _with_mean(workdir, tmp_path, 6.0)
  res = convergence.run(_opts(wd))['results']
  assert cfg['depth']['r_max'] == res['r_max'] == 4 < 6
  assert res['ref_depth'] == min(6, cfg['depth']['r_max'])
  assert res['argmax_depth']['share_changing_after_ref'] == 0  # nothing changes after R


def test_sweep_delta_zero_is_a_valid_tolerance(tmp_path, main_cases):
  """--delta=0 (the headline at exactly uniform depth's loss) passes the flag check and
  reaches the workdir (missing here); a negative one is refused."""
  missing = tmp_path / 'no_such_workdir'
  zero, neg = main_cases('experiments.sweep_eps', [[f'--workdir={missing}', f'--delta={d}']
                                                   for d in ('0', '-0.01')])
  assert zero['rc'] == 2 and 'does not exist' in zero['stderr'], zero['stderr'][-2000:]
  assert neg['rc'] == 2 and '--delta=-0.01 must be a finite number >= 0' in neg['stderr']


def test_sweep_stars_a_calibrated_eps_of_zero(tmp_path):
  """eps = 0 is a threshold calibrate_eps may certify (the smallest grid point): it is
  starred like any other; a report that certified none (eps None) stars nothing."""
  from elastic_depth import reports  # pylint: disable=g-import-not-at-top
  ld = types.SimpleNamespace(step=7, r_max=4, data_cfg=config_lib.DataConfig())
  opts = _opts(str(tmp_path))
  for eps, want in ((0.0, [0.0]), (1e-3, [1e-3]), (None, None)):
    reports.write(str(tmp_path), 'calibrate_eps', {'eps': eps}, flags={'r_max': 4},
                  checkpoint={'step': 7, 'data_config': dataclasses.asdict(ld.data_cfg)},
                  markdown='')
    got = sweep_eps._calibrated(opts, ld)  # pylint: disable=protected-access
    assert (list(got['calibrated'].thresholds) if got else None) == want


def test_train_router_needs_a_held_out_batch(tmp_path):
  """--fit_from=0 leaves no batch to evaluate on (and none for sweep_eps): refused before
  the workdir is read."""
  missing = _opts(str(tmp_path / 'no_such_workdir'))
  with pytest.raises(common.SetupError, match='--fit_from=0 and --fit_batches=1 must be >= 1'):
    train_router.run(missing, train_router.RouterOptions(fit_from=0, fit_batches=1))


def test_router_report_scores_the_fit_batches_and_the_held_out_ones(workdir):
  """The saved probe, evaluated on pairs harvested from batches fit_from.. (train) and
  0..fit_from - 1 (held out), gives the report's figures; the markdown rows are those."""
  x = train_router.RouterOptions(steps=5, lr=1e-2, max_pairs=1000, fit_from=1, fit_batches=1)
  out = train_router.run(_opts(workdir, tag='split'), x)
  res = _numbers(out['paths']['json'])
  ld = common.load(common.Options(workdir=workdir, batches=2, progress=False))
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


def test_generate_refuses_bad_flags_before_loading(tmp_path, main_cases):
  """--wait_rows=0 (no row ever waits for a readout) and an eps count that is neither one nor
  one per prompt: one line, exit 2, before the workdir (missing here) is read."""
  base = [f'--workdir={tmp_path / "no_such_workdir"}', '--prompt=a', '--prompt=b']
  got = main_cases('experiments.generate', [base + ['--wait_rows=0'],
                                            base + ['--eps=1,2,3']])
  for res, words in zip(got, ('--wait_rows must be >= 1, got 0', '--eps needs one value')):
    assert res['rc'] == 2 and res['stderr'].startswith(f'error: {words}'), res['stderr']
    assert len(res['stderr'].strip().splitlines()) == 1


def test_generate_cli_gives_each_prompt_its_own_eps_up_to_max_len(workdir):
  """One eps per prompt: each row decodes as decoding.generate at its own eps (0: never
  exits, 1e9: at the first check); the longer prompt plus --max_new_tokens fills max_len
  exactly (allowed); the summary's mean loops is the mean of the printed depths."""
  cfg, mdl, _, _ = common.load_model(workdir)
  vocab = synthetic.SyntheticVocab(cfg.data.synth_num_vars)
  texts, eps = ['? 3 1 4 =', '? 2 ='], [0.0, 1e9]
  ids = vocab.encode_batch(texts)
  n = cfg.model.max_len - max(len(x) for x in ids)
  out = subprocess.run([sys.executable, '-m', 'experiments.generate', f'--workdir={workdir}',
                        *[f'--prompt={x}' for x in texts], f'--max_new_tokens={n}',
                        f'--eps={eps[0]},{eps[1]}', '--show_depths'], cwd=REPO,
                       capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = re.findall(r'^(\d): (\S+)\[(\d+)\]$', out.stdout, re.M)
  depths = []
  for r, (x, e) in enumerate(zip(ids, eps)):
    ecfg = config_lib.ExitConfig(policy='kl', eps=e, max_loops=cfg.depth.r_max)
    toks, depth = decoding.generate(mdl, jnp.asarray(x)[None], n, ecfg, jax.random.key(0))
    got = [(t, int(d)) for row, t, d in rows if int(row) == r]
    assert got == [(vocab.id_to_token(t), int(d)) for t, d in zip(toks[0, len(x):], depth[0])]
    depths += [int(d) for d in depth[0]]
  assert set(depths[:n]) == {cfg.depth.r_max} and set(depths[n:]) == {2}
  summary = re.search(r'mean loops (\S+) over (\d+) tokens', out.stdout)
  assert float(summary.group(1)) == pytest.approx(np.mean(depths), abs=0.005)
  assert int(summary.group(2)) == len(depths) == 2 * n


def test_convergence_breaks_down_by_difficulty_only_where_a_scored_target_has_one():
  """groups_for: the difficulty breakdown needs a scored target (mask > 0) labelled other
  than -1 (text and padding); labels under mask 0 alone add none."""
  vocab = synthetic.SyntheticVocab(10)
  mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], np.float32)
  diff = np.where(mask > 0, -1, 2).astype(np.int32)
  trace = types.SimpleNamespace(targets=np.ones_like(diff), mask=mask, difficulty=diff)
  ld = types.SimpleNamespace(data=types.SimpleNamespace(tokenizer=vocab))
  assert set(convergence.groups_for(ld, trace)) == {'class'}
  diff[1, 0] = 3
  groups = convergence.groups_for(ld, trace)
  assert set(groups) == {'class', 'difficulty'} and groups['difficulty']['hops=3'][1, 0]
