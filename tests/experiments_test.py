"""The measurement mains end to end on a tiny trained workdir: what they share (reports,
errors, flags, plots)."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import mains_opts, report_results
from elastic_depth import calibrate, checkpoint, config as config_lib
from elastic_depth import train_step
from experiments import (calibrate_eps, common, convergence, depth_oracle, eval_depth, flags_util,
                         sweep_eps, train_router)
from experiments import difficulty as difficulty_main

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_round_trip(make_config):
  cfg = make_config()
  assert common.config_from_dict(train_step.config_dict(cfg)) == cfg
  assert common.config_from_dict({'depth': {'buckets': [1, 2]}, 'zzz': 1}).depth.buckets == (1, 2)


def test_three_reports_exist_parse_and_repeat_bit_identically(workdir):
  runs = [
      (eval_depth, mains_opts(workdir), (), 'eval_depth'),
      (convergence, mains_opts(workdir), (convergence.ConvergenceOptions(eps_conv=1e-3),),
       'convergence'),
      (sweep_eps, mains_opts(workdir), (sweep_eps.SweepOptions(
          eps_grid=[0.0, 1e-3, 1e9], delta=0.01, curves=('kl', 'state_delta'),
          state_delta_grid=[1e-2, 1e9], timing_repeats=0),), 'sweep_eps'),  # no clocks
  ]
  for mod, opts, x, name in runs:
    first = mod.run(opts, *x)
    for ext in ('json', 'md', 'png'):
      path = os.path.join(workdir, 'reports', f'{name}.{ext}')
      assert os.path.getsize(path) > 0, path
    res = report_results(os.path.join(workdir, 'reports', f'{name}.json'))
    mod.run(opts, *x)
    assert report_results(os.path.join(workdir, 'reports', f'{name}.json')) == res
    assert first['paths']['json'].endswith(f'{name}.json')
  el = report_results(os.path.join(workdir, 'reports', 'eval_depth.json'))
  assert el['depths'] == [1, 2, 3, 4] and el['train_mean'] == 2.5
  sw = report_results(os.path.join(workdir, 'reports', 'sweep_eps.json'))
  kl = sw['curves']['kl']
  assert kl['mean_loops'][0] == 4 and kl['mean_loops'][-1] == 2
  assert kl['loss'][0] == pytest.approx(el['loss'][-1], rel=1e-5)
  assert 'by_difficulty' in report_results(os.path.join(workdir, 'reports', 'convergence.json'))


def test_missing_workdir_and_checkpoint_are_clear_errors(workdir, tmp_path):
  with pytest.raises(common.SetupError, match='does not exist'):
    common.load(mains_opts(str(tmp_path / 'nope')))
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(common.SetupError, match='no config.json'):
    common.load(mains_opts(str(empty)))
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    (empty / 'config.json').write_text(f.read())
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoints'):
    common.load(mains_opts(str(empty)))
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
    common.load(dataclasses.replace(mains_opts(workdir), seq_len=cfg.model.max_len + 1))
  low = int(cfg.depth.mean) - 1 if cfg.depth.mean == int(cfg.depth.mean) else int(cfg.depth.mean)
  assert 1 <= low < cfg.depth.mean
  opts = dataclasses.replace(mains_opts(workdir), max_depth=low, batches=1)
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
    common.load(mains_opts(workdir, data={'synth_num_vars': '20'}))


def test_command_line_matches_in_process_run_bit_identically(workdir):
  ref = eval_depth.run(mains_opts(workdir, tag='inproc'))['results']
  out = subprocess.run([sys.executable, '-m', 'experiments.eval_depth', f'--workdir={workdir}',
                        '--quiet', '--batches=2', '--tag=cli', '--data_set=synth_max_hops=6'],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert report_results(os.path.join(workdir, 'reports', 'eval_depth_cli.json')) == json.loads(
      json.dumps(ref))


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
    common.load(mains_opts(str(tmp_path)))


def test_bad_numbers_are_refused_before_any_work(workdir, tmp_path):
  """NaN, infinities and out-of-range settings: a SetupError before the workdir is read
  (a missing one here), or, for what needs the model's loop cap, right after loading."""
  missing = mains_opts(str(tmp_path / 'no_such_workdir'))
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
    depth_oracle.run(mains_opts(workdir), depth_oracle.OracleOptions(
        schedules=('uniform:2', 'uniform:9'), prompt_len=4, new_tokens=4, prefill_depth=7))


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


def test_float_flags_accept_their_lower_bound():
  """eps = 0 (every check exits at once) is a valid grid point: lower is inclusive."""
  assert flags_util.floats(['0', '1e-3'], 'eps_grid', ValueError, lower=0.0) == [0.0, 1e-3]
  with pytest.raises(ValueError, match='>= 0'):
    flags_util.floats(['-1e-9'], 'eps_grid', ValueError, lower=0.0)
