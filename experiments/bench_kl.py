"""Benchmark the fused KL halting kernel against the unfused XLA reference.

Usage: python -m experiments.bench_kl [--shapes=8192x576x49152,...]

Per shape (N tokens x D model dim x V vocab) it reports the median wall time
and the compiled memory analysis (argument / output / temp bytes) of both
paths, plus the size of the [N, V] logits the reference materialises. On GPU
it also reports the fraction of the FLOP floor (2 * 2 * N * D * V flops) and
of the HBM bandwidth floor reached. On CPU the Pallas kernel only runs in
interpret mode, which proves correctness but says nothing about speed: the
kernel is timed only at small shapes there, and the reference only up to
--cpu_max_gflop.
"""

import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import flags_util
from experiments.bench_util import time_fn
from elastic_depth.kernels import kl_halting as klh

FLAGS = flags.FLAGS
flags.DEFINE_string('out', 'runs/bench_kl.json', 'Output JSON path.')
flags.DEFINE_list('shapes', ['8192x576x49152', '1024x576x49152',
                             '256x576x8192'],
                  'Comma-separated NxDxV shapes (paper shape first).')
flags.DEFINE_integer('repeats', 5, 'Timed repetitions per measurement.', lower_bound=1)
flags.DEFINE_enum('dtype', 'auto', ['auto', 'float32', 'bfloat16'],
                  'Input dtype of h / w; auto = bfloat16 on GPU, else float32.')
flags.DEFINE_integer('block_n', 0, 'Token block; 0 = backend default.', lower_bound=0)
flags.DEFINE_integer('block_v', 0, 'Vocab tile; 0 = backend default.', lower_bound=0)
flags.DEFINE_integer('block_d', 0, 'Contraction chunk; 0 = backend default.', lower_bound=0)
flags.DEFINE_list('v_splits', ['auto', '1'], 'Kernel variants timed per shape: vocab '
                  'splits (kl_halting v_splits; auto = its default). The first is `kernel`.')
flags.DEFINE_float('peak_tflops', 989.0,
                   'Dense matmul peak of the accelerator for the FLOP floor '
                   '(H100/H200 SXM bf16: 989; use ~495 for fp32 via TF32).')
flags.DEFINE_float('peak_gbps', 4800.0,
                   'HBM bandwidth for the bandwidth floor (H200: 4800 GB/s).')
flags.DEFINE_float('cpu_max_gflop', 150.0,
                   'On CPU, time the reference only below this many GFLOP.')
flags.DEFINE_float('cpu_kernel_max_gflop', 5.0,
                   'On CPU, time the interpreted kernel only below this.')
for _name in ('peak_tflops', 'peak_gbps'):
  flags_util.require(_name, lambda x: 0 < x < float('inf'), 'a positive finite number')
for _name in ('cpu_max_gflop', 'cpu_kernel_max_gflop'):
  flags_util.require(_name, lambda x: x >= 0, 'a number >= 0')


def parse_shape(text):
  """'NxDxV' -> (N, D, V); a one-line exit naming the flag on anything else."""
  try:
    n, d, v = (int(x) for x in text.lower().split('x'))
  except ValueError:
    n = d = v = 0
  if min(n, d, v) < 1:
    raise SystemExit(f'error: --shapes: {text!r} is not NxDxV with positive integers')
  return n, d, v


def memory_stats(compiled):
  """Compiled memory analysis in bytes, or None where the backend has none."""
  try:
    mem = compiled.memory_analysis()
  except Exception as e:  # pylint: disable=broad-except
    return {'error': repr(e)}
  if mem is None:
    return None
  keys = ('argument_size_in_bytes', 'output_size_in_bytes',
          'temp_size_in_bytes', 'generated_code_size_in_bytes')
  return {k: int(getattr(mem, k)) for k in keys if hasattr(mem, k)}


