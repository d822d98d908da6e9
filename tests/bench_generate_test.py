"""Smoke tests of bench_generate (batch 1 and batched, `nano` shape) and of its report's
math: phases, FLOP books, savings, the calibrated eps, the markdown columns."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import md_table, py_json
from elastic_depth import books, config as config_lib
from experiments import bench_util

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_generate_writes_all_variants(tmp_path):
  out = tmp_path / 'gen.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.bench_generate', '--shapes=nano', '--new_tokens=3',
       '--prompt_len=4', '--repeats=1', f'--out={out}'],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(out.read_text())['shapes']['nano']
  assert set(res['variants']) == {'a0_r8', 'a1_worst', 'a1_eps', 'a1_gated'}
  for v in res['variants'].values():
    assert v['tokens_per_s'] > 0 and 1 <= v['mean_loops'] <= 32
  assert res['variants']['a0_r8']['mean_loops'] == 8
  assert res['parts']['loop_ms'] > 0 and res['parts']['pair_check_ms'] > 0
  parts = res['parts']  # the check's cost in loops: check time over loop time
  assert parts['check_over_loop'] == pytest.approx(parts['pair_check_ms'] / parts['loop_ms'])


def test_bench_generate_batch_sizes_write_json_and_markdown(tmp_path):
  out = tmp_path / 'batch.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.bench_generate', '--batch_sizes=1,2',
       '--serve_shape=nano', '--new_tokens=3', '--prompt_len=4', '--repeats=1', f'--out={out}'],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  doc = json.loads(out.read_text())
  assert 'no quality' in doc['model'] and (tmp_path / 'batch.md').read_text().count('\n| ') == 9
  assert doc['prefill_engine'] == 'compacted'
  for rows in doc['batches'].values():
    a0, a1 = rows['a0'], rows['a1_depthwise']
    assert a0['mean_loops'] == 8 and 1 <= a1['mean_loops'] <= 8
    assert a1['loop_saving'] == pytest.approx(1 - a1['mean_loops'] / 8)
    assert a1['time_saving'] == pytest.approx(1 - a1['seconds'] / a0['seconds'])
    # per phase: the prefill timed on its own, decode = call - prefill
    assert a0['prompt_mean_loops'] == 8 and 1 <= a1['prompt_mean_loops'] <= 8
    assert a1['prefill_s'] > 0 and a0['prefill_s'] > 0
    if a1['decode_s'] is not None and a0['decode_s'] is not None:  # None: noise > decode
      assert 0 < a1['decode_s'] and a1['decode_tokens_per_s'] == pytest.approx(
          a1['tokens_per_s'] * a1['seconds'] / a1['decode_s'])
      assert a1['decode_time_saving'] == pytest.approx(1 - a1['decode_s'] / a0['decode_s'])
    p, g = 4 * a1['prompt_mean_loops'], 3 * a1['mean_loops']
    assert a1['loop_saving_all_tokens'] == pytest.approx(1 - (p + g) / (8 * 7))
    assert 0 < a1['row_utilisation'] <= 1
    # decode FLOP books from each engine's counts: A0 one pass of everything and 8 loops
    assert a0['decode_counts'] == dict(prelude=1, core=8, coda=1, head=1, checks=0)
    ls = rows['a1_lockstep']
    assert ls['decode_counts']['core'] >= ls['mean_loops'] - 1e-6  # rows run the deepest's
    assert ls['decode_counts']['checks'] == ls['decode_counts']['core']
    nano = config_lib.ModelConfig(**bench_util.MODEL_SHAPES['nano'])
    for r in rows.values():  # each engine's FLOPs are its counts' (cache of 4 + 3 slots)
      assert r['decode_flops'] == pytest.approx(
          float(books.decode_flops(nano, **r['decode_counts'], cache_len=7)))
    assert a1['decode_counts']['checks'] == a1['decode_counts']['core'] > 0  # checks booked
    for r in (a1, ls, rows['a1_waiting']):
      assert r['decode_flop_saving'] == pytest.approx(1 - r['decode_flops'] / a0['decode_flops'])
      if r['decode_realized_over_flops'] is not None:
        assert r['decode_realized_over_flops'] == pytest.approx(
            r['decode_time_saving'] / r['decode_flop_saving'])
      # no engine saves more FLOPs than running each token's own loops, one readout
      assert r['decode_flop_saving'] <= r['own_loops_flop_saving'] + 1e-9
      assert r['own_loops_over_loop'] is None or 0 < r['own_loops_over_loop'] < 1
    assert all(r['sys_s_median'] >= 0 and r['minor_faults_median'] >= 0 for r in rows.values())
  # the depth-wise (compacted or not) and lockstep engines run the same tokens to the same depths
  al, wt = rows['a1_allrows'], rows['a1_waiting']
  assert rows['a1_lockstep']['mean_loops'] == a1['mean_loops'] == al['mean_loops']
  # uniform depth through the depth-wise engine too: A1 also judged against the faster A0
  u = rows['a0_depthwise']
  assert u['mean_loops'] == 8 and u['prompt_mean_loops'] == 8 and u['decode_counts']['checks'] == 0
  best = min((a0, u), key=lambda r: r['seconds'])
  assert a1['best_a0_engine'] == ('lockstep' if best is a0 else 'depthwise')
  assert a1['realized_over_loop_best_a0'] == pytest.approx(
      (1 - a1['seconds'] / best['seconds']) / a1['loop_saving'])
  assert wt['mean_loops'] == a1['mean_loops'] and wt['engine_steps'] >= a1['engine_steps']
  assert a1['readout_rows'] <= al['readout_rows'] and a1['prelude_rows'] <= al['prelude_rows']


def test_decode_phase_is_the_call_minus_its_prefill_paired_per_round():
  # bench_generate --batch_sizes: decode = median over rounds of (call - its prefill)
  assert bench_util.paired_remainder([1.0, 2.0, 1.5], [0.25, 1.5, 0.5]) == 0.75
  # noise larger than the decode phase gives no figure, not a negative one
  assert bench_util.paired_remainder([1.0, 1.0], [1.25, 1.5]) is None
  with pytest.raises(ValueError):
    bench_util.paired_remainder([1.0], [0.5, 0.5])


def test_bench_generate_batch_row_savings_and_realized_over_loop():
  """bench_generate_batch._row: loop and time savings against A0 and their ratio."""
  got = py_json('''
    import json
    from experiments import bench_generate_batch as g
    a0 = g._row(12, 4.0, [8, 8, 8])
    a1 = g._row(12, 2.0, [2, 2, 4], a0)
    deeper = g._row(12, 2.0, [8, 8, 9], a0)
    print(json.dumps(dict(a0=a0, a1=a1, deeper=deeper)))
  ''')
  a1 = got['a1']
  loop = 1 - np.mean([2, 2, 4]) / 8.0   # 2/3
  time_ = 1 - 2.0 / 4.0                 # 1/2
  assert got['a0']['tokens_per_s'] == 3.0 and a1['tokens_per_s'] == 6.0
  assert a1['loop_saving'] == pytest.approx(loop)
  assert a1['time_saving'] == pytest.approx(time_)
  assert a1['realized_over_loop'] == pytest.approx(time_ / loop)  # 0.75, not 1.33
  assert got['deeper']['realized_over_loop'] is None  # no loop saving: no ratio


def test_bench_generate_batch_phase_fields_pair_the_rounds_and_weigh_prompt_and_tokens():
  """bench_generate_batch._phase_fields: decode = median of the per-round call - prefill,
  savings against A0's phases, and the loop saving over prompt and generated tokens."""
  got = py_json('''
    import json
    from absl import flags
    from experiments import bench_generate, bench_generate_batch as g  # the flags' owner
    flags.FLAGS(['x', '--prompt_len=4', '--new_tokens=6'])
    a0 = g._phase_fields(g._row(24, 6.0, [8] * 3), [5.0, 6.0, 7.0], [2.0, 2.0, 2.0], 24,
                         [6, 6])
    a1 = g._phase_fields(g._row(24, 3.0, [2, 2, 4], a0), [3.0, 4.0, 5.0], [1.0, 1.5, 1.0],
                         24, [4, 2], a0)
    noisy = g._phase_fields(g._row(24, 2.0, [8] * 3), [2.0] * 3, [2.0] * 3, 24, [6, 6])
    vs_noisy = g._phase_fields(g._row(24, 3.0, [2, 2, 4], noisy), [3.0, 4.0, 5.0],
                               [1.0, 1.5, 1.0], 24, [4, 2], noisy)
    print(json.dumps(dict(a0=a0, a1=a1, noisy=noisy, vs_noisy=vs_noisy)))
  ''')
  a0, a1 = got['a0'], got['a1']
  assert got['noisy']['decode_s'] is None  # no decode phase above the noise: no figure
  assert got['vs_noisy']['decode_time_saving'] is None
  assert got['vs_noisy']['decode_realized_over_loop'] is None
  assert a0['decode_s'] == 4.0 and a0['prefill_s'] == 2.0 and a0['decode_tokens_per_s'] == 6
  assert a1['decode_s'] == 2.5  # median of 2, 2.5, 4: not 4 - 1 (medians subtracted)
  assert a1['prefill_s'] == 1.0 and a1['prompt_mean_loops'] == 3.0
  assert a1['decode_time_saving'] == pytest.approx(1 - 2.5 / 4.0)
  assert a1['prefill_time_saving'] == pytest.approx(1 - 1.0 / 2.0)
  assert a1['prompt_loop_saving'] == pytest.approx(1 - 3.0 / 6.0)
  loop = 1 - (8 / 3) / 8
  assert a1['decode_realized_over_loop'] == pytest.approx((1 - 2.5 / 4.0) / loop)
  all_tokens = 1 - (3.0 * 4 + (8 / 3) * 6) / (6.0 * 4 + 8.0 * 6)  # prompt 4, new tokens 6
  assert a1['loop_saving_all_tokens'] == pytest.approx(all_tokens)
  assert a1['realized_over_loop_all_tokens'] == pytest.approx((1 - 3.0 / 6.0) / all_tokens)


