"""Report files for the measurement experiments: JSON, a small PNG and a markdown table.

Every experiment writes <workdir>/reports/<name>.{json,png,md}. The JSON holds
`results` (all numbers; deterministic) next to `command`, `flags`, `checkpoint` and
`date` (which naturally differ between runs).
"""

import datetime
import json
import math
import os
import sys
from typing import Any, Callable, Optional

import numpy as np


def clean(x: Any) -> Any:
  """JSON-safe copy: numpy scalars/arrays to Python, non-finite floats to None."""
  if isinstance(x, dict):
    return {str(k): clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [clean(v) for v in x]
  if isinstance(x, np.ndarray):
    return clean(x.tolist())
  if isinstance(x, (np.bool_, bool)):
    return bool(x)
  if isinstance(x, (np.integer, int)):
    return int(x)
  if isinstance(x, (np.floating, float)):
    return float(x) if math.isfinite(float(x)) else None
  return x


def write(workdir: str, name: str, results: dict, *, flags: dict, checkpoint: dict,
          markdown: str, plot: Optional[Callable[[Any], None]] = None) -> dict:
  """Writes reports/<name>.json, .md and (with plot(fig)) .png; returns the paths."""
  out_dir = os.path.join(workdir, 'reports')
  os.makedirs(out_dir, exist_ok=True)
  paths = {ext: os.path.join(out_dir, f'{name}.{ext}') for ext in ('json', 'md', 'png')}
  doc = {'experiment': name, 'date': datetime.datetime.now().isoformat(timespec='seconds'),
         'command': ' '.join(sys.argv), 'flags': clean(flags),
         'checkpoint': clean(checkpoint), 'results': clean(results)}
  with open(paths['json'], 'w', encoding='utf-8') as f:
    json.dump(doc, f, indent=1, allow_nan=False)
  with open(paths['md'], 'w', encoding='utf-8') as f:
    f.write(markdown)
  if plot is None:
    paths.pop('png')
  else:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
    fig = plt.figure(figsize=(10, 4), dpi=100)
    plot(fig)
    fig.tight_layout()
    fig.savefig(paths['png'], dpi=100)
    plt.close(fig)
  return paths


def read_report(path: str, keys: tuple = ()) -> dict:
  """The whole record of a report JSON that `write` made, its `results` holding `keys`;
  ValueError naming the file when it is cut off or another kind of report."""
  try:
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
    results = record['results']
    missing = [k for k in keys if k not in results]
  except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
    raise ValueError(f'{path} is not a readable report ({type(e).__name__}: {e})') from None
  if missing:
    raise ValueError(f'{path} is a report without {missing}')
  return record


def read_results(path: str, keys: tuple = ()) -> dict:
  """The `results` of a report JSON that `write` made (see `read_report`)."""
  return read_report(path, keys)['results']


def table(header: list[str], rows: list[list[Any]]) -> str:
  """A markdown table; floats with 4 significant decimals."""
  fmt = lambda v: ('-' if v is None else f'{v:.4g}' if isinstance(v, float) else str(v))
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(fmt(v) for v in r) + ' |' for r in rows]
  return '\n'.join(lines) + '\n'


def _title(name: str, checkpoint: dict) -> str:
  return (f"# {name}\n\nworkdir `{checkpoint.get('workdir')}`, step {checkpoint.get('step')}; "
          f"{checkpoint.get('data')}\n\n")


# ----------------------------------------------------------------------------
# Per-experiment markdown and plots.


def elasticity_markdown(res: dict, checkpoint: dict) -> str:
  rows = [[d, l, '*' if d == res['ref_depth'] else ''] for d, l in
          zip(res['depths'], res['loss'])]
  return (_title('Elasticity: loss vs uniform depth', checkpoint)
          + f"{res['tokens']} tokens; training mean depth {res['train_mean']}, "
            f"r_max at training {res['train_r_max']}\n\n"
          + table(['depth', 'loss (nats/token)', 'train mean'], rows))


def elasticity_plot(res: dict):
  def plot(fig):
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(res['depths'], res['loss'], 'o-', label='uniform depth (A0)')
    ax.axvline(res['train_mean'], color='gray', ls='--', label='training mean')
    ax.axvline(res['train_r_max'], color='gray', ls=':', label='training r_max')
    ax.set_xlabel('loops')
    ax.set_ylabel('validation NLL (nats/token)')
    ax.legend()
  return plot


