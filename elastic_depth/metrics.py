"""Metric sinks: JSONL, TensorBoard event files, and a console progress bar."""

import json
import math
import os
from typing import Optional

import tqdm
from tensorboardX import SummaryWriter


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