def test_bench_generate_batch_flop_fields_are_the_executed_books_and_their_ratios():
  """bench_generate_batch._flop_fields against model.flops_per_token's parts by hand."""
  got = py_json('''
    import json
    from experiments import bench_generate_batch as g
    from elastic_depth import config, model
    m = config.ModelConfig(vocab_size=64, d_model=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, mlp_dim=64, max_len=32)
    f = model.flops_per_token(m, 0, 2 * 24, core_keys=24)
    c0 = dict(prelude=1.0, core=8.0, coda=1.0, head=1.0, checks=0.0)
    c1 = dict(prelude=1.0, core=3.0, coda=2.5, head=2.5, checks=3.0)
    a0 = g._flop_fields(dict(mean_loops=8.0), c0, m, 24)
    a1 = g._flop_fields(dict(mean_loops=3.0, loop_saving=1 - 3 / 8, decode_time_saving=0.4),
                        c1, m, 24, a0)
    print(json.dumps(dict(a0=a0, a1=a1, f={k: float(v) for k, v in f.items()})))
  ''')
  a0, a1, f = got['a0'], got['a1'], got['f']
  coda = f['coda_head'] - f['head']
  want0 = f['prelude'] + 8 * f['loop'] + coda + f['head']
  assert a0['decode_flops'] == pytest.approx(want0, rel=1e-12)
  assert a1['decode_flops'] > f['prelude'] + 3 * f['loop'] + 2.5 * f['coda_head']  # + checks
  saving = 1 - a1['decode_flops'] / want0
  assert a1['decode_flop_saving'] == pytest.approx(saving, rel=1e-12)
  assert a1['decode_realized_over_flops'] == pytest.approx(0.4 / saving, rel=1e-12)
  own = 1 - (f['prelude'] + 3 * f['loop'] + coda + f['head']) / want0  # one readout, free check
  assert a1['own_loops_flop_saving'] == pytest.approx(own, rel=1e-12)
  assert a1['own_loops_over_loop'] == pytest.approx(own / (1 - 3 / 8), rel=1e-12)
  assert a1['decode_counts'] == dict(prelude=1.0, core=3.0, coda=2.5, head=2.5, checks=3.0)


