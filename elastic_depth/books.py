"""The books of an exit policy: FLOPs as executed, its headline against uniform depth,
what its check executes per core loop, and a cheap check's frontier against the exact one
at equal mean loops (issue 10)."""

import re
from typing import Mapping, Optional, Sequence

import numpy as np

from elastic_depth import config as config_lib
from elastic_depth import model as model_lib
from elastic_depth import policies

DEFAULT_DELTA = 0.01        # nats/token: the tolerance of 'matches quality'
FRONTIER_TOLERANCE = 0.002  # nats/token a cheap check may lose against the exact one
CHECK_BUDGET = 0.25         # core loops of check work per loop
SEQ_135M = 1024             # sequence length the 135M-block costs are taken at


def executed_flops(mcfg, core, coda, head, seq_len: int, core_keys=None, outer_keys=None):
  """Forward FLOPs per token position from executed counts (`inference.Counts`).

  prelude + core loops x loop + coda readouts x coda + head products x head, with
  model.flops_per_token's parts; counts may be batch passes (what the masked engine
  runs for every position) or per-token arrays (the work of active tokens only).
  core_keys: keys per query the core's attention executed (`Counts.core_keys`); outer_keys:
  those of the prelude and coda attention (`OUTER_KEYS`; only models with attention in
  every block have any). None: the causal seq_len / 2 of model FLOPs.
  """
  keys = None if core_keys is None else np.asarray(core_keys, np.float64)
  f = model_lib.flops_per_token(mcfg, 0, seq_len, core_keys=keys, outer_keys=outer_keys)
  core, coda, head = (np.asarray(x, np.float64) for x in (core, coda, head))
  coda_only = f['coda_head'] - f['head']
  return f['prelude'] + core * f['loop'] + coda * coda_only + head * f['head']


# Keys per query the prelude and coda attention execute, by semantics, from the sequence
# length and the core's executed keys (`Counts.core_keys`): parallel scoring runs the
# chunked causal attention; a cached decode step attends over every slot of its cache
# (masked) in every block, as the core does and decode_flops counts.
OUTER_KEYS = {config_lib.Semantics.PARALLEL: lambda seq_len, core_keys: model_lib.causal_keys(
                  seq_len),
              config_lib.Semantics.CACHED: lambda seq_len, core_keys: core_keys}

GAP_LEVEL = 0.9  # coverage of the gaps' bootstrap intervals


def _rows(curve: Mapping):
  """A curve's per-sequence sums: (loss [P, N], loops [P, N], tokens [N]), or None."""
  if not all(k in curve for k in ('row_loss', 'row_loops', 'row_tokens')):
    return None
  return (np.asarray(curve['row_loss'], np.float64), np.asarray(curve['row_loops'], np.float64),
          np.asarray(curve['row_tokens'], np.float64))


def _reweighted(rows, w_N) -> dict:
  """A curve's (mean loops, loss) points with sequence n counted w_N[n] times."""
  loss, loops, tokens = rows
  t = max(float(tokens @ w_N), 1.0)
  return {'mean_loops': loops @ w_N / t, 'loss': loss @ w_N / t}


