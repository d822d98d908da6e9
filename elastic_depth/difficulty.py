"""Depth against known difficulty on the synthetic corpus: does exit depth track k?

On answer tokens of difficulty k (the synthetic generator's label), from one traced
uniform run at depth R and the A1 (KL exit) sweep over the same batches and keys:
  * loss by (k, r) for r = 1..R;
  * the A1 point used: the fewest mean loops within `delta` of uniform depth at the
    training mean (the sweep headline), else the best gap to A0 at equal loops;
  * per difficulty: loss at depth 1, at the training mean and at the A1 exit, and the
    mean A1 exit depth; Spearman's rank correlation of exit depth with k;
  * the frontier: A1's best gain over A0 at equal mean loops.
"""

from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from scipy import stats

from elastic_depth import analysis, calibrate


def _by_k(values_NxL: np.ndarray, diff_NxL: np.ndarray, sel_NxL: np.ndarray,
          ks: Sequence[int]) -> list[float]:
  return [float(np.asarray(values_NxL, np.float64)[sel_NxL & (diff_NxL == k)].mean())
          for k in ks]


def _a1_point(res: dict) -> int:
  """Index on the KL curve of the headline point (or of the best gap if none)."""
  h = res['headline']['kl']
  if h['best'] is not None:
    return h['best']['index']
  return int(np.argmin(h['frontier']['gap_same_loops']))


def report(model, batches: Sequence[Mapping[str, Any]], rng: jax.Array, r_max: int,
           ref_depth: float, *, eps_grid: Optional[Sequence[float]] = None,
           delta: float = 0.01, progress: bool = False) -> dict:
  """Loss by (k, r), A1 exit depth by k and the A0/A1 frontier (JSON-friendly).

  Args:
    model: an fp32 LoopedLM.
    batches: validation batches with 'difficulty' (synthetic corpus).
    rng: key of the initial states (batch k uses analysis.batch_key(rng, k)).
    r_max: deepest uniform depth traced, and the exit cap of A1.
    ref_depth: the training-mean depth.
    eps_grid: A1 thresholds (default: analysis.default_grid(1e-6, 1, 25)).
    delta: tolerance of "matches training-mean quality", nats.
    progress: tqdm bars.
  """
  if not all('difficulty' in b for b in batches):
    raise ValueError('the batches carry no difficulty labels (synthetic corpus only)')
  grid = list(eps_grid or analysis.default_grid(1e-6, 1.0, 25))
  trace = analysis.trace_batches(model, batches, r_max, rng, progress)
  sweep = analysis.sweep(model, batches, rng, r_max, ref_depth, eps_grid=grid, delta=delta,
                         trace=trace, progress=progress)
  j = _a1_point(sweep)
  keys = [analysis.batch_key(rng, k) for k in range(len(batches))]
  scored = calibrate.score_grid(model, batches, keys, [grid[j]], r_max)
  diff, sel = trace.difficulty, (trace.mask > 0) & (trace.difficulty > 0)
  ks = sorted(int(k) for k in np.unique(diff[sel]))
  nll = trace.stats['nll']
  ref = min(int(round(ref_depth)), r_max)
  exit_depth = scored['depth'][0]
  rho = stats.spearmanr(exit_depth[sel], diff[sel])[0] if len(ks) > 1 else float('nan')
  h = sweep['headline']['kl']
  return {
      'r_max': r_max, 'ref_depth': float(ref_depth), 'delta': float(delta), 'k': ks,
      'tokens_by_k': [int((sel & (diff == k)).sum()) for k in ks],
      'loss_by_k_r': [_by_k(nll[r], diff, sel, ks) for r in range(r_max)],  # [R][K]
      'loss_depth1': _by_k(nll[0], diff, sel, ks),
      'loss_train_mean': _by_k(nll[ref - 1], diff, sel, ks),
      'loss_a1': _by_k(scored['nll'][0], diff, sel, ks),
      'exit_depth_a1': _by_k(exit_depth, diff, sel, ks),
      'a1_eps': grid[j], 'a1_mean_loops': sweep['curves']['kl']['mean_loops'][j],
      'a1_loss': sweep['curves']['kl']['loss'][j], 'ref_loss': h['ref_loss'],
      'spearman_exit_k': float(rho),
      'best_gain_same_loops': float(-h['best_gap_same_loops']),
      'loops_share_within_delta': (None if h['best'] is None else
                                   h['best']['mean_loops'] / float(ref_depth)),
      'a0': sweep['a0'], 'a1': sweep['curves']['kl'], 'frontier': h['frontier']}