def test_bench_generate_calibrates_eps_to_the_target_loops_by_brute_force():
  """bench_generate._calibrate on the nano model: for each eps of the grid every token exits
  at the first loop >= 2 whose KL is below eps (16 if none), the eps whose mean depth is
  nearest the target wins (the smallest of a tie), and the gate is the 90th percentile of
  the state change wherever the KL is below that eps (Python loops over a traced run)."""
  got = py_json('''
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from elastic_depth import config, inference, model
    from experiments import bench_generate, bench_util
    m = model.LoopedLM(config.ModelConfig(max_len=32, **bench_util.MODEL_SHAPES['nano']),
                       nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(1), (1, 6), 0, 64)
    out = {}
    for target in (1.0, 3.0, 5.0, 13.0):  # 1, 13: several eps tie
      out[target] = bench_generate._calibrate(m, prompt, target)
    toks = jnp.concatenate([prompt, prompt[:, ::-1]], axis=1)
    tr = inference.score(m, toks, config.ExitConfig(policy='uniform', depth=16),
                         jax.random.key(0), trace=True).traces
    print(json.dumps(dict(out=out, kl=np.asarray(tr['kl'], np.float64)[:, 0].tolist(),
                          delta=np.asarray(tr['delta'], np.float64)[:, 0].tolist())))
  ''')
  kl, delta = got['kl'], got['delta']  # [loop - 1][token]
  tokens = range(len(kl[0]))

  def depth(eps, t):
    return next((i for i in range(2, 17) if kl[i - 1][t] < eps), 16)
  for target, (eps, gate) in got['out'].items():
    errs = [(abs(sum(depth(e, t) for t in tokens) / len(tokens) - float(target)), e)
            for e in np.logspace(-8, 0, 81)]
    best = min(err for err, _ in errs)
    assert eps == pytest.approx(min(e for err, e in errs if err == best), rel=1e-12)
    fired = sorted(delta[i - 1][t] for i in range(2, 17) for t in tokens if kl[i - 1][t] < eps)
    if not fired:
      assert gate == 0.0
      continue
    pos = 0.9 * (len(fired) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(fired) - 1)
    assert gate == pytest.approx(fired[lo] + (pos - lo) * (fired[hi] - fired[lo]), rel=1e-6)