def headline(a0: dict, curve: dict, ref_depth: float, delta: float = DEFAULT_DELTA) -> dict:
  """The exit policy against uniform depth.

  * ref: A0 at the training-mean depth (linearly interpolated if fractional);
  * best: the curve point with the smallest mean loops whose loss is within delta of
    ref (ties: lower loss), with its loop and FLOP savings relative to ref;
  * frontier: for every curve point, A0's loss interpolated at the same mean loops and
    at the same FLOPs/token (gap = curve loss - A0 loss; negative: the policy wins).
  """
  d0 = np.asarray(a0['mean_loops'], np.float64)
  l0 = np.asarray(a0['loss'], np.float64)
  f0 = np.asarray(a0['flops'], np.float64)
  ref_loss = float(np.interp(ref_depth, d0, l0))
  ref_flops = float(np.interp(ref_depth, d0, f0))
  ml = np.asarray(curve['mean_loops'], np.float64)
  loss = np.asarray(curve['loss'], np.float64)
  fl = np.asarray(curve['flops'], np.float64)
  a0_same_loops = np.interp(ml, d0, l0)
  a0_same_flops = np.interp(fl, f0, l0)
  frontier = {'a0_loss_same_loops': a0_same_loops.tolist(),
              'gap_same_loops': (loss - a0_same_loops).tolist(),
              'a0_loss_same_flops': a0_same_flops.tolist(),
              'gap_same_flops': (loss - a0_same_flops).tolist(),
              'flops_in_a0_range': ((fl >= f0.min()) & (fl <= f0.max())).tolist()}
  within_u = [float(d) for d, x in zip(d0, l0) if x <= ref_loss + delta]
  out = {'policy': curve.get('policy'), 'ref_depth': float(ref_depth), 'ref_loss': ref_loss,
         'ref_outside_a0': bool(not d0.min() <= ref_depth <= d0.max()),  # interp clamped
         'ref_flops': ref_flops, 'delta': float(delta), 'frontier': frontier,
         'uniform_depth_within_delta': min(within_u) if within_u else None,
         'points_beating_a0_same_loops': int(np.sum(loss < a0_same_loops)),
         'best_gap_same_loops': float(np.min(loss - a0_same_loops)) if len(loss) else None,
         'best': None}
  ok = [i for i in range(len(loss)) if loss[i] <= ref_loss + delta]
  if ok:
    i = min(ok, key=lambda j: (ml[j], loss[j]))
    out['best'] = {
        'index': i, 'threshold': curve['threshold'][i], 'mean_loops': float(ml[i]),
        'loss': float(loss[i]), 'flops': float(fl[i]),
        'loop_saving': float(1.0 - ml[i] / ref_depth),
        'flops_saving': float(1.0 - fl[i] / ref_flops),  # as the engine executed
        'flops_active_saving': (float(1.0 - curve['flops_active'][i] / ref_flops)
                                if 'flops_active' in curve else None),
        'a0_loss_same_loops': float(a0_same_loops[i]),
        'gap_same_loops': float(loss[i] - a0_same_loops[i]),
        'a0_loss_same_flops': float(a0_same_flops[i]),
        'gap_same_flops': float(loss[i] - a0_same_flops[i]),
        'gap_same_loops_interval': same_loops_gap_interval(a0, curve, i)}
  return out


def _draws(n: int, boots: int, seed: int) -> np.ndarray:
  """Bootstrap weights [boots, n]: how often each of n sequences is drawn."""
  return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n),
                                                 size=boots).astype(np.float64)


def _bootstrap(curves, stat, boots: int, seed: int, level: float) -> Optional[dict]:
  """The central `level` range of stat(curves reweighted by one draw) over paired draws
  of the scored sequences (stat may return None: that draw is skipped), or None unless
  every curve has per-sequence sums over the same sequences."""
  rows = [_rows(c) for c in curves]
  if (boots <= 0 or any(r is None for r in rows)
      or any(not np.array_equal(r[2], rows[0][2]) for r in rows)):
    return None
  n = len(rows[0][2])
  values = [stat([_reweighted(r, w) for r in rows]) for w in _draws(n, boots, seed)]
  values = [v for v in values if v is not None]
  if not values:
    return None
  q = (1.0 - level) / 2
  lo, med, hi = np.quantile(values, [q, 0.5, 1.0 - q])
  return {'interval': [float(lo), float(hi)], 'median': float(med), 'level': float(level),
          'boots': len(values), 'sequences': int(n)}


def same_loops_gap_interval(a0: Mapping, curve: Mapping, i: int, boots: int = 1000,
                            seed: int = 0, level: float = GAP_LEVEL) -> Optional[dict]:
  """A paired bootstrap interval of point i's loss minus A0's at the same mean loops
  (the headline's gap_same_loops) over the scored sequences; None without per-sequence
  sums over the same sequences."""
  def gap(cs):
    u, c = cs
    return c['loss'][i] - np.interp(c['mean_loops'][i], u['mean_loops'], u['loss'])
  return _bootstrap([a0, curve], gap, boots, seed, level)


