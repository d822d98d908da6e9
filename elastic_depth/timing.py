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
                warmup: int = 1, settle: int = 0) -> Timings:
  """Times argument-free functions in interleaved rounds (a, b, a, b, ...).

  Args:
    fns: name -> function; each call is waited for with jax.block_until_ready.
    repeats: timed rounds; each calls every function once, in order.
    warmup: untimed rounds first (compilation).
    settle: untimed calls of each function right before its timed one, in every round
      (a, a, b, b, ... with settle=1): times a function warm, as back-to-back calls run
      (on a VM, the first call after seconds of other work fetches its freed memory again).
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
      for _ in range(settle):
        jax.block_until_ready(f())
      t0 = time.perf_counter()
      jax.block_until_ready(f())
      times[k].append(time.perf_counter() - t0)
  return Timings(times, loads)
