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
estimate is below eps, in the same units as KL. The map from state to KL differs between
the first loops (large, fast-falling KL) and later ones, so a probe may carry one set of
parameters per loop (`fit(loops=...)`); a check reads the set of its own loop, at the
same cost. The fit minimises the squared error of log KL, or (`Objective.CROSSINGS`) the
exit decisions the estimate gets wrong over log-uniform thresholds.
"""

import enum
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
from elastic_depth.policies import KLProbe, kl_probe_log_of_change, kl_probe_set_log
from elastic_depth.policies import relative_change

# KL below 1e-7 nats (under any threshold worth using; deep loops sit at the fp32 noise
# floor) is censored: the fit asks only that the estimate be below it there.
LOG_FLOOR = float(np.log(1e-7))
# The thresholds an exit is run at (sweep_eps's grid tops out at 10 nats): the crossings
# objective counts the estimate's errors inside [LOG_FLOOR, LOG_CEIL] only.
LOG_CEIL = float(np.log(10.0))


class Objective(str, enum.Enum):
  """What `fit` minimises over (token, loop) pairs, in log KL."""
  SQUARES = 'squares'      # squared error (censored at LOG_FLOOR)
  CROSSINGS = 'crossings'  # |clip(estimate) - clip(log KL)| to [LOG_FLOOR, LOG_CEIL]: how
                           # many exit decisions it gets wrong over log-uniform thresholds


def _squares(pred, y):
  err = jnp.where(y <= LOG_FLOOR, jnp.maximum(pred - LOG_FLOOR, 0.0), pred - y)
  return err * err


def _crossings(pred, y):
  clip = lambda v: jnp.clip(v, LOG_FLOOR, LOG_CEIL)
  return jnp.abs(clip(pred) - clip(y))


_OBJECTIVES = {Objective.SQUARES: _squares, Objective.CROSSINGS: _crossings}


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
  prefilled and gives no pairs.

  Args:
    mdl: the frozen LM.
    batches: dicts of 'inputs' (int [B, L]) and 'mask' ([B, L]: tokens > 0 give pairs).
    r_max: the depth R of the runs (the loop cap of the exit runs).
    rng: key of the initial recurrent states.
    max_pairs: at most this many pairs, drawn without replacement when there are more.
    seed: seed of that draw.
    semantics: parallel or cached (a Semantics or its value).
    exit_eps: also each batch under the exact KL exit at each of these eps, in the same
      semantics (parallel: masked engine, exited tokens frozen; cached: earlier tokens
      offer the keys/values of the loop they exited at), its tokens' loops 2..depth: the
      states that runs with exits reach.
    progress: a bar over the runs.
  Returns:
    Harvest of N pairs (token, loop i in 2..R) over all runs: delta_NxD [N, D]
    s_i - s_{i-1}, states_NxD [N, D] s_i, log_kl_N float32 [N] log KL(p_i || p_{i-1})
    floored at LOG_FLOOR, and loops_N int [N] the loop i.
  """
  sem = Semantics(semantics)
  make = {Semantics.PARALLEL: (_parallel_run, _exit_run),
          Semantics.CACHED: (_cached_run, _cached_run)}[sem]
  runs = [make[0](mdl, r_max, rng)] + [make[1](mdl, r_max, rng, e) for e in exit_eps]
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
    return s, kl, _ran(np.asarray(b['mask']) > 0, depth, r_max)
  return fn


def _ran(keep_BxL: np.ndarray, depth_BxL: np.ndarray, r_max: int) -> np.ndarray:
  """[R, B, L]: loop i of token (b, l) ran (kept, and i <= its depth)."""
  return keep_BxL[None] & (np.arange(1, r_max + 1)[:, None, None] <= depth_BxL[None])


def _cached_run(mdl, r_max: int, rng, eps: Optional[float] = None):
  """batch -> (states, KL, ran) decoded token by token at uniform depth r_max, or under
  the exact KL exit at eps (ran: the loops up to each token's depth)."""
  cfg = (ExitConfig(policy='uniform', depth=r_max, max_loops=r_max) if eps is None else
         ExitConfig(policy='kl', eps=eps, max_loops=r_max))

  @jax.jit
  def step(cache, tok_B, pos):
    _, cache, depth_B, tr = decoding.decode_step(mdl, cache, tok_B, pos, cfg, rng, trace=True)
    return cache, tr['state'][:, :, 0], tr['kl'][:, :, 0], depth_B  # [R, B, D], [R, B], [B]

  def fn(b):
    toks = jnp.asarray(b['inputs'], jnp.int32)
    n, length = toks.shape
    cache, _, _ = decoding.prefill(mdl, toks[:, :1], cfg, rng, length)
    s = np.zeros((r_max, n, length, mdl.cfg.d_model), np.float32)
    kl = np.zeros((r_max, n, length), np.float32)
    depth = np.zeros((n, length), np.int32)
    for t in range(1, length):
      cache, st, k, dep = step(cache, toks[:, t], jnp.int32(t))
      s[:, :, t], kl[:, :, t], depth[:, t] = jax.device_get((st, k, dep))
    keep = np.asarray(b['mask']) > 0
    keep[:, 0] = False  # prefilled
    return s, kl, _ran(keep, depth, r_max)
  return fn