def test_bench_generate_report_puts_each_engines_figures_in_its_column():
  """bench_generate_report.markdown on a document whose engines' figures all differ: each
  cell holds the engine and field its header names; a figure of 0 prints as 0, only a
  missing one (None) as '-'; GFLOP are FLOPs / 1e9."""
  from experiments import bench_generate_report  # pylint: disable=g-import-not-at-top
  keys = ('a0', 'a1_depthwise', 'a1_allrows', 'a1_lockstep', 'a1_waiting', 'a0_match',
          'a0_depthwise', 'a0_match_depthwise')
  eng = {k: dict(tokens_per_s=100.0 * (i + 1), mean_loops=8.0 - i, loop_saving=0.1 * i,
                 time_saving=0.05 * (i + 1), realized_over_loop=0.25 * i,
                 forced_loss=2.0 + 0.125 * i, forced_tokens=48, decode_tokens_per_s=50.0 * (i + 1),
                 decode_realized_over_loop=0.5 + i, realized_over_loop_all_tokens=1.5 + i,
                 prefill_s=0.001 * (i + 1), prompt_mean_loops=8.0 - 0.5 * i,
                 decode_flops=3e6 * (i + 1), decode_flop_saving=0.02 * i,
                 decode_realized_over_flops=0.75 * i, own_loops_over_loop=0.1 * (i + 1),
                 decode_speed_vs_match=1.0 + 0.1 * i, speed_vs_match=2.0 + 0.1 * i)
         for i, k in enumerate(keys)}
  eng['a1_depthwise']['realized_over_loop'] = 0.0  # none realized: 0.00, not '-'
  eng['a1_allrows']['realized_over_loop'] = None   # no loop saving: no figure
  eng['a1_depthwise'].update(realized_over_loop_best_a0=0.625, best_a0_engine='depthwise',
                             match_engine='depthwise')
  q = dict(a0_loss=2.0, a1_loss=2.125, policy='kl', eps=1e-3, matched=True, match_depth=3,
           match_loss=2.5, tol=0.5)
  doc = dict(date='d', model='m', machine='x', loadavg=[0, 0, 0], quality=q,
             decode_tokens='forced', prefill_engine='compacted', wait_rows=2,
             match_key='a0_match', batches={'4': eng})
  md = bench_generate_report.markdown(doc)
  a0, a1, al, ls, wt, _, a0_dw, u = (eng[k] for k in keys)
  [main] = md_table(md, '| B | A0 tok/s')[1]
  assert main[1] == f"{a0['tokens_per_s']:.0f} ({a0_dw['tokens_per_s']:.0f})"
  assert main[5:] == [f"{a1['loop_saving']:.1%}",
                      f"{a1['time_saving']:.1%} ({al['time_saving']:.1%})", '0.00 (-)',
                      '0.62 (depthwise)']
  [forced] = md_table(md, '| B | tokens scored')[1]
  assert forced[2].split(' / ') == [f"{e['forced_loss']:.4f}" for e in (a0, a1, wt, ls)]
  assert forced[3] == f"{a1['forced_loss'] - a0['forced_loss']:+.4f}" == '+0.1250'
  [phase] = md_table(md, '| B | decode tok/s')[1]
  assert phase[3].split(' (')[0].split(' / ') == [f"{e['prefill_s'] * 1e3:.2f}"
                                                  for e in (a0, a1, ls)]
  [flops] = md_table(md, '| B | GFLOP / token A0')[1]
  assert float(flops[1]) == pytest.approx(a0['decode_flops'] / 1e9)
  [front] = md_table(md, '| B | loops uniform / A1')[1]  # the faster engine's uniform row
  assert front[1:4] == [f"{u['mean_loops']:.2f} / {wt['mean_loops']:.2f}", 'depthwise',
                        f"{u['decode_tokens_per_s']:.0f}"]
  assert front[6] == f"{u['forced_loss']:.4f} / {wt['forced_loss']:.4f}"