def delta_flops(d_model: int) -> int:
  """FLOPs of the relative state change that every check computes at every loop."""
  return 5 * d_model  # difference, two squared norms, a division


def decode_flops(mcfg, prelude, core, coda, head, checks, cache_len: int):
  """Forward FLOPs per generated token from a decode engine's executed counts.

  Args:
    mcfg: the model config.
    prelude, core, coda, head, checks: prelude passes, core loops, coda readouts, head
      products and state-change checks per generated token as executed (row passes over
      the batch divided by its tokens), scalars or arrays.
    cache_len: slots of the cache; every decode pass attends over all of them (masked).
  Returns:
    FLOPs per generated token (float or array).
  """
  f = model_lib.flops_per_token(mcfg, 0, 2 * cache_len, core_keys=cache_len)
  prelude, core, coda, head, checks = (np.asarray(x, np.float64)
                                       for x in (prelude, core, coda, head, checks))
  return (prelude * f['prelude'] + core * f['loop'] + coda * (f['coda_head'] - f['head'])
          + head * f['head'] + checks * delta_flops(mcfg.d_model))


def check_cost(mcfg: config_lib.ModelConfig, loops, readouts, heads, seq_len: int,
               probe_size: Optional[Sequence[int]] = None):
  """Check work per core loop, in core loops, from per-token executed counts.

  The output readout (one coda pass and one head product per token) is what A0 pays
  too, so it is not the check's: cost = ((readouts - 1) x coda + (heads - 1) x head +
  loops x (delta + probe)) / (loops x loop), with `model.flops_per_token`'s parts for
  mcfg and a state probe's FLOPs at its width (`policies.probe_flops`).

  Args:
    mcfg: the model shape to cost the counts at (e.g. the 135M blocks).
    loops, readouts, heads: mean core loops, readouts and head products per token as
      the engine executed them (final readout included), scalars or arrays.
    seq_len: the sequence length of the attention FLOPs.
    probe_size: the state probe the check runs every loop (`policies.probe_size`).
  Returns:
    core loops of check work per core loop (float or array).
  """
  f = model_lib.flops_per_token(mcfg, 0, seq_len)
  coda = f['coda_head'] - f['head']
  loops, readouts, heads = (np.asarray(x, np.float64) for x in (loops, readouts, heads))
  work = ((readouts - 1) * coda + (heads - 1) * f['head']
          + loops * (delta_flops(mcfg.d_model) + policies.probe_flops(probe_size, mcfg.d_model)))
  return work / (loops * f['loop'])


def lower_envelope(mean_loops: Sequence[float], loss: Sequence[float]):
  """(m, l) of the Pareto points: the lowest loss reachable at up to m mean loops."""
  order = np.lexsort((np.asarray(loss, np.float64), np.asarray(mean_loops, np.float64)))
  m = np.asarray(mean_loops, np.float64)[order]
  l = np.asarray(loss, np.float64)[order]
  keep, best = [], np.inf
  for i in range(len(m)):
    if l[i] < best:
      keep.append(i)
      best = l[i]
  return m[keep], l[keep]


def _lowest(envs, grid):
  """Per grid point, the lowest loss of the envelopes there: an envelope holds its last
  loss beyond its last point (reachable at up to m loops) and is absent before its first."""
  vals = []
  for m, l in envs:
    v = np.interp(grid, m, l)
    v[grid < m[0]] = np.inf
    vals.append(v)
  return np.min(vals, axis=0)


def _crossings(envs, grid):
  """Mean loops between grid points where two envelopes (linear there) cross."""
  out = []
  for i in range(len(envs)):
    for j in range(i + 1, len(envs)):
      with np.errstate(invalid='ignore'):  # inf - inf where neither covers: no crossing
        d = _lowest([envs[i]], grid) - _lowest([envs[j]], grid)
      a, b = d[:-1], d[1:]
      ok = np.isfinite(a) & np.isfinite(b) & (a * b < 0)
      out.append(grid[:-1][ok] + (grid[1:] - grid[:-1])[ok] * a[ok] / (a[ok] - b[ok]))
  return np.concatenate(out) if out else np.zeros(0)


