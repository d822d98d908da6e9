"""Many processes on JAX's own engine: 2 processes x 2 CPU devices train like 1 x 4 and 1 x 1.

Every run is `python -m experiments.pretrain` in subprocesses talking only to 127.0.0.1;
the per-step losses come from each run's metrics.jsonl (written by process 0 only).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 20

FLAGS = [
    '--config.data.source=synthetic', '--config.data.synth_examples=600',
    '--config.data.loss_on=answers',  # the two-process run ends with the difficulty report
    '--config.data.synth_max_hops=2', '--config.model.vocab_size=64',
    '--config.model.d_model=32', '--config.model.num_heads=4', '--config.model.num_kv_heads=2',
    '--config.model.head_dim=8', '--config.model.mlp_dim=64', '--config.model.max_len=32',
    '--config.depth.mean=1.5', '--config.depth.r_max=2', '--config.depth.buckets=(1,2)',
    '--config.train.seq_len=16', '--config.train.batch_size=8', f'--config.train.steps={STEPS}',
    '--config.train.lr=1e-2', '--config.train.warmup_steps=2', '--config.train.log_every=1',
    '--config.train.eval_every=10', '--config.train.eval_batches=2',
    '--config.train.ckpt_every=10',
    '--config.train.eval_depths=(1,)', '--config.train.peak_flops=1e9', '--quiet',
]


def _env(devices: int) -> dict:
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO,
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')
  for k in ('SLURM_STEP_NUM_TASKS', 'OMPI_COMM_WORLD_SIZE', 'JAX_COORDINATOR_ADDRESS'):
    env.pop(k, None)
  return env


def _port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _start(workdir, devices: int, extra=(), proc=None):
  args = [sys.executable, '-m', 'experiments.pretrain', f'--workdir={workdir}', *FLAGS,
          *extra]
  if proc is not None:
    args += [f'--coordinator_address=127.0.0.1:{proc[0]}', '--num_processes=2',
             f'--process_id={proc[1]}', '--heartbeat_timeout_s=10']
  return subprocess.Popen(args, cwd=REPO, env=_env(devices), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _wait(p, timeout=420):
  out, err = p.communicate(timeout=timeout)
  assert p.returncode == 0, err[-4000:]
  return out


def _losses(workdir, key='train/loss') -> dict[int, float]:
  out = {}
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    for line in f:
      rec = json.loads(line)
      if key in rec:
        out[rec['step']] = rec[key]
  return out


def _two_processes(workdir, extra=()):
  port = _port()
  procs = [_start(workdir, 2, extra, (port, i)) for i in range(2)]
  return [_wait(p) for p in procs]


def _runs(root) -> dict:
  """Losses of the five runs: 2 processes x 2 devices, 1 x 4, 1 x 1, fsdp 4, resume."""
  wd = {k: str(root / k) for k in ('p2', 'd4', 'd1', 'fsdp4', 'resume')}
  outs = _two_processes(wd['p2'])
  no_report = '--nodifficulty_report'
  singles = [_start(wd['d4'], 4, [no_report]), _start(wd['d1'], 1, [no_report]),
             _start(wd['fsdp4'], 4, ['--config.train.fsdp=4', no_report])]
  for p in singles:
    _wait(p)
  # the 2-process checkpoint of step 10, resumed by 1 process with 1 device
  shutil.copytree(wd['p2'], wd['resume'])
  shutil.rmtree(os.path.join(wd['resume'], 'checkpoints', str(STEPS)))
  os.remove(os.path.join(wd['resume'], 'metrics.jsonl'))
  _wait(_start(wd['resume'], 1, ['--resume', no_report]))
  return {'stdout': outs,**{k: _losses(v) for k, v in wd.items()},
          **{f'{k}/val': _losses(v, 'val/loss_r1') for k, v in wd.items()},
          **{f'{k}/{m}': _losses(v, f'train/{m}') for k, v in wd.items()
             for m in ('mfu', 'tokens_per_s')}}


def _assert_same(a: dict, b: dict, steps):
  assert set(steps) <= set(a) and set(steps) <= set(b)
  for s in steps:
    assert a[s] == pytest.approx(b[s], rel=2e-5, abs=1e-6), s


def test_two_processes_fsdp_and_a_resume_equal_one_device(tmp_path):
  """One test over the five runs (a module fixture would be rebuilt on each xdist worker)."""
  runs = _runs(tmp_path)
  # two processes equal four devices and one
  _assert_same(runs['p2'], runs['d4'], range(1, STEPS + 1))
  _assert_same(runs['p2'], runs['d1'], range(1, STEPS + 1))
  assert runs['d1'][1] - runs['d1'][STEPS] > 0.05  # it trained: a real comparison
  # the validation set (2 global batches of 8) does not shrink with two processes
  _assert_same(runs['p2/val'], runs['d1/val'], (10, 20))
  _assert_same(runs['p2/val'], runs['d4/val'], (10, 20))
  # MFU is the whole mesh's: per token/s, 4 devices log a quarter of what 1 device logs
  per_tps = {k: [runs[f'{k}/mfu'][s] / runs[f'{k}/tokens_per_s'][s] for s in runs[f'{k}/mfu']]
             for k in ('d1', 'd4', 'p2')}
  assert per_tps['d1'] and len(per_tps['d4']) == len(per_tps['p2']) == len(per_tps['d1'])
  for k in ('d4', 'p2'):
    np.testing.assert_allclose(per_tps[k], np.asarray(per_tps['d1']) / 4, rtol=1e-9)
  # one banner, closing line and report per job: process 0's
  lines = ('elastic-depth: ', 'validation loss: depth 1 = ', 'report ')
  lead, other = runs['stdout']
  assert all(line in lead for line in lines), lead
  assert not any(line in other for line in lines), other
  assert os.path.exists(os.path.join(tmp_path, 'p2', 'reports', 'difficulty.json'))
  # fsdp equals one device
  _assert_same(runs['fsdp4'], runs['d1'], range(1, STEPS + 1))
  # the two-process checkpoint resumes on one device
  assert min(runs['resume']) == 11
  _assert_same(runs['resume'], runs['p2'], range(11, STEPS + 1))


def test_a_killed_peer_stops_the_other_process(tmp_path):
  port = _port()
  extra = ['--config.train.steps=100000', '--config.train.ckpt_every=100000']
  procs = [_start(str(tmp_path / 'wd'), 2, extra, (port, i)) for i in range(2)]
  metrics = tmp_path / 'wd' / 'metrics.jsonl'
  deadline = time.time() + 300
  while not (metrics.exists() and metrics.read_text().count('\n') >= 3):
    assert time.time() < deadline and procs[0].poll() is None, procs[0].stderr.read()[-3000:]
    time.sleep(0.5)
  procs[1].send_signal(signal.SIGKILL)
  t0 = time.time()
  try:
    _, err = procs[0].communicate(timeout=120)
  except subprocess.TimeoutExpired:
    procs[0].kill()
    pytest.fail('the surviving process hung after its peer was killed')
  assert time.time() - t0 < 120
  assert procs[0].returncode != 0
  # Either a collective fails first (our one line, exit 3), or, when the survivor waits
  # outside a socket read, jax's coordination service stops it after the heartbeat
  # timeout with its own fatal message naming the cause, or the CPU collectives' gloo
  # transport aborts the process from C++ (an uncaught gloo::EnforceNotMet when the
  # peer's socket closes mid-collective; no Python handler can turn it into our line).
  lines = err.strip().splitlines()
  ours = lines[-1].startswith('error: process 0 of 2: a peer process failed')
  assert ours == (procs[0].returncode == 3), err[-3000:]
  gloo = "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in err
  assert ours or 'another task died' in err or gloo, err[-3000:]


def test_a_signal_to_one_process_stops_both_at_one_step(tmp_path):
  """SIGTERM reaches one process only: both agree on the step, save it together, exit 0."""
  port, wd = _port(), tmp_path / 'wd'
  extra = ['--config.train.steps=100000', '--config.train.ckpt_every=100000']
  procs = [_start(str(wd), 2, extra, (port, i)) for i in range(2)]
  metrics = wd / 'metrics.jsonl'
  deadline = time.time() + 300
  while not (metrics.exists() and metrics.read_text().count('\n') >= 3):
    assert time.time() < deadline and procs[0].poll() is None, procs[0].stderr.read()[-3000:]
    time.sleep(0.5)
  procs[0].send_signal(signal.SIGTERM)
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=120))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail('the processes hung: they did not agree on the step to stop at')
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  stopped = [int(out.split('saved step ')[1].split(',')[0]) for out, _ in outs]
  assert stopped[0] == stopped[1], outs
  assert os.listdir(wd / 'checkpoints') == [str(stopped[0])]
  with open(wd / 'summary.json', encoding='utf-8') as f:
    assert json.load(f)['preempted_at'] == stopped[0]
