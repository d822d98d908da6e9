"""Run-directory and process hygiene: the workdir probe, preemption signals, metrics repair."""

import json
import os
import signal
import threading

from elastic_depth.config import ConfigError


class Preemption:
  """Turns SIGTERM/SIGINT into a flag checked at step boundaries.

  A second signal while the first is pending stops at once (KeyboardInterrupt) without
  saving; the previous checkpoint stays restorable since saves are atomic.
  """

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in (signal.SIGTERM, signal.SIGINT):
        self._old[s] = signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.signum is not None:
      self.__exit__()
      raise KeyboardInterrupt(f'second signal {signum}: stopping without saving')
    self.signum = signum
    print(f'\nsignal {signum} received: saving a checkpoint at the end of this step',
          flush=True)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)
    self._old = {}


def check_workdir(workdir: str) -> None:
  """Creates the workdir or raises a clear error if it is not writable."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f'.write_probe.{os.getpid()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f'workdir {workdir!r} is not writable: {e}') from e


def drop_jsonl_steps_after(path: str, step: int) -> int:
  """Removes the records of steps after `step` (a resumed run logs them again) and lines
  cut off by a kill (they do not parse); returns how many. Replaces the file atomically."""
  try:
    with open(path, encoding='utf-8') as f:
      lines = f.read().splitlines(keepends=True)
  except FileNotFoundError:
    return 0

  def later(line: str) -> bool:
    try:
      return int(json.loads(line)['step']) > step
    except (ValueError, KeyError, TypeError):  # a fragment a kill left
      return True
  keep = [l if l.endswith('\n') else l + '\n' for l in lines if not later(l)]
  if len(keep) == len(lines):
    return 0
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.writelines(keep)
  os.replace(tmp, path)
  return len(lines) - len(keep)


def end_jsonl_line(path: str) -> None:
  """Terminates a metrics line cut off by a kill, so appended records stay parseable."""
  try:
    with open(path, 'rb+') as f:
      f.seek(0, os.SEEK_END)
      if f.tell():
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b'\n':
          f.write(b'\n')
  except FileNotFoundError:
    pass