def short_table(res: dict) -> str:
  """The main job's closing table (markdown)."""
  rows = ['| k | tokens | loss @ depth 1 | loss @ training mean | loss @ A1 exit | '
          'mean A1 exit depth |', '|---|---:|---:|---:|---:|---:|']
  for i, k in enumerate(res['k']):
    rows.append(f"| {k} | {res['tokens_by_k'][i]} | {res['loss_depth1'][i]:.3f} | "
                f"{res['loss_train_mean'][i]:.3f} | {res['loss_a1'][i]:.3f} | "
                f"{res['exit_depth_a1'][i]:.2f} |")
  share = res['loops_share_within_delta']
  rows.append(
      f"\nA1 eps={res['a1_eps']:.3g}: {res['a1_mean_loops']:.2f} mean loops (training mean "
      f"{res['ref_depth']:g}), loss {res['a1_loss']:.4f} vs {res['ref_loss']:.4f}; "
      + (f"{100 * share:.0f}% of the training-mean loops within {res['delta']} nats; "
         if share is not None else f"never within {res['delta']} nats of the training mean; ")
      + f"best gain over A0 at equal loops {res['best_gain_same_loops']:+.3f} nats; "
      f"Spearman(exit depth, k) = {res['spearman_exit_k']:.2f}")
  return '\n'.join(rows)


def markdown(res: dict) -> str:
  """Short table and the full loss-by-(k, r) table."""
  head = '| r | ' + ' | '.join(f'k={k}' for k in res['k']) + ' |'
  rows = [head, '|---|' + '---:|' * len(res['k'])]
  rows += [f'| {r + 1} | ' + ' | '.join(f'{x:.3f}' for x in res['loss_by_k_r'][r]) + ' |'
           for r in range(res['r_max'])]
  return (short_table(res) + '\n\n## Loss on answers of difficulty k at uniform depth r '
          '(nats)\n\n' + '\n'.join(rows) + '\n')


def plot(res: dict):
  """Loss vs depth per k, exit depth by k, and the A0/A1 frontier."""
  def draw(fig):
    ax = fig.add_subplot(1, 3, 1)
    r = np.arange(1, res['r_max'] + 1)
    for i, k in enumerate(res['k']):
      ax.plot(r, [row[i] for row in res['loss_by_k_r']], 'o-', ms=3, label=f'k={k}')
    ax.set(xlabel='uniform depth r', ylabel='loss (nats)', title='loss by difficulty')
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 3, 2)
    ax.bar([str(k) for k in res['k']], res['exit_depth_a1'])
    ax.set(xlabel='difficulty k', ylabel='mean A1 exit depth',
           title=f"exit depth (Spearman {res['spearman_exit_k']:.2f})")
    ax = fig.add_subplot(1, 3, 3)
    ax.plot(res['a0']['mean_loops'], res['a0']['loss'], 'k.-', label='A0 uniform')
    ax.plot(res['a1']['mean_loops'], res['a1']['loss'], 'o-', ms=3, label='A1 KL exit')
    ax.plot([res['a1_mean_loops']], [res['a1_loss']], 'r*', ms=12, label='A1 point used')
    ax.set(xlabel='mean loops (answer tokens)', ylabel='loss (nats)', title='frontier')
    ax.legend(fontsize=7)
  return draw