def fit(h: Harvest, rank: int = 32, hidden: int = 0, steps: int = 1000, lr: float = 1e-2,
        seed: int = 0, batch: int = 16384, loops: int = 1,
        objective: Objective = Objective.SQUARES) -> KLProbe:
  """A probe of `loops` parameter sets: set r for loop r + 2, the last also for every later
  loop (loops = 1: one for all; fewer where the harvest has fewer loops), each fitted on
  its loops' pairs alone (`_fit_set`) by the objective's mean over them.

  Args:
    h: the pairs (`harvest`).
    rank: K, the rank of the quadratic form of the state change.
    hidden: H, hidden units of the correction (0: none).
    steps: Adam steps per set.
    lr: learning rate.
    seed: seed of the initial weights and of the pairs drawn per step.
    batch: pairs drawn per step (all of a set's pairs when it has fewer).
    loops: the number of parameter sets.
    objective: what each set minimises (`Objective`).
  Returns:
    KLProbe with a leading axis of R' = min(loops, max loop of h - 1) sets: a_RxDxK
    [R', D, K], w_RxD, mu_RxD, sd_RxD [R', D], b_R, alpha_R [R'], w1_Rx2DxH [R', 2D, H],
    b1_RxH, w2_RxH [R', H].
  Raises:
    ValueError if a set has no pairs.
  """
  group = probe_loop_np(h.loops_N, loops)
  sets = []
  for g in range(int(group.max()) + 1):
    m = group == g
    if not m.any():
      raise ValueError(f'kl_probe.fit: no pairs from loop {g + 2} (harvest deeper, or fit '
                       f'fewer loop sets than loops={loops})')
    sets.append(_fit_set(Harvest(h.delta_NxD[m], h.states_NxD[m], h.log_kl_N[m],
                                 h.loops_N[m]), rank, hidden, steps, lr, seed, batch,
                         _OBJECTIVES[Objective(objective)]))
  return jax.tree.map(lambda *a: jnp.stack(a), *sets)


def probe_loop_np(loops_N, n_sets: int) -> np.ndarray:
  """policies.probe_loop for numpy loop indices and a probe of n_sets sets."""
  return np.clip(np.asarray(loops_N) - 2, 0, n_sets - 1)


def _fit_set(h: Harvest, rank: int, hidden: int, steps: int, lr: float, seed: int,
             batch: int, objective=_squares) -> KLProbe:
  """Minimises objective(estimate, log KL) (Adam on `batch` pairs drawn per step, all of
  them when fewer); A and W1 start random, alpha at 1, the hidden readout at 0 and b at
  the mean residual. Returns a one-set probe without the leading axis."""
  d, x = jnp.asarray(h.delta_NxD), jnp.asarray(h.states_NxD)
  y = jnp.asarray(h.log_kl_N)
  mu, sd = x.mean(0), x.std(0) + 1e-6
  dim = d.shape[1]
  k_a, k_w = jax.random.split(jax.random.key(seed))
  params = {'a_RxDxK': jax.random.normal(k_a, (dim, rank)) / np.sqrt(dim * rank),
            'w_RxD': jnp.zeros(dim), 'b_R': jnp.zeros(()), 'alpha_R': jnp.ones(()),
            'w1_Rx2DxH': jax.random.normal(k_w, (2 * dim, hidden)) / np.sqrt(2 * dim),
            'b1_RxH': jnp.zeros(hidden), 'w2_RxH': jnp.zeros(hidden)}
  probe = lambda p, mu, sd: KLProbe(mu_RxD=mu, sd_RxD=sd, **p)
  params['b_R'] = jnp.mean(y - _predict_set(probe(params, mu, sd), d, x))
  tx = optax.adam(lr)
  opt = tx.init(params)

  def loss_fn(p, data):  # the data are arguments: closed over, XLA would fold them in
    d, x, y, mu, sd = data
    return jnp.mean(objective(_predict_set(probe(p, mu, sd), d, x), y))

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


