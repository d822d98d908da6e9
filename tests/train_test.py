"""Tests for the training loop: its log, resume, preemption and non-finite steps."""

import dataclasses
import json

import jax
import pytest

from elastic_depth import distributed
from elastic_depth import policies
from elastic_depth import train as train_lib
from elastic_depth import train_step


def test_the_log_shows_the_loops_run_and_times_steps_only(tmp_path, make_config, monkeypatch):
  """train/loops is the bucket each step ran (train/depth the drawn r); tokens/s times the
  steps between log points, not the evaluations and saves between them (a fake clock jumps
  1000 s in each); the progress bar starts after the first step, which compiles."""
  from elastic_depth import checkpoint, metrics  # pylint: disable=g-import-not-at-top
  clock = [0.0]

  def tick():
    clock[0] += 1.0
    return clock[0]

  def slow(fn):
    def wrapped(*a, **kw):
      clock[0] += 1000.0
      return fn(*a, **kw)
    return wrapped

  bars = []

  class Bar:
    def __init__(self, total, initial, **_):
      self.total, self.initial, self.n, self.closed = total, initial, initial, False
      bars.append(self)

    def update(self, n=1):
      self.n += n

    def set_postfix(self, **_):
      pass

    def close(self):
      self.closed = True

  monkeypatch.setattr(train_lib, '_clock', tick)
  monkeypatch.setattr(train_lib, 'evaluate', slow(train_lib.evaluate))
  monkeypatch.setattr(checkpoint, 'save', slow(checkpoint.save))
  monkeypatch.setattr(metrics, 'progress', Bar)
  cfg = make_config(depth=dict(mean=2.0, r_max=3, buckets=(1, 3)),
                    train=dict(steps=8, log_every=1, eval_every=2, ckpt_every=3,
                               eval_batches=1, eval_depths=(1,)))
  train_lib.run(cfg, str(tmp_path), quiet=True)
  recs = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  steps = [r for r in recs if 'train/loss' in r]
  assert [r['step'] for r in steps] == list(range(1, 9))
  seed_key = jax.random.key(cfg.train.seed)
  for r in steps:
    drawn, idx = policies.draw_bucket(seed_key, r['step'] - 1, cfg.depth)
    assert r['train/depth'] == int(drawn) and r['train/loops'] == (1, 3)[int(idx)]
  tokens = cfg.train.batch_size * cfg.train.seq_len
  rates = [r['train/tokens_per_s'] for r in steps[1:]]
  assert len(rates) == 7 and min(rates) >= tokens / 2, rates  # 1-2 ticks a step, no 1000 s
  [bar] = bars
  assert bar.initial == 1 and bar.n == 8 and bar.closed and bar.total == 8


def test_a_resume_after_a_kill_logs_each_step_once(tmp_path, make_config):
  """Steps logged after the last checkpoint (a kill before the next) are logged again by
  --resume: their old records are dropped, so metrics.jsonl holds each step once."""
  import shutil  # pylint: disable=g-import-not-at-top
  cfg = make_config(train=dict(steps=6, log_every=1, eval_every=100, ckpt_every=3,
                               eval_batches=1, eval_depths=(1,)))
  wd = tmp_path / 'run'
  train_lib.run(cfg, str(wd), quiet=True)
  shutil.rmtree(wd / 'checkpoints' / '6')  # as if killed between step 6's log and save
  with open(wd / 'metrics.jsonl', 'a', encoding='utf-8') as f:
    f.write('{"step": 7, "train/lo')  # and a line cut off by the kill
  train_lib.run(cfg, str(wd), resume=True, quiet=True)
  recs = [json.loads(l) for l in (wd / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in recs if 'train/loss' in r] == [1, 2, 3, 4, 5, 6]
  assert [r['step'] for r in recs if 'val/loss_r1' in r] == [6]


def test_a_preempted_resume_keeps_the_last_validation_in_the_summary(tmp_path, make_config,
                                                                     monkeypatch):
  """A resumed session stopped by a signal before it validates: summary.json still holds
  the last validation (the finished run's), beside preempted_at."""
  cfg = make_config(train=dict(steps=4, log_every=1, eval_every=4, ckpt_every=4,
                               eval_batches=1, eval_depths=(1,)))
  train_lib.run(cfg, str(tmp_path), quiet=True)
  done = json.loads((tmp_path / 'summary.json').read_text())
  assert done['step'] == 4 and set(done['val_loss']) == {'1'}
  calls = []

  def signal_after_one_step(signum):
    calls.append(signum)
    return 15 if len(calls) == 2 else None  # calls: before step 5, after it

  monkeypatch.setattr(distributed, 'agree_signal', signal_after_one_step)
  more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
  summary = train_lib.run(more, str(tmp_path), resume=True, quiet=True)
  saved = json.loads((tmp_path / 'summary.json').read_text())
  assert summary['preempted_at'] == saved['preempted_at'] == 5
  assert saved['step'] == 4 and saved['val_loss'] == done['val_loss']
  assert saved['last_step'] == 5


def test_the_logged_lr_under_nan_skips_is_the_one_applied(tmp_path, make_config):
  """A skipped step leaves the optimizer's schedule count behind, so step s applies
  schedule(s - 1 - steps skipped before it), and that is the lr logged."""
  cfg = make_config(train=dict(steps=8, log_every=1, eval_every=100, ckpt_every=100,
                               eval_batches=1, eval_depths=(1,), lr=1e30, warmup_steps=4,
                               nan_policy='skip', max_skips=100))
  train_lib.run(cfg, str(tmp_path), quiet=True)
  recs = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  recs = [r for r in recs if 'train/lr' in r]
  assert [r['step'] for r in recs] == list(range(1, 9))
  skipped = [r['train/skipped'] for r in recs]
  assert 0 < skipped[-1] < 7, skipped  # some steps ran, later ones were skipped
  sched, before = train_step.lr_schedule(cfg), 0
  for r in recs:
    assert r['train/lr'] == pytest.approx(float(sched(r['step'] - 1 - before)), rel=1e-6)
    before = r['train/skipped']
