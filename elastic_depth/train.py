"""TrainState, the pure randomised-depth train_step, eval_step, and the training loop."""

import dataclasses
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from elastic_depth import model as model_lib
from elastic_depth import policies, recurrence
from elastic_depth.config import Config, NanPolicy, Schedule, grad_accum_steps


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
  logits = logits_BxLxV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
  return jnp.sum((lse - tgt) * mask_BxL), jnp.sum(mask_BxL)


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
    return total / jnp.maximum(count, 1.0), count

  def step_fn(state: TrainState, batch):
    r, bucket_idx = policies.draw_bucket(seed_key, state.step, cfg.depth)
    key = jax.random.fold_in(seed_key, state.step)
    grad = jax.value_and_grad(loss_fn, has_aux=True)
    n_micro = batch['inputs'].shape[0]

    def micro_step(acc, xs):
      i, micro = xs
      (loss, count), g = grad(state.params, micro, bucket_idx, jax.random.fold_in(key, i))
      return jax.tree.map(jnp.add, acc, (loss, count, g)), None

    zeros = (jnp.float32(0), jnp.float32(0), jax.tree.map(jnp.zeros_like, state.params))
    (loss, count, grads), _ = jax.lax.scan(micro_step, zeros, (jnp.arange(n_micro), batch))
    loss, grads = loss / n_micro, jax.tree.map(lambda g: g / n_micro, grads)
    gnorm = optax.global_norm(grads)
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


def place_state(state: TrainState, mesh: Mesh) -> TrainState:
  """Replicates the state on the mesh (so the first step does not recompile)."""
  return jax.device_put(state, NamedSharding(mesh, P()))