def make_inputs(n, d, v, dtype, seed=0):
  """h, hprev = h + noise, w with unit-scale logits."""
  k_h, k_p, k_w = jax.random.split(jax.random.PRNGKey(seed), 3)
  h_NxD = jax.random.normal(k_h, (n, d), jnp.float32)
  hprev_NxD = h_NxD + 0.3 * jax.random.normal(k_p, (n, d), jnp.float32)
  w_VxD = jax.random.normal(k_w, (v, d), jnp.float32) * (3.0 / np.sqrt(d))
  return h_NxD.astype(dtype), hprev_NxD.astype(dtype), w_VxD.astype(dtype)


def roofline(n, d, v, dtype, seconds):
  """Fractions of the FLOP and bandwidth floors reached in `seconds`."""
  flops = 2 * 2 * n * d * v
  itemsize = jnp.dtype(dtype).itemsize
  min_bytes = itemsize * (2 * n * d + v * d) + 3 * 4 * n
  flop_floor_s = flops / (FLAGS.peak_tflops * 1e12)
  bw_floor_s = min_bytes / (FLAGS.peak_gbps * 1e9)
  return {
      'achieved_tflops': flops / seconds / 1e12,
      'flop_floor_s': flop_floor_s,
      'bandwidth_floor_s': bw_floor_s,
      'frac_of_flop_floor': flop_floor_s / seconds,
      'frac_of_bandwidth_floor': bw_floor_s / seconds,
      'frac_of_roofline': max(flop_floor_s, bw_floor_s) / seconds,
  }


