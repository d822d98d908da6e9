"""Measurements on a frozen looped LM: traces, elasticity and convergence (sweeps: `frontier`).

Everything runs jitted in fp32 ('highest' matmul precision) with one fixed key: a
token's initial recurrent state is a function of (rng, its position) in every run
(trace and sweep alike), and all reductions happen on the host in float64 over the
masked tokens in a fixed order, so a checkpoint and its flags give bit-identical numbers.

One traced uniform run at depth R gives per-loop arrays [R, N, L] (N = all rows of
all batches): in parallel semantics with no exits the readout of loop i equals the
output at uniform depth i, so `trace.stats['nll'][i - 1]` is the loss at depth i.
"""

import dataclasses
import functools
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from elastic_depth import decoding, inference, losses
from elastic_depth import model as model_lib
from elastic_depth.config import ExitConfig, ExitPolicy, Semantics


def default_grid(lo: float = 1e-6, hi: float = 1.0, n: int = 13) -> list[float]:
  """Log-spaced thresholds lo..hi (default: 1e-6..1, two points per decade)."""
  return [float(x) for x in np.logspace(np.log10(lo), np.log10(hi), n)]


CONFIDENCE_GRID = default_grid(1e-4, 0.5, 11)  # thresholds on 1 - max_v p_i(v)


def batch_key(rng: jax.Array, k: int) -> jax.Array:
  """Key of batch k's initial state: rng itself (states depend on position only)."""
  del k  # model.initial_state: a sequence starts from the same states in any batch
  return rng


def bar(items, desc: str, progress: bool):
  """A tqdm bar over items, hidden unless progress."""
  return tqdm.tqdm(items, desc=desc, disable=not progress, dynamic_ncols=True, leave=False)


def masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
  """sum(x * mask) / sum(mask) over the last two axes' worth of tokens, float64; NaN when
  the mask holds no token (not 0, which would read as a loss of 0 or no loops)."""
  m = np.asarray(mask, np.float64)
  total = np.sum(m)
  return float(np.sum(np.asarray(x, np.float64) * m) / total) if total > 0 else float('nan')


