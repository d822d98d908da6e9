"""Timing helper shared by the benchmarks."""

import statistics
import time

import jax


def time_fn(fn, args, repeats):
  """Median / min wall seconds of fn(*args) after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return {'median_s': statistics.median(times), 'min_s': min(times),
          'repeats': repeats}
