"""Choosing the exit threshold eps with a guarantee: Learn-then-Test (LTT) as in CALM.

The risk of a threshold is the mean, over exchangeable units (validation sequences),
of a per-unit risk in [0, bound]:
  * loss: the mean over the unit's scored tokens of min(max(nll_eps - nll_full, 0), bound)
    (the loss increase against full depth, clipped to [0, bound]);
  * argmax: the share of the unit's scored tokens whose argmax differs from full depth.
For a grid of thresholds sorted from the most conservative (smallest eps, fewest exits)
upward, fixed-sequence testing rejects H0_j: R(eps_j) > delta in order while the
p-value is <= alpha and stops at the first failure; the chosen eps is the last one
rejected. Then P(R(chosen) > delta) <= alpha over the draw of the calibration units
(Angelopoulos et al., "Learn then Test", 2021; Schuster et al., CALM, 2022).
"""

import enum
import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from elastic_depth import analysis, inference, losses
from elastic_depth.config import ExitConfig, ExitPolicy


class Risk(str, enum.Enum):
  """What a premature exit costs a token."""
  LOSS = 'loss'      # loss increase against full depth, clipped to [0, bound]
  ARGMAX = 'argmax'  # the argmax differs from full depth's


class PValue(str, enum.Enum):
  """Valid p-values for H0: R > delta from n i.i.d. risks in [0, 1]."""
  HOEFFDING = 'hoeffding'
  HOEFFDING_BENTKUS = 'hoeffding_bentkus'


def _h1(a: float, b: float) -> float:
  """Bernoulli KL divergence KL(a || b), the Hoeffding exponent."""
  a = min(max(a, 1e-12), 1 - 1e-12)
  return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


def p_hoeffding(mean: float, n: int, delta: float) -> float:
  """exp(-n h1(min(mean, delta), delta)): Hoeffding's bound in its tight (KL) form."""
  if mean >= delta:
    return 1.0
  return float(min(1.0, math.exp(-n * _h1(mean, delta))))


def p_hoeffding_bentkus(mean: float, n: int, delta: float) -> float:
  """min(Hoeffding, e * P(Binom(n, delta) <= ceil(n * mean))) (Bates et al., 2021)."""
  bentkus = math.e * float(stats.binom.cdf(math.ceil(n * mean - 1e-9), n, delta))
  return float(min(1.0, p_hoeffding(mean, n, delta), bentkus))


P_VALUES = {PValue.HOEFFDING: p_hoeffding, PValue.HOEFFDING_BENTKUS: p_hoeffding_bentkus}


def fixed_sequence(risks_GxN: np.ndarray, delta: float, alpha: float,
                   pvalue: str = PValue.HOEFFDING_BENTKUS.value,
                   bound: float = 1.0) -> tuple[Optional[int], list[float]]:
  """Learn-then-Test with fixed-sequence testing.

  Args:
    risks_GxN: per-unit risks in [0, bound], one row per threshold, rows ordered from
      the most conservative threshold to the most aggressive.
    delta: the risk level not to exceed.
    alpha: the allowed probability of exceeding it.
    pvalue: a PValue.
    bound: the largest possible per-unit risk (risks are divided by it).
  Returns:
    (index of the chosen threshold, or None if even the first is not certified;
     the p-values computed, in order, up to and including the first failure).
  """
  fn = P_VALUES[PValue(pvalue)]
  if not (0 < alpha < 1 and 0 < bound < np.inf and 0 < delta < bound):
    raise ValueError(f'want 0 < alpha={alpha} < 1 and 0 < delta={delta} < bound={bound}')
  r = np.asarray(risks_GxN, np.float64) / bound
  if r.ndim != 2 or r.shape[1] == 0 or not np.all((r >= 0) & (r <= 1)):
    raise ValueError(f'risks must be [G, N] with N >= 1 units, each in [0, bound={bound}] '
                     f'(got shape {r.shape}; NaN or out-of-range values are refused)')
  n = r.shape[1]
  chosen, ps = None, []
  for j in range(r.shape[0]):
    ps.append(fn(float(r[j].mean()), n, delta / bound))
    if ps[-1] > alpha:
      break
    chosen = j
  return chosen, ps


def unit_risks(nll_GxNxL: np.ndarray, argmax_GxNxL: np.ndarray, nll_ref_NxL: np.ndarray,
               argmax_ref_NxL: np.ndarray, mask_NxL: np.ndarray, risk: str,
               bound: float) -> np.ndarray:
  """Per-unit (sequence) risks [G, N'] for each threshold; rows without tokens dropped."""
  m = np.asarray(mask_NxL, np.float64)
  keep = m.sum(-1) > 0
  if Risk(risk) == Risk.LOSS:
    per_tok = np.clip(np.asarray(nll_GxNxL, np.float64) - nll_ref_NxL, 0.0, bound)
  else:
    per_tok = (np.asarray(argmax_GxNxL) != argmax_ref_NxL).astype(np.float64)
  return ((per_tok * m).sum(-1) / np.maximum(m.sum(-1), 1.0))[:, keep]


@functools.partial(nnx.jit, static_argnames=('policy', 'r_max'))
def _score(model, inputs_BxL, targets_BxL, rng, eps, exit_mask_BxL, *, policy: ExitPolicy,
           r_max: int):
  """(nll, argmax, depth) [B, L] under an exit policy; eps is traced."""
  cfg = ExitConfig(policy=policy, eps=eps, depth=r_max, max_loops=r_max, check_every=1)
  res = inference.score(model, inputs_BxL, cfg, rng, exit_mask_BxL=exit_mask_BxL)
  return (losses.nll(res.logits, targets_BxL),
          losses.argmax_rows(res.logits), res.depth)