def convergence_markdown(res: dict, checkpoint: dict) -> str:
  pl = res['per_loop']
  md = _title('Convergence', checkpoint)
  md += (f"{res['tokens']} tokens, R={res['r_max']}, reference (training mean) depth "
         f"{res['ref_depth']}, eps_conv={res['eps_conv']}\n\n")
  a, k = res['argmax_depth'], res['kl_depth']
  md += table(['convergence depth', 'mean', 'median', 'p90', f"share > {res['ref_depth']}"],
              [['argmax stable', a['mean'], a['median'], a['p90'],
                a['share_changing_after_ref']],
               ['KL < eps_conv', k['mean'], k['median'], k['p90'],
                k['share_changing_after_ref']]])
  if k.get('share_not_converged'):
    md += (f"\nKL < eps_conv: {100 * k['share_not_converged']:.1f}% of the tokens never fell "
           f"below eps_conv within R={res['r_max']} loops; the row counts them at depth "
           f"{res['r_max'] + 1}.\n")
  md += '\n' + table(['loop', 'loss', 'mean KL', 'mean rev KL', 'mean rel. change',
                      'share argmax changed'],
                     [[i, pl['loss'][i - 1], pl['mean_kl'][i - 1], pl['mean_rkl'][i - 1],
                       pl['mean_delta'][i - 1], pl['mean_argmax_changed'][i - 1]]
                      for i in pl['loop']])
  for key in sorted(x for x in res if x.startswith('by_')):
    md += f'\n## {key}\n\n' + table(
        ['group', 'tokens', 'mean depth', 'median', 'p90', f"share > {res['ref_depth']}",
         'KL depth median', f"loss @{res['ref_depth']}", 'loss @R'],
        [[g, r['count'], r['mean'], r['median'], r['p90'], r['share_changing_after_ref'],
          r['kl_depth_median'], r['loss_ref'], r['loss_final']] for g, r in res[key].items()])
  return md


def convergence_plot(res: dict):
  def plot(fig):
    pl = res['per_loop']
    ax = fig.add_subplot(1, 2, 1)
    loops = pl['loop'][1:]
    for k in ('mean_kl', 'mean_rkl', 'mean_delta'):
      ax.semilogy(loops, [max(v, 1e-12) for v in pl[k][1:]], 'o-', ms=3, label=k[5:])
    ax.axvline(res['ref_depth'], color='gray', ls='--')
    ax.set_xlabel('loop')
    ax.set_title('successive change')
    ax.legend()
    ax = fig.add_subplot(1, 2, 2)
    h = res['argmax_depth']['histogram']
    ax.bar(range(1, len(h) + 1), h, label='argmax stable')
    ax.axvline(res['ref_depth'], color='gray', ls='--', label='training mean')
    ax.set_xlabel('convergence depth')
    ax.set_ylabel('tokens')
    ax.legend()
  return plot


def sweep_markdown(res: dict, checkpoint: dict) -> str:
  md = _title('Exit-policy sweep', checkpoint)
  md += (f"{res['tokens']} tokens, R={res['r_max']}, reference: uniform depth "
         f"{res['ref_depth']} (training mean), delta={res['delta']} nats\n\n## Headline\n\n")
  rows = []
  for name, h in res['headline'].items():
    b = h['best'] or {}
    rows.append([name, h['ref_loss'], b.get('threshold'), b.get('mean_loops'), b.get('loss'),
                 b.get('loop_saving'), b.get('flops_saving'), b.get('flops_active_saving'),
                 (b.get('wall_clock') or {}).get('saving'), b.get('a0_loss_same_loops'),
                 b.get('gap_same_loops'), _ci(b.get('gap_same_loops_interval')),
                 h['uniform_depth_within_delta']])
  md += table(['policy', 'A0 loss @ref', 'eps', 'mean loops', 'loss', 'loop saving',
               'FLOP saving (engine as run)', 'FLOP saving (active tokens, executed)',
               'wall-clock saving (same run)', 'A0 loss @same loops', 'gap',
               'gap: bootstrap interval', 'min uniform depth within delta'],
              rows)
  for key, title in (('a0', 'A0 (uniform depth)'),
                     ('a0_cached', 'A0 (uniform depth, cached semantics: the @cached curves\' '
                                   'reference)')):
    if key in res:
      a0 = res[key]
      md += f'\n## {title}\n\n' + table(
          ['depth', 'loss', 'GFLOPs/token'],
          [[int(d), l, f / 1e9] for d, l, f in zip(a0['threshold'], a0['loss'], a0['flops'])])
  for name, c in res['curves'].items():
    fr = res['headline'][name]['frontier']
    md += f'\n## {name}\n\n' + table(
        ['threshold', 'mean loops', 'loss', 'core passes', 'GFLOPs/token (masked)',
         'GFLOPs/token (active)', 'readouts/token', 'share at R',
         'A0 loss @same loops', 'gap', 'A0 loss @same FLOPs'],
        [[c['threshold'][i], c['mean_loops'][i], c['loss'][i], c['mean_core_passes'][i],
          c['flops'][i] / 1e9, c['flops_active'][i] / 1e9, c['mean_readouts'][i],
          c['share_max_depth'][i], fr['a0_loss_same_loops'][i], fr['gap_same_loops'][i],
          _in_range(fr, i)] for i in range(len(c['threshold']))])
  return md + _books_markdown(res.get('check_books') or {})