def frontier_gap(exact: Mapping, cheap, loss_cap: float = np.inf) -> Optional[dict]:
  """How much a cheap check's frontier loses against the exact one at equal mean loops.

  A frontier is the lower envelope of a curve's (mean loops, loss) points joined
  linearly; a family of curves (one check at several min_loops) has, at each mean loops,
  the lowest of its members' frontiers there. The frontiers are compared at every
  breakpoint, and every crossing of two members, inside the mean-loop range both cover.
  Positive gap: the cheap check is worse.

  Args:
    exact: a curve with 'mean_loops' and 'loss' lists.
    cheap: such a curve, or a list of them (a family).
    loss_cap: compare only where the exact frontier's loss is at most this (the
      operating range, e.g. within delta of uniform depth at the training mean).
  Returns:
    {'max_gap', 'at_mean_loops', 'range', 'points'}, or None without overlap.
  """
  me, le = lower_envelope(exact['mean_loops'], exact['loss'])
  envs = [lower_envelope(c['mean_loops'], c['loss'])
          for c in (cheap if isinstance(cheap, (list, tuple)) else [cheap])]
  lo = max(me[0], min(m[0] for m, _ in envs))
  hi = min(me[-1], max(m[-1] for m, _ in envs))
  if lo > hi:
    return None
  # where the exact frontier (decreasing) crosses the cap: the operating range's start
  cap_at = [np.interp(loss_cap, le[::-1], me[::-1])] if le[-1] <= loss_cap < le[0] else []
  grid = np.unique(np.concatenate([me, *[m for m, _ in envs], [lo, hi], cap_at]))
  grid = np.unique(np.concatenate([grid, _crossings(envs, grid)]))
  grid = grid[(grid >= lo) & (grid <= hi)]
  grid = grid[np.interp(grid, me, le) <= loss_cap * (1 + 1e-12) + 1e-15]
  if not len(grid):
    return None
  gap = _lowest(envs, grid) - np.interp(grid, me, le)
  # where a member starts, the family's frontier drops: its value just before counts too
  starts = [(k, m[0]) for k, (m, _) in enumerate(envs) if len(envs) > 1 and m[0] > grid[0]]
  for k, x in starts:
    if x <= grid[-1] and np.interp(x, me, le) <= loss_cap:
      before = _lowest(envs[:k] + envs[k + 1:], np.array([x]))[0] - np.interp(x, me, le)
      gap[grid == x] = np.maximum(gap[grid == x], before)
  i = int(np.argmax(gap))
  return {'max_gap': float(gap[i]), 'at_mean_loops': float(grid[i]),
          'range': [float(grid[0]), float(grid[-1])], 'points': int(len(grid))}


def frontier_gap_interval(exact: Mapping, cheap, loss_cap: float = np.inf, boots: int = 1000,
                          seed: int = 0, level: float = GAP_LEVEL) -> Optional[dict]:
  """A paired bootstrap interval of `frontier_gap`'s max_gap over the scored sequences.

  Every curve of one sweep scores the same sequences, so a replicate draws sequences
  with replacement once and reweights every curve's per-sequence sums ('row_loss',
  'row_loops', 'row_tokens': `frontier.row_sums`) by the same draw; the interval is the
  central `level` quantile range of the replicates' max_gap. It covers the noise of the
  scored sequences, not that of the probe's fit; a max over the grid leans high under noise.

  Returns:
    {'interval': [lo, hi], 'level', 'boots', 'sequences', 'median'}, or None where a
    curve lacks per-sequence sums, the curves scored different sequences, or no
    replicate overlaps.
  """
  family = isinstance(cheap, (list, tuple))

  def gap(cs):
    g = frontier_gap(cs[0], cs[1:] if family else cs[1], loss_cap)
    return None if g is None else g['max_gap']
  return _bootstrap([exact, *(cheap if family else [cheap])], gap, boots, seed, level)


def curve_costs(curve: Mapping, mcfg: config_lib.ModelConfig, seq_len: int) -> list:
  """Check cost per loop (core loops) at every point of a sweep curve, at shape mcfg."""
  return np.atleast_1d(check_cost(mcfg, curve['mean_loops_counted'], curve['mean_readouts'],
                                  curve['mean_heads'], seq_len,
                                  curve.get('probe_size'))).tolist()


