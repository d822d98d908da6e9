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

import math
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from scipy import stats

from elastic_depth import analysis, calibrate, frontier


def _by_k(values_NxL: np.ndarray, diff_NxL: np.ndarray, sel_NxL: np.ndarray,
          ks: Sequence[int]) -> list[float]:
  return [float(np.asarray(values_NxL, np.float64)[sel_NxL & (diff_NxL == k)].mean())
          for k in ks]


# A1 variants: every token under the KL rule (exited tokens frozen), or the decision
# taken on answer tokens only (the others run R loops and are not counted)
# name -> (policy, exit decided on answer tokens only)
VARIANTS = {'kl': ('kl', False), 'kl_answers': ('kl', True),
            'confidence_answers': ('confidence', True)}


def _a1_point(h: dict) -> int:
  """Index on a KL curve of its headline point (or of the best gap if none)."""
  if h['best'] is not None:
    return h['best']['index']
  return int(np.argmin(h['frontier']['gap_same_loops']))


def _variant(model, batches, rng, r_max, sweep, name, diff, sel, ks):
  """Exit depth and loss by k at the variant's headline point, Spearman and frontier."""
  h, curve = sweep['headline'][name], sweep['curves'][name]
  j = _a1_point(h)
  keys = [analysis.batch_key(rng, k) for k in range(len(batches))]
  policy, mask_only = VARIANTS[name]
  scored = calibrate.score_grid(model, batches, keys, [curve['threshold'][j]], r_max,
                                policy=policy, mask_only=mask_only)
  exit_depth = scored['depth'][0]
  return {'loss_a1': _by_k(scored['nll'][0], diff, sel, ks),
          'exit_depth_a1': _by_k(exit_depth, diff, sel, ks),
          'a1_eps': curve['threshold'][j], 'a1_mean_loops': curve['mean_loops'][j],
          'a1_loss': curve['loss'][j],
          'spearman_exit_k': spearman_exit_k(exit_depth[sel], diff[sel]),
          'best_gain_same_loops': float(-h['best_gap_same_loops']),
          'loops_share_within_delta': (None if h['best'] is None else
                                       h['best']['mean_loops'] / sweep['ref_depth']),
          'curve': curve, 'frontier': h['frontier']}


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
    eps_grid: A1 thresholds (default: analysis.default_grid(), 13 points 1e-6..1).
    delta: tolerance of "matches training-mean quality", nats.
    progress: tqdm bars.
  """
  if not all('difficulty' in b for b in batches):
    raise ValueError('the batches carry no difficulty labels (synthetic corpus only)')
  grid = list(eps_grid or analysis.default_grid())
  trace = analysis.trace_batches(model, batches, r_max, rng, progress)
  sweep = frontier.sweep(model, batches, rng, r_max, ref_depth, eps_grid=grid, delta=delta,
                         trace=trace, progress=progress, timing_repeats=0, extra_curves={
                             'kl_answers': frontier.Curve('kl', grid, mask_only=True),
                             'confidence_answers': frontier.Curve(
                                 'confidence', analysis.CONFIDENCE_GRID,
                                 mask_only=True)})
  diff, sel = trace.difficulty, (trace.mask > 0) & (trace.difficulty > 0)
  ks = sorted(int(k) for k in np.unique(diff[sel]))
  nll = trace.stats['nll']
  ref = min(int(round(ref_depth)), r_max)
  return {
      'r_max': r_max, 'ref_depth': float(ref_depth), 'delta': float(delta), 'k': ks,
      'tokens_by_k': [int((sel & (diff == k)).sum()) for k in ks],
      'loss_by_k_r': [_by_k(nll[r], diff, sel, ks) for r in range(r_max)],  # [R][K]
      'loss_depth1': _by_k(nll[0], diff, sel, ks),
      'loss_train_mean': _by_k(nll[ref - 1], diff, sel, ks),
      'ref_loss': sweep['headline']['kl']['ref_loss'], 'a0': sweep['a0'],
      'a1': {name: _variant(model, batches, rng, r_max, sweep, name, diff, sel, ks)
             for name in VARIANTS}}


def _summary_line(name: str, v: dict, res: dict) -> str:
  share = v['loops_share_within_delta']
  return (f"{name}: eps={v['a1_eps']:.3g}, {v['a1_mean_loops']:.2f} mean loops (training "
          f"mean {res['ref_depth']:g}), loss {v['a1_loss']:.4f} vs {res['ref_loss']:.4f}; "
          + (f"{100 * share:.0f}% of the training-mean loops within {res['delta']} nats; "
             if share is not None else f"never within {res['delta']} nats; ")
          + f"best gain over A0 at equal loops {v['best_gain_same_loops']:+.3f} nats; "
          f"Spearman(exit depth, k) = {_rho(v['spearman_exit_k'])}")


def spearman_exit_k(depth_N, k_N) -> float:
  """Spearman(exit depth, k); NaN where undefined (one class of k, or a constant depth)."""
  if len(np.unique(k_N)) < 2 or len(np.unique(depth_N)) < 2:
    return float('nan')
  return float(stats.spearmanr(depth_N, k_N)[0])


def _rho(rho) -> str:
  """A rank correlation, or 'undefined' (one class of k, or a constant exit depth)."""
  return 'undefined' if rho is None or not math.isfinite(rho) else f'{rho:.2f}'


def short_table(res: dict) -> str:
  """The main job's closing table (markdown): A1 with the decision on answer tokens
  (kl_answers), with every token under the rule (kl), and the confidence exit on answers."""
  a, b, c = (res['a1'][n] for n in ('kl_answers', 'kl', 'confidence_answers'))
  rows = ['| k | tokens | loss @ depth 1 | loss @ training mean | loss @ A1 exit | '
          'mean A1 exit depth | (every token exits: loss, depth) | '
          '(confidence exit: loss, depth) |', '|---|---:|---:|---:|---:|---:|---:|---:|']
  for i, k in enumerate(res['k']):
    rows.append(f"| {k} | {res['tokens_by_k'][i]} | {res['loss_depth1'][i]:.3f} | "
                f"{res['loss_train_mean'][i]:.3f} | {a['loss_a1'][i]:.3f} | "
                f"{a['exit_depth_a1'][i]:.2f} | {b['loss_a1'][i]:.3f}, "
                f"{b['exit_depth_a1'][i]:.2f} | {c['loss_a1'][i]:.3f}, "
                f"{c['exit_depth_a1'][i]:.2f} |")
  return '\n'.join(rows + [''] + [_summary_line(n, res['a1'][n], res)
                                   for n in ('kl_answers', 'kl', 'confidence_answers')])


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
    x = np.arange(len(res['k']))
    for off, name in ((-0.2, 'kl_answers'), (0.2, 'kl')):
      v = res['a1'][name]
      ax.bar(x + off, v['exit_depth_a1'], width=0.4,
             label=f"{name} (Spearman {_rho(v['spearman_exit_k'])})")
    ax.set_xticks(x, [str(k) for k in res['k']])
    ax.set(xlabel='difficulty k', ylabel='mean A1 exit depth', title='exit depth by k')
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 3, 3)
    ax.plot(res['a0']['mean_loops'], res['a0']['loss'], 'k.-', label='A0 uniform')
    for name, v in res['a1'].items():
      ax.plot(v['curve']['mean_loops'], v['curve']['loss'], 'o-', ms=3, label=name)
      ax.plot([v['a1_mean_loops']], [v['a1_loss']], 'r*', ms=10)
    ax.set(xlabel='mean loops (answer tokens)', ylabel='loss (nats)', title='frontier')
    ax.legend(fontsize=7)
  return draw
