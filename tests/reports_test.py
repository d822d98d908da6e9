"""Report files: JSON-safe values, the JSON/markdown/PNG triple, markdown tables."""

import json
import math
import os

import numpy as np
import pytest

from conftest import md_table
from elastic_depth import reports


def test_clean_converts_numpy_and_non_finite_values():
  raw = {'a': np.float32(0.5), 'b': np.arange(3), 'c': [np.int64(2), float('nan')],
         'd': (np.bool_(True), -math.inf), 3: {'e': np.array([[1.5, np.inf]])}}
  got = reports.clean(raw)
  assert got == {'a': 0.5, 'b': [0, 1, 2], 'c': [2, None], 'd': [True, None],
                 '3': {'e': [[1.5, None]]}}
  assert type(got['b'][0]) is int and type(got['d'][0]) is bool
  json.dumps(got, allow_nan=False)  # strict JSON


def test_write_makes_the_three_files(tmp_path):
  calls = []
  paths = reports.write(str(tmp_path), 'demo', {'loss': np.float64(1.25), 'bad': np.nan},
                        flags={'eps': 0.1}, checkpoint={'step': 7}, markdown='# demo\n',
                        plot=lambda fig: calls.append(fig.add_subplot(1, 1, 1).plot([0, 1])))
  assert sorted(paths) == ['json', 'md', 'png'] and len(calls) == 1
  assert all(os.path.dirname(p) == str(tmp_path / 'reports') for p in paths.values())
  with open(paths['json']) as f:
    doc = json.load(f)
  assert doc['experiment'] == 'demo' and doc['results'] == {'loss': 1.25, 'bad': None}
  assert doc['flags'] == {'eps': 0.1} and doc['checkpoint'] == {'step': 7}
  assert {'date', 'command'} <= set(doc)
  assert open(paths['md']).read() == '# demo\n'
  with open(paths['png'], 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_write_without_a_plot_writes_no_png(tmp_path):
  paths = reports.write(str(tmp_path), 'x', {}, flags={}, checkpoint={}, markdown='')
  assert sorted(paths) == ['json', 'md']
  assert sorted(os.listdir(tmp_path / 'reports')) == ['x.json', 'x.md']


@pytest.mark.parametrize('value,cell', [(0.123456, '0.1235'), (None, '-'), (7, '7'),
                                        ('kl', 'kl'), (12345.678, '1.235e+04')])
def test_table_formats_cells(value, cell):
  out = reports.table(['name', 'value'], [['row', value]])
  assert out.splitlines() == ['| name | value |', '|---|---|', f'| row | {cell} |']


def test_read_results_returns_what_write_wrote_and_names_a_bad_file(tmp_path):
  paths = reports.write(str(tmp_path), 'r', {'eps': 0.1, 'loss': [1.0, float('nan')]},
                        flags={}, checkpoint={}, markdown='')
  assert reports.read_results(paths['json'], ('eps',)) == {'eps': 0.1, 'loss': [1.0, None]}
  with pytest.raises(ValueError, match=r"is a report without \['depths'\]"):
    reports.read_results(paths['json'], ('eps', 'depths'))
  cut = tmp_path / 'cut.json'
  cut.write_text(open(paths['json'], encoding='utf-8').read()[:20])
  with pytest.raises(ValueError, match='cut.json is not a readable report .JSONDecodeError'):
    reports.read_results(str(cut))
  (tmp_path / 'other.json').write_text('[1, 2]')
  with pytest.raises(ValueError, match='other.json is not a readable report .TypeError'):
    reports.read_results(str(tmp_path / 'other.json'))


def test_read_report_returns_the_whole_record_and_checks_its_results(tmp_path):
  paths = reports.write(str(tmp_path), 'r', {'eps': 0.1}, flags={'r_max': 6},
                        checkpoint={'step': 3}, markdown='')
  rec = reports.read_report(paths['json'], ('eps',))
  assert (rec['results'], rec['flags'], rec['checkpoint']) == ({'eps': 0.1}, {'r_max': 6},
                                                                {'step': 3})
  with pytest.raises(ValueError, match=r"is a report without \['depths'\]"):
    reports.read_report(paths['json'], ('depths',))
  (tmp_path / 'flat.json').write_text('{"eps": 0.1}')
  with pytest.raises(ValueError, match='flat.json is not a readable report .KeyError'):
    reports.read_report(str(tmp_path / 'flat.json'))


def test_convergence_markdown_says_how_many_tokens_never_converged():
  """Tokens whose KL never falls below eps_conv within R loops count at depth R + 1 in the
  KL row's mean and shares; the text says so and how many (it was only in the JSON)."""
  dist = lambda share: dict(mean=3.7, median=3.0, p90=5.0, share_changing_after_ref=0.08,
                            **share)
  res = dict(r_max=6, ref_depth=5, eps_conv=1e-3, tokens=1082,
             per_loop=dict(loop=[1], loss=[2.0], mean_kl=[0.1], mean_rkl=[0.1],
                           mean_delta=[0.5], mean_argmax_changed=[0.2]),
             argmax_depth=dist({}), kl_depth=dist({'share_not_converged': 26 / 1082}))
  md = reports.convergence_markdown(res, {'workdir': 'w', 'step': 1, 'data': 'd'})
  assert '2.4% of the tokens never fell below eps_conv within R=6 loops' in md
  assert 'counts them at depth 7' in md
  res['kl_depth']['share_not_converged'] = 0.0
  assert 'never fell' not in reports.convergence_markdown(res, {})


def test_sweep_plot_draws_each_semantics_quality_line():
  """With cached semantics the plot draws the A0 @ref + delta line the '@cached' curves are
  judged against, at its own height (only the parallel line was drawn)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  a0 = dict(mean_loops=[1.0, 2.0, 4.0], flops=[1e9, 2e9, 4e9], loss=[1.0, 0.5, 0.4])
  a0c = dict(mean_loops=[1.0, 2.0, 4.0], flops=[1e9, 2e9, 4e9], loss=[1.1, 0.6, 0.45])
  res = dict(a0=a0, a0_cached=a0c, curves={}, ref_depth=2.0, delta=0.01)
  fig = figure.Figure()
  reports.sweep_plot(res)(fig)
  for ax in fig.axes:
    lines = {l.get_label(): l.get_ydata()[0] for l in ax.lines}
    assert lines['A0 @ref + delta'] == pytest.approx(0.51)
    assert lines['A0 @ref + delta @cached'] == pytest.approx(0.61)


def test_a0_loss_at_equal_flops_is_blank_outside_a0s_flop_range():
  """np.interp clamps outside A0's FLOP range, so the sweep table shows '-' there rather
  than A0's end value as if it were A0's loss at that cost (older JSONs lack the flag)."""
  fr = {'a0_loss_same_loops': [0.7, 0.6], 'gap_same_loops': [0.01, 0.02],
        'a0_loss_same_flops': [0.555, 0.444], 'flops_in_a0_range': [True, False]}
  curve = {'threshold': [1e-3, 1e-2], 'mean_loops': [2.0, 3.0], 'loss': [0.71, 0.62],
           'mean_core_passes': [2.0, 3.0], 'flops': [2e9, 9e9], 'flops_active': [2e9, 9e9],
           'mean_readouts': [1.0, 1.0], 'share_max_depth': [0.0, 0.0]}
  res = {'tokens': 10, 'r_max': 4, 'ref_depth': 2.0, 'delta': 0.01, 'curves': {'kl': curve},
         'headline': {'kl': {'best': None, 'ref_loss': 0.7, 'frontier': fr,
                             'uniform_depth_within_delta': 2}}}
  md = reports.sweep_markdown(res, {})
  rows = [l for l in md.splitlines() if l.startswith('| 0.01 |') or l.startswith('| 0.001 |')]
  assert rows[0].endswith('| 0.555 |') and rows[1].endswith('| - |'), rows
  del fr['flops_in_a0_range']
  assert '| 0.444 |' in reports.sweep_markdown(res, {})


def _table_rows(md: str, header_start: str) -> list[dict]:
  """Rows of the first markdown table whose header line starts with header_start, as
  {column: cell} dicts."""
  head, body = md_table(md, header_start)
  return [dict(zip(head, row, strict=True)) for row in body]


def test_convergence_group_table_puts_each_value_under_its_header():
  dist = dict(mean=3.7, median=3.0, p90=5.0, share_changing_after_ref=0.08)
  group = dict(count=11, mean=2.5, median=2.0, p90=4.0, share_changing_after_ref=0.125,
               kl_depth_median=3.5, loss_ref=1.25, loss_final=0.75)
  res = dict(r_max=6, ref_depth=5, eps_conv=1e-3, tokens=100,
             per_loop=dict(loop=[1], loss=[2.0], mean_kl=[0.1], mean_rkl=[0.1],
                           mean_delta=[0.5], mean_argmax_changed=[0.2]),
             argmax_depth=dist, kl_depth=dist, by_hops={'2': group})
  md = reports.convergence_markdown(res, {})
  (row,) = _table_rows(md.split('## by_hops')[1], '| group')
  assert row == {'group': '2', 'tokens': '11', 'mean depth': '2.5', 'median': '2',
                 'p90': '4', 'share > 5': '0.125', 'KL depth median': '3.5',
                 'loss @5': '1.25', 'loss @R': '0.75'}


def test_sweep_headline_puts_each_value_under_its_header():
  best = dict(threshold=0.01, mean_loops=4.5, loss=0.625, loop_saving=0.25,
              flops_saving=0.125, flops_active_saving=0.375, wall_clock={'saving': 0.0625},
              a0_loss_same_loops=0.6875, gap_same_loops=-0.0625, gap_same_loops_interval=None)
  res = {'tokens': 10, 'r_max': 8, 'ref_depth': 6.0, 'delta': 0.01, 'curves': {},
         'headline': {'kl': {'best': best, 'ref_loss': 0.5625, 'frontier': {},
                             'uniform_depth_within_delta': 5}}}
  (row,) = _table_rows(reports.sweep_markdown(res, {}), '| policy')
  assert row == {
      'policy': 'kl', 'A0 loss @ref': '0.5625', 'eps': '0.01', 'mean loops': '4.5',
      'loss': '0.625', 'loop saving': '0.25', 'FLOP saving (engine as run)': '0.125',
      'FLOP saving (active tokens, executed)': '0.375', 'wall-clock saving (same run)': '0.0625',
      'A0 loss @same loops': '0.6875', 'gap': '-0.0625', 'gap: bootstrap interval': '-',
      'min uniform depth within delta': '5'}
