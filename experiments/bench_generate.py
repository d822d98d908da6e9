"""Generation speed at batch 1: uniform depth vs KL exit, and the cost of one exit check.

  python -m experiments.bench_generate                 # shapes S and P, JSON to runs/
  python -m experiments.bench_generate --shapes=S --new_tokens=64

All variants run side by side in one process; times are medians over repeats.
Throughput depends only on how many loops and checks run, not on the weights, so a
random-init model is used and exits are controlled through eps:
  a0_r8        uniform depth 8, no checks (the final readout only);
  a1_worst     KL check at every loop, never firing, capped at 8 loops;
  a1_eps       KL exit at an eps that gives the target mean loops on this model;
  a1_gated     the same eps, checks only where the relative state change < gate.
Shapes come from `bench_util.MODEL_SHAPES`.

With --batch_sizes=1,8,32 the batched comparison runs instead (bench_generate_batch.py):
A0 at uniform depth (decoding.generate) against A1 through the depth-wise engine
(serving.generate) and A1 in lockstep (decoding.generate), per batch size. The
reference implementation's figures (Huginn with KL exit, experiments/reference_figures.json)
were measured elsewhere: the `vs_reference` ratio is indicative, not a side-by-side
measurement.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from elastic_depth import config, decoding, inference, losses, model as model_lib
from experiments import bench_generate_batch, bench_util, common, flags_util

_SHAPES = flags.DEFINE_list('shapes', ['S', 'P'], 'Shapes to run (bench_util.MODEL_SHAPES).')
_NEW = flags.DEFINE_integer('new_tokens', 32, 'Tokens generated per timed call.', lower_bound=1)
_PROMPT = flags.DEFINE_integer('prompt_len', 16, 'Prompt length.', lower_bound=1)
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed repeats (median).', lower_bound=1)
flags_util.require('shapes', flags_util.one_of(bench_util.MODEL_SHAPES),
                   f'shape names from {sorted(bench_util.MODEL_SHAPES)}')
_TARGET = flags.DEFINE_float('target_loops', 5.0, 'Mean loops the a1_eps variant aims at.')
_OUT = flags.DEFINE_string('out', 'runs/bench_generate.json', 'JSON output.')
flags_util.require('target_loops', lambda x: 1 <= x < float('inf'), 'a finite number >= 1')


def _median_time(fn, *args, repeats: int) -> float:
  return bench_util.time_fn(fn, args, repeats)['median_s']


def _parts(mdl, repeats: int) -> dict:
  """Milliseconds for one core loop, one single readout, and one paired KL check (batch 1)."""
  d = mdl.cfg.d_model
  s = jax.random.normal(jax.random.key(0), (1, 1, d))
  pos = jnp.zeros((1, 1), jnp.int32)
  loop = jax.jit(lambda s: mdl.core_step(s, s, pos)[0])
  single = jax.jit(lambda s: mdl.logits(mdl.decode_state(s, pos)[0]))
  pos2 = jnp.zeros((1, 2), jnp.int32)

  def pair(s):
    x = jnp.concatenate([s, 0.5 * s], axis=1)
    logits = mdl.logits(mdl.decode_state(x, pos2)[0])
    return losses.kl_from_logits(logits[:, 1], logits[:, 0])
  pair = jax.jit(pair)
  reps = max(repeats * 10, 20)
  out = {k: 1e3 * _median_time(f, s, repeats=reps)
         for k, f in (('loop_ms', loop), ('readout_ms', single), ('pair_check_ms', pair))}
  out['check_over_loop'] = out['pair_check_ms'] / out['loop_ms']
  return out


def _calibrate(mdl, prompt, target: float) -> tuple[float, float]:
  """(eps, gate) giving about `target` mean loops on this model (from a traced run)."""
  toks = jnp.concatenate([prompt, prompt[:, ::-1]], axis=1)
  tr = inference.score(mdl, toks, config.ExitConfig(policy='uniform', depth=16),
                       jax.random.key(0), trace=True).traces
  kl, delta = np.asarray(tr['kl'])[1:], np.asarray(tr['delta'])[1:]
  best = None
  for eps in np.logspace(-8, 0, 81):
    below = kl < eps
    depth = np.where(below.any(0), below.argmax(0) + 2, 16)
    err = abs(depth.mean() - target)
    if best is None or err < best[0]:
      best = (err, float(eps))
  eps = best[1]
  # gate: the 90th percentile of the state change where the KL criterion fires
  gate = float(np.quantile(delta[kl < eps], 0.9)) if np.any(kl < eps) else 0.0
  return eps, gate


def bench_shape(name: str) -> dict:
  """All generation variants for one shape."""
  mcfg = config.ModelConfig(max_len=bench_util.random_model_len(_PROMPT.value, _NEW.value),
                            **bench_util.MODEL_SHAPES[name])
  ref = bench_util.reference_tok_s('generate', name, batch_size=1)
  mdl = model_lib.LoopedLM(mcfg, nnx.Rngs(0))
  prompt = jax.random.randint(jax.random.key(1), (1, _PROMPT.value), 0, mcfg.vocab_size)
  eps, gate = _calibrate(mdl, prompt, _TARGET.value)
  variants = {
      'a0_r8': config.ExitConfig(policy='uniform', depth=8),
      'a1_worst': config.ExitConfig(policy='kl', eps=1e-30, max_loops=8),
      'a1_eps': config.ExitConfig(policy='kl', eps=eps, max_loops=32),
      'a1_gated': config.ExitConfig(policy='gated_kl', eps=eps, max_loops=32, gate=gate),
  }
  rows = {}
  for key, ecfg in variants.items():
    gen = jax.jit(lambda p, ecfg=ecfg: decoding.generate(mdl, p, _NEW.value, ecfg,
                                                         jax.random.key(0)))
    sec = _median_time(gen, prompt, repeats=_REPEATS.value)
    _, depth = gen(prompt)
    rows[key] = dict(tokens_per_s=_NEW.value / sec, mean_loops=float(np.mean(depth)),
                     vs_reference=_NEW.value / sec / ref if ref else None,
                     eps=ecfg.eps, gate=ecfg.gate)
    print(f'{name} {key:9s} {rows[key]["tokens_per_s"]:8.1f} tok/s  mean loops '
          f'{rows[key]["mean_loops"]:.2f}'
          + (f'  x{rows[key]["vs_reference"]:.1f} vs reference*' if ref else ''), flush=True)
  parts = _parts(mdl, _REPEATS.value)
  print(f'{name} loop {parts["loop_ms"]:.2f} ms, paired check {parts["pair_check_ms"]:.2f} ms'
        f' ({parts["check_over_loop"]:.2f} loops)', flush=True)
  return dict(model=bench_util.MODEL_SHAPES[name], variants=rows, parts=parts,
              reference_tokens_per_s=ref, reference_note=bench_util.REFERENCE_NOTE)


def main(argv):
  flags_util.no_arguments(argv)
  if bench_generate_batch.requested():
    bench_generate_batch.main(_calibrate)
    return
  out = dict(backend=jax.default_backend(), devices=str(jax.devices()),
             loadavg=os.getloadavg(), date=time.strftime('%Y-%m-%d %H:%M'),
             glibc_tunables=bench_util.glibc_tunables(),
             new_tokens=_NEW.value, prompt_len=_PROMPT.value,
             shapes={n: bench_shape(n) for n in _SHAPES.value})
  bench_util.write_json(_OUT.value, out)
  print(f'* {bench_util.REFERENCE_NOTE}\nwrote {_OUT.value}')


if __name__ == '__main__':
  app.run(common.one_line_errors(main), flags_parser=flags_util.parse_or_fail)
