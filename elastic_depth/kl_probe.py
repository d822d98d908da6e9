"""The KL probe: KL(p_i || p_{i-1}) estimated from the recurrent state, with no readout.

An exit check that reads the output distribution pays a coda pass and a head product per
read (2.1 core loops at the 135M blocks); the relative state change is free but exits
other tokens than KL does. The probe is fitted on the frozen model's own per-loop KL:

  log KL_i ~ alpha log ||(s_i - s_{i-1}) A||^2 + x_i.w + b + w2.gelu([x_i, d_i] W1 + b1),
  x_i = (s_i - mu) / sd,  d_i = (s_i - s_{i-1}) / sd,

a rank-K quadratic form of the state change (what KL is to second order through a fixed
readout Jacobian and Fisher) with a per-token scale read linearly off the state (how
peaked p_i is), and optionally H hidden units for what neither captures. It costs
~2DK + 4DH FLOPs per check (`policies.probe_flops`). Policy `kl_probe` exits where the
estimate is below eps, in the same units as KL.
"""

import json
import os
from typing import Iterable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from elastic_depth import analysis, decoding, inference, model as model_lib
from elastic_depth.config import ExitConfig, Semantics
from elastic_depth.kernels import kl_halting
from elastic_depth.policies import KLProbe, kl_probe_log_of_change, relative_change

# KL below 1e-7 nats (under any threshold worth using; deep loops sit at the fp32 noise
# floor) is censored: the fit asks only that the estimate be below it there.
LOG_FLOOR = float(np.log(1e-7))


class Harvest(NamedTuple):
  """(token, loop) pairs from loops 2..R: the state change, the state and log KL."""
  delta_NxD: np.ndarray  # s_i - s_{i-1}
  states_NxD: np.ndarray  # s_i
  log_kl_N: np.ndarray   # log KL(p_i || p_{i-1}), floored at LOG_FLOOR (censored there)
  loops_N: np.ndarray    # the loop i of each pair (2..R)


def _recorded_loop(r_max: int) -> model_lib.LoopFn:
  """Loop policy: r_max loops, recording each loop's state and KL to the loop before."""
  def loop(mdl, s0, inj, pos):
    step = mdl.step_fn(inj, pos)
    read = lambda s: mdl.logits(mdl.decode_state(s, pos)[0]).astype(jnp.float32)

    def body(c, _):
      s_old, a_old = c
      s = step(s_old)
      a = read(s)
      flat = lambda x: x.reshape(-1, x.shape[-1])
      kl = kl_halting.reference_kl_from_logits(flat(a), flat(a_old))[0].reshape(a.shape[:2])
      return (s, a), (s.astype(jnp.float32), kl)
    (s, _), aux = jax.lax.scan(body, (s0, read(s0)), None, length=r_max)
    return s, aux
  return loop


def harvest(mdl, batches: Iterable[dict], r_max: int, rng: jax.Array,
            max_pairs: int = 100_000, seed: int = 0,
            semantics: Semantics = Semantics.PARALLEL,
            exit_eps: Sequence[float] = (), progress: bool = False) -> Harvest:
  """Every batch at uniform depth r_max; the masked tokens' loops 2..R as pairs.

  Parallel semantics: one forward per batch (`_recorded_loop`). Cached semantics: token
  by token through `decoding.decode_step` (its trace), each token after the tokens
  before it ran r_max loops and offer their last loop's keys/values; position 0 is
  prefilled and gives no pairs. exit_eps (parallel only): also each batch under the
  exact KL exit at each of these eps (masked engine, exited tokens frozen), its tokens'
  loops 2..depth: the states that runs with exits reach. progress: a bar over the runs.
  """
  sem = Semantics(semantics)
  if exit_eps and sem != Semantics.PARALLEL:
    raise ValueError('kl_probe.harvest: exit_eps needs parallel semantics')
  runs = [{Semantics.PARALLEL: _parallel_run, Semantics.CACHED: _cached_run}[sem](
      mdl, r_max, rng)] + [_exit_run(mdl, r_max, rng, e) for e in exit_eps]
  pairs = [[], [], [], []]  # change, state, KL, loop
  jobs = [(fn, b) for fn in runs for b in batches]
  for fn, b in analysis.bar(jobs, f'harvest ({sem.value})', progress):
    s_RxBxLxD, kl_RxBxL, ran_RxBxL = fn(b)
    r, row, col = np.nonzero(ran_RxBxL[1:])  # loop r + 2 of token (row, col) ran
    s_new, s_old = s_RxBxLxD[r + 1, row, col], s_RxBxLxD[r, row, col]
    for out, v in zip(pairs, (s_new - s_old, s_new, kl_RxBxL[r + 1, row, col], r + 2)):
      out.append(v)
  d, x, k, l = (np.concatenate(v) for v in pairs)
  if len(k) > max_pairs:
    idx = np.random.default_rng(seed).choice(len(k), max_pairs, replace=False)
    d, x, k, l = d[idx], x[idx], k[idx], l[idx]
  log_kl = np.log(np.maximum(k.astype(np.float64), np.exp(LOG_FLOOR))).astype(np.float32)
  return Harvest(d, x, log_kl, l)


