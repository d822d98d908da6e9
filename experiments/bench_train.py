"""Benchmark the full jitted training step: tokens/s, fraction of peak, memory, reference.

Usage: python -m experiments.bench_train [--shapes=tiny,S,P] [--steps=5] [--out=...]
  [--remat=nothing,dots,all_dots,off] [--loss_chunk=0,512] [--attention_impl=auto,xla,cudnn]
  [--micro_batch=ROWS] [--unroll=1,8] [--fuse_projections]
  [--reference_dir=DIR --rounds=N]

Per shape it builds the library's own train step (`train_step.make_train_step`: AdamW,
clipping, the bucketed-depth switch) with a single depth bucket (r,) so that every
step runs exactly r loops, times `--steps` steps after `--warmup` untimed ones
(the first compiles) and reports the median step time as tokens/s, with XLA's
compiled memory analysis (temporaries, peak) for each remat choice (`--remat`;
default the shape's own, `Shape.remat`) and each loss chunking (`--loss_chunk`: 0 is the
plain head + cross-entropy over [B, L, V] logits, N > 0 the fused one, N tokens at a
time, `train.loss_chunk`; default the shape's own) and each attention implementation
(`--attention_impl`, model.attention_impl; default auto).

FLOPs are model FLOPs: 3x the forward matmul FLOPs of `model.flops_per_token` at
depth r (the usual "6N" convention); `hw_flops_per_token` also counts the matmuls
that the backward pass recomputes: remat's (all of a loop's with remat_policy=nothing;
with dots the attention scores/outputs, except the chunked attention's, whose output and
log-sum-exp it keeps; none with all_dots or off) and a flash-style attention backward's
(the chunked attention's or cuDNN's: the scores of every attention block). Both are divided
by the matmul peak measured in the same process (`metrics.measure_matmul_peak`, one
large fp32 jnp.dot), before and after the shapes; on an accelerator the model FLOP/s
are also reported as MFU against the device kind's bf16 peak (`metrics.peak_flops`).

Reference: with --reference_dir (a checkout of seal-rg/recurrent-pretraining, and
torch installed) the reference's own training step is timed at S and P in this run,
after ours, never at once (`experiments/bench_reference.py`); --rounds alternates the
two, each later round starting with --round_warmup untimed steps of each. Without it,
the ratio is against experiments/reference_figures.json, recorded on another machine and
labelled so.

`135m` is the real step of launch/135m.flags (bf16, 16 x 2048, 8 micro-batches, head + loss
fused in chunks of 4,096): on a CPU it is only compiled (FLOPs and memory reported,
`timed: false`).

The machine may be shared: the JSON records the load average, the busiest other
processes and each step's process CPU time; only ratios measured within one run are
meaningful.
"""

import dataclasses
import datetime
import itertools
import os
import platform
import statistics
import sys
import time

from absl import app
from absl import flags
import jax

from elastic_depth import config as config_lib
from elastic_depth import metrics
from experiments import bench_reference
from experiments import bench_util
from experiments import flags_util
from experiments import timed_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMAT_CHOICES = [p.value for p in config_lib.RematPolicy] + ['off']

FLAGS = flags.FLAGS
flags.DEFINE_list('shapes', ['tiny', 'S', 'P'], 'Shapes to run (see SHAPES).')
flags.DEFINE_integer('steps', 5, 'Timed steps per shape and round (capped by a shape\'s '
                     'max_steps unless --nocap_heavy).')
flags.DEFINE_integer('warmup', 1, 'Untimed steps after the AOT compile.')
flags.DEFINE_bool('cap_heavy', True, 'Cap the timed steps of heavy shapes (P: 3).')
flags.DEFINE_string('out', 'runs/bench_train.json', 'Output JSON path.')
flags.DEFINE_integer('depth', 0, 'Override the depth r of every shape (0: the shape\'s).',
                     lower_bound=0)
flags.DEFINE_enum('dtype', '', ['', 'float32', 'bfloat16'], 'Compute dtype (default: the '
                  'shape\'s; 135m is bfloat16, the others float32).')
flags.DEFINE_list('remat', [], f'Remat choices to time per shape, of {REMAT_CHOICES} '
                  '(off: no jax.checkpoint); default: the shape\'s own choice.')