_TUNED = {'/min*': r'/min\d+', '/g*': r'/g\d[\d.]*(?:e[+-]?\d+)?'}  # min_loops, eps_growth


def _families(name: str) -> list:
  """The families a curve belongs to, as (family, its member at the default setting):
  'kl/min3/every2@cached' -> [('kl/min*/every2@cached', 'kl/every2@cached')]; likewise
  '/g<g>' (eps_growth) -> '/g*'."""
  out = []
  for star, pat in _TUNED.items():
    m = re.search(pat, name)
    if m is not None:
      out.append((name[:m.start()] + star + name[m.end():], name[:m.start()] + name[m.end():]))
  return out


def _exact_curve(res: Mapping, c: Mapping, exact: str) -> Optional[Mapping]:
  """The exact check's curve in the semantics of curve c (its recorded schedule,
  `frontier.policy_curve`), named as the sweep names it: '<exact>@<semantics>', or
  '<exact>' in parallel semantics."""
  sem = c['schedule']['semantics']
  return res['curves'].get(exact if sem == 'parallel' else f'{exact}@{sem}')


def _judged(ref: Optional[Mapping], c: Mapping, cap: float, cost_135m: list) -> dict:
  """A curve's (or family's) frontier against the exact curve, overall and operating."""
  gap = None if ref is None or ref is c else frontier_gap(ref, c)
  return {'frontier_vs_exact': gap,
          'frontier_vs_exact_operating': None if gap is None else frontier_gap(ref, c, cap),
          'frontier_vs_exact_interval': None if gap is None else frontier_gap_interval(ref, c),
          'frontier_vs_exact_operating_interval':
              None if gap is None else frontier_gap_interval(ref, c, cap),
          'meets': None if gap is None else bool(
              gap['max_gap'] <= FRONTIER_TOLERANCE and max(cost_135m) <= CHECK_BUDGET)}


def check_books(res: Mapping, mcfg: config_lib.ModelConfig, seq_len: int,
                exact: str = 'kl') -> dict:
  """Per curve of a sweep: check cost per loop at its shape and at the 135M blocks, and
  its frontier against the exact curve of the same semantics (None where absent), over
  the whole overlap and over the operating range (exact loss within the headline's
  delta of uniform depth at the training mean).

  Curves that differ only in min_loops ('<c>/min<m>', and '<c>' itself: m = 1) are also
  judged together as '<c>/min*': one check, tuned by both its threshold and min_loops,
  whose frontier at each mean loops is the best of its members' there; likewise curves
  that differ only in eps_growth ('<c>/g<g>', and '<c>': g = 1) as '<c>/g*'.
  """
  big = config_lib.ModelConfig(**config_lib.BLOCKS_135M)
  out, families = {}, {}
  for name, c in res['curves'].items():
    if 'mean_heads' not in c:
      continue
    ref = _exact_curve(res, c, exact)
    h = res['headline'].get(name, {})
    cap = h.get('ref_loss', np.inf) + h.get('delta', 0.0)
    cost_135m = curve_costs(c, big, SEQ_135M)
    out[name] = {'cost': curve_costs(c, mcfg, seq_len), 'cost_135m': cost_135m,
                 'exact': exact, **_judged(ref, c, cap, cost_135m)}
    for fam, base in _families(name):
      families.setdefault(fam, [base]).append(name)
  for fam, names in families.items():
    members = [n for n in names if n in out]
    pts = [res['curves'][n] for n in members]
    ref = _exact_curve(res, pts[0], exact)
    h = res['headline'].get(members[0], {})
    cost = [x for n in members for x in out[n]['cost']]
    cost_135m = [x for n in members for x in out[n]['cost_135m']]
    out[fam] = {'cost': cost, 'cost_135m': cost_135m, 'exact': exact, 'members': members,
                **_judged(None if any(ref is c for c in pts) else ref,
                          pts, h.get('ref_loss', np.inf) + h.get('delta', 0.0), cost_135m)}
  return out
