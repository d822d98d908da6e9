"""The shared interleaved timer against a call log and known sleeps."""

import time

import jax.numpy as jnp

from elastic_depth import timing


def test_rounds_interleave_after_the_warmup_and_time_each_call():
  log = []

  def make(name, secs):
    def f():
      log.append(name)
      time.sleep(secs)
      return jnp.ones(3)  # waited for with block_until_ready
    return f
  t = timing.interleaved({'a': make('a', 0.02), 'b': make('b', 0.0)}, repeats=3, warmup=2)
  assert log == ['a', 'b'] * 5  # 2 untimed rounds, then 3 timed ones, in order
  assert [len(v) for v in t.times.values()] == [3, 3] and len(t.loads) == 3
  assert all(s >= 0.02 for s in t.times['a']) and all(s >= 0 for s in t.times['b'])
  assert all(x >= 0 for x in t.loads)


def test_no_warmup_times_every_call():
  log = []
  t = timing.interleaved({'f': lambda: log.append(1)}, repeats=4, warmup=0)
  assert len(log) == 4 and len(t.times['f']) == 4


def test_settle_times_each_function_right_after_an_untimed_call_of_itself():
  """A function slow only when another ran before it (cold) is timed warm with settle."""
  log = []

  def make(name):
    def f():
      if log and log[-1] != name:  # the first call after another function's: slow
        time.sleep(0.05)
      log.append(name)
    return f
  fns = {'a': make('a'), 'b': make('b')}
  cold = timing.interleaved(fns, repeats=3, warmup=0)
  assert all(s >= 0.05 for s in cold.times['b'])  # each timed call followed the other
  log.clear()
  warm = timing.interleaved(fns, repeats=3, warmup=0, settle=1)
  assert log == ['a', 'a', 'b', 'b'] * 3
  assert all(s < 0.05 for v in warm.times.values() for s in v)


def test_each_timed_call_reports_the_cpu_time_and_faults_it_caused():
  """A call that touches fresh memory shows its pages; one that spins shows user time."""
  import mmap  # pylint: disable=g-import-not-at-top

  def touch():  # 64 MiB mapped and written afresh at every call, whatever malloc's tunables
    with mmap.mmap(-1, 64 << 20) as m:
      for i in range(0, len(m), 4096):
        m[i] = 1
    return jnp.ones(1)

  def spin():
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:
      pass
    return jnp.ones(1)
  t = timing.interleaved({'touch': touch, 'spin': spin}, repeats=3, warmup=1)
  assert set(t.usage) == {'touch', 'spin'} and all(len(v) == 3 for v in t.usage.values())
  # 16,384 4-KiB pages (32 huge ones where the kernel backs all memory with them)
  assert all(u.minor_faults >= 32 for u in t.usage['touch'])
  assert all(u.user_s + u.sys_s >= 0.04 for u in t.usage['spin'])
  assert max(u.minor_faults for u in t.usage['spin']) < min(
      u.minor_faults for u in t.usage['touch'])


def test_a_computing_call_is_user_time():
  """0.1 s of pure computation (the CPU clock read once per ~1 ms of arithmetic; a tight
  loop of clock reads would be kernel time) is reported as user time, not kernel time."""
  def compute():
    t0 = time.process_time()
    while time.process_time() - t0 < 0.1:
      sum(range(100_000))
    return jnp.ones(1)
  t = timing.interleaved({'compute': compute}, repeats=2, warmup=0)
  assert all(u.user_s >= 0.08 and u.user_s > 2 * u.sys_s for u in t.usage['compute'])


def test_the_timed_call_waits_for_its_result():
  """A result still pending when f returns (its block_until_ready waits 0.05 s): the time
  of the call includes that wait."""
  class Pending:
    def block_until_ready(self):
      time.sleep(0.05)
      return self
  t = timing.interleaved({'f': Pending}, repeats=2, warmup=0)
  assert all(s >= 0.05 for s in t.times['f'])


def test_each_round_records_the_one_minute_load(monkeypatch):
  """loads holds os.getloadavg()'s 1-minute average at the start of each timed round."""
  monkeypatch.setattr(timing.os, 'getloadavg', lambda: (0.25, 7.0, 9.0))
  t = timing.interleaved({'f': lambda: None}, repeats=3, warmup=1)
  assert t.loads == [0.25] * 3
