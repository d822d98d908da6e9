"""TrainState, the optimizer and its schedule, the pure randomised-depth train_step and
eval_step, and the validation that uses them."""

import dataclasses
import json
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from elastic_depth import distributed, losses, policies
from elastic_depth import model as model_lib
from elastic_depth.config import Config, NanPolicy, Schedule, TrainConfig


class TrainState(struct.PyTreeNode):
  """Step counter, fp32 parameters and optimizer state."""
  step: jax.Array
  params: Any
  opt_state: Any


def lr_schedule(cfg: Config) -> optax.Schedule:
  """Linear warmup then cosine, or warmup-stable-decay."""
  t = cfg.train
  warm = max(t.warmup_steps, 1)
  floor = t.lr * t.min_lr_ratio
  if t.schedule == Schedule.COSINE:
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
  graphdef, params = nnx.split(model_lib.build_model(cfg.model, seed), nnx.Param)
  params = nnx.to_pure_dict(params)
  opt_state = make_optimizer(cfg).init(params)
  return graphdef, TrainState(jnp.int32(0), params, opt_state)


def make_train_step(graphdef, cfg: Config, mesh: Mesh) -> Callable:
  """Builds the jitted pure step: (state, batch of [A, B, L] arrays) -> (state, metrics)."""
  tx = make_optimizer(cfg)
  seed_key = jax.random.key(cfg.train.seed)
  skip = cfg.train.nan_policy == NanPolicy.SKIP

  def loss_fn(params, micro, bucket_idx, key):
    mdl = model_lib.bind(graphdef, params)
    chunk = cfg.train.loss_chunk
    out = mdl.forward(micro['inputs'], key, model_lib.bucketed(bucket_idx, cfg.depth),
                      head=not chunk)
    if chunk:  # head + cross-entropy fused, chunk tokens at a time
      flat = lambda x: x.reshape((-1,) + x.shape[2:])
      total = losses.head_nll(flat(out.hidden), mdl.head_matrix(),
                              flat(micro['targets']), flat(micro['mask']), chunk)
      return total, jnp.sum(micro['mask'])
    total, count = losses.masked_nll(out.logits, micro['targets'], micro['mask'])
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
  shard = distributed.state_shardings(jax.eval_shape(lambda: init_state(cfg)[1]), mesh,
                                      cfg.train)
  return jax.jit(step_fn, in_shardings=(shard, distributed.batch_sharding(mesh)),
                 out_shardings=(shard, rep), donate_argnums=(0,))


def make_eval_step(graphdef, cfg: Config) -> Callable:
  """Jitted (params, batch, depth) -> (sum NLL, count); one executable for every depth."""
  key = jax.random.fold_in(jax.random.key(cfg.train.seed), 0xe7a1)

  @jax.jit
  def eval_step(params, batch, depth):
    mdl = model_lib.bind(graphdef, params)
    out = mdl.forward(batch['inputs'], key, model_lib.dynamic(depth))
    return losses.masked_nll(out.logits, batch['targets'], batch['mask'])
  return eval_step


def evaluate(eval_step, params, batches, depths, mesh: Mesh) -> dict[int, float]:
  """Mean validation NLL (nats/token) at each uniform depth.

  batches are this process's rows of global batches (Data.val_batches), scored over the
  mesh, so the validation set does not depend on the number of processes.
  """
  out = {}
  for d in depths:
    tot = cnt = 0.0
    for b in batches:
      s, c = eval_step(params, distributed.shard_rows(b, mesh), jnp.int32(d))
      tot, cnt = tot + float(s), cnt + float(c)
    out[int(d)] = tot / max(cnt, 1.0)
  return out


def validation_depths(cfg: Config) -> list[int]:
  """The uniform depths validation scores: train.eval_depths up to depth.r_max, then r_max.

  Depths above r_max were never trained; experiments.eval_depth scores them.
  """
  return sorted({min(d, cfg.depth.r_max) for d in cfg.train.eval_depths})


def train_flops_per_token(cfg: Config) -> float:
  """Model FLOPs per trained token, expected over the depth draws (remat not counted).

  The forward runs the drawn bucket's loops, the backward (2x) the last backprop_depth of
  them (all when 0); the expectation is over policies.bucket_probabilities.
  """
  d = cfg.depth
  p = policies.bucket_probabilities(d)
  b = np.asarray(d.buckets, np.float64)
  back = np.minimum(b, d.backprop_depth) if d.backprop_depth > 0 else b
  f = lambda r: model_lib.flops_per_token(cfg.model, float(r), cfg.train.seq_len)['total']
  return f(p @ b) + 2 * f(p @ back)  # FLOPs are linear in the loops


def config_dict(cfg: Config) -> dict:
  """JSON-friendly nested dict of the config."""
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


def place_state(state: TrainState, mesh: Mesh, t: Optional[TrainConfig] = None
                ) -> TrainState:
  """Puts the state on the mesh by the sharding rules (so the first step does not recompile)."""
  return jax.device_put(state, distributed.state_shardings(state, mesh, t or TrainConfig()))