def _predict_set(one: KLProbe, d_NxD, x_NxD):
  """A one-set probe's (no leading axis) log KL for flat pairs (state x, change d)."""
  return kl_probe_set_log(one, x_NxD[None], d_NxD[None])[0]


def _predict(probe: KLProbe, h: Harvest) -> np.ndarray:
  """The probe's log KL for a harvest's pairs, each with its loop's parameter set."""
  pred = np.zeros(len(h.loops_N), np.float32)
  for i in np.unique(h.loops_N):
    m = h.loops_N == i
    pred[m] = np.asarray(kl_probe_log_of_change(probe, jnp.asarray(h.states_NxD[m])[None],
                                                jnp.asarray(h.delta_NxD[m])[None], int(i))[0])
  return pred


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
  (censored at LOG_FLOOR: the estimate is floored there too; RMSE over pairs above it).

  Args:
    probe: the KL probe (`fit`, `load`); each pair reads its loop's parameter set.
    h: the pairs (`harvest`), N of them.
  Returns:
    JSON-friendly dict: 'n' (pairs), 'share_floored' (share of log KL at LOG_FLOOR),
    'rmse_log_kl' (the estimate's RMSE in log KL over the pairs above the floor),
    'spearman_probe' and 'spearman_state_change' (rank correlations with log KL of the
    floored estimate and of the relative state change), 'rank', 'hidden' and 'loops' (K,
    H and the parameter sets), and 'mse_censored' (mean squared error in log KL over all
    pairs; at the floor only an estimate above it counts).
  """
  pred = _predict(probe, h)
  x = jnp.asarray(h.states_NxD)[None]
  change = np.asarray(relative_change(x, x - jnp.asarray(h.delta_NxD)[None])[0])
  y = h.log_kl_N
  above = y > LOG_FLOOR
  return {'n': int(len(y)), 'share_floored': float(1.0 - above.mean()),
          'rmse_log_kl': float(np.sqrt(np.mean((pred[above] - y[above]) ** 2))),
          'spearman_probe': spearman(np.maximum(pred, LOG_FLOOR), y),
          'spearman_state_change': spearman(change, y), 'rank': int(probe.a_RxDxK.shape[2]),
          'hidden': int(probe.w2_RxH.shape[1]), 'loops': int(probe.a_RxDxK.shape[0]),
          'mse_censored': float(np.mean(np.where(above, pred - y, np.maximum(pred - y, 0)) ** 2))}


def file_name(semantics) -> str:
  """The workdir file (no .json) of the probe fitted in a semantics: kl_probe[_cached]."""
  return {Semantics.PARALLEL: 'kl_probe', Semantics.CACHED: 'kl_probe_cached'}[
      Semantics(semantics)]


def save(probe: KLProbe, path: str, fit_record: Optional[dict] = None) -> None:
  """Writes the probe as JSON (R x (D x K + 3 D) numbers), with what it was fitted on."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  doc = {k: np.asarray(v).tolist() for k, v in probe._asdict().items()}
  with open(path, 'w', encoding='utf-8') as f:
    json.dump({**doc, 'fit': fit_record}, f)


# the one-set files of the twenty-fifth session: these names, no leading loop axis
_ONE_SET = dict(zip(KLProbe._fields, ('a_DxK', 'w_D', 'b', 'mu_D', 'sd_D', 'alpha', 'w1_2DxH',
                                       'b1_H', 'w2_H')))


def load(path: str, d_model: Optional[int] = None) -> KLProbe:
  """Reads a probe written by save(); ValueError if it does not fit a d_model-wide state."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'no KL probe at {path}: run python -m experiments.train_router '
                            '--probe=kl_probe --workdir=... first')
  try:
    with open(path, encoding='utf-8') as f:
      doc = json.load(f)
    if 'a_RxDxK' in doc:
      probe = KLProbe(**{k: jnp.asarray(doc[k], jnp.float32) for k in KLProbe._fields})
    else:
      probe = KLProbe(**{k: jnp.asarray(doc[old], jnp.float32)[None]
                         for k, old in _ONE_SET.items()})
    if probe.a_RxDxK.ndim != 3:
      raise ValueError(f'a_RxDxK has shape {probe.a_RxDxK.shape}')
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f'{path} is not a KL probe written by kl_probe.save: {e!r}') from None
  dim = probe.a_RxDxK.shape[1]
  if d_model is not None and dim != d_model:
    raise ValueError(f'{path} was fitted on {dim}-wide states, the model has d_model={d_model}')
  return probe