def _in_range(fr: dict, i: int):
  """A0's loss at point i's FLOPs, or None ('-') where they lie outside A0's FLOP range
  (the JSON keeps np.interp's clamped value beside 'flops_in_a0_range')."""
  inside = fr.get('flops_in_a0_range')  # absent from JSONs written before the flag
  return fr['a0_loss_same_flops'][i] if inside is None or inside[i] else None


def _ci(ci) -> str:
  """A bootstrap interval as 'level%: [lo, hi]' ('-' where none)."""
  return '-' if not ci else (f"{100 * ci['level']:.0f}%: [{ci['interval'][0]:+.4f}, "
                            f"{ci['interval'][1]:+.4f}]")


def _books_markdown(bk: dict) -> str:
  """The exit-check books: cost per loop and the frontier against the exact check."""
  if not bk:
    return ''
  rows = []
  for name, b in bk.items():
    g = b['frontier_vs_exact'] or {}
    o = b.get('frontier_vs_exact_operating') or {}
    rows.append([name, min(b['cost']), max(b['cost']), min(b['cost_135m']), max(b['cost_135m']),
                 b['exact'], g.get('max_gap'), _ci(b.get('frontier_vs_exact_interval')),
                 g.get('at_mean_loops'),
                 '-' if not g else f"{g['range'][0]:.2f}-{g['range'][1]:.2f}", o.get('max_gap'),
                 _ci(b.get('frontier_vs_exact_operating_interval')),
                 '-' if not o else f"{o['range'][0]:.2f}-{o['range'][1]:.2f}", b['meets']])
  return ('\n## Exit-check books\n\nCheck work per core loop, in core loops (executed readouts '
          'and head products beyond the output readout, and the state change every loop), '
          'over the curve\'s points; the frontier of each curve against the exact check\'s '
          'at equal mean loops (positive: worse), with a paired bootstrap interval over the '
          'scored sequences (`books.frontier_gap_interval`).\n\n' + table(
              ['curve', 'cost min', 'cost max', 'cost @135M min', 'cost @135M max', 'exact',
               'max frontier gap', 'bootstrap interval', 'at mean loops', 'range',
               'max gap, operating range', 'bootstrap interval', 'operating range',
               'meets (gap <= 0.002, cost <= 0.25 @135M)'],
              rows))


def sweep_plot(res: dict):
  def plot(fig):
    a0 = res['a0']
    for j, (key, label, scale) in enumerate((('mean_loops', 'mean loops per token', 1.0),
                                             ('flops', 'GFLOPs per token', 1e-9))):
      ax = fig.add_subplot(1, 2, j + 1)
      ax.plot(np.asarray(a0[key]) * scale, a0['loss'], 'k.-', label='A0 uniform')
      if 'a0_cached' in res:
        a0c = res['a0_cached']
        ax.plot(np.asarray(a0c[key]) * scale, a0c['loss'], 'k.--', label='A0 uniform @cached')
      for name, c in res['curves'].items():
        style = ('r*', 12) if name == 'calibrated' else ('o-', 3)  # calibrate_eps's eps
        ax.plot(np.asarray(c[key]) * scale, c['loss'], style[0], ms=style[1], label=name)
      ref = float(np.interp(res['ref_depth'], a0['mean_loops'], a0['loss']))
      ax.axhline(ref + res['delta'], color='gray', ls=':', label='A0 @ref + delta')
      if 'a0_cached' in res:  # the line the '@cached' curves are judged against
        a0c = res['a0_cached']
        ref = float(np.interp(res['ref_depth'], a0c['mean_loops'], a0c['loss']))
        ax.axhline(ref + res['delta'], color='gray', ls='-.', label='A0 @ref + delta @cached')
      ax.set_xlabel(label)
      ax.set_ylabel('NLL (nats/token)')
      ax.legend(fontsize=8)
  return plot