def bench_shape(n, d, v, dtype, blocks, on_gpu):
  """Both paths at one shape, the kernel in each --v_splits variant; a JSON-able dict."""
  row = None
  for i, text in enumerate(FLAGS.v_splits):
    splits = None if text == 'auto' else int(text)
    one = _bench_variant(n, d, v, dtype, dict(blocks, v_splits=splits), on_gpu, i == 0)
    if row is None:
      row = one
    row.setdefault('kernel_variants', {})[text] = dict(
        one['kernel'], v_splits=klh.vocab_splits(
            -(-n // blocks['block_n']), -(-v // blocks['block_v']), splits)[0])
    ref_t, ker_t = row['reference'].get('time'), one['kernel'].get('time')
    if on_gpu and isinstance(ref_t, dict) and isinstance(ker_t, dict):
      row['kernel_variants'][text]['speedup_vs_ref'] = ref_t['median_s'] / ker_t['median_s']
  return row


def _bench_variant(n, d, v, dtype, blocks, on_gpu, time_reference):
  """Measures both paths (the reference only if time_reference) at one shape."""
  gflop = 2 * 2 * n * d * v / 1e9
  row = {'shape': {'N': n, 'D': d, 'V': v}, 'gflop': gflop,
         'naive_logits_bytes': 2 * n * v * 4}
  specs = (jax.ShapeDtypeStruct((n, d), dtype),
           jax.ShapeDtypeStruct((n, d), dtype),
           jax.ShapeDtypeStruct((v, d), dtype))
  ref_fn = jax.jit(klh.reference_kl_halting)

  def kernel_fn(h, hprev, w):
    return klh.kl_halting(h, hprev, w, interpret=not on_gpu, **blocks)

  kernel_fn = jax.jit(kernel_fn)
  # the reference is compiled and timed with the first variant only
  ref = {'memory': memory_stats(ref_fn.lower(*specs).compile())} if time_reference else {}
  ker = {'memory': memory_stats(kernel_fn.lower(*specs).compile()),
         'interpret': not on_gpu}
  if not on_gpu:
    ker['memory_note'] = ('interpret-mode emulation (copies the W block per '
                          'grid step); not the GPU kernel footprint')

  time_ref = (on_gpu or gflop <= FLAGS.cpu_max_gflop) and time_reference
  time_ker = on_gpu or gflop <= FLAGS.cpu_kernel_max_gflop
  if time_ref or time_ker:
    args = make_inputs(n, d, v, dtype)
    if time_ref:
      ref['time'] = time_fn(ref_fn, args, FLAGS.repeats)
    elif not time_reference:
      ref['time'] = 'timed with the first variant'
    else:
      ref['time'] = 'skipped on CPU (above --cpu_max_gflop)'
    if time_ker:
      ker['time'] = time_fn(kernel_fn, args, FLAGS.repeats)
      got = kernel_fn(*args)
      want = ref_fn(*args)
      ker['max_abs_err_kl'] = float(jnp.max(jnp.abs(got[0] - want[0])))
      ker['max_abs_err_lse'] = float(jnp.max(jnp.abs(got[2] - want[2])))
      ker['argmax_agree'] = float(jnp.mean(got[1] == want[1]))
      if not on_gpu:
        ker['time_note'] = 'interpret mode: correctness only, not speed'
    else:
      ker['time'] = ('skipped on CPU: interpret mode proves correctness only '
                     '(timed at small shapes)')
    del args
  else:
    ref['time'] = 'skipped on CPU (above --cpu_max_gflop)'
    ker['time'] = ('skipped on CPU: interpret mode proves correctness only '
                   '(timed at small shapes)')
  for part in (ref, ker):
    if on_gpu and isinstance(part.get('time'), dict):
      part['roofline'] = roofline(n, d, v, dtype, part['time']['median_s'])
  if (on_gpu and isinstance(ref.get('time'), dict)
      and isinstance(ker.get('time'), dict)):
    row['speedup_kernel_vs_ref'] = (ref['time']['median_s']
                                    / ker['time']['median_s'])
  row['reference'] = ref
  row['kernel'] = ker
  return row


def _ms(part):
  t = part.get('time')
  return f'{1e3 * t["median_s"]:.3f} ms' if isinstance(t, dict) else 'not timed'


def main(argv):
  flags_util.no_arguments(argv)
  bad = [t for t in FLAGS.v_splits if t != 'auto' and not (t.isdigit() and int(t) > 0)]
  if bad or not FLAGS.v_splits:
    raise SystemExit(f'error: --v_splits: {FLAGS.v_splits}; want auto or integers > 0')
  shapes = [parse_shape(text) for text in FLAGS.shapes]  # every shape checked before work
  backend = jax.default_backend()
  on_gpu = backend == 'gpu'
  dtype_name = FLAGS.dtype
  if dtype_name == 'auto':
    dtype_name = 'bfloat16' if on_gpu else 'float32'
  dtype = jnp.dtype(dtype_name)
  results = []
  for n, d, v in shapes:
    if on_gpu:
      blocks = {'block_n': FLAGS.block_n or 64, 'block_v': FLAGS.block_v or 128,
                'block_d': FLAGS.block_d or klh.gpu_block_d(d)}
    else:  # big blocks keep the interpreter's grid and loop short
      blocks = {'block_n': FLAGS.block_n or 256,
                'block_v': FLAGS.block_v or 2048,
                'block_d': FLAGS.block_d or None}
    t0 = time.perf_counter()
    row = bench_shape(n, d, v, dtype, blocks, on_gpu)
    row['blocks'] = blocks
    row['bench_wall_s'] = time.perf_counter() - t0
    print(f'N={n} D={d} V={v}: reference ' + _ms(row['reference']) + '; kernel ' + ', '.join(
        f'v_splits={k} ({r["v_splits"]}) ' + _ms(r) for k, r in row['kernel_variants'].items()),
          flush=True)
    results.append(row)
  report = {
      'backend': backend,
      'device_kind': jax.devices()[0].device_kind,
      'jax_version': jax.__version__,
      'dtype': dtype_name,
      'repeats': FLAGS.repeats,
      'peak_tflops': FLAGS.peak_tflops if on_gpu else None,
      'peak_gbps': FLAGS.peak_gbps if on_gpu else None,
      'note': ('GPU: compiled Pallas (Triton) kernel vs jitted reference.'
               if on_gpu else
               'CPU: Pallas runs in interpret mode only, so kernel timings '
               'prove nothing about speed; the kernel is timed only at small '
               'shapes (correctness check), skipped at big shapes, and its '
               'memory analysis is of the interpreter. Reference timed up to '
               '--cpu_max_gflop; memory analyses come from compilation only.'),
      'results': results,
  }
  out_dir = os.path.dirname(FLAGS.out)
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
  with open(FLAGS.out, 'w') as f:
    json.dump(report, f, indent=2)
  print(f'wrote {FLAGS.out}')


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
