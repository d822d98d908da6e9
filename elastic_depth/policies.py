"""Depth sampling for training and per-token exit criteria (A0 uniform, A1 KL, A2 router,
and the KL probe: KL(p_i || p_{i-1}) estimated from the state, no readout).

A criterion is built as `check_fn(s_new, s_old, carry, i, active) -> (exit, carry, stats)`
for `recurrence.early_exit`. KL criteria read the output distribution
p_i = softmax(head(readout(s_i))) in fp32; the readout (coda + final norm) is
passed in as a closure so the same criterion serves parallel scoring and cached
decoding.
"""

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from elastic_depth import losses
from elastic_depth.config import DepthConfig, ExitPolicy
from elastic_depth.kernels import kl_halting


# ----------------------------------------------------------------------------
# Depth sampling (training).


def sample_depth(key: jax.Array, mean: float, sigma: float, r_max: int) -> jax.Array:
  """r = Poisson(exp(tau)) + 1, tau ~ N(log(mean - 1) - sigma^2/2, sigma), clipped to [1, r_max]."""
  if mean <= 1:
    return jnp.int32(1)
  k_tau, k_poisson = jax.random.split(key)
  mu = math.log(mean - 1.0) - 0.5 * sigma ** 2
  tau = mu + sigma * jax.random.normal(k_tau, (), jnp.float32)
  r = jax.random.poisson(k_poisson, jnp.exp(tau), (), jnp.int32) + 1
  return jnp.clip(r, 1, r_max).astype(jnp.int32)


def bucket_index(r: jax.Array, buckets: Sequence[int]) -> jax.Array:
  """Index of the bucket nearest to r (ties go to the deeper bucket)."""
  b = jnp.asarray(buckets, jnp.float32)
  dist = jnp.abs(b - jnp.asarray(r, jnp.float32))
  # argmin takes the first minimum; reverse so that ties pick the deeper bucket
  return (len(buckets) - 1 - jnp.argmin(dist[::-1])).astype(jnp.int32)


def draw_bucket(seed_key: jax.Array, step: jax.Array, cfg: DepthConfig):
  """Depth draw for one optimizer step, a pure function of (seed, step): (r, bucket_idx)."""
  key = jax.random.fold_in(jax.random.fold_in(seed_key, 0x5eed), step)
  r = sample_depth(key, cfg.mean, cfg.sigma, cfg.r_max)
  return r, bucket_index(r, cfg.buckets)


def bucket_probabilities(cfg: DepthConfig, nodes: int = 200) -> np.ndarray:
  """P(bucket j) per optimizer step under sample_depth and bucket_index, in float64.

  The Poisson mixture is integrated over tau by Gauss-Hermite quadrature; r = r_max takes
  the whole upper tail.
  """
  r = np.arange(1, cfg.r_max + 1, dtype=np.float64)
  if cfg.mean <= 1:
    p_r = (r == 1).astype(np.float64)
  else:
    z, w = np.polynomial.hermite_e.hermegauss(nodes)
    lam = np.exp(math.log(cfg.mean - 1.0) - 0.5 * cfg.sigma ** 2 + cfg.sigma * z)[:, None]
    k = r[:-1] - 1  # Poisson draws k -> r = k + 1 below r_max
    lgam = np.array([math.lgamma(x + 1) for x in k])
    p_r = (w / w.sum()) @ np.exp(k * np.log(lam) - lam - lgam)
    p_r = np.append(p_r, max(1.0 - p_r.sum(), 0.0))
  idx = np.asarray(jax.vmap(lambda x: bucket_index(x, cfg.buckets))(jnp.asarray(r)))
  return np.bincount(idx, weights=p_r, minlength=len(cfg.buckets))


