"""experiments.generate, and bench_exit / bench_generate on a trained checkpoint."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import nll_np
from elastic_depth import config as config_lib, decoding
from elastic_depth.data import synthetic
from experiments import common

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  assert doc['decode_tokens'] == 'forced'
  assert 'Forced decoding' in (tmp_path / 'forced.md').read_text()
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