flags.DEFINE_list('loss_chunk', [], 'train.loss_chunk values to time per shape and remat '
                  'choice (0: plain cross-entropy; default: the shape\'s own).')
flags.DEFINE_list('attention_impl', [], 'model.attention_impl values to time per shape, '
                  f'remat and loss chunk, of {[a.value for a in config_lib.AttentionImpl]} '
                  '(default: auto).')
flags.DEFINE_integer('micro_batch', 0, 'Override the micro-batch rows (train.batch_size) of '
                     'every shape, tokens per step kept (0: the shape\'s).')
flags.DEFINE_bool('fuse_projections', False, 'model.fuse_projections: q/k/v and gate/up as '
                  'one matmul each (same parameters and result).')
flags.DEFINE_list('unroll', [], 'depth.unroll values to time per shape and remat choice: '
                  'core loops per iteration of the training scan (same result; default 1).')
flags.DEFINE_integer('peak_n', 2048, 'Side of the square fp32 matmul for the peak.')
flags.DEFINE_string('tiny_flags', os.path.join(REPO, 'launch', 'tiny.flags'),
                    'Flag file the `tiny` shape is parsed from.')
flags.DEFINE_string('reference_dir', '', 'Checkout of seal-rg/recurrent-pretraining: time '
                    'the reference\'s own training step at S and P in this run (needs '
                    "torch: pip install -e '.[reference]'); empty: quote the recorded figures.")
flags.DEFINE_integer('reference_threads', 2, 'torch.set_num_threads for the reference.')
flags.DEFINE_integer('rounds', 1, 'Alternate our steps and the reference\'s this many times '
                     '(medians over all rounds; more rounds even out a shared machine\'s load).')
flags.DEFINE_integer('round_warmup', 1, 'Untimed steps at the start of every later round, '
                     'ours and the reference\'s: on a VM the first XLA:CPU step after a '
                     'pause of seconds spends seconds in the kernel (WORKSPACE.md).')

TARGET_RATIO = 1.2  # x the reference's tokens/s (issue 13)
TARGET_PEAK_FRACTION = {'S': 0.40}
REFERENCE_SHAPES = ('S', 'P', 'Pmha')  # shapes the reference's config classes can express


@dataclasses.dataclass(frozen=True)
class Shape:
  """A benchmark shape: model/train overrides, depth, and how it is run."""
  model: dict | None        # None: parsed from --tiny_flags
  train: dict | None
  r: int
  max_steps: int | None = None  # cap of the timed steps (heavy shapes)
  remat: str = 'nothing'        # the shape's remat choice (REMAT_CHOICES)
  loss_chunk: int = 0           # the shape's train.loss_chunk (0: plain cross-entropy)
  dtype: str = 'float32'
  timed_on_cpu: bool = True     # False: on CPU only compiled (FLOPs and memory reported)


def _shape(name: str, seq_len: int, batch_size: int, r: int, **kw) -> Shape:
  """A Shape of bench_util.MODEL_SHAPES[name] at these sequence/batch sizes."""
  train_kw = dict(seq_len=seq_len, batch_size=batch_size, **kw.pop('train', {}))
  return Shape(dict(bench_util.MODEL_SHAPES[name], max_len=seq_len), train_kw, r, **kw)


SHAPES = {
    # launch/tiny.flags, parsed at run time (model and train fields), at r=8
    'tiny': Shape(None, None, 8),
    # the comparison points with the reference; remat per shape (WORKSPACE.md, issue 13):
    # S keeps the matmul outputs (faster, memory is no concern there), P recomputes them
    # (no more memory than before) and fuses the head and loss in chunks of 512 tokens
    # (faster and smaller there; not at S's 4k vocab)
    'S': _shape('S', 256, 8, 8, remat='dots'),
    'P': _shape('P', 512, 2, 8, max_steps=3, loss_chunk=512),  # the 135M block shape
    # P with 9 kv heads: the reference's config has no GQA, so this is P at its FLOPs
    'Pmha': dataclasses.replace(_shape('P', 512, 2, 8, max_steps=3), model=dict(
        bench_util.MODEL_SHAPES['P'], num_kv_heads=9, max_len=512)),
    # the real 135M step of launch/135m.flags: bf16, 16 x 2048, 8 micro-batches per step,
    # head + loss fused in chunks of 4,096 tokens (135m_h200.flags: --remat=off --unroll=8)
    '135m': _shape('P', 2048, 16, 8, max_steps=3, dtype='bfloat16', timed_on_cpu=False,
                   loss_chunk=4096, train=dict(tokens_per_step=262144)),
    'nano': _shape('nano', 16, 2, 2),  # a few-second shape for the smoke test
}