def bucket_frequencies(seed: int, n: int, cfg: DepthConfig) -> tuple[np.ndarray, np.ndarray]:
  """Empirical draws over steps 0..n-1: (r per step, bucket depth per step)."""
  key = jax.random.key(seed)
  r, idx = jax.vmap(lambda s: draw_bucket(key, s, cfg))(jnp.arange(n))
  return np.asarray(r), np.asarray(cfg.buckets)[np.asarray(idx)]


# ----------------------------------------------------------------------------
# Exit criteria.


class Router(NamedTuple):
  """A2 linear probe on the recurrent state: P(argmax still changes) = sigmoid(s.w + b)."""
  w_D: jax.Array
  b: jax.Array
  mu_D: jax.Array   # feature standardisation
  sd_D: jax.Array


def router_logit(router: Router, s_BxLxD: jax.Array) -> jax.Array:
  """Router logit per token in fp32."""
  x = (s_BxLxD.astype(jnp.float32) - router.mu_D) / router.sd_D
  return jnp.einsum('BLD,D->BL', x, router.w_D) + router.b


class KLProbe(NamedTuple):
  """KL(p_i || p_{i-1}) read off the state, in log space: alpha log ||(s_i - s_{i-1}) A||^2
  (a rank-K quadratic form of the change) + x_i.w + b (x_i the standardised s_i: how
  peaked p_i is) + w2.gelu([x_i, (s_i - s_{i-1}) / sd] W1 + b1) (H hidden units; H = 0:
  none). One set of parameters per loop (leading axis R): set r serves loop r + 2, the
  last set every loop after it too (`probe_loop`); R = 1: one set for all loops."""
  a_RxDxK: jax.Array
  w_RxD: jax.Array
  b_R: jax.Array
  mu_RxD: jax.Array   # feature standardisation of s_i
  sd_RxD: jax.Array
  alpha_R: jax.Array  # the quadratic form's exponent
  w1_Rx2DxH: jax.Array
  b1_RxH: jax.Array
  w2_RxH: jax.Array


Probe = Union[Router, KLProbe]  # the state probes a check may carry (policy router, kl_probe)


def probe_loop(probe: KLProbe, i):
  """The parameter set (index on KLProbe's leading axis) that serves loop i (>= 2)."""
  return jnp.clip(jnp.asarray(i) - 2, 0, probe.a_RxDxK.shape[0] - 1)


def kl_probe_log(probe: KLProbe, s_new_BxLxD: jax.Array, s_old_BxLxD: jax.Array,
                 i) -> jax.Array:
  """The probe's estimate of log KL(p_i || p_{i-1}) at loop i per token, fp32 [B, L]."""
  s = s_new_BxLxD.astype(jnp.float32)
  return kl_probe_log_of_change(probe, s, s - s_old_BxLxD.astype(jnp.float32), i)


def kl_probe_log_of_change(probe: KLProbe, s: jax.Array, d: jax.Array, i) -> jax.Array:
  """kl_probe_log from the state s_i and its change d = s_i - s_{i-1} (fp32, [B, L, D])."""
  return kl_probe_set_log(jax.tree.map(lambda a: a[probe_loop(probe, i)], probe), s, d)


def kl_probe_set_log(p: KLProbe, s: jax.Array, d: jax.Array) -> jax.Array:
  """kl_probe_log_of_change with one parameter set p (a KLProbe without the axis R: its
  fields keep their names, a_RxDxK being [D, K] here; K the probe's rank, H its hidden
  units, E = 2 D the hidden units' features, the probe's own letters)."""
  q_BxLxK = jnp.einsum('BLD,DK->BLK', d, p.a_RxDxK)
  x = (s - p.mu_RxD) / p.sd_RxD
  out = (p.alpha_R * jnp.log(jnp.sum(q_BxLxK * q_BxLxK, -1) + 1e-12)
         + jnp.einsum('BLD,D->BL', x, p.w_RxD) + p.b_R)
  if p.w2_RxH.shape[0]:
    z = jnp.concatenate([x, d / p.sd_RxD], -1)
    h_BxLxH = jax.nn.gelu(jnp.einsum('BLE,EH->BLH', z, p.w1_Rx2DxH) + p.b1_RxH)
    out = out + jnp.einsum('BLH,H->BL', h_BxLxH, p.w2_RxH)
  return out


