"""Where the training step's time goes: a jax.profiler trace, summed per part of the model.

Usage: python -m experiments.profile_train --shapes=S [--remat=nothing] [--profile_steps=2]
  [--out=runs/profile_train.json]

Builds the same step as `bench_train` (its flags: --shapes, --remat, --depth, --dtype,
--loss_chunk, --attention_impl, --micro_batch, --unroll, --fuse_projections),
runs one untimed step, traces --profile_steps steps with `jax.profiler`, and sums the
XLA:CPU op events (on every thread) by
  region: the core loops (inside the depth scan), outside them (embedding, prelude, coda,
          head, loss), or the optimizer (clipping and AdamW, outside the micro-batch scan);
  pass:   forward, backward, or the forward that remat recomputes in the backward pass;
  part:   the model's named scopes (attention projections, sdpa, rope, mlp, norm, adapter,
          head) or `other`;
  kind:   matmul (a dot, or a fusion around one) or elementwise (every other op).
Each op event is attributed through its HLO instruction's op_name. Times are per step,
summed over the threads that ran ops; `wall_s` is the step's wall time. On a GPU the
events are the device's kernels (their `hlo_op` stat names the instruction), and the
JSON adds the 40 costliest kernels by name (`kernels`) and the trace's device lines;
--hlo_dir keeps the compiled HLO, to look a kernel's instruction up.
"""

import collections
import glob
import gzip
import os
import re
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax

from experiments import bench_train
from experiments import bench_util
from experiments import flags_util
from experiments import timed_step

FLAGS = flags.FLAGS
flags.DEFINE_integer('profile_steps', 2, 'Steps traced per shape.')
flags.DEFINE_string('hlo_dir', '', 'Also write each compiled step\'s optimized HLO there '
                    '(gzipped text; its instruction names are the GPU kernels\' names).')

PARTS = ('sdpa', 'rope', 'attention', 'mlp', 'adapter', 'head', 'norm')  # innermost first
_INSTR = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*? (\w[\w-]*)\((.*)$', re.M)
_COMP = re.compile(r'^(?:ENTRY )?%(\S+) .*\{\s*$', re.M)


def hlo_ops(hlo_text: str) -> dict:
  """HLO instruction name -> (op_name metadata, is_matmul) of a compiled module's text."""
  has_dot = {}  # computation name -> contains a dot
  for block in re.split(r'\n(?=\S)', hlo_text):
    m = _COMP.match(block)
    if m:
      has_dot[m.group(1)] = bool(re.search(r' dot\(', block))
  out = {}
  for m in _INSTR.finditer(hlo_text):
    name, op, rest = m.groups()
    on = re.search(r'op_name="([^"]*)"', rest)
    calls = re.search(r'calls=%([\w.-]+)', rest)
    matmul = op == 'dot' or bool(calls and has_dot.get(calls.group(1)))
    out[name] = (on.group(1) if on else '', matmul)
  return out


def classify(op_name: str, matmul: bool) -> tuple[str, str, str, str]:
  """(region, pass, part, kind) of one op from its op_name."""
  if '/while/' not in op_name:
    region = 'optimizer' if op_name else 'other'
  else:
    region = 'core loops' if op_name.count('/while/') >= 2 else 'outside loops'
  if 'rematted_computation' in op_name:
    pas = 'remat recompute'
  elif 'transpose(' in op_name:
    pas = 'backward'
  else:
    pas = 'forward'
  scopes = set(re.split(r'[/()]', op_name))
  part = next((p for p in PARTS if p in scopes), 'other')
  return region, pas, part, 'matmul' if matmul else 'elementwise'


# GPU kernels by family, from their names (first match wins): library kernels carry no HLO
# op name in a trace of CUDA-graph launches, so this is how their time is attributed.
KERNEL_FAMILIES = (
    ('attention (cuDNN)', re.compile(r'sdpa|fmha|cudnn')),
    ('matmul fp32 (TF32)', re.compile(r'f32f32_tf32|sgemm')),
    ('matmul', re.compile(r'nvjet|gemm|xmma|cutlass|dot')),
    ('copy', re.compile(r'^Memcpy|^Memset|copy')),
    ('XLA fusion', re.compile(r'fusion|concatenate|convert|reduce|transpose|slice')),
)


def kernel_family(name: str) -> str:
  """The KERNEL_FAMILIES family of one GPU kernel name, or 'other'."""
  return next((fam for fam, pat in KERNEL_FAMILIES if pat.search(name)), 'other')


def _planes(trace_dir: str):
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  path = sorted(glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True))[-1]
  return ProfileData.from_file(path).planes


def _stats(ev) -> dict:
  try:
    return {str(k): v for k, v in ev.stats}
  except (TypeError, ValueError):
    return {}


def device_op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter, list]:
  """GPU: kernel ns per HLO op and per kernel, plus the lines.

  A kernel's op is its hlo_op stat, else its own name (CUDA-graph launches carry no stat:
  XLA's own kernels are named as their instruction, library kernels stay unmatched);
  where no kernel has the stat and the trace has an 'XLA Ops' line, that line's events.
  """
  ops, kernels, lines = collections.Counter(), collections.Counter(), []
  xla_ops, stat_ops = collections.Counter(), 0
  for plane in _planes(trace_dir):
    if not plane.name.startswith('/device:'):
      continue
    for line in plane.lines:
      evs = list(line.events)
      lines.append(dict(plane=plane.name, line=line.name, events=len(evs),
                        s=sum(e.duration_ns for e in evs) / 1e9,
                        sample=[[e.name[:100], {k: str(v)[:100] for k, v in _stats(e).items()}]
                                for e in evs[:2]]))
      if line.name == 'XLA Ops':  # a fallback where the kernels carry no hlo_op stat
        for ev in evs:
          xla_ops[ev.name.lstrip('%')] += ev.duration_ns
      if not line.name.startswith('Stream'):
        continue
      for ev in evs:
        kernels[ev.name] += ev.duration_ns
        op = _stats(ev).get('hlo_op')
        stat_ops += bool(op)
        ops[str(op or ev.name).lstrip('%')] += ev.duration_ns
  return xla_ops if xla_ops and not stat_ops else ops, kernels, lines


