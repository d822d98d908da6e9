"""Progress output (a bar, or plain lines with counts, rate and ETA) and the device peaks of MFU."""

import io
import json
import os

import pytest
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


@pytest.mark.parametrize('kind,peak', [
    # device_kind strings as jax reports them, against the data sheets' dense bf16 peaks
    ('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA H100 PCIe', 756e12), ('NVIDIA H200', 989e12),
    ('NVIDIA H100 NVL', 835e12), ('NVIDIA H200 NVL', 835e12),  # the PCIe cards with NVLink
    ('NVIDIA GH200 480GB', 989e12),  # Grace Hopper's GPU (H100-class: 989 dense bf16)
    ('NVIDIA A100-SXM4-80GB', 312e12), ('NVIDIA A100 80GB PCIe', 312e12),
    ('NVIDIA GeForce RTX 4090', 165e12), ('NVIDIA L4', 121e12), ('NVIDIA L40S', 362e12),
    ('NVIDIA L40', 181e12), ('TPU v4', 275e12), ('TPU v5 lite', 197e12), ('TPU v5p', 459e12),
    ('TPU v6 lite', 918e12), ('cpu', 0.0), ('NVIDIA A10G', 0.0), ('NVIDIA H1000', 0.0),
])
def test_peak_flops_matches_whole_device_names(kind, peak):
  """'L4' is not an L40S, an H100 PCIe is not an SXM part, and an unknown kind gives 0."""
  assert metrics.peak_flops(device_kind=kind) == peak


def test_configured_peak_wins_over_the_device_kind():
  assert metrics.peak_flops(123.0, device_kind='NVIDIA H100 80GB HBM3') == 123.0
