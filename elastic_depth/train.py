"""TrainState, the pure randomised-depth train_step, eval_step, and the training loop."""

import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from elastic_depth import model as model_lib
from elastic_depth import inference, policies, recurrence
from elastic_depth.config import (Config, ConfigError, NanPolicy, Schedule, grad_accum_steps,
                                  validate)


class TrainState(struct.PyTreeNode):
  """Step counter, fp32 parameters and optimizer state."""
  step: jax.Array
  params: Any
  opt_state: Any


class NonFiniteError(FloatingPointError):
  """Raised when the loss or gradient is NaN/Inf and the policy is to stop."""


def build_model(cfg: Config, seed: int = 0) -> model_lib.LoopedLM:
  """Instantiates the LM with fp32 parameters."""
  return model_lib.LoopedLM(cfg.model, nnx.Rngs(seed))


def lr_schedule(cfg: Config) -> optax.Schedule:
  """Linear warmup then cosine, or warmup-stable-decay."""
  t = cfg.train
  warm = max(t.warmup_steps, 1)
  floor = t.lr * t.min_lr_ratio
  if Schedule(t.schedule) == Schedule.COSINE:
    return optax.warmup_cosine_decay_schedule(0.0, t.lr, warm, max(t.steps, warm + 1), floor)
  decay = max(int(t.decay_frac * t.steps), 1)
  stable = max(t.steps - warm - decay, 0)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, t.lr, warm), optax.constant_schedule(t.lr),
       optax.linear_schedule(t.lr, floor, decay)], [warm, warm + stable])


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW with gradient clipping; weight decay on matrices only."""
  t = cfg.train
  decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.adamw(lr_schedule(cfg), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                  mask=decay_mask))


def init_state(cfg: Config, seed: int = 0):
  """Returns (graphdef, TrainState) with freshly initialised parameters."""
  graphdef, params = nnx.split(build_model(cfg, seed), nnx.Param)
  params = params.to_pure_dict()
  opt_state = make_optimizer(cfg).init(params)
  return graphdef, TrainState(jnp.int32(0), params, opt_state)


def bind(graphdef, params) -> model_lib.LoopedLM:
  """Rebuilds the module from a pure parameter dict (inside or outside jit)."""
  state = nnx.State(jax.tree.map(lambda x: nnx.Param(x), params))
  return nnx.merge(graphdef, state)


def forward_bucket(mdl, inputs_BxL, bucket_idx, key, cfg: Config) -> jax.Array:
  """Logits [B, L, V] at depth cfg.depth.buckets[bucket_idx] (switch over fixed scans)."""
  pos = model_lib.positions(inputs_BxL)
  e, _ = mdl.encode(inputs_BxL, pos)
  s0 = mdl.initial_state(e, key)
  step = lambda s: mdl.core_step(s, e, pos)[0]
  s = recurrence.bucketed_depth(step, s0, bucket_idx, cfg.depth.buckets,
                                backprop_depth=cfg.depth.backprop_depth,
                                remat=cfg.depth.remat)
  return mdl.logits(mdl.decode_state(s, pos)[0])


def forward_depth(mdl, inputs_BxL, depth, key) -> jax.Array:
  """Logits [B, L, V] at a traced uniform depth (forward only)."""
  pos = model_lib.positions(inputs_BxL)
  e, _ = mdl.encode(inputs_BxL, pos)
  s0 = mdl.initial_state(e, key)
  s = recurrence.dynamic_depth(lambda s: mdl.core_step(s, e, pos)[0], s0, depth)
  return mdl.logits(mdl.decode_state(s, pos)[0])


def masked_nll(logits_BxLxV, targets_BxL, mask_BxL):
  """(sum of NLL over unmasked targets, number of targets), fp32."""
  return jnp.sum(inference.nll(logits_BxLxV, targets_BxL, mask_BxL)), jnp.sum(mask_BxL)


def make_mesh(devices=None) -> Mesh:
  """A 1-D data-parallel mesh over all (or the given) devices."""
  devices = jax.devices() if devices is None else devices
  return Mesh(np.asarray(devices), ('data',))


def make_train_step(graphdef, cfg: Config, mesh: Mesh) -> Callable:
  """Builds the jitted pure step: (state, batch of [A, B, L] arrays) -> (state, metrics)."""
  tx = make_optimizer(cfg)
  seed_key = jax.random.key(cfg.train.seed)
  skip = NanPolicy(cfg.train.nan_policy) == NanPolicy.SKIP

  def loss_fn(params, micro, bucket_idx, key):
    mdl = bind(graphdef, params)
    logits = forward_bucket(mdl, micro['inputs'], bucket_idx, key, cfg)
    total, count = masked_nll(logits, micro['targets'], micro['mask'])
    return total, count  # sums: micro-batches are weighted by their token counts

  def step_fn(state: TrainState, batch):
    r, bucket_idx = policies.draw_bucket(seed_key, state.step, cfg.depth)
    key = jax.random.fold_in(jax.random.fold_in(seed_key, 0x1a17), state.step)
    grad = jax.value_and_grad(loss_fn, has_aux=True)

    def micro_step(acc, xs):
      i, micro = xs
      (loss, count), g = grad(state.params, micro, bucket_idx, jax.random.fold_in(key, i))
      return jax.tree.map(jnp.add, acc, (loss, count, g)), None

    zeros = (jnp.float32(0), jnp.float32(0), jax.tree.map(jnp.zeros_like, state.params))
    (loss, count, grads), _ = jax.lax.scan(micro_step, zeros, (jnp.arange(batch['inputs'].shape[0]), batch))
    denom = jnp.maximum(count, 1.0)
    loss, grads = loss / denom, jax.tree.map(lambda g: g / denom, grads)
    gnorm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if skip:  # discard a non-finite update (the stop policy is enforced on the host)
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
      params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
    new = TrainState(state.step + 1, params, opt_state)
    metrics = dict(loss=loss, grad_norm=gnorm, depth=r, bucket=jnp.asarray(
        cfg.depth.buckets)[bucket_idx], finite=finite, tokens=count)
    return new, metrics

  rep = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P(None, 'data'))
  return jax.jit(step_fn, in_shardings=(rep, data), out_shardings=(rep, rep),
                 donate_argnums=(0,))


def make_eval_step(graphdef, cfg: Config) -> Callable:
  """Jitted (params, batch, depth) -> (sum NLL, count); one executable for every depth."""
  key = jax.random.fold_in(jax.random.key(cfg.train.seed), 0xe7a1)

  @jax.jit
  def eval_step(params, batch, depth):
    logits = forward_depth(bind(graphdef, params), batch['inputs'], depth, key)
    return masked_nll(logits, batch['targets'], batch['mask'])
  return eval_step


def evaluate(eval_step, params, batches, depths) -> dict[int, float]:
  """Mean validation NLL (nats/token) at each uniform depth."""
  out = {}
  for d in depths:
    tot = cnt = 0.0
    for b in batches:
      s, c = eval_step(params, {k: b[k] for k in ('inputs', 'targets', 'mask')},
                       jnp.int32(d))
      tot, cnt = tot + float(s), cnt + float(c)
    out[int(d)] = tot / max(cnt, 1.0)
  return out


def shard_batch(batch, mesh: Mesh, accum: int):
  """Stacks host batches to [A, B, L] and places them on the data axis."""
  sharding = NamedSharding(mesh, P(None, 'data'))
  out = {}
  for k in ('inputs', 'targets', 'mask'):
    x = np.stack([b[k] for b in batch]) if accum > 1 else batch[0][k][None]
    out[k] = jax.make_array_from_process_local_data(sharding, x)
  return out


def train_flops_per_token(cfg: Config) -> float:
  """Model FLOPs per trained token at the mean depth (3x forward, remat not counted)."""
  return 3 * model_lib.flops_per_token(cfg.model, cfg.depth.mean, cfg.train.seq_len)['total']


def config_dict(cfg: Config) -> dict:
  """JSON-friendly nested dict of the config."""
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


def accum_steps(cfg: Config) -> int:
  """Micro-batches per optimizer step (from tokens_per_step when set)."""
  return grad_accum_steps(cfg.train)


def wall_clock() -> float:
  """Monotonic seconds."""
  return time.perf_counter()


def place_state(state: TrainState, mesh: Mesh) -> TrainState:
  """Replicates the state on the mesh (so the first step does not recompile)."""
  return jax.device_put(state, NamedSharding(mesh, P()))


def measure_matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
  """Achieved FLOP/s of a large square matmul on the default device (median)."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n ** 3 / float(np.median(times))


