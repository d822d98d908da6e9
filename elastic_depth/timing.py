"""Wall-clock timing shared by `frontier.wall_clock` and the benchmarks (experiments/)."""

import os
import time
from typing import Any, Callable, Mapping, NamedTuple

import jax


class Timings(NamedTuple):
  """Seconds per round of each timed function, and the 1-minute load at each round's start."""
  times: dict   # name -> [seconds per round]
  loads: list   # os.getloadavg()[0] per round
  usage: dict   # name -> [Usage of each timed call]


class Usage(NamedTuple):
  """What one call cost this process beside its wall time (resource.getrusage deltas)."""
  user_s: float      # CPU time in user mode, all threads
  sys_s: float       # CPU time in the kernel (page faults, zeroing fresh memory, ...)
  minor_faults: int  # pages mapped afresh


def _rusage() -> tuple[float, float, int]:
  try:
    import resource  # pylint: disable=g-import-not-at-top  (POSIX only)
  except ImportError:
    return 0.0, 0.0, 0
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime, r.ru_stime, r.ru_minflt


def call_usage(f: Callable[[], Any]) -> tuple[Any, float, Usage]:
  """Calls f, waits for its result, and returns (result, wall seconds, Usage of the call)."""
  u0 = _rusage()
  t0 = time.perf_counter()
  out = jax.block_until_ready(f())
  wall = time.perf_counter() - t0
  u1 = _rusage()
  return out, wall, Usage(u1[0] - u0[0], u1[1] - u0[1], u1[2] - u0[2])


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
    Timings of the timed rounds, with each timed call's CPU time and page faults.
  """
  for _ in range(warmup):
    for f in fns.values():
      jax.block_until_ready(f())
  times = {k: [] for k in fns}
  usage = {k: [] for k in fns}
  loads = []
  for _ in range(repeats):
    loads.append(os.getloadavg()[0])
    for k, f in fns.items():
      for _ in range(settle):
        jax.block_until_ready(f())
      _, wall, use = call_usage(f)
      times[k].append(wall)
      usage[k].append(use)
  return Timings(times, loads, usage)
