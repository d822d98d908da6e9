"""Wall-clock timing shared by `analysis.wall_clock` and the benchmarks (experiments/)."""

import os
import time
from typing import Any, Callable, Mapping, NamedTuple

import jax


class Timings(NamedTuple):
  """Seconds per round of each timed function, and the 1-minute load at each round's start."""
  times: dict   # name -> [seconds per round]
  loads: list   # os.getloadavg()[0] per round


def interleaved(fns: Mapping[str, Callable[[], Any]], repeats: int,
                warmup: int = 1) -> Timings:
  """Times argument-free functions in interleaved rounds (a, b, a, b, ...).

  Args:
    fns: name -> function; each call is waited for with jax.block_until_ready.
    repeats: timed rounds; each calls every function once, in order.
    warmup: untimed rounds first (compilation).
  Returns:
    Timings of the timed rounds.
  """
  for _ in range(warmup):
    for f in fns.values():
      jax.block_until_ready(f())
  times = {k: [] for k in fns}
  loads = []
  for _ in range(repeats):
    loads.append(os.getloadavg()[0])
    for k, f in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f())
      times[k].append(time.perf_counter() - t0)
  return Timings(times, loads)
