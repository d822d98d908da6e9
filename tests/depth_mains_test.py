"""experiments.eval_depth, convergence, saturation and depth_oracle end to end."""

import dataclasses
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import md_table, mains_opts, nll_np, report_results, with_mean
from elastic_depth import config as config_lib, decoding
from elastic_depth.data import synthetic
from elastic_depth import oracle
from experiments import common, convergence, depth_oracle, eval_depth

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  out = depth_oracle.run(
      common.Options(workdir=workdir, batches=1, progress=False, tag='oracle'), x)
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
      depth_oracle.run(mains_opts(workdir), dataclasses.replace(x, **bad))


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
  got = report_results(str(tmp_path / 'sat' / 'reports' / 'saturation.json'))[good]['saturation']
  assert got == min(d for d, l in zip(range(1, 6), loss) if l <= min(loss) + 0.02) == 3
  # a tagged run reads and writes tagged files, beside the untagged ones (it overwrote them)
  reports.write(good, 'eval_depth_fw', dict(depths=[1, 2], loss=[2.0, 1.0], train_mean=2),
                flags={}, checkpoint={}, markdown='')
  out = run(f'--workdirs={good}', f'--out={tmp_path / "sat"}', '--tag=fw')
  assert out.returncode == 0, out.stderr[-3000:]
  sat = tmp_path / 'sat' / 'reports'
  assert report_results(str(sat / 'saturation_fw.json'))[good]['saturation'] == 2
  assert report_results(str(sat / 'saturation.json'))[good]['saturation'] == 3
  md = (tmp_path / 'sat' / 'reports' / 'saturation_fw.md').read_text()
  assert 'reports/eval_depth_fw.json' in md
  for args, words in (([f'--workdirs={bad}'], 'empty, missing or not finite'),
                      ([f'--workdirs={good}', 'stray'], "unexpected arguments ['stray']")):
    out = run(*args, f'--out={tmp_path / "sat2"}')
    assert out.returncode == 2 and words in out.stderr, out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1


def test_eval_depth_reference_depth_is_the_rounded_training_mean(workdir, tmp_path):
  """ref_depth rounds the training mean (3.6 -> 4), as convergence's and difficulty's do;
  the fixture's 2.5 cannot tell rounding from truncation."""
  wd, _ = with_mean(workdir, tmp_path, 3.6)
  res = eval_depth.run(mains_opts(wd))['results']
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
    assert report_results(str(out / 'saturation.json'))[run]['saturation'] == want
    [cells] = md_table((out / 'saturation.md').read_text(), '| run |')[1]
    assert cells[0] == run
    at = dict(zip(depths, loss))
    assert cells[2:] == [str(want)] + [f'{at[d]:.4f}' for d in (1, 2, 4, 8)] + [f'{min(loss):.4f}']
  assert res[2]['rc'] == 2 and 'empty, missing or not finite' in res[2]['stderr'], res[2]['stderr']


def test_eval_depth_counts_the_scored_tokens_and_prints_the_best_depth(workdir, capsys):
  """tokens counts the targets the loss weighs (mask > 0: answers only here), not every
  position; the printed best depth is the one of least loss."""
  opts = mains_opts(workdir, tag='answers', data={'loss_on': 'answers'})
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
  wd, _ = with_mean(workdir, tmp_path, 3.6)
  opts = common.Options(workdir=wd, batches=1, progress=False)
  r_max = common.load(opts).r_max
  res = depth_oracle.run(opts, depth_oracle.OracleOptions(
      schedules=(f'uniform:{r_max}',), prompt_len=4, new_tokens=2, prefill_depth=0))['results']
  assert res['prefill_depth'] == round(3.6) == r_max == 4
  assert res['points'][0]['mean_loops'] == r_max


def test_convergence_refuses_a_kl_threshold_no_token_can_meet_or_every_token_meets(tmp_path):
  """eps_conv = 0 (no KL is below it) and inf (every KL is) measure nothing: refused before
  the workdir is read (a missing one here)."""
  missing = mains_opts(str(tmp_path / 'no_such_workdir'))
  for eps in (0.0, float('inf'), -1e-3):
    with pytest.raises(common.SetupError, match=f'--eps_conv={eps} must be a finite KL'):
      convergence.run(missing, convergence.ConvergenceOptions(eps_conv=eps))


def test_convergence_reference_depth_is_the_depth_training_ran_at(workdir, tmp_path):
  """A training mean above r_max ran every draw at r_max (common.train_mean): the report's
  reference depth is r_max, not the configured mean."""
  wd, cfg = with_mean(workdir, tmp_path, 6.0)
  res = convergence.run(mains_opts(wd))['results']
  assert cfg['depth']['r_max'] == res['r_max'] == 4 < 6
  assert res['ref_depth'] == min(6, cfg['depth']['r_max'])
  assert res['argmax_depth']['share_changing_after_ref'] == 0  # nothing changes after R


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