def score_grid(model, batches: Sequence[dict], keys: Sequence[jax.Array],
               eps_grid: Sequence[float], r_max: int, policy: str = ExitPolicy.KL.value,
               mask_only: bool = False, progress: bool = False):
  """Per-token nll, argmax, depth [G, N, L] at every eps, and the same at full depth r_max.

  Args:
    model: the frozen LM.
    batches: dicts of 'inputs', 'targets' (int [B, L]) and, with mask_only, 'mask'
      ([B, L], the scored tokens), every batch of the same L; N rows in all.
    keys: one key per batch: batch k uses keys[k] for its initial state (pass the keys
      frontier.sweep uses).
    eps_grid: the G thresholds.
    r_max: the loop cap of the policy runs and the full depth of the reference.
    policy: the exit policy (an ExitPolicy value).
    mask_only: only the batch's scored (mask) tokens may exit.
    progress: a bar over the thresholds (full depth first).
  Returns:
    dict: 'nll' fp32, 'argmax' int32 and 'depth' int32, each [G, N, L] (row g at
    eps_grid[g]); 'ref_nll' fp32 and 'ref_argmax' int32 [N, L] at uniform depth r_max.
  """
  out = []
  bar = analysis.bar(range(1 + len(eps_grid)), 'calibration grid', progress)
  with jax.default_matmul_precision('highest'):
    for pol, grid in ((ExitPolicy.UNIFORM, [0.0]), (ExitPolicy(policy), list(eps_grid))):
      run = functools.partial(_score, policy=pol, r_max=r_max)
      per = []
      for eps in grid:
        rows = [jax.device_get(run(
            model, jnp.asarray(b['inputs'], jnp.int32), jnp.asarray(b['targets'], jnp.int32),
            k, jnp.float32(eps), jnp.asarray(b['mask']) > 0 if mask_only else None))
                for b, k in zip(batches, keys)]
        per.append([np.concatenate([r[i] for r in rows]) for i in range(3)])
        bar.update(1)  # after the point is scored: 100% means done
      out.append([np.stack([p[i] for p in per]) for i in range(3)])
  bar.close()
  (ref_nll, ref_am, _), (nll, am, depth) = out
  return {'nll': nll, 'argmax': am, 'depth': depth, 'ref_nll': ref_nll[0],
          'ref_argmax': ref_am[0]}


def _summary(scored: dict, mask_NxL: np.ndarray, j: Optional[int], risk: str,
             bound: float) -> dict:
  """Risk, loss and mean loops at grid index j (None: full depth) on one split."""
  m = np.asarray(mask_NxL, np.float64)
  tok = lambda x: float((np.asarray(x, np.float64) * m).sum() / max(m.sum(), 1.0))
  if j is None:
    return {'risk': 0.0, 'loss': tok(scored['ref_nll']), 'mean_loops': None,
            'loss_full': tok(scored['ref_nll'])}
  units = unit_risks(scored['nll'][j:j + 1], scored['argmax'][j:j + 1], scored['ref_nll'],
                     scored['ref_argmax'], m, risk, bound)[0]
  return {'risk': float(units.mean()), 'units': int(units.size),
          'loss': tok(scored['nll'][j]), 'loss_full': tok(scored['ref_nll']),
          'mean_loops': tok(scored['depth'][j])}


def calibrate(cal: dict, cal_mask: np.ndarray, test: dict, test_mask: np.ndarray,
              eps_grid: Sequence[float], *, delta: float, alpha: float,
              risk: str = Risk.LOSS.value, pvalue: str = PValue.HOEFFDING_BENTKUS.value,
              bound: float = 1.0) -> dict:
  """Picks eps on the calibration split and reports it on the held-out split.

  Args:
    cal, test: score_grid outputs of the two (disjoint) splits, on the same grid.
    cal_mask, test_mask: [N, L] scored tokens of each split.
    eps_grid: the thresholds, increasing (most conservative first).
    delta, alpha: the guarantee P(risk > delta) <= alpha.
    risk: a Risk; pvalue: a PValue; bound: clip of the per-token loss increase.
  Returns:
    JSON-friendly dict: chosen eps (None: keep full depth), p-values, the calibration
    units (sequences) and their mean risk at every eps, and for each split the risk, loss
    and mean loops at the chosen eps.
  """
  grid = [float(e) for e in eps_grid]
  if grid != sorted(grid):
    raise ValueError(f'eps grid {grid} must be increasing (most conservative first)')
  if len(grid) != np.shape(cal['nll'])[0]:
    raise ValueError(f'eps grid of {len(grid)} thresholds, but the scores hold '
                     f"{np.shape(cal['nll'])[0]}: score_grid must run on the same grid")
  b = bound if Risk(risk) == Risk.LOSS else 1.0
  units = unit_risks(cal['nll'], cal['argmax'], cal['ref_nll'], cal['ref_argmax'], cal_mask,
                     risk, b)
  j, ps = fixed_sequence(units, delta, alpha, pvalue, b)
  return {'eps': None if j is None else grid[j], 'index': j, 'eps_grid': grid,
          'delta': float(delta), 'alpha': float(alpha), 'risk': Risk(risk).value,
          'pvalue': PValue(pvalue).value, 'bound': float(b), 'p_values': ps,
          'units': int(units.shape[1]),
          'calibration_risk_by_eps': [float(x) for x in units.mean(-1)],
          'calibration': _summary(cal, cal_mask, j, risk, b),
          'heldout': _summary(test, test_mask, j, risk, b)}
