"""Quality for `bench_generate --batch_sizes`: the loss a policy reaches in the timed calls'
semantics, A1's matched eps, and the frontier's baseline (the cheapest uniform decode depth
of matched quality)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from elastic_depth import analysis, config, decoding
from elastic_depth.config import ExitPolicy


def masked_loss(nll, mask) -> float:
  return float(np.sum(np.asarray(nll) * mask) / max(np.sum(mask), 1.0))


def cached_loss(mdl, batches, rng, policy, eps, r_max, prefill_depth=None) -> float:
  """Mean answer-masked loss over batches, cached semantics (token 0 prefilled at the
  policy's depth: prefill_depth is not used)."""
  del prefill_depth
  run = jax.jit(lambda i, t, e: analysis.cached_outputs(
      mdl, i, t, rng, e, None, policy=policy, min_loops=1, r_max=r_max)[0])
  tot, n = 0.0, 0.0
  for b in batches:
    m = np.asarray(b['mask'], np.float64)
    tot += masked_loss(run(b['inputs'], b['targets'], jnp.float32(eps)), m) * m.sum()
    n += m.sum()
  return tot / max(n, 1.0)


def forced_loss(mdl, pool: dict, rng, policy, eps, r_max, prefill_depth=None,
                 chunk: int = 64) -> float:
  """Mean answer-masked loss of forced decoding over every validation window of the pool:
  the prompt prefilled in parallel semantics (at uniform prefill_depth if given, else by
  the policy), then the text after it decoded in cached semantics (the timed calls' work;
  lockstep decoding, which equals serving's per row)."""
  n = pool['forced'].shape[1]
  cfg = config.ExitConfig(policy=policy, eps=eps, depth=r_max, max_loops=r_max)
  pcfg = None if prefill_depth is None else config.ExitConfig(policy='uniform',
                                                             depth=prefill_depth)
  run = jax.jit(lambda x, f: decoding.generate(mdl, x, n, cfg, rng, forced_BxN=f,
                                               prefill_cfg=pcfg)[2])
  nll, = analysis.in_row_chunks(lambda x, f: (run(x, f),), [pool['prompt'], pool['forced']],
                                chunk)
  return masked_loss(nll, np.asarray(pool['weight'], np.float64))


def quality_fn(mdl, batches, pool: dict, rng):
  """(loss(policy, eps, r_max), what it measures): forced decoding of every validation
  window where the timed calls decode the text (`forced_loss`), else cached-semantics
  teacher forcing of the validation batches (token 0 prefilled)."""
  if 'forced' in pool:
    return (functools.partial(forced_loss, mdl, pool, rng),
            f'forced decoding of {pool["prompt"].shape[0]} validation windows (prompt '
            'prefilled in parallel semantics, text decoded in cached semantics)')
  return (functools.partial(cached_loss, mdl, batches, rng),
          'cached-semantics teacher forcing of the validation batches')


def cheapest_uniform(loss, a0_depth: int, a0_loss: float, tol: float) -> dict:
  """The smallest uniform decode depth whose loss is within tol of A0's, the
  prompt prefilled as A0's: the frontier's baseline (what uniform depth alone buys at
  matched quality; a deep prompt is its best case)."""
  tried = {}
  for d in range(1, a0_depth):
    tried[d] = loss(ExitPolicy.UNIFORM, 0.0, d, prefill_depth=a0_depth)
    print(f'quality: uniform depth {d} loss {tried[d]:.4f} (A0 {a0_loss:.4f})', flush=True)
    if tried[d] <= a0_loss + tol:
      return dict(match_depth=d, match_loss=tried[d], uniform_tried=tried)
  return dict(match_depth=a0_depth, match_loss=a0_loss, uniform_tried=tried)


def matched(loss, a0_depth: int, r_max: int, policy: str, grid, tol: float) -> dict:
  """A0's loss, the most aggressive eps of grid whose loss is within tol of it, and the
  cheapest uniform depth within the same tolerance (loss: `quality_fn`'s)."""
  a0 = loss(ExitPolicy.UNIFORM, 0.0, a0_depth)
  tried = {}
  for eps in sorted((float(e) for e in grid), reverse=True):
    tried[eps] = loss(ExitPolicy(policy), eps, r_max)
    print(f'quality: eps {eps:.0e} loss {tried[eps]:.4f} (A0 {a0:.4f})', flush=True)
    if tried[eps] <= a0 + tol:
      break
  eps = eps if tried[eps] <= a0 + tol else min(tried)
  return dict(a0_loss=a0, a1_loss=tried[eps], eps=eps, matched=tried[eps] <= a0 + tol,
              tried=tried, tol=tol, **cheapest_uniform(loss, a0_depth, a0, tol))