def probe_size(probe: Optional[Probe]) -> Optional[tuple[int, int]]:
  """None without a probe, (0, 0) for the router, (K, H) for a KL probe (`probe_flops`)."""
  if probe is None:
    return None
  if isinstance(probe, KLProbe):
    return int(probe.a_RxDxK.shape[-1]), int(probe.w2_RxH.shape[-1])
  return 0, 0


def probe_flops(size: Optional[Sequence[int]], d_model: int) -> int:
  """FLOPs per token and check of a state probe of `probe_size` size at width d_model."""
  if size is None:
    return 0
  k, h = size
  # the router: standardise and dot; the KL probe adds the change's rank-K projection
  # and its squared norm, and the hidden layer over [x, change] (bias, gelu, readout)
  return 4 * d_model + 2 * (d_model + 1) * k + (d_model + 4 * d_model * h + 13 * h) * (h > 0)


def _probe_stats(probe: Optional[Probe], s_new, s_old, i) -> dict:
  """The statistic a state probe adds to a check: the router's P(change) or the KL estimate."""
  if probe is None:
    return {}
  if isinstance(probe, KLProbe):
    return {'kl_hat': jnp.exp(kl_probe_log(probe, s_new, s_old, i))}
  return {'p_change': jax.nn.sigmoid(router_logit(probe, s_new))}


def relative_change(s_new, s_old) -> jax.Array:
  """||s_i - s_{i-1}|| / ||s_i|| per token, fp32."""
  a, b = s_new.astype(jnp.float32), s_old.astype(jnp.float32)
  return jnp.linalg.norm(a - b, axis=-1) / (jnp.linalg.norm(a, axis=-1) + 1e-12)


class CheckCarry(NamedTuple):
  """Carry of the exit check: what p_{i-1} needs, and the readouts it executed."""
  prev: Any             # p_{i-1}: logits [B, L, V] fp32, or its hidden [B, L, D] (kernel);
                        # state_delta with patience > 1: the run of loops below eps [B, L]
  coda: jax.Array       # readout passes (coda + final norm) over the batch, int32 []
  head: jax.Array       # head products over the batch, int32 []
  coda_BxL: jax.Array   # readouts run while the token was active, int32 [B, L]
  head_BxL: jax.Array   # head products run while the token was active, int32 [B, L]


def _counted(carry: CheckCarry, prev, active_BxL, coda: int, head: int) -> CheckCarry:
  """carry with prev replaced and coda/head executions added (per batch and per active token)."""
  a = active_BxL.astype(jnp.int32)
  return CheckCarry(prev, carry.coda + coda, carry.head + head,
                    carry.coda_BxL + coda * a, carry.head_BxL + head * a)


def _flat_logits(h_BxLxD, w_VxD):
  b, l, d = h_BxLxD.shape
  return kl_halting.head_logits(h_BxLxD.reshape(b * l, d), w_VxD).reshape(b, l, -1)


def _flat(x):
  return x.reshape(-1, x.shape[-1])


class _HeadCheck(NamedTuple):
  """What a KL-policy check needs to read p_i (static settings and closures)."""
  policy: ExitPolicy
  readout: Callable
  w_VxD: jax.Array
  targets_BxL: Optional[jax.Array]
  trace: bool
  kernel: bool
  is_check: Callable
  reads: Callable


HEAD_POLICIES = (ExitPolicy.KL, ExitPolicy.GATED_KL, ExitPolicy.REVERSE_KL,
                  ExitPolicy.CONFIDENCE)


def _no_stats(shape):
  inf = jnp.full(shape, jnp.inf, jnp.float32)
  return {'kl': inf, 'rkl': inf, 'conf': inf, 'argmax': jnp.zeros(shape, jnp.int32),
          'lse': jnp.zeros(shape, jnp.float32), 'logit_t': jnp.zeros(shape, jnp.float32)}