def _parallel_run(mdl, r_max: int, rng):
  """batch -> (states [R, B, L, D], KL [R, B, L], ran [R, B, L]: the mask at every loop)
  of one uniform forward."""
  @jax.jit
  def run(inputs_BxL):
    return mdl.forward(inputs_BxL, rng, _recorded_loop(r_max)).aux

  def fn(b):
    s, kl = jax.device_get(run(b['inputs']))
    return s, kl, np.broadcast_to(np.asarray(b['mask']) > 0, kl.shape)
  return fn


def _exit_run(mdl, r_max: int, rng, eps: float):
  """batch -> (states, KL, ran [R, B, L]) under the exact KL exit at eps (masked engine)."""
  cfg = ExitConfig(policy='kl', eps=eps, max_loops=r_max)

  @jax.jit
  def run(inputs_BxL):
    res = mdl.forward(inputs_BxL, rng, inference.exit_loop(cfg, trace=True,
                                                           trace_states=True)).aux
    return res.traces['state'], res.traces['kl'], res.depth

  def fn(b):
    s, kl, depth = jax.device_get(run(b['inputs']))
    loops = np.arange(1, r_max + 1)[:, None, None]
    return s, kl, (np.asarray(b['mask']) > 0)[None] & (loops <= depth[None])
  return fn


def _cached_run(mdl, r_max: int, rng):
  """batch -> (states, KL, ran) decoded token by token at uniform depth r_max."""
  cfg = ExitConfig(policy='uniform', depth=r_max, max_loops=r_max)

  @jax.jit
  def step(cache, tok_B, pos):
    _, cache, _, tr = decoding.decode_step(mdl, cache, tok_B, pos, cfg, rng, trace=True)
    return cache, tr['state'][:, :, 0], tr['kl'][:, :, 0]  # [R, B, D], [R, B]

  def fn(b):
    toks = jnp.asarray(b['inputs'], jnp.int32)
    n, length = toks.shape
    cache, _, _ = decoding.prefill(mdl, toks[:, :1], cfg, rng, length)
    s = np.zeros((r_max, n, length, mdl.cfg.d_model), np.float32)
    kl = np.zeros((r_max, n, length), np.float32)
    for t in range(1, length):
      cache, st, k = step(cache, toks[:, t], jnp.int32(t))
      s[:, :, t], kl[:, :, t] = jax.device_get((st, k))
    keep = np.asarray(b['mask']) > 0
    keep[:, 0] = False  # prefilled
    return s, kl, np.broadcast_to(keep, kl.shape)
  return fn


def fit(h: Harvest, rank: int = 32, hidden: int = 0, steps: int = 1000, lr: float = 1e-2,
        seed: int = 0, batch: int = 16384) -> KLProbe:
  """Least squares on log KL, censored at LOG_FLOOR (Adam on `batch` pairs drawn per step,
  all of them when fewer); A and W1 start random, alpha at 1, the hidden readout at 0 and
  b at the mean residual."""
  d, x = jnp.asarray(h.delta_NxD), jnp.asarray(h.states_NxD)
  y = jnp.asarray(h.log_kl_N)
  mu, sd = x.mean(0), x.std(0) + 1e-6
  dim = d.shape[1]
  k_a, k_w = jax.random.split(jax.random.key(seed))
  params = {'a_DxK': jax.random.normal(k_a, (dim, rank)) / np.sqrt(dim * rank),
            'w_D': jnp.zeros(dim), 'b': jnp.zeros(()), 'alpha': jnp.ones(()),
            'w1_2DxH': jax.random.normal(k_w, (2 * dim, hidden)) / np.sqrt(2 * dim),
            'b1_H': jnp.zeros(hidden), 'w2_H': jnp.zeros(hidden)}
  probe = lambda p, mu, sd: KLProbe(mu_D=mu, sd_D=sd, **p)
  params['b'] = jnp.mean(y - _predict(probe(params, mu, sd), d, x))
  tx = optax.adam(lr)
  opt = tx.init(params)

  def loss_fn(p, data):  # the data are arguments: closed over, XLA would fold them in
    d, x, y, mu, sd = data
    pred = _predict(probe(p, mu, sd), d, x)
    err = jnp.where(y <= LOG_FLOOR, jnp.maximum(pred - LOG_FLOOR, 0.0), pred - y)
    return jnp.mean(err * err)

  n = int(y.shape[0])
  take = min(batch, n)

  @jax.jit
  def step(p, o, data, t):
    if take < n:
      idx = jax.random.randint(jax.random.fold_in(jax.random.key(seed + 1), t), (take,), 0, n)
      data = tuple(a[idx] for a in data[:3]) + data[3:]
    g = jax.grad(loss_fn)(p, data)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  data = (d, x, y, mu, sd)
  for t in range(steps):
    params, opt = step(params, opt, data, jnp.int32(t))
  return probe(params, mu, sd)