def shape_config(name: str, r: int, dtype: str, remat: str, loss_chunk: int | None = None,
                 attention_impl: str = 'auto', unroll: int = 1) -> config_lib.Config:
  """The Config of a shape at fixed depth r (a single bucket: the switch has one branch)."""
  sh = SHAPES[name]
  model_kw, train_kw = sh.model, sh.train
  if model_kw is None:  # tiny: parse the launch file as pretrain does
    parsed = flags_util.parse_config(['bench_train', f'--flagfile={FLAGS.tiny_flags}'])
    model_kw = dataclasses.asdict(parsed.model)
    train_kw = {k: getattr(parsed.train, k) for k in ('seq_len', 'batch_size')}
  model = dataclasses.replace(config_lib.ModelConfig(), **{
      **model_kw, 'dtype': dtype, 'attention_impl': config_lib.AttentionImpl(attention_impl),
      'fuse_projections': FLAGS.fuse_projections})
  depth = config_lib.DepthConfig(
      mean=float(r), sigma=0.0, r_max=r, buckets=(r,), remat=remat != 'off',
      unroll=unroll,
      remat_policy=config_lib.RematPolicy.NOTHING if remat == 'off' else remat)
  chunk = sh.loss_chunk if loss_chunk is None else loss_chunk
  if FLAGS.micro_batch:
    train_kw = dict(train_kw, batch_size=FLAGS.micro_batch)
  train = dataclasses.replace(config_lib.TrainConfig(), **train_kw, steps=1000,
                              warmup_steps=10, loss_chunk=chunk)
  cfg = config_lib.Config(model=model, depth=depth, train=train)
  config_lib.validate(cfg)
  return cfg


def variants(name: str) -> list[tuple[str, int, str, int]]:
  """(remat, loss_chunk, attention_impl, unroll) of every step to build: the flags' product."""
  sh = SHAPES[name]
  return list(itertools.product(FLAGS.remat or [sh.remat],
                                [int(c) for c in FLAGS.loss_chunk] or [sh.loss_chunk],
                                FLAGS.attention_impl or ['auto'],
                                [int(u) for u in FLAGS.unroll] or [1]))


def bench_shape(name: str, steps: int, warmup: int, rounds: int = 1) -> list[dict]:
  """Compiles and times the train step of one shape for each remat choice, and the
  reference's step (--reference_dir) at S and P, alternating for `rounds` rounds."""
  sh = SHAPES[name]
  r, dtype = FLAGS.depth or sh.r, FLAGS.dtype or sh.dtype
  timed = sh.timed_on_cpu or jax.default_backend() != 'cpu'
  ours = [timed_step.TimedStep(name, shape_config(name, r, dtype, c, n, a, u), timed)
          for c, n, a, u in variants(name)]
  ref = None
  if FLAGS.reference_dir and name in REFERENCE_SHAPES:
    ref = bench_reference.ReferenceStep(FLAGS.reference_dir, sh.model, seq_len=sh.train[
        'seq_len'], batch_size=sh.train['batch_size'], r=r, threads=FLAGS.reference_threads)
  for i in range(rounds if timed else 0):
    untimed = warmup if i == 0 else FLAGS.round_warmup
    for o in ours:
      o.run(steps, untimed)
    if ref is not None:
      ref.run(steps, untimed)
  results = [o.result() for o in ours]
  if ref is not None:
    measured = ref.result()
    for res in results:
      res['reference'] = measured
      res['reference_tokens_per_s'] = measured['tokens_per_s']
      res['reference_note'] = ('measured in this run, one step after the other (never at '
                               'once), by experiments/bench_reference.py')
  return results