class _Preemption:
  """Turns SIGTERM/SIGINT into a flag checked at step boundaries.

  A second signal while the first is pending stops at once (KeyboardInterrupt) without
  saving; the previous checkpoint stays restorable since saves are atomic.
  """

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in (signal.SIGTERM, signal.SIGINT):
        self._old[s] = signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.signum is not None:
      self.__exit__()
      raise KeyboardInterrupt(f'second signal {signum}: stopping without saving')
    self.signum = signum
    print(f'\nsignal {signum} received: saving a checkpoint at the end of this step',
          flush=True)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)
    self._old = {}


def check_workdir(workdir: str) -> None:
  """Creates the workdir or raises a clear error if it is not writable."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f'.write_probe.{os.getpid()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f'workdir {workdir!r} is not writable: {e}') from e


def _end_jsonl_line(path: str) -> None:
  """Terminates a metrics line cut off by a kill, so appended records stay parseable."""
  try:
    with open(path, 'rb+') as f:
      f.seek(0, os.SEEK_END)
      if f.tell():
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b'\n':
          f.write(b'\n')
  except FileNotFoundError:
    pass


def run(cfg: Config, workdir: str, *, resume: bool = False, quiet: bool = False) -> dict:
  """Trains cfg in workdir; returns the final summary (losses by depth, tokens/s).

  Everything that can be checked is checked before compiling: the config (ConfigError),
  the workdir, the data (DataError), and on --resume the checkpoint's model config and
  tokenizer (CheckpointError). SIGTERM/SIGINT save a checkpoint at the next step boundary
  and return with summary['preempted_at']. A non-finite loss or gradient raises
  NonFiniteError (nan_policy=stop, or after max_skips skips) without saving the bad state.
  """
  validate(cfg)
  check_workdir(workdir)
  from elastic_depth import checkpoint, data as data_lib, metrics  # pylint: disable=g-import-not-at-top
  t = cfg.train
  with _Preemption() as pre:
    mesh = make_mesh()
    if t.batch_size % jax.process_count() or (t.batch_size // jax.process_count()) % max(
        jax.local_device_count(), 1):
      raise ConfigError(f'train.batch_size={t.batch_size} is not divisible across '
                        f'{jax.device_count()} devices')
    mngr = checkpoint.existing_manager(workdir, t.keep_checkpoints)
    steps = list(mngr.all_steps()) if mngr is not None else []
    if steps and not resume:
      raise ConfigError(f'{workdir!r} already holds checkpoints {steps}; pass '
                        '--resume to continue, or choose a new --workdir (nothing deleted)')
    found = checkpoint.latest_meta(mngr) if steps else None
    if found is not None:  # before building data or compiling anything
      where = f'{mngr.directory}/{found[0]}'
      checkpoint.check_model_config(found[1].get('config', {}).get('model', {}), cfg.model,
                                    where)
    tok_file = os.path.join(workdir, 'tokenizer.json')
    had_tok = os.path.exists(tok_file)
    try:
      ds = data_lib.build(cfg.data, seq_len=t.seq_len,
                          batch_size=t.batch_size // jax.process_count(),
                          vocab_size=cfg.model.vocab_size, workdir=workdir,
                          shard_index=jax.process_index(), shard_count=jax.process_count())
    except data_lib.DataError:
      if not had_tok and os.path.exists(tok_file):  # trained on data that failed: not reused
        os.remove(tok_file)
      raise
    if found is not None:
      checkpoint.check_tokenizer(found[1].get('tokenizer'), ds.tokenizer, where)
    if mngr is None:
      mngr = checkpoint.manager(workdir, t.keep_checkpoints)
    graphdef, state = init_state(cfg, t.seed)
    start = 0
    if resume:
      restored = checkpoint.restore_latest(mngr, state, cfg, tokenizer=ds.tokenizer,
                                           quarantine=True)
      if restored is None:
        print(f'--resume: no checkpoint in {mngr.directory} yet; starting at step 0',
              flush=True)
      else:
        start, state, meta = restored
        try:
          ds.train_iter.set_state(meta['data_iter'])
        except Exception as e:  # pylint: disable=broad-except
          raise checkpoint.CheckpointError(
              f'checkpoint {mngr.directory}/{start}: its data-iterator state does not fit '
              f'the current data ({type(e).__name__}: {e}); resume with the data flags of '
              'that run') from e
    state = place_state(state, mesh)
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      json.dump(config_dict(cfg), f, indent=1)
    accum = accum_steps(cfg)
    step_fn = make_train_step(graphdef, cfg, mesh)
    eval_step = make_eval_step(graphdef, cfg)
    val = ds.val_batches(t.eval_batches)
    depths = sorted({min(d, cfg.depth.r_max) for d in t.eval_depths})
    _end_jsonl_line(os.path.join(workdir, 'metrics.jsonl'))
    writer = metrics.MetricWriter(workdir, enabled=jax.process_index() == 0)
    peak = measure_matmul_peak(1024 if jax.default_backend() == 'cpu' else 8192)
    flops_tok = train_flops_per_token(cfg)
    schedule = lr_schedule(cfg)  # for logging; built once, not per step
    tokens_step = accum * t.batch_size * t.seq_len
    tok_info = checkpoint.tokenizer_info(ds.tokenizer)
    meta = lambda: {'config': config_dict(cfg), 'data_iter': ds.train_iter.get_state(),
                    'tokenizer': tok_info}
    bar = metrics.progress(t.steps, start, disable=quiet or None)
    skips, last, last_step, summary = 0, wall_clock(), start, {}
    print(f'elastic-depth: {model_lib.count_params(cfg.model):,} params, '
          f'{ds.describe()}, {tokens_step} tokens/step, steps {start}->{t.steps}', flush=True)
    try:
      for step in range(start, t.steps):
        if pre.signum is not None:  # signalled before the first step: nothing new to save
          print(f'\npreempted by signal {pre.signum} before step {step + 1}: nothing new '
                'to save, exiting', flush=True)
          summary['preempted_at'] = step
          break
        batch = shard_batch([next(ds.train_iter) for _ in range(accum)], mesh, accum)
        state, m = step_fn(state, batch)
        m = jax.device_get(m)
        done = step + 1
        finite = bool(m['finite'])
        skips += (not finite) and NanPolicy(t.nan_policy) == NanPolicy.SKIP
        rec = dict(loss=m['loss'], grad_norm=m['grad_norm'], depth=m['depth'],
                   skipped=skips, lr=float(schedule(step)))
        if step == start:  # exclude compilation from the throughput
          last, last_step = wall_clock(), done
        elif done % t.log_every == 0 or done == t.steps:
          now = wall_clock()
          tps = (done - last_step) * tokens_step / max(now - last, 1e-9)
          last, last_step = now, done
          rec.update(tokens_per_s=tps, mfu=tps * flops_tok / peak)
          bar.set_postfix(loss=f'{m["loss"]:.3f}', r=int(m['depth']), tok_s=f'{tps:,.0f}')
        if done % t.log_every == 0 or done == t.steps or step == start or not finite:
          writer.write(done, rec, 'train/')
        if not finite and (NanPolicy(t.nan_policy) == NanPolicy.STOP or skips > t.max_skips):
          checkpoint.wait(mngr)  # the bad state is never saved
          good = checkpoint.committed_steps(mngr)
          why = ('train.nan_policy=stop' if NanPolicy(t.nan_policy) == NanPolicy.STOP else
                 f'{skips} non-finite steps skipped, more than train.max_skips='
                 f'{t.max_skips}')
          raise NonFiniteError(
              f'non-finite loss/gradient at step {done} (loss={m["loss"]}, grad_norm='
              f'{m["grad_norm"]}, depth {int(m["depth"])}; {why}); '
              + (f'last good checkpoint: step {good[-1]} in {mngr.directory} (resume with '
                 '--resume, e.g. with a lower --config.train.lr)' if good else
                 'no checkpoint was saved'))
        bar.update(1)
        if done % t.eval_every == 0 or done == t.steps:
          losses = evaluate(eval_step, state.params, val, depths)
          writer.write(done, {f'loss_r{d}': v for d, v in losses.items()}, 'val/')
          summary = {**summary, 'step': done, 'val_loss': losses}
        if done % t.ckpt_every == 0 or done == t.steps or pre.signum is not None:
          checkpoint.save(mngr, done, state, meta(), force=True)
        if pre.signum is not None:
          checkpoint.wait(mngr)
          print(f'\npreempted by signal {pre.signum}: saved step {done}, exiting',
                flush=True)
          summary['preempted_at'] = done
          break
      checkpoint.wait(mngr)
    finally:
      bar.close()
      writer.close()
      try:
        mngr.close()
      except Exception:  # pylint: disable=broad-except  already raised or reported
        pass
  summary.update(skipped=skips, last_step=int(state.step))
  with open(os.path.join(workdir, 'summary.json'), 'w', encoding='utf-8') as f:
    json.dump(summary, f, indent=1)
  return summary