def test_exits_are_judged_against_the_faster_uniform_engine():
  """bench_generate_batch._vs_best_a0 / _vs_match by hand: the baseline is whichever of the
  lockstep and depth-wise uniform rows ran faster end to end, per batch (a fresh
  interpreter: the module defines absl flags that other mains' tests define too)."""
  got = py_json('''
    import json
    from experiments import bench_generate_batch as g
    row = lambda sec, dec: dict(seconds=sec, decode_s=dec)
    out = []
    for lock, dw in ((4.0, 2.0), (2.0, 4.0)):
      rows = dict(a0=row(lock, lock - 1), a0_depthwise=row(dw, dw - 1),
                  a0_match=row(lock / 2, lock / 2 - 0.5),
                  a0_match_depthwise=row(dw / 2, dw / 2 - 0.5),
                  a1=dict(row(1.5, 1.0), loop_saving=0.5))
      out.append(g._vs_match(g._vs_best_a0(rows, ['a1']), 'a0_match', ['a1'])['a1'])
    print(json.dumps(out))
  ''')
  for a1, (lock, dw, engine) in zip(got, ((4.0, 2.0, 'depthwise'), (2.0, 4.0, 'lockstep'))):
    base = min(lock, dw)
    assert a1['best_a0_engine'] == a1['match_engine'] == engine
    assert a1['realized_over_loop_best_a0'] == pytest.approx((1 - 1.5 / base) / 0.5)
    assert a1['decode_realized_over_loop_best_a0'] == pytest.approx((1 - 1.0 / (base - 1)) / 0.5)
    assert a1['speed_vs_match'] == pytest.approx(base / 2 / 1.5)
    assert a1['decode_speed_vs_match'] == pytest.approx((base / 2 - 0.5) / 1.0)


def test_bench_generate_runs_with_fewer_new_tokens_than_the_prompt(main_cases):
  """--new_tokens=2 after a 16-token prompt (both in range) runs, batch 1 and batched."""
  args = ['--prompt_len=16', '--new_tokens=2', '--repeats=1', '--out={tmp}/g.json']
  got = main_cases('experiments.bench_generate', [['--shapes=nano', *args],
                                                  ['--batch_sizes=1', '--serve_shape=nano',
                                                   *args]])
  for res in got:
    assert res['rc'] == 0, res['stderr'][-3000:]
    assert 'g.json' in res['files']