def in_row_chunks(fn, arrays: Sequence[np.ndarray], chunk: int = 64) -> tuple:
  """fn over the rows of arrays in chunks of one size (one compile), outputs float64.

  Args:
    fn: a row-wise function of len(arrays) arrays [c, ...] returning a tuple of arrays
      [c, ...] (row i of each output depends on row i of the inputs only).
    arrays: inputs with the same number of rows N.
    chunk: rows per call; the last chunk is padded with repeats of the first rows.

  Returns:
    fn's outputs over all N rows (float64), each [N, ...].
  """
  rows = int(np.shape(arrays[0])[0])
  c = min(chunk, rows)
  idx = np.arange(-(-rows // c) * c) % rows
  parts = [fn(*(jnp.asarray(np.asarray(a)[idx[i:i + c]]) for a in arrays))
           for i in range(0, len(idx), c)]
  return tuple(np.concatenate([np.asarray(p[k], np.float64) for p in parts])[:rows]
               for k in range(len(parts[0])))


# ----------------------------------------------------------------------------
# Traces.


@dataclasses.dataclass
class Trace:
  """Per-loop statistics of a uniform run at depth R over all validation tokens."""
  stats: dict[str, np.ndarray]  # kl, rkl, delta, nll (float32), argmax (int32): [R, N, L]
  inputs: np.ndarray            # int32 [N, L]
  targets: np.ndarray           # int32 [N, L]
  mask: np.ndarray              # float32 [N, L]
  difficulty: Optional[np.ndarray] = None  # int32 [N, L] when the batches have it

  @property
  def r_max(self) -> int:
    return int(self.stats['nll'].shape[0])


def check_fp32(model) -> None:
  if model.cfg.dtype != 'float32':
    raise ValueError(f'measurements run in float32 but the model computes in '
                     f'{model.cfg.dtype}; rebuild it with model.dtype=float32 (parameters '
                     'are float32 either way)')


def trace_outputs(model, inputs_BxL, targets_BxL, key, *, r_max: int):
  """Per-loop stats [R, B, L] of a uniform run at depth r_max (what trace_batches jits)."""
  cfg = ExitConfig(policy=ExitPolicy.UNIFORM, depth=r_max, max_loops=r_max)
  return inference.score(model, inputs_BxL, cfg, key, targets_BxL=targets_BxL,
                         trace=True).traces


def policy_outputs(model, inputs_BxL, targets_BxL, key, eps, router, mask_BxL=None, *,
                   policy: ExitPolicy, min_loops: int, r_max: int, gate: float = 0.0,
                   mask_only: bool = False, check_every: int = 1, patience: int = 1,
                   eps_growth: float = 1.0):
  """(NLL_BxL, inference.Counts) under an exit policy (what policy_curve jits; eps is traced).

  With mask_only, only the tokens of mask_BxL (e.g. answer tokens) may exit early.
  """
  cfg = ExitConfig(policy=policy, eps=eps, depth=r_max, min_loops=min_loops,
                   max_loops=r_max, check_every=check_every, gate=gate, patience=patience,
                   eps_growth=eps_growth)
  res = inference.score(model, inputs_BxL, cfg, key, router=router,
                        exit_mask_BxL=(mask_BxL > 0) if mask_only else None)
  return losses.nll(res.logits, targets_BxL), res.counts


def cached_outputs(model, inputs_BxL, targets_BxL, key, eps, router, mask_BxL=None, *,
                   policy: ExitPolicy, min_loops: int, r_max: int, gate: float = 0.0,
                   mask_only: bool = False, check_every: int = 1, patience: int = 1,
                   eps_growth: float = 1.0):
  """policy_outputs in cached semantics: token 0 prefilled, then decode_step per token.

  Counts cover the decoded positions 1..L-1 (batch passes: [L-1], per token [B, L-1]);
  `depth` covers every position.
  """
  del mask_BxL
  if mask_only:
    raise ValueError('cached semantics has no exit mask: every decoded token may exit '
                     '(use semantics=parallel for curves whose exits are limited to answers)')
  cfg = ExitConfig(policy=policy, eps=eps, depth=r_max, min_loops=min_loops,
                   max_loops=r_max, check_every=check_every, gate=gate, patience=patience,
                   eps_growth=eps_growth)
  toks = jnp.concatenate([inputs_BxL, targets_BxL[:, -1:]], 1)  # the last target's logits
  logits, depth, depth0, n = decoding.score_cached(model, toks, 1, cfg, key, router,
                                                    with_counts=True)
  n = jax.tree.map(lambda x: x[..., :-1], n)  # drop the step that decodes the last target
  return losses.nll(logits, targets_BxL), n._replace(depth=jnp.concatenate([depth0, n.depth], 1))


_trace_run = nnx.jit(trace_outputs, static_argnames=('r_max',))
_statics = ('policy', 'min_loops', 'r_max', 'gate', 'mask_only', 'check_every', 'patience',
            'eps_growth')
RUNS = {Semantics.PARALLEL: nnx.jit(policy_outputs, static_argnames=_statics),
         Semantics.CACHED: nnx.jit(cached_outputs, static_argnames=_statics)}


def trace_batches(model: model_lib.LoopedLM, batches: Sequence[Mapping[str, Any]],
                  r_max: int, rng: jax.Array, progress: bool = False) -> Trace:
  """Traced uniform-depth runs (policy 'uniform', depth r_max) over the batches.

  Args:
    model: the frozen LM, computing in float32 (else ValueError).
    batches: dicts of 'inputs', 'targets' (int [B, L]), 'mask' ([B, L], the scored
      tokens) and optionally 'difficulty' ([B, L], kept only if every batch has it); N
      rows in all.
    r_max: the depth R of the runs.
    rng: the fixed key of the initial states (`batch_key`: the same for every batch).
    progress: a tqdm bar over the batches.
  Returns:
    Trace: per-loop stats [R, N, L] (kl, rkl, conf, delta, nll float32; argmax int32), the
    batches' inputs, targets and difficulty [N, L] concatenated, and mask float32 [N, L].
  """
  check_fp32(model)
  run = functools.partial(_trace_run, r_max=r_max)
  outs = []
  with jax.default_matmul_precision('highest'):
    for k, b in enumerate(bar(batches, f'trace R={r_max}', progress)):
      outs.append(jax.device_get(run(model, jnp.asarray(b['inputs'], jnp.int32),
                                     jnp.asarray(b['targets'], jnp.int32),
                                     batch_key(rng, k))))
  cat = lambda name: np.concatenate([np.asarray(b[name]) for b in batches], axis=0)
  has_diff = all('difficulty' in b for b in batches)
  return Trace(stats={k: np.concatenate([o[k] for o in outs], axis=1) for k in outs[0]},
               inputs=cat('inputs'), targets=cat('targets'),
               mask=cat('mask').astype(np.float32),
               difficulty=cat('difficulty') if has_diff else None)


# ----------------------------------------------------------------------------
# Elasticity and convergence.


def elasticity(trace: Trace) -> dict:
  """Mean NLL (nats/token, mask-weighted) at uniform depth 1..R."""
  r = trace.r_max
  return {'depths': list(range(1, r + 1)),
          'loss': [masked_mean(trace.stats['nll'][i], trace.mask) for i in range(r)]}


def argmax_convergence(argmax_RxNxL: np.ndarray) -> np.ndarray:
  """First loop after which the argmax never changes again up to R (1 if never changes)."""
  r = argmax_RxNxL.shape[0]
  changed = argmax_RxNxL[1:] != argmax_RxNxL[:-1]          # loop i+1 differs from loop i
  loop = np.arange(2, r + 1).reshape(-1, *([1] * (argmax_RxNxL.ndim - 1)))
  return np.max(np.where(changed, loop, 1), axis=0, initial=1).astype(np.int32)


def kl_convergence(kl_RxNxL: np.ndarray, eps: float) -> np.ndarray:
  """First loop i >= 2 with KL(p_j || p_{j-1}) < eps for every j in i..R; R + 1 if none.

  Loop 1 is never counted (its KL compares with the readout of the initial state),
  matching the exit policies, which cannot fire before loop 2.
  """
  r = kl_RxNxL.shape[0]
  high = ~(kl_RxNxL[1:] < eps)  # a NaN KL is not converged (no policy exits on it)
  loop = np.arange(3, r + 2).reshape(-1, *([1] * (kl_RxNxL.ndim - 1)))
  return np.max(np.where(high, loop, 2), axis=0, initial=2).astype(np.int32)


def depth_distribution(depth: np.ndarray, sel: np.ndarray, bins: int, ref_depth: int) -> dict:
  """count, mean, median, p90, histogram over 1..bins and share with depth > ref_depth."""
  v = np.asarray(depth)[np.asarray(sel, bool)].astype(np.float64)
  if v.size == 0:
    return {'count': 0}
  hist = np.bincount(v.astype(np.int64), minlength=bins + 1)[1:bins + 1]
  return {'count': int(v.size), 'mean': float(v.mean()), 'median': float(np.median(v)),
          'p90': float(np.quantile(v, 0.9)), 'histogram': [int(x) for x in hist],
          'share_changing_after_ref': float(np.mean(v > ref_depth))}


def difficulty_groups(difficulty: np.ndarray) -> dict[str, np.ndarray]:
  """Synthetic generator groups: random (-1), format (0) and hops=k answers."""
  out = {'random': difficulty == -1, 'format': difficulty == 0}
  for k in sorted(set(np.unique(difficulty).tolist()) - {-1, 0}):
    out[f'hops={k}'] = difficulty == k
  return out


def class_groups(class_ids: np.ndarray, names: Sequence[str]) -> dict[str, np.ndarray]:
  """One boolean mask per token class (e.g. data.token_classes of the targets)."""
  return {n: class_ids == i for i, n in enumerate(names)}


def convergence(trace: Trace, ref_depth: float, eps_conv: float = 1e-3,
                groups: Optional[Mapping[str, Mapping[str, np.ndarray]]] = None) -> dict:
  """Per-loop convergence curves and per-token convergence depths.

  Args:
    trace: from trace_batches.
    ref_depth: the training-mean depth; `share_changing_after_ref` counts tokens whose
      argmax still changes after loop round(ref_depth).
    eps_conv: KL threshold of the KL-based convergence depth.
    groups: {breakdown name: {group name: bool [N, L]}} (token classes, difficulty).
  Returns:
    JSON-friendly dict.
  """
  r, st, mask = trace.r_max, trace.stats, trace.mask
  valid = mask > 0
  ref = int(round(ref_depth))
  am_conv = argmax_convergence(st['argmax'])
  kl_conv = kl_convergence(st['kl'], eps_conv)
  changed = np.concatenate([np.zeros_like(st['argmax'][:1], bool),
                            st['argmax'][1:] != st['argmax'][:-1]])
  per_loop = {'loop': list(range(1, r + 1))}
  for name, arr in (('kl', st['kl']), ('rkl', st['rkl']), ('delta', st['delta']),
                    ('argmax_changed', changed)):
    per_loop[f'mean_{name}'] = [masked_mean(arr[i], mask) for i in range(r)]
  per_loop['loss'] = elasticity(trace)['loss']
  out = {'r_max': r, 'ref_depth': ref, 'eps_conv': eps_conv, 'tokens': int(valid.sum()),
         'per_loop': per_loop,
         'argmax_depth': depth_distribution(am_conv, valid, r, ref),
         'kl_depth': depth_distribution(kl_conv, valid, r + 1, ref)}
  out['kl_depth']['share_not_converged'] = float(np.mean(kl_conv[valid] > r))
  nll = st['nll']
  for breakdown, gs in (groups or {}).items():
    rows = {}
    for g, sel in gs.items():
      sel = np.asarray(sel, bool) & valid
      if not sel.any():
        continue
      row = depth_distribution(am_conv, sel, r, ref)
      row.pop('histogram')
      row['kl_depth_median'] = float(np.median(kl_conv[sel]))
      row['loss_ref'] = float(nll[min(ref, r) - 1][sel].astype(np.float64).mean())
      row['loss_final'] = float(nll[-1][sel].astype(np.float64).mean())
      rows[g] = row
    out[f'by_{breakdown}'] = rows
  return out