def _logit_stats(hc: _HeadCheck, a, prev, shape):
  """KL statistics of p_i (logits a) against the carried p_{i-1}: no head product."""
  st = _no_stats(shape)
  if hc.trace or hc.policy != ExitPolicy.REVERSE_KL:
    kl, _, lse = kl_halting.reference_kl_from_logits(_flat(a), _flat(prev))
    st.update(kl=kl.reshape(shape), lse=lse.reshape(shape))
    if hc.trace:  # not the reference's jnp.argmax: scalar code on XLA:CPU
      st['argmax'] = losses.argmax_rows(a)
  if hc.trace or hc.policy == ExitPolicy.REVERSE_KL:
    st['rkl'] = kl_halting.reference_kl_from_logits(_flat(prev), _flat(a))[0].reshape(shape)
  if hc.trace or hc.policy == ExitPolicy.CONFIDENCE:  # 1 - max_v p_i(v), fp32
    st['conf'] = -jnp.expm1(jnp.max(a, -1) - jax.nn.logsumexp(a, -1))
  if hc.trace and hc.targets_BxL is not None:
    st['logit_t'] = jnp.take_along_axis(a, hc.targets_BxL[..., None], -1)[..., 0]
  return st


def _kernel_stats(hc: _HeadCheck, h, h_old, shape):
  """KL statistics from the fused kernel (two head products; p_{i-1} from its hidden)."""
  hn, ho = _flat(h), _flat(h_old)
  if hc.policy == ExitPolicy.REVERSE_KL:
    return dict(_no_stats(shape), rkl=kl_halting.kl_halting_auto(ho, hn, hc.w_VxD)[0].reshape(shape))
  kl, am, _ = kl_halting.kl_halting_auto(hn, ho, hc.w_VxD)
  return dict(_no_stats(shape), kl=kl.reshape(shape), argmax=am.reshape(shape))


def _head_stats(hc: _HeadCheck, s_new, carry: CheckCarry, i, active):
  """(stats of the check at loop i, carry with p_i); a readout only where one is read."""
  shape = s_new.shape[:2]
  check = hc.is_check(i)

  def run(c):
    h = hc.readout(s_new)
    if hc.kernel:
      st = lax.cond(check, lambda: _kernel_stats(hc, h, c.prev, shape),
                    lambda: _no_stats(shape))
      two = 2 * check.astype(jnp.int32)
      return st, _counted(c, h, active, 1, 0)._replace(
          head=c.head + two, head_BxL=c.head_BxL + two * active.astype(jnp.int32))
    a = _flat_logits(h, hc.w_VxD)
    st = (_logit_stats(hc, a, c.prev, shape) if hc.trace else
          lax.cond(check, lambda: _logit_stats(hc, a, c.prev, shape), lambda: _no_stats(shape)))
    return st, _counted(c, a, active, 1, 1)

  if hc.trace:
    return run(carry)
  return lax.cond(hc.reads(i), run, lambda c: (_no_stats(shape), c), carry)


def check_schedule(policy: ExitPolicy, min_loops: int, check_every: int,
                   max_loops: Optional[int] = None):
  """(is_check(i), reads(i)): the loops a check decides at, and those it reads p_i at.

  KL-type checks need p_{i-1} (none at loop 1) and read the loop before each check too,
  unless that check lies beyond max_loops; the confidence check reads p_i at its check
  loops only, from min_loops on.
  """
  policy = ExitPolicy(policy)
  first = min_loops if policy == ExitPolicy.CONFIDENCE else max(min_loops, 2)
  is_check = lambda i: (i >= first) & ((i - min_loops) % check_every == 0)
  if policy == ExitPolicy.CONFIDENCE:
    return is_check, is_check
  before = ((lambda i: is_check(i + 1)) if max_loops is None else
            (lambda i: is_check(i + 1) & (i < max_loops)))
  return is_check, lambda i: is_check(i) | before(i)