def op_times(trace_dir: str) -> collections.Counter:
  """Summed duration (ns) per XLA op name over every thread of a trace."""
  times = collections.Counter()
  for plane in _planes(trace_dir):
    for line in plane.lines:
      if 'XLA' not in line.name:
        continue
      for ev in line.events:
        if not (ev.name.startswith('ThunkExecutor') or 'Await' in ev.name):
          # the thunk runtime's completion events ('end: <op>') are their op's time
          times[ev.name.removeprefix('end: ')] += ev.duration_ns
  return times


def profile_shape(name: str, remat: str, steps: int, attention_impl: str = 'auto',
                  loss_chunk: int | None = None, unroll: int = 1) -> dict:
  """Traces `steps` steps of one shape and returns the time breakdown (seconds per step)."""
  sh = bench_train.SHAPES[name]
  cfg = bench_train.shape_config(name, FLAGS.depth or sh.r, FLAGS.dtype or sh.dtype, remat,
                                 loss_chunk, attention_impl, unroll)
  ours = timed_step.TimedStep(name, cfg, True)
  ours.run(0, warmup=1)
  text = ours.compiled.as_text()
  ops = hlo_ops(text)
  if FLAGS.hlo_dir:
    os.makedirs(FLAGS.hlo_dir, exist_ok=True)
    path = os.path.join(FLAGS.hlo_dir, f'{name}_{remat}_c{loss_chunk}_u{unroll}.hlo.txt.gz')
    with gzip.open(path, 'wt', encoding='utf-8') as f:
      f.write(text)
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    t0 = time.perf_counter()
    ours.run(steps)
    wall = (time.perf_counter() - t0) / steps
    jax.profiler.stop_trace()
    gpu = jax.default_backend() == 'gpu'
    times, kernels, lines = device_op_times(d) if gpu else (op_times(d), None, None)
  by = collections.defaultdict(float)
  unmatched = 0.0
  for op, ns in times.items():
    if op not in ops:
      unmatched += ns
      continue
    region, pas, part, kind = classify(*ops[op])
    by[' | '.join((region, pas, part, kind))] += ns / 1e9 / steps
  total = sum(by.values())
  summary = {axis: _sum_by(by, i) for i, axis in enumerate(('region', 'pass', 'part', 'kind'))}
  out = dict(shape=name, remat=remat, attention_impl=attention_impl,
             loss_chunk=ours.cfg.train.loss_chunk, batch_size=ours.cfg.train.batch_size,
             grad_accum=ours.accum, unroll=ours.cfg.depth.unroll, steps=steps, wall_s=wall,
             op_s=total, unmatched_s=unmatched / 1e9 / steps, summary=summary,
             detail=dict(sorted(by.items(), key=lambda kv: -kv[1])))
  if kernels is not None:  # GPU: the kernels by family and by name, and the trace's lines
    families = collections.Counter()
    for k, v in kernels.items():
      families[kernel_family(k)] += v / 1e9 / steps
    out.update(kernel_s=sum(kernels.values()) / 1e9 / steps, lines=lines,
               families=dict(families.most_common()),
               kernels={k[:160]: v / 1e9 / steps for k, v in kernels.most_common(40)})
  return out


def _sum_by(by: dict, i: int) -> dict:
  out = collections.defaultdict(float)
  for key, v in by.items():
    out[key.split(' | ')[i]] += v
  return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _print(res: dict) -> None:
  """One profile's summary (and, on a GPU, its costliest kernels)."""
  print(f'\n{res["shape"]} remat={res["remat"]} attention={res["attention_impl"]}: wall '
        f'{res["wall_s"]:.2f} s/step, ops {res["op_s"]:.2f} s/step, unmatched '
        f'{res["unmatched_s"]:.2f}')
  for axis, parts in res['summary'].items():
    print(f'  {axis:7s} ' + ', '.join(f'{k} {100 * v / max(res["op_s"], 1e-12):.0f}%'
                                      for k, v in parts.items()))
  if 'families' in res:
    print(f'  kernels {res["kernel_s"]:.3f} s/step: ' + ', '.join(
        f'{k} {100 * v / res["kernel_s"]:.0f}%' for k, v in res['families'].items()))
  for k, v in list(res.get('kernels', {}).items())[:15]:
    print(f'  {v * 1e3:9.2f} ms  {k[:100]}')


def main(argv):
  flags_util.no_arguments(argv)
  bench_train.check_flags()
  load = os.getloadavg()
  results = []
  for name in FLAGS.shapes:
    for remat, chunk, impl, unroll in bench_train.variants(name):
      res = profile_shape(name, remat, FLAGS.profile_steps, impl, chunk, unroll)
      results.append(res)
      _print(res)
  out = FLAGS.out if FLAGS.out != FLAGS['out'].default else 'runs/profile_train.json'
  bench_util.write_json(out, dict(
      command=" ".join(sys.argv), cpu=bench_util.cpu_description(),
      load_avg_start=list(load), load_avg_end=list(os.getloadavg()),
      glibc_tunables=bench_util.glibc_tunables(),
      jax_version=jax.__version__, results=results))
  print(f'wrote {out}')


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
