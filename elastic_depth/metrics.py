"""Metric sinks: JSONL, TensorBoard event files, and a console progress bar."""

import json
import math
import os
import re
import sys
import time
from typing import Optional

import tqdm
from tensorboardX import SummaryWriter

from elastic_depth import lifecycle

# Dense bf16 peak FLOP/s by device kind (vendor data sheets). A kind matches the first
# pattern found in it as whole words (case-insensitive), most specific first: 'L4' is not
# 'L40S', and an H100 PCIe or NVL is not an H100 SXM (NVL: 1,671 TFLOP/s sparse = 835 dense).
PEAK_BF16_FLOPS = (
    (r'GH200', 989e12), (r'H200 NVL', 835e12), (r'H200', 989e12), (r'H100 PCIe', 756e12),
    (r'H100 NVL', 835e12), (r'H100', 989e12),
    (r'A100', 312e12), (r'RTX 4090', 165e12), (r'L40S', 362e12), (r'L40', 181e12), (r'L4', 121e12),
    (r'TPU v5 lite', 197e12), (r'TPU v5e', 197e12), (r'TPU v5p?', 459e12),
    (r'TPU v4', 275e12), (r'TPU v6( lite|e)?', 918e12),
)
_PEAK_PATTERNS = tuple((re.compile(rf'(?<![A-Za-z0-9]){p}(?![A-Za-z0-9])', re.IGNORECASE), f)
                       for p, f in PEAK_BF16_FLOPS)


def measure_matmul_peak(n: int = 2048, dtype: str = 'float32', repeats: int = 5) -> float:
  """Achieved FLOP/s of a large square matmul on the default device (median); benchmarks."""
  import statistics  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from elastic_depth import timing  # pylint: disable=g-import-not-at-top
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  times = timing.interleaved({'matmul': lambda: f(a)}, repeats).times['matmul']
  return 2 * n ** 3 / statistics.median(times)


def peak_flops(configured: float = 0.0, device_kind: Optional[str] = None) -> float:
  """Peak FLOP/s for MFU: the configured value, else the device kind's bf16 peak, else 0."""
  if configured > 0:
    return configured
  if device_kind is None:
    import jax  # pylint: disable=g-import-not-at-top
    device_kind = jax.devices()[0].device_kind
  return next((flops for pat, flops in _PEAK_PATTERNS if pat.search(device_kind)), 0.0)


class MetricWriter:
  """Writes scalars to <workdir>/metrics.jsonl and TensorBoard event files."""

  def __init__(self, workdir: str, enabled: bool = True, resume_step: int = 0):
    """resume_step > 0: records of later steps (logged after the checkpoint a resumed run
    starts from) are dropped from the JSONL file and purged from TensorBoard's view."""
    self.enabled = enabled
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, 'metrics.jsonl')
      lifecycle.end_jsonl_line(path)
      if resume_step:
        lifecycle.drop_jsonl_steps_after(path, resume_step)
      self._jsonl = open(path, 'a', encoding='utf-8')
      self._tb = SummaryWriter(os.path.join(workdir, 'tb'),
                               purge_step=resume_step + 1 if resume_step else None)

  def write(self, step: int, scalars: dict, prefix: str = '') -> None:
    """Logs a dict of scalars at step."""
    if not self.enabled:
      return
    clean = {f'{prefix}{k}': float(v) for k, v in scalars.items()}
    rec = {'step': int(step), **{k: (v if math.isfinite(v) else str(v))
                                 for k, v in clean.items()}}
    self._jsonl.write(json.dumps(rec) + '\n')
    self._jsonl.flush()
    for k, v in clean.items():
      self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    """Flushes and closes the sinks."""
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


class LineProgress:
  """tqdm's counts, rate and ETA as one plain line every `interval` s, for logs that are not terminals."""

  def __init__(self, total: Optional[int], initial: int = 0, desc: str = 'train',
               unit: str = 'it', interval: float = 30.0, file=None):
    self.total, self.n, self.initial, self.desc, self.unit = total, initial, initial, desc, unit
    self.interval, self.file = interval, file or sys.stderr
    self._start = self._last = time.monotonic()
    self._postfix, self._shown = '', initial

  def set_postfix(self, refresh: bool = False, **kw) -> None:
    del refresh
    self._postfix = ', '.join(f'{k}={v}' for k, v in kw.items())

  def set_postfix_str(self, s: str = '', refresh: bool = False) -> None:
    del refresh
    self._postfix = s

  def update(self, n: int = 1) -> None:
    self.n += n
    if time.monotonic() - self._last >= self.interval:
      self._emit()

  def close(self) -> None:
    if self.n != self._shown:
      self._emit()

  def __enter__(self) -> 'LineProgress':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _emit(self) -> None:
    now = time.monotonic()
    counts = '{n_fmt}/{total_fmt} ({percentage:.0f}%)' if self.total else '{n_fmt}'
    line = tqdm.tqdm.format_meter(
        self.n, self.total, now - self._start, prefix=self.desc, unit=self.unit,
        initial=self.initial, postfix=self._postfix or None,
        bar_format='{desc}: ' + counts + ' {unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]')
    print(line, file=self.file, flush=True)
    self._last, self._shown = now, self.n


def progress(total: Optional[int], initial: int = 0, desc: str = 'train', unit: str = 'it',
             disable: Optional[bool] = None, file=None, interval: float = 30.0):
  """A tqdm bar with ETA on a terminal, else a LineProgress; disable=True: silent."""
  file = file or sys.stderr
  if disable is None and not (hasattr(file, 'isatty') and file.isatty()):
    return LineProgress(total, initial, desc, unit, interval, file)
  return tqdm.tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                   disable=bool(disable), mininterval=1.0, smoothing=0.1, file=file)
