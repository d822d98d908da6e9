"""Depth sampling for training and per-token exit criteria (A0 uniform, A1 KL, A2 router).

A criterion is built as `check_fn(s_new, s_old, carry, i, active) -> (exit, carry, stats)`
for `recurrence.early_exit`. KL criteria read the output distribution
p_i = softmax(head(readout(s_i))) in fp32; the readout (coda + final norm) is
passed in as a closure so the same criterion serves parallel scoring and cached
decoding.
"""

import math
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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


def relative_change(s_new, s_old) -> jax.Array:
  """||s_i - s_{i-1}|| / ||s_i|| per token, fp32."""
  a, b = s_new.astype(jnp.float32), s_old.astype(jnp.float32)
  return jnp.linalg.norm(a - b, axis=-1) / (jnp.linalg.norm(a, axis=-1) + 1e-12)


def _kl_stats(h_new, h_old, w_VxD, use_kernel: bool):
  """(KL(p_new || p_old), argmax p_new, lse p_new) per token, and h_new, h_old as [N, D]."""
  b, l, d = h_new.shape
  hn, ho = h_new.reshape(b * l, d), h_old.reshape(b * l, d)
  kl, am, lse = kl_halting.kl_halting_auto(hn, ho, w_VxD, use_kernel=use_kernel)
  return kl.reshape(b, l), am.reshape(b, l), lse.reshape(b, l), hn, ho


def make_check_fn(policy: str, *, eps: float, readout: Optional[Callable] = None,
                  w_VxD: Optional[jax.Array] = None, router: Optional[Router] = None,
                  targets_BxL: Optional[jax.Array] = None, use_kernel: bool = False,
                  trace: bool = False):
  """Builds (check_fn, carry0_fn) for `recurrence.early_exit`.

  Args:
    policy: an ExitPolicy value.
    eps: threshold (KL in nats, relative state change, or router probability).
    readout: s_BxLxD -> h_BxLxD (coda + final norm); needed by KL policies / trace.
    w_VxD: LM head; needed by KL policies / trace.
    router: A2 probe; needed by the router policy.
    targets_BxL: if given with trace, stats include the per-loop NLL of the targets.
    use_kernel: fused Pallas KL on GPU.
    trace: compute KL, reverse KL, state change, argmax (and NLL) at every loop.
  Returns:
    check_fn and carry0_fn(s0) -> initial carry.
  """
  policy = ExitPolicy(policy)
  needs_head = trace or policy in (ExitPolicy.KL, ExitPolicy.REVERSE_KL)

  def carry0(s0):
    return readout(s0) if needs_head else jnp.zeros((), s0.dtype)

  def check_fn(s_new, s_old, h_old, i, active=None):
    del active  # every token is checked; the engine masks the decision
    stats = {'delta': relative_change(s_new, s_old)}
    if needs_head:
      h_new = readout(s_new)
      kl, am, lse, hn, ho = _kl_stats(h_new, h_old, w_VxD, use_kernel)
      stats.update(kl=kl, argmax=am)
      if trace or policy == ExitPolicy.REVERSE_KL:
        stats['rkl'] = kl_halting.kl_halting_auto(ho, hn, w_VxD, use_kernel=use_kernel
                                                  )[0].reshape(kl.shape)
      if trace and targets_BxL is not None:
        logit_t = jnp.einsum('BLD,BLD->BL', h_new.astype(jnp.float32),
                             jnp.take(w_VxD, targets_BxL, axis=0).astype(jnp.float32))
        stats['nll'] = lse - logit_t
    else:
      h_new = h_old
    if router is not None:
      stats['p_change'] = jax.nn.sigmoid(router_logit(router, s_new))
    first = i < 2  # no previous distribution at loop 1
    exit_map = {
        ExitPolicy.UNIFORM: lambda: jnp.zeros_like(stats['delta'], bool),
        ExitPolicy.KL: lambda: (stats['kl'] < eps) & ~first,
        ExitPolicy.REVERSE_KL: lambda: (stats['rkl'] < eps) & ~first,
        ExitPolicy.STATE_DELTA: lambda: (stats['delta'] < eps) & ~first,
        ExitPolicy.ROUTER: lambda: stats['p_change'] < eps,
    }
    out_stats = stats if trace else {}
    return exit_map[policy](), h_new, out_stats

  return check_fn, carry0


def scheduled(check_fn: Callable, schedule_fn: Callable) -> Callable:
  """check_fn whose decision is replaced by `i >= schedule_fn()` (synthetic exits for
  benchmarks: the check still runs, so its cost is real)."""
  def fn(s_new, s_old, carry, i, active=None):
    _, carry, stats = check_fn(s_new, s_old, carry, i, active)
    return i >= schedule_fn(), carry, stats
  return fn