def check_flags() -> None:
  """Bad flags -> a one-line `error: ...` (exit 2) before anything compiles."""
  unknown = [s for s in FLAGS.shapes if s not in SHAPES]
  if unknown:
    flags_util.fail(f'--shapes: unknown {unknown}; known: {sorted(SHAPES)}')
  bad = [c for c in FLAGS.remat if c not in REMAT_CHOICES]
  if bad:
    flags_util.fail(f'--remat: unknown choices {bad}; known: {REMAT_CHOICES}')
  impls = [a.value for a in config_lib.AttentionImpl]
  if any(a not in impls for a in FLAGS.attention_impl):
    flags_util.fail(f'--attention_impl: {FLAGS.attention_impl}; known: {impls}')
  if not all(c.isdigit() for c in FLAGS.loss_chunk):
    flags_util.fail(f'--loss_chunk: {FLAGS.loss_chunk} must be integers >= 0')
  if FLAGS.micro_batch < 0 or (FLAGS.micro_batch and FLAGS.reference_dir):
    flags_util.fail(f'--micro_batch={FLAGS.micro_batch} must be >= 0, and 0 beside '
                    '--reference_dir (the reference runs the shape\'s own batch)')
  if not all(u.isdigit() and int(u) >= 1 for u in FLAGS.unroll):
    flags_util.fail(f'--unroll: {FLAGS.unroll} must be integers >= 1')
  if FLAGS.rounds < 1 or FLAGS.steps < 1:
    flags_util.fail(f'--rounds={FLAGS.rounds} and --steps={FLAGS.steps} must be >= 1')
  for name in ('round_warmup', 'warmup'):
    if FLAGS[name].value < 0:
      flags_util.fail(f'--{name}={FLAGS[name].value} must be >= 0')
  for name in ('peak_n', 'reference_threads'):
    if FLAGS[name].value < 1:
      flags_util.fail(f'--{name}={FLAGS[name].value} must be >= 1')
  if 'tiny' in FLAGS.shapes and not os.access(FLAGS.tiny_flags, os.R_OK):
    flags_util.fail(f'--tiny_flags={FLAGS.tiny_flags!r} does not name a readable flag file '
                    '(the `tiny` shape is parsed from it)')
  if FLAGS.reference_dir:
    try:
      bench_reference.check_reference_dir(FLAGS.reference_dir)
    except bench_reference.ReferenceUnavailable as e:
      flags_util.fail(str(e))


def _score(res: dict, peak: float, device_peak: float) -> None:
  """Adds the fractions of peak, MFU and the ratio against the reference to a result."""
  if not res['timed']:
    return
  res['fraction_of_peak'] = res['model_flops_per_s'] / peak
  res['hw_fraction_of_peak'] = res['hw_flops_per_s'] / peak
  if device_peak:  # accelerators: MFU against the device kind's bf16 peak
    res['device_peak_flops'] = device_peak
    res['mfu'] = res['model_flops_per_s'] / device_peak
  ref = res.get('reference_tokens_per_s')
  if ref is None:
    ref = bench_util.reference_tok_s('train', res['shape'], seq_len=res['seq_len'],
                                     batch_size=res['batch_size'], depth=res['depth'])
    if ref:
      res['reference_tokens_per_s'] = ref
      res['reference_note'] = bench_util.REFERENCE_NOTE
  if ref:
    res['ratio_vs_reference'] = res['tokens_per_s'] / ref
    res['target_tokens_per_s'] = TARGET_RATIO * ref
    res['meets_speed_target'] = res['tokens_per_s'] >= TARGET_RATIO * ref
  if res['shape'] in TARGET_PEAK_FRACTION:
    res['target_fraction_of_peak'] = TARGET_PEAK_FRACTION[res['shape']]
    res['meets_peak_target'] = res['fraction_of_peak'] >= TARGET_PEAK_FRACTION[res['shape']]


