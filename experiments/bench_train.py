"""Benchmark the full jitted training step: tokens/s, model FLOP/s and fraction of peak.

Usage: python -m experiments.bench_train [--shapes=tiny,S,P] [--steps=5] [--out=...]

Per shape it builds the library's own train step (`train.make_train_step`: AdamW,
clipping, the bucketed-depth switch) with a single depth bucket (r,) so that every
step runs exactly r loops, times `--steps` steps after `--warmup` untimed ones
(the first compiles) and reports the median step time as tokens/s.

FLOPs are model FLOPs: 3x the forward matmul FLOPs of `model.flops_per_token` at
depth r (the usual "6N" convention); `hw_flops_per_token` also counts the forward
of the core loops recomputed in the backward pass by `jax.checkpoint` (remat).
Both are divided by the matmul peak measured in the same process
(`metrics.measure_matmul_peak`, one large fp32 jnp.dot), before and after the shapes.
Shapes S and P come from `bench_util.MODEL_SHAPES`; the reference implementation's
figures (experiments/reference_figures.json) were measured elsewhere, so the ratio
against them is indicative, not a side-by-side measurement.

The machine may be shared: the JSON records the load average and the busiest
other processes, and only ratios measured within one run are meaningful.
"""

import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
import jax
import numpy as np

from elastic_depth import config as config_lib
from elastic_depth import metrics
from elastic_depth import distributed
from elastic_depth import model as model_lib
from elastic_depth import train as train_lib
from experiments import flags_util
from experiments import bench_util

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_list('shapes', ['tiny', 'S', 'P'], 'Shapes to run (see SHAPES).')
flags.DEFINE_integer('steps', 5, 'Timed steps per shape (capped by a shape\'s max_steps '
                     'unless --nocap_heavy).')
flags.DEFINE_integer('warmup', 1, 'Untimed steps after the AOT compile.')
flags.DEFINE_bool('cap_heavy', True, 'Cap the timed steps of heavy shapes (P: 3).')
flags.DEFINE_string('out', 'runs/bench_train.json', 'Output JSON path.')
flags.DEFINE_integer('depth', 0, 'Override the depth r of every shape (0: the shape\'s).')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Compute dtype.')
flags.DEFINE_bool('remat', True, 'jax.checkpoint on each scanned core loop.')
flags.DEFINE_integer('peak_n', 2048, 'Side of the square fp32 matmul for the peak.')
flags.DEFINE_string('tiny_flags', os.path.join(REPO, 'launch', 'tiny.flags'),
                    'Flag file the `tiny` shape is parsed from.')

TARGET_RATIO = 2.0  # x the reference figure (measured elsewhere: see bench_util)
TARGET_PEAK_FRACTION = {'S': 0.40}


def _shape(name: str, seq_len: int, batch_size: int, r: int, max_steps=None):
  """(model overrides, train overrides, depth r, max timed steps or None) of a shared shape."""
  return (dict(bench_util.MODEL_SHAPES[name], max_len=seq_len),
          dict(seq_len=seq_len, batch_size=batch_size), r, max_steps)


SHAPES = {
    # launch/tiny.flags, parsed at run time (model and train fields), at r=8
    'tiny': (None, None, 8, None),
    'S': _shape('S', 256, 8, 8),  # the comparison point with the reference figures
    'P': _shape('P', 512, 2, 8, 3),  # the 135M block shape
    'nano': _shape('nano', 16, 2, 2),  # a few-second shape for the smoke test
}


def shape_config(name: str, r: int, dtype: str, remat: bool) -> config_lib.Config:
  """The Config of a shape at fixed depth r (a single bucket: the switch has one branch)."""
  model_kw, train_kw, _, _ = SHAPES[name]
  if model_kw is None:  # tiny: parse the launch file as pretrain does
    parsed = flags_util.parse_config(['bench_train', f'--flagfile={FLAGS.tiny_flags}'])
    model_kw = dataclasses.asdict(parsed.model)
    train_kw = {k: getattr(parsed.train, k) for k in ('seq_len', 'batch_size')}
  model = dataclasses.replace(config_lib.ModelConfig(), **{**model_kw, 'dtype': dtype})
  depth = config_lib.DepthConfig(mean=float(r), sigma=0.0, r_max=r, buckets=(r,),
                                 remat=remat)
  train = dataclasses.replace(config_lib.TrainConfig(), **train_kw, steps=1000,
                              warmup_steps=10)
  cfg = config_lib.Config(model=model, depth=depth, train=train)
  config_lib.validate(cfg)
  return cfg


