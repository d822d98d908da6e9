"""Metric sinks: JSONL, TensorBoard event files, and a console progress bar."""

import json
import math
import os
from typing import Optional

import tqdm
from tensorboardX import SummaryWriter

# Dense bf16 peak FLOP/s by device kind (vendor data sheets; substring of device_kind).
PEAK_BF16_FLOPS = (
    ('H200', 989e12), ('H100', 989e12), ('A100', 312e12), ('RTX 4090', 165e12),
    ('L4', 121e12), ('TPU v5 lite', 197e12), ('TPU v5e', 197e12), ('TPU v5p', 459e12),
    ('TPU v4', 275e12), ('TPU v6', 918e12),
)


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
  for name, flops in PEAK_BF16_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return 0.0


class MetricWriter:
  """Writes scalars to <workdir>/metrics.jsonl and TensorBoard event files."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', encoding='utf-8')
      self._tb = SummaryWriter(os.path.join(workdir, 'tb'))

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


def progress(total: int, initial: int = 0, desc: str = 'train',
             disable: Optional[bool] = None) -> tqdm.tqdm:
  """A tqdm bar with ETA (steps)."""
  return tqdm.tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                   disable=disable, mininterval=1.0, smoothing=0.1)
