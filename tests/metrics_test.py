"""Progress output (a bar, or plain lines with counts, rate and ETA) and the device peaks of MFU."""

import glob
import io
import json
import os
import struct
import time

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


def _tb_scalars_as_tensorboard_shows_them(tb_dir: str) -> dict:
  """{(tag, step): value} that TensorBoard displays: event files read in the order they
  were written, and a SessionLog START at step T purges every earlier event of step >= T
  (tensorboardX's documented purge_step semantics). TFRecord parsed by hand."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  events = []
  for path in glob.glob(os.path.join(tb_dir, 'events.out.tfevents.*')):
    with open(path, 'rb') as f:
      data = f.read()
    pos, evs = 0, []
    while pos < len(data):
      (n,) = struct.unpack('<Q', data[pos:pos + 8])
      ev = event_pb2.Event()
      ev.ParseFromString(data[pos + 12:pos + 12 + n])
      evs.append(ev)
      pos += 12 + n + 4
    events.append(evs)
  events.sort(key=lambda evs: evs[0].wall_time)  # file by file, in the order written
  shown = {}
  for ev in (e for evs in events for e in evs):
    if ev.HasField('session_log') and ev.session_log.status == ev.session_log.START:
      shown = {k: v for k, v in shown.items() if k[1] < ev.step}
    for v in ev.summary.value:
      shown[(v.tag, ev.step)] = v.simple_value
  return shown


def test_resumed_metric_writer_keeps_the_checkpoint_steps_records_in_both_sinks(tmp_path):
  """A run logs steps 1..5 and is killed; it resumes from the checkpoint of step 3 and logs
  4 and 5 again: JSONL and TensorBoard each show steps 1..5 once, step 3 from the first
  session (it precedes the checkpoint) and 4, 5 from the second."""
  wd = str(tmp_path)
  w = metrics.MetricWriter(wd)
  for s in range(1, 6):
    w.write(s, {'train/loss': float(s)})
  w.close()
  time.sleep(1.1)  # tensorboardX names event files by the second: a new file for session 2
  w = metrics.MetricWriter(wd, resume_step=3)
  for s in (4, 5):
    w.write(s, {'train/loss': 10.0 * s})
  w.close()
  want = {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0}
  recs = [json.loads(l) for l in open(os.path.join(wd, 'metrics.jsonl'), encoding='utf-8')]
  assert {r['step']: r['train/loss'] for r in recs} == want and len(recs) == 5
  shown = _tb_scalars_as_tensorboard_shows_them(os.path.join(wd, 'tb'))
  assert shown == {('train/loss', s): v for s, v in want.items()}, shown
