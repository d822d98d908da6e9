"""Dry run: every check of a training run, then the train step compiled ahead of time.

Nothing is trained and no parameter is allocated: the step is lowered against
ShapeDtypeStructs carrying the run's shardings and compiled for the present backend,
once with remat on and once off, and XLA's memory analysis (per device) is reported
beside the model FLOPs and the time the run would take on named accelerators.
"""

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from elastic_depth import distributed, metrics, train, train_step
from elastic_depth import model as model_lib
from elastic_depth.config import Config, grad_accum_steps

ACCELERATORS = ('H200', 'H100', 'RTX 4090', 'TPU v5e')
GIB = 2.0 ** 30


def abstract_batch(cfg: Config, mesh) -> dict:
  """ShapeDtypeStructs of one step's [A, B, L] batch, sharded over the mesh."""
  t = cfg.train
  shape = (grad_accum_steps(t), t.batch_size, t.seq_len)
  sh = distributed.batch_sharding(mesh)
  return {'inputs': jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
          'targets': jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
          'mask': jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)}


def compile_abstract(cfg: Config, mesh):
  """The train step compiled against abstract state and batch (nothing allocated)."""
  graphdef, state = jax.eval_shape(lambda: train_step.init_state(cfg, cfg.train.seed))
  state = distributed.abstract_like(
      state, distributed.state_shardings(state, mesh, cfg.train))
  step = train_step.make_train_step(graphdef, cfg, mesh)
  return step.lower(state, abstract_batch(cfg, mesh)).compile()


def memory_of(compiled) -> dict:
  """Per-device bytes of a compiled step (arguments, outputs, temporaries, peak)."""
  mem = compiled.memory_analysis()
  out = {}
  for k in ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes',
            'alias_size_in_bytes', 'generated_code_size_in_bytes'):
    out[k] = int(getattr(mem, k, 0) or 0)
  # donated state: outputs alias the arguments, so the peak is args + temps (+ unaliased)
  out['peak_bytes'] = (out['argument_size_in_bytes'] + out['temp_size_in_bytes']
                       + out['output_size_in_bytes'] - out['alias_size_in_bytes'])
  return out


def compiled_memory(cfg: Config, mesh) -> dict:
  """Per-device bytes of the compiled train step (arguments, outputs, temporaries)."""
  t0 = time.perf_counter()
  compiled = compile_abstract(cfg, mesh)
  return {'compile_s': time.perf_counter() - t0, **memory_of(compiled)}


def plan(cfg: Config, mfu: float = 0.30) -> dict:
  """Parameters, FLOPs, tokens and the run time on named accelerators at `mfu`."""
  t = cfg.train
  tokens_step = grad_accum_steps(t) * t.batch_size * t.seq_len
  flops_tok = train_step.train_flops_per_token(cfg)
  total = flops_tok * tokens_step * t.steps
  hours = {name: total / (metrics.peak_flops(device_kind=name) * mfu) / 3600
           for name in ACCELERATORS}
  return {'params': model_lib.count_params(cfg.model), 'tokens_per_step': tokens_step,
          'steps': t.steps, 'tokens': tokens_step * t.steps,
          'train_flops_per_token': flops_tok, 'total_flops': total, 'mfu': mfu,
          'hours_one_device': hours}


def run(cfg: Config, workdir: str, *, resume: bool = False, mfu: float = 0.30,
        remat_choices: tuple[bool, ...] = (True, False)) -> dict:
  """Preflight checks, then the plan and the compiled memory for each remat choice."""
  train.preflight(cfg, workdir, resume)
  mesh = distributed.make_mesh(fsdp=cfg.train.fsdp)
  out: dict[str, Any] = {'plan': plan(cfg, mfu), 'backend': jax.default_backend(),
                         'devices': jax.device_count(), 'mesh': dict(mesh.shape)}
  for remat in remat_choices:
    c = dataclasses.replace(cfg, depth=dataclasses.replace(cfg.depth, remat=remat))
    out[f'remat_{"on" if remat else "off"}'] = compiled_memory(c, mesh)
  return out


def describe(res: dict) -> str:
  """The dry run's printout."""
  p = res['plan']
  lines = [f"dry run on {res['devices']} {res['backend']} device(s), mesh {res['mesh']}",
           f"params {p['params']:,}; training FLOPs/token at the mean depth "
           f"{p['train_flops_per_token']:.3g}; {p['tokens_per_step']:,} tokens/step x "
           f"{p['steps']:,} steps = {p['tokens']:.3g} tokens, {p['total_flops']:.3g} FLOPs",
           'per-device memory of the compiled step: arguments / outputs / temporaries / peak']
  size = lambda n: f'{n / GIB:.2f} GiB' if n >= GIB else f'{n / 2**20:.1f} MiB'
  for k in ('remat_on', 'remat_off'):
    if k not in res:
      continue
    m = res[k]
    lines.append(f"  {k}: " + ' / '.join(size(m[f]) for f in (
        'argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes', 'peak_bytes'))
                 + f" (compiled in {m['compile_s']:.0f} s)")
  fmt = lambda h: f'{h:.1f} h' if h >= 1 else f'{60 * h:.1f} min'
  lines.append(f"time on one device at {100 * p['mfu']:.0f}% bf16 MFU: " + ', '.join(
      f'{k} {fmt(v)}' for k, v in p['hours_one_device'].items()))
  return '\n'.join(lines)