def _decide(policy: ExitPolicy, stats, i, eps, gate):
  """The exit decision of a policy from its statistics (none at loop 1 but the router's)."""
  first = i < 2  # no previous distribution at loop 1
  rules = {
      ExitPolicy.UNIFORM: lambda: jnp.zeros_like(stats['delta'], bool),
      ExitPolicy.KL: lambda: (stats['kl'] < eps) & ~first,
      ExitPolicy.GATED_KL: lambda: (stats['kl'] < eps) & (stats['delta'] < gate) & ~first,
      ExitPolicy.REVERSE_KL: lambda: (stats['rkl'] < eps) & ~first,
      ExitPolicy.STATE_DELTA: lambda: (stats['delta'] < eps) & ~first,
      ExitPolicy.ROUTER: lambda: stats['p_change'] < eps,
      ExitPolicy.KL_PROBE: lambda: (stats['kl_hat'] < eps) & ~first,
      ExitPolicy.CONFIDENCE: lambda: stats['conf'] < eps,
  }
  return rules[policy]()


def threshold(eps, growth: float, i):
  """The exit threshold at loop i: eps * growth^(i - 2) from loop 2 on (exit.eps_growth)."""
  if growth == 1.0:
    return eps
  return eps * jnp.float32(growth) ** jnp.maximum(jnp.asarray(i) - 2, 0).astype(jnp.float32)


def run_below(delta_BxL, eps, i, run_BxL, active_BxL):
  """Consecutive loops (from loop 2) with delta < eps, updated where the token is active."""
  run = jnp.where((delta_BxL < eps) & (i >= 2), run_BxL + 1, 0)
  return jnp.where(active_BxL, run, run_BxL).astype(jnp.int32)


def _carry0(s0, *, patient: bool, needs_head: bool, trace: bool, readout, w_VxD,
            kernel: bool) -> CheckCarry:
  """make_check_fn's initial CheckCarry for the states s0 [B, L, D]."""
  b, l = s0.shape[:2]
  zero = lambda: jnp.zeros((b, l), jnp.int32)
  empty = CheckCarry(jnp.zeros((), s0.dtype), jnp.int32(0), jnp.int32(0), zero(), zero())
  if patient:
    return empty._replace(prev=zero())
  if not needs_head:
    return empty
  if trace:  # the loop-1 stats compare with the initial state's readout
    return _counted(empty, _flat_logits(readout(s0), w_VxD), jnp.ones((b, l), bool), 1, 1)
  prev = jnp.zeros_like(s0) if kernel else jnp.zeros((b, l, w_VxD.shape[0]), jnp.float32)
  return empty._replace(prev=prev)