def flop_counts(cfg: config_lib.Config, r: int) -> dict:
  """Per-token FLOPs: model (3x forward) and hardware (plus the remat recompute)."""
  fwd = model_lib.flops_per_token(cfg.model, r, cfg.train.seq_len)
  model = 3 * fwd['total']
  recompute = r * fwd['loop'] if cfg.depth.remat else 0.0
  return dict(forward=float(fwd['total']), model=float(model),
              remat_recompute=float(recompute), hw=float(model + recompute),
              head_fraction=float(fwd['head'] / fwd['total']))


def random_batch(cfg: config_lib.Config, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  shape = (cfg.train.batch_size, cfg.train.seq_len)
  v = cfg.model.vocab_size
  return dict(inputs=rng.integers(0, v, shape).astype(np.int32),
              targets=rng.integers(0, v, shape).astype(np.int32),
              mask=np.ones(shape, np.float32))


def bench_shape(name: str, steps: int, warmup: int) -> dict:
  """Compiles and times the train step of one shape."""
  r = FLAGS.depth or SHAPES[name][2]
  cfg = shape_config(name, r, FLAGS.dtype, FLAGS.remat)
  mesh = distributed.make_mesh(jax.devices()[:1])
  graphdef, state = train_lib.init_state(cfg, cfg.train.seed)
  state = train_lib.place_state(state, mesh)
  step_fn = train_lib.make_train_step(graphdef, cfg, mesh)
  batch = distributed.shard_batch([random_batch(cfg)], mesh, 1)
  tokens = cfg.train.batch_size * cfg.train.seq_len

  t0 = time.perf_counter()
  compiled = step_fn.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  mem = {}
  try:
    ma = compiled.memory_analysis()
    mem = dict(temp_bytes=int(ma.temp_size_in_bytes),
               argument_bytes=int(ma.argument_size_in_bytes))
  except Exception:  # pylint: disable=broad-except
    pass

  times, losses, depths = [], [], set()
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    state, m = compiled(state, batch)
    loss = float(m['loss'])  # blocks
    dt = time.perf_counter() - t0
    losses.append(loss)
    depths.add(int(m['bucket']))
    if i >= warmup:
      times.append(dt)
  med = statistics.median(times)
  fl = flop_counts(cfg, r)
  return dict(
      shape=name, depth=r, dtype=cfg.model.dtype, remat=cfg.depth.remat,
      params=int(model_lib.count_params(cfg.model)), batch_size=cfg.train.batch_size,
      seq_len=cfg.train.seq_len, tokens_per_step=tokens, config=train_lib.config_dict(cfg),
      compile_s=compile_s, step_times_s=times, step_s_median=med,
      step_s_min=min(times), tokens_per_s=tokens / med,
      tokens_per_s_best=tokens / min(times),
      flops_per_token=fl['model'], flops_per_token_forward=fl['forward'],
      flops_per_token_remat_recompute=fl['remat_recompute'],
      flops_per_token_hw=fl['hw'], head_flop_fraction=fl['head_fraction'],
      model_flops_per_s=fl['model'] * tokens / med,
      hw_flops_per_s=fl['hw'] * tokens / med,
      first_loss=losses[0], last_loss=losses[-1],
      all_finite=bool(np.all(np.isfinite(losses))), depths_run=sorted(depths), **mem)


def busy_processes(limit: int = 8) -> list[str]:
  """The busiest other processes (pid %cpu command), for the record."""
  try:
    out = subprocess.run(['ps', '-eo', 'pid,pcpu,args', '--sort=-pcpu'], capture_output=True,
                         text=True, timeout=5, check=False).stdout.splitlines()[1:]
  except (OSError, subprocess.SubprocessError):
    return []
  me = str(os.getpid())
  rows = [l.strip()[:160] for l in out if l.split(None, 1)[0] != me]
  return rows[:limit]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  unknown = [s for s in FLAGS.shapes if s not in SHAPES]
  if unknown:
    raise app.UsageError(f'unknown shapes {unknown}; known: {sorted(SHAPES)}')
  load_start = os.getloadavg()
  procs_start = busy_processes()
  t_start = time.perf_counter()
  peaks = [metrics.measure_matmul_peak(FLAGS.peak_n)]
  results = []
  for name in FLAGS.shapes:
    cap = SHAPES[name][3] if FLAGS.cap_heavy else None
    steps = max(1, min(FLAGS.steps, cap) if cap else FLAGS.steps)
    res = bench_shape(name, steps, FLAGS.warmup)
    results.append(res)
    print(f'{name}: {res["tokens_per_s"]:,.0f} tok/s (median of {steps}, '
          f'compile {res["compile_s"]:.1f}s)', flush=True)
  peaks.append(metrics.measure_matmul_peak(FLAGS.peak_n))
  peak = float(statistics.median(peaks))
  for res in results:
    res['fraction_of_peak'] = res['model_flops_per_s'] / peak
    res['hw_fraction_of_peak'] = res['hw_flops_per_s'] / peak
    ref = bench_util.reference_tok_s('train', res['shape'], seq_len=res['seq_len'],
                                     batch_size=res['batch_size'], depth=res['depth'])
    if ref:
      res['reference_tokens_per_s'] = ref
      res['reference_note'] = bench_util.REFERENCE_NOTE
      res['ratio_vs_reference'] = res['tokens_per_s'] / ref
      res['target_tokens_per_s'] = TARGET_RATIO * ref
      res['meets_speed_target'] = res['tokens_per_s'] >= TARGET_RATIO * ref
      # tokens/s that the speed target implies at 100% of the measured matmul peak
      res['target_fraction_of_peak_needed'] = TARGET_RATIO * ref * res['flops_per_token'] / peak
    if res['shape'] in TARGET_PEAK_FRACTION:
      res['target_fraction_of_peak'] = TARGET_PEAK_FRACTION[res['shape']]
      res['meets_peak_target'] = res['fraction_of_peak'] >= TARGET_PEAK_FRACTION[res['shape']]

  doc = dict(
      date=datetime.datetime.now().isoformat(timespec='seconds'),
      command=' '.join(sys.argv), flags={k: FLAGS[k].value for k in
                                         ('shapes', 'steps', 'warmup', 'cap_heavy', 'depth',
                                          'dtype', 'remat', 'peak_n')},
      jax_version=jax.__version__, backend=jax.default_backend(),
      devices=[str(d) for d in jax.devices()], cpu_count=os.cpu_count(),
      machine=platform.machine(), xla_flags=os.environ.get('XLA_FLAGS', ''),
      matmul_peak_flops=peak, matmul_peak_samples=peaks,
      load_avg_start=list(load_start), load_avg_end=list(os.getloadavg()),
      other_processes_start=procs_start, other_processes_end=busy_processes(),
      wall_s=time.perf_counter() - t_start, results=results)
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, 'w', encoding='utf-8') as f:
    json.dump(doc, f, indent=1)

  print(f'\nmatmul peak (fp32, n={FLAGS.peak_n}): {peak / 1e9:.1f} GFLOP/s; '
        f'load avg {load_start[0]:.2f} -> {doc["load_avg_end"][0]:.2f}')
  head = (f'{"shape":6} {"params":>9} {"tok/step":>8} {"step s":>7} {"tok/s":>9} '
          f'{"GF/tok":>7} {"GFLOP/s":>8} {"%peak":>6} {"%peak hw":>8} {"ref tok/s*":>10} '
          f'{"ratio*":>6} {"target":>7}')
  print(head)
  print('-' * len(head))
  for res in results:
    ref = res.get('reference_tokens_per_s')
    print(f'{res["shape"]:6} {res["params"]:>9,} {res["tokens_per_step"]:>8} '
          f'{res["step_s_median"]:>7.3f} {res["tokens_per_s"]:>9,.0f} '
          f'{res["flops_per_token"] / 1e9:>7.3f} {res["model_flops_per_s"] / 1e9:>8.1f} '
          f'{100 * res["fraction_of_peak"]:>5.1f}% {100 * res["hw_fraction_of_peak"]:>7.1f}% '
          + (f'{ref:>10,.0f} {res["ratio_vs_reference"]:>5.2f}x '
             f'{"met" if res["meets_speed_target"] else "MISSED":>7}' if ref else
             f'{"-":>10} {"-":>6} {"-":>7}'))
  print(f'* {bench_util.REFERENCE_NOTE}\nwrote {FLAGS.out}')


if __name__ == '__main__':
  app.run(main)