def _predict(probe: KLProbe, d_NxD, x_NxD):
  """The probe's log KL for flat pairs (state x, change d)."""
  return kl_probe_log_of_change(probe, x_NxD[None], d_NxD[None])[0]


def _ranks(v: np.ndarray) -> np.ndarray:
  """Ranks with ties averaged."""
  _, inv, counts = np.unique(v, return_inverse=True, return_counts=True)
  start = np.concatenate([[0], np.cumsum(counts)[:-1]])
  return (start + 0.5 * (counts - 1))[inv]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
  """Spearman rank correlation, ties averaged."""
  return float(np.corrcoef(_ranks(np.asarray(a)), _ranks(np.asarray(b)))[0, 1])


def evaluate(probe: KLProbe, h: Harvest) -> dict:
  """How well the probe, and the relative state change for comparison, order the true KL
  (censored at LOG_FLOOR: the estimate is floored there too; RMSE over pairs above it)."""
  pred = np.asarray(_predict(probe, jnp.asarray(h.delta_NxD), jnp.asarray(h.states_NxD)))
  x = jnp.asarray(h.states_NxD)[None]
  change = np.asarray(relative_change(x, x - jnp.asarray(h.delta_NxD)[None])[0])
  y = h.log_kl_N
  above = y > LOG_FLOOR
  return {'n': int(len(y)), 'share_floored': float(1.0 - above.mean()),
          'rmse_log_kl': float(np.sqrt(np.mean((pred[above] - y[above]) ** 2))),
          'spearman_probe': spearman(np.maximum(pred, LOG_FLOOR), y),
          'spearman_state_change': spearman(change, y), 'rank': int(probe.a_DxK.shape[1]),
          'hidden': int(probe.w2_H.shape[0]),
          'mse_censored': float(np.mean(np.where(above, pred - y, np.maximum(pred - y, 0)) ** 2))}


def file_name(semantics) -> str:
  """The workdir file (no .json) of the probe fitted in a semantics: kl_probe[_cached]."""
  return {Semantics.PARALLEL: 'kl_probe', Semantics.CACHED: 'kl_probe_cached'}[
      Semantics(semantics)]


def save(probe: KLProbe, path: str, fit_record: Optional[dict] = None) -> None:
  """Writes the probe as JSON (D x K + 3 D numbers), with what it was fitted on."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  doc = {k: np.asarray(v).tolist() for k, v in probe._asdict().items()}
  with open(path, 'w', encoding='utf-8') as f:
    json.dump({**doc, 'fit': fit_record}, f)


def load(path: str, d_model: Optional[int] = None) -> KLProbe:
  """Reads a probe written by save(); ValueError if it does not fit a d_model-wide state."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'no KL probe at {path}: run python -m experiments.train_router '
                            '--probe=kl_probe --workdir=... first')
  try:
    with open(path, encoding='utf-8') as f:
      doc = json.load(f)
    probe = KLProbe(**{k: jnp.asarray(doc[k], jnp.float32) for k in KLProbe._fields})
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f'{path} is not a KL probe written by kl_probe.save: {e!r}') from None
  dim = probe.a_DxK.shape[0]
  if d_model is not None and dim != d_model:
    raise ValueError(f'{path} was fitted on {dim}-wide states, the model has d_model={d_model}')
  return probe