def make_check_fn(policy: str, *, eps: float, readout: Optional[Callable] = None,
                  w_VxD: Optional[jax.Array] = None, router: Optional[Probe] = None,
                  targets_BxL: Optional[jax.Array] = None, use_kernel: bool = False,
                  trace: bool = False, min_loops: int = 1, check_every: int = 1,
                  gate: float = 0.0, max_loops: Optional[int] = None, patience: int = 1,
                  eps_growth: float = 1.0, trace_states: bool = False):
  """Builds (check_fn, carry0_fn) for `recurrence.early_exit`.

  KL criteria run a readout only at the loops whose p_i a check reads (check loops
  and the loops just before them), keep p_{i-1}'s logits in the carry (one head
  product per readout; the fused kernel keeps the hidden state and recomputes
  p_{i-1}: two), and compute reverse KL from the same two logit arrays. The carry
  counts what ran (`CheckCarry`).

  Args:
    policy: an ExitPolicy value.
    eps: threshold (KL or the probe's KL estimate in nats, relative state change, or
      router probability).
    readout: s_BxLxD -> h_BxLxD (coda + final norm); needed by KL policies / trace.
    w_VxD: LM head; needed by KL policies / trace.
    router: the state probe: a Router (policy router) or a KLProbe (policy kl_probe).
    targets_BxL: if given with trace, stats include the per-loop NLL of the targets.
    use_kernel: fused Pallas KL on GPU (not with trace).
    trace: compute KL, reverse KL, state change, argmax (and NLL) at every loop.
    min_loops, check_every: the engine's check schedule (checks at loops >= 2 only).
    max_loops: the engine's loop cap (no read for a check beyond it; None: unbounded).
    gate: gated_kl exits only where the relative state change is below it.
    patience: state_delta exits once the change has been below eps at this many
      consecutive loops from loop 2 on (the run is carried per token).
    eps_growth: the threshold at loop i is eps * eps_growth^(i - 2) (`threshold`).
    trace_states: with trace, also record s_i itself (stats 'state', [B, L, D] fp32).
  Returns:
    check_fn and carry0_fn(s0) -> initial CheckCarry.
  """
  policy = ExitPolicy(policy)
  wants = {ExitPolicy.ROUTER: Router, ExitPolicy.KL_PROBE: KLProbe}.get(policy)
  if wants is not None and not isinstance(router, wants):
    raise ValueError(f'error: exit.policy={policy.value} needs a policies.{wants.__name__}, '
                     f'got {type(router).__name__}')
  needs_head = trace or policy in HEAD_POLICIES
  patient = policy == ExitPolicy.STATE_DELTA and patience > 1
  if patient and trace:  # the carry holds the run, not the readout a trace compares with
    raise ValueError('error: per-loop traces need exit.patience=1')
  kernel = policy != ExitPolicy.CONFIDENCE and kl_halting.kernel_active(use_kernel)
  hc = _HeadCheck(policy, readout, w_VxD, targets_BxL, trace, needs_head and not trace and kernel,
                  *check_schedule(policy, min_loops, check_every, max_loops))

  carry0 = functools.partial(_carry0, patient=patient, needs_head=needs_head, trace=trace,
                             readout=readout, w_VxD=w_VxD, kernel=hc.kernel)
  eps0 = eps

  def check_fn(s_new, s_old, carry, i, active=None):
    eps = threshold(eps0, eps_growth, i)
    active = jnp.ones(s_new.shape[:2], bool) if active is None else active
    stats = {'delta': relative_change(s_new, s_old)}
    if needs_head:
      st, carry = _head_stats(hc, s_new, carry, i, active)
      stats.update(kl=st['kl'], argmax=st['argmax'])
      if trace or policy == ExitPolicy.REVERSE_KL:
        stats['rkl'] = st['rkl']
      if trace or policy == ExitPolicy.CONFIDENCE:
        stats['conf'] = st['conf']
      if trace and targets_BxL is not None:
        stats['nll'] = st['lse'] - st['logit_t']
      if trace and trace_states:
        stats['state'] = s_new.astype(jnp.float32)
    stats.update(_probe_stats(router, s_new, s_old, i))
    if patient:
      run = run_below(stats['delta'], eps, i, carry.prev, active)
      return run >= patience, carry._replace(prev=run), stats if trace else {}
    return _decide(policy, stats, i, eps, gate), carry, stats if trace else {}

  return check_fn, carry0


def scheduled(check_fn: Callable, schedule_fn: Callable) -> Callable:
  """check_fn that also exits at `i >= schedule_fn()` (synthetic exits for benchmarks, or
  given per-row depths [B, 1]: `decoding.decode_step`'s depth_B).

  The check's own decision stays part of the exit, so XLA cannot compile its work away
  (a discarded decision lets it drop the readout, head and KL); benchmarks give it a
  threshold no statistic reaches (eps < 0), so the exits are the schedule's.
  """
  def fn(s_new, s_old, carry, i, active=None):
    want, carry, stats = check_fn(s_new, s_old, carry, i, active)
    return want | (i >= schedule_fn()), carry, stats
  return fn