def _print_table(doc: dict) -> None:
  """The human-readable summary of a run."""
  print(f'\nmatmul peak (fp32, n={FLAGS.peak_n}): {doc["matmul_peak_flops"] / 1e9:.1f} '
        f'GFLOP/s; load avg {doc["load_avg_start"][0]:.2f} -> {doc["load_avg_end"][0]:.2f}')
  head = (f'{"shape":6} {"remat":>13} {"tok/step":>8} {"step s":>7} {"tok/s":>9} '
          f'{"GF/tok":>7} {"%peak":>6} {"%pk hw":>6} {"temp MB":>8} {"ref tok/s":>9} '
          f'{"ratio":>6} {"target":>7}')
  print(head + '\n' + '-' * len(head))
  notes = set()
  for res in doc['results']:
    remat = (res['remat'] + (f'/c{res["loss_chunk"]}' if res['loss_chunk'] else '')
             + ('' if res['attention_impl'] == 'auto' else f'/{res["attention_impl"]}')
             + (f'/u{res["unroll"]}' if res.get('unroll', 1) > 1 else '')
             + ('/fused' if res.get('fuse_projections') else ''))
    line = (f'{res["shape"]:6} {remat:>13} {res["tokens_per_step"]:>8} ')
    temp = f'{res.get("temp_bytes", float("nan")) / 1e6:>8.0f}'
    if not res['timed']:
      print(line + f'{"(compiled only on cpu: not timed)":>46} {temp}  '
            f'model {res["flops_per_token"] * res["tokens_per_step"]:.3g} FLOP/step')
      continue
    ref = res.get('reference_tokens_per_s')
    line += (f'{res["step_s_median"]:>7.3f} {res["tokens_per_s"]:>9,.1f} '
             f'{res["flops_per_token"] / 1e9:>7.3f} {100 * res["fraction_of_peak"]:>5.1f}% '
             f'{100 * res["hw_fraction_of_peak"]:>5.1f}% {temp} ')
    if ref:
      notes.add(res['reference_note'])
      line += (f'{ref:>9,.1f} {res["ratio_vs_reference"]:>5.2f}x '
               f'{"met" if res["meets_speed_target"] else "MISSED":>7}')
    print(line + (f'  MFU {100 * res["mfu"]:.1f}%' if 'mfu' in res else ''))
  for n in sorted(notes):
    print(f'reference: {n}')
  print(f'wrote {FLAGS.out}')


def main(argv):
  flags_util.no_arguments(argv)
  check_flags()
  load_start = os.getloadavg()
  procs_start = bench_util.busy_processes()
  t_start = time.perf_counter()
  peaks = [metrics.measure_matmul_peak(FLAGS.peak_n)]
  results = []
  for name in FLAGS.shapes:
    cap = SHAPES[name].max_steps if FLAGS.cap_heavy else None
    steps = max(1, min(FLAGS.steps, cap) if cap else FLAGS.steps)
    for res in bench_shape(name, steps, FLAGS.warmup, FLAGS.rounds):
      results.append(res)
      print(f'{name} remat={res["remat"]} loss_chunk={res["loss_chunk"]} '
            f'attention={res["attention_impl"]} unroll={res["unroll"]}: ' + (
          f'{res["tokens_per_s"]:,.1f} tok/s (median of {len(res["step_times_s"])})'
          if res['timed'] else 'compiled only') + f', compile {res["compile_s"]:.1f}s'
          + (f'; reference {res["reference"]["tokens_per_s"]:,.1f} tok/s'
             if 'reference' in res else ''), flush=True)
  peaks.append(metrics.measure_matmul_peak(FLAGS.peak_n))
  peak = float(statistics.median(peaks))
  device_peak = metrics.peak_flops() if jax.default_backend() != 'cpu' else 0.0
  for res in results:
    _score(res, peak, device_peak)
  doc = dict(
      date=datetime.datetime.now().isoformat(timespec='seconds'),
      command=' '.join(sys.argv), flags={k: FLAGS[k].value for k in (
          'shapes', 'steps', 'warmup', 'cap_heavy', 'depth', 'dtype', 'remat', 'loss_chunk',
          'attention_impl', 'peak_n',
          'reference_dir', 'reference_threads', 'rounds', 'round_warmup')},
      jax_version=jax.__version__, backend=jax.default_backend(),
      devices=[str(d) for d in jax.devices()], cpu_count=os.cpu_count(),
      machine=platform.machine(), cpu=bench_util.cpu_description(),
      xla_flags=os.environ.get('XLA_FLAGS', ''),
      glibc_tunables=bench_util.glibc_tunables(),
      matmul_peak_flops=peak, matmul_peak_samples=peaks,
      load_avg_start=list(load_start), load_avg_end=list(os.getloadavg()),
      other_processes_start=procs_start, other_processes_end=bench_util.busy_processes(),
      wall_s=time.perf_counter() - t_start, results=results)
  bench_util.write_json(FLAGS.out, doc)
  _print_table(doc)


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
