"""Progress output: a bar on a terminal, plain lines with counts, rate and ETA in a log."""

import io
import json
import os

import tqdm

from elastic_depth import metrics


class _Tty(io.StringIO):

  def isatty(self):
    return True


def test_log_gets_plain_lines_with_counts_eta_and_postfix():
  out = io.StringIO()
  bar = metrics.progress(10, initial=2, desc='train', unit='step', file=out, interval=0.0)
  assert isinstance(bar, metrics.LineProgress)
  for i in range(3):
    bar.set_postfix(loss=f'{1.0 / (i + 1):.3f}', r=4)
    bar.update(1)
  bar.close()
  lines = out.getvalue().splitlines()
  assert '\r' not in out.getvalue()
  assert len(lines) == 3  # one per update at interval 0; close adds nothing new
  assert lines[-1].startswith('train: 5/10 (50%) step [')
  assert 'loss=0.333, r=4' in lines[-1]
  assert '<' in lines[-1] and 'step/s' in lines[-1]  # elapsed<remaining, rate


def test_interval_throttles_and_close_prints_the_last_count():
  out = io.StringIO()
  bar = metrics.progress(None, desc='prepare', unit='doc', file=out, interval=3600.0)
  bar.update(7)
  bar.update(5)
  assert out.getvalue() == ''
  bar.set_postfix_str('1,234 tokens/s')
  bar.close()
  (line,) = out.getvalue().splitlines()
  assert line.startswith('prepare: 12 doc [') and '1,234 tokens/s' in line


def test_terminal_gets_tqdm_and_quiet_gets_nothing():
  tty = _Tty()
  bar = metrics.progress(4, file=tty)
  assert isinstance(bar, tqdm.tqdm) and not bar.disable
  bar.close()
  quiet = io.StringIO()
  bar = metrics.progress(4, disable=True, file=quiet)
  bar.update(4)
  bar.close()
  assert quiet.getvalue() == ''


def test_metric_writer_keeps_jsonl_strict_with_non_finite_values(tmp_path):
  w = metrics.MetricWriter(str(tmp_path))
  w.write(3, {'train/loss': 1.5, 'train/bad': float('nan')})
  w.close()
  text = open(os.path.join(tmp_path, 'metrics.jsonl'), encoding='utf-8').read()
  (rec,) = [json.loads(l, parse_constant=lambda c: 1 / 0) for l in text.splitlines()]
  assert rec == {'step': 3, 'train/loss': 1.5, 'train/bad': 'nan'}
