"""Exit-policy frontiers on a frozen looped LM: A0 and policy curves, the sweep, wall clock.

Every curve is scored with the same fixed key as `analysis.trace_batches` (a token's
initial state depends on its position only), in fp32 with 'highest' matmul precision,
and reduced on the host in float64 over the masked tokens; FLOPs are as executed
(`books.executed_flops` of the engine's counters).
"""

import functools
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from elastic_depth import books, policies, timing
from elastic_depth import model as model_lib
from elastic_depth.analysis import (CONFIDENCE_GRID, RUNS, Trace, bar, batch_key, check_fp32,
                                    default_grid, elasticity, masked_mean, trace_batches)
from elastic_depth.config import ExitPolicy, Semantics


class Curve(NamedTuple):
  """An exit-policy curve: one scored run per threshold."""
  policy: str
  thresholds: Sequence[float]
  router: Optional[policies.Probe] = None  # the state probe (router or kl_probe policy)
  min_loops: int = 1
  semantics: Semantics = Semantics.PARALLEL
  gate: float = 0.0  # gated_kl's state-change gate
  mask_only: bool = False  # only scored (mask) tokens may exit; the others run R loops
  check_every: int = 1  # checks at min_loops + k * check_every only
  patience: int = 1  # state_delta: consecutive loops below the threshold before an exit
  eps_growth: float = 1.0  # the threshold at loop i is eps * eps_growth^(i - 2)


def row_sums(x_NxL: np.ndarray, mask_NxL: np.ndarray) -> list:
  """Per-sequence masked sums in float64: what `books.frontier_gap_interval` resamples."""
  m = np.asarray(mask_NxL, np.float64)
  return np.sum(np.asarray(x_NxL, np.float64) * m, axis=-1).tolist()


def uniform_curve(trace: Trace, mcfg) -> dict:
  """A0 at every depth 1..R from the trace: loss, mean loops and FLOPs/token."""
  e = elasticity(trace)
  seq_len = trace.inputs.shape[1]
  tokens = row_sums(np.ones_like(trace.mask), trace.mask)
  return {'policy': 'uniform', 'threshold': e['depths'],
          'mean_loops': [float(d) for d in e['depths']],
          'loss': e['loss'],
          'row_tokens': tokens,
          'row_loss': [row_sums(trace.stats['nll'][d - 1], trace.mask) for d in e['depths']],
          'row_loops': [[d * t for t in tokens] for d in e['depths']],
          # the trace ran the masked engine: its core attention multiplies all L keys
          'flops': [float(books.executed_flops(
              mcfg, d, 1, 1, seq_len, seq_len,
              books.OUTER_KEYS[Semantics.PARALLEL](seq_len, seq_len))) for d in e['depths']]}


def cached_uniform_curve(model: model_lib.LoopedLM, batches: Sequence[Mapping[str, Any]],
                         rng: jax.Array, r_max: int, progress: bool = False) -> dict:
  """A0 at every depth 1..R in cached semantics (decode_step per token): what a cached
  curve's frontier is judged against."""
  runs = [policy_curve(model, batches, rng, Curve('uniform', [0.0],
                                                  semantics=Semantics.CACHED), d)
          for d in bar(list(range(1, r_max + 1)), 'A0 cached', progress)]
  return {'policy': 'uniform', 'threshold': list(range(1, r_max + 1)),
          **{k: [r[k][0] for r in runs] for k in ('mean_loops', 'loss', 'flops', 'row_loss',
                                                  'row_loops')},
          'row_tokens': runs[0]['row_tokens']}


def policy_curve(model: model_lib.LoopedLM, batches: Sequence[Mapping[str, Any]],
                 rng: jax.Array, curve: Curve, r_max: int, progress: bool = False) -> dict:
  """Scores the batches at every threshold of the curve, in the curve's semantics.

  The threshold is a traced argument: one compilation per policy (and batch shape).
  FLOPs are as executed (`executed_flops` of the engine's counts): 'flops' is what
  the engine ran per position (parallel: every position runs the batch's deepest
  token's loops and every check's readout; cached: each decode step runs its deepest
  row's loops for every row); 'flops_active' is the work of active tokens only (loops,
  readouts and head products while active, plus the final readout), i.e. what an
  engine running active tokens only would execute. Cached counts cover positions
  1..L-1 (position 0 is prefilled).

  Args:
    model: the frozen LM, computing in float32 (else ValueError).
    batches: dicts of 'inputs', 'targets' (int [B, L]) and 'mask' ([B, L], the scored
      tokens), every batch of the same L; N rows in all.
    rng: the fixed key of the initial states (`batch_key`: the same for every batch).
    curve: the policy, its thresholds, probe, semantics and check schedule.
    r_max: the loop cap (max_loops and uniform depth).
    progress: a tqdm bar over the thresholds.
  Returns:
    dict: 'policy' (ExitPolicy), 'probe_size' (`policies.probe_size` of curve.router),
    'row_tokens' (each row's scored tokens, N floats) and one list entry per threshold
    under 'threshold'; 'mean_loops', 'loss' (mask-weighted mean loops and NLL,
    nats/token); 'flops', 'flops_active' (FLOPs per position as above); 'mean_core_passes'
    (the batch's core passes per counted position, padding included); 'mean_readouts',
    'mean_heads', 'mean_loops_counted' (mask-weighted per-token readouts, head products
    and loops over the counted positions); 'share_max_depth' (masked share of tokens at
    r_max loops); 'row_loss', 'row_loops' (per-row masked sums of NLL and loops, N each).
  """
  check_fp32(model)
  policy, min_loops = ExitPolicy(curve.policy), curve.min_loops
  run = functools.partial(RUNS[Semantics(curve.semantics)], policy=policy,
                          min_loops=min_loops, r_max=r_max, gate=float(curve.gate),
                          mask_only=curve.mask_only, check_every=curve.check_every,
                          patience=curve.patience, eps_growth=curve.eps_growth)
  seq_len = int(np.asarray(batches[0]['inputs']).shape[1])
  outer_keys = books.OUTER_KEYS[Semantics(curve.semantics)]  # the prelude's and coda's
  out = {k: [] for k in ('threshold', 'mean_loops', 'loss', 'flops', 'flops_active',
                         'mean_core_passes', 'mean_readouts', 'mean_heads',
                         'mean_loops_counted', 'share_max_depth', 'row_loss', 'row_loops')}
  mask = np.concatenate([np.asarray(b['mask'], np.float32) for b in batches])
  out['row_tokens'] = row_sums(np.ones_like(mask), mask)
  with jax.default_matmul_precision('highest'):
    for eps in bar(list(curve.thresholds), f'sweep {policy.value}', progress):
      nll, counts = [], []
      for k, b in enumerate(batches):
        n, c = jax.device_get(run(
            model, jnp.asarray(b['inputs'], jnp.int32),
            jnp.asarray(b['targets'], jnp.int32), batch_key(rng, k), jnp.float32(eps),
            curve.router, jnp.asarray(b['mask'], jnp.float32)))
        nll.append(n)
        counts.append(c)
      cat = lambda name: np.concatenate([getattr(c, name) for c in counts])
      # batch passes broadcast to the positions they ran for (the last t of each row)
      per_pos = lambda name: np.concatenate([np.broadcast_to(
          np.asarray(getattr(c, name), np.float64), c.coda.shape) for c in counts])
      nll, depth = np.concatenate(nll), cat('depth')
      t = counts[0].coda.shape[1]
      ones = np.ones_like(mask[:, -t:])  # the engine runs every position, padding included
      out['threshold'].append(float(eps))
      out['mean_loops'].append(masked_mean(depth, mask))
      out['loss'].append(masked_mean(nll, mask))
      out['row_loss'].append(row_sums(nll, mask))
      out['row_loops'].append(row_sums(depth, mask))
      keys = per_pos('core_keys')  # the engine's executed keys per core query
      outer = outer_keys(seq_len, keys)
      out['flops'].append(masked_mean(books.executed_flops(
          model.cfg, per_pos('core_passes'), per_pos('coda_passes'), per_pos('head_passes'),
          seq_len, keys, outer), ones))
      out['flops_active'].append(masked_mean(books.executed_flops(
          model.cfg, depth[:, -t:], cat('coda'), cat('head'), seq_len, keys, outer),
          mask[:, -t:]))
      out['mean_core_passes'].append(masked_mean(per_pos('core_passes'), ones))
      out['mean_readouts'].append(masked_mean(cat('coda'), mask[:, -t:]))
      out['mean_heads'].append(masked_mean(cat('head'), mask[:, -t:]))
      out['mean_loops_counted'].append(masked_mean(depth[:, -t:], mask[:, -t:]))
      out['share_max_depth'].append(masked_mean(depth == r_max, mask))
  out['policy'] = policy
  out['probe_size'] = policies.probe_size(curve.router)  # its FLOPs are in the check books
  out['schedule'] = dict(semantics=Semantics(curve.semantics).value, min_loops=curve.min_loops,
                         eps_growth=curve.eps_growth, check_every=curve.check_every,
                         patience=curve.patience)
  return out


BUILTIN_CURVES = ('kl', 'gated_kl', 'reverse_kl', 'confidence', 'state_delta')


def unknown_curves(curves: Sequence[str]) -> list[str]:
  """The names in curves that are not built-in curves, sorted."""
  return sorted(set(curves) - set(BUILTIN_CURVES))


def _grids(curves: Sequence[str], eps_grid, state_delta_grid) -> dict:
  """Each built-in curve's thresholds; ValueError on an unknown curve."""
  bad = unknown_curves(curves)
  if bad:
    raise ValueError(f'unknown curve {bad[0]!r}; built-in curves: {sorted(BUILTIN_CURVES)}')
  eps_grid = default_grid() if eps_grid is None else list(eps_grid)
  return {'kl': eps_grid, 'gated_kl': eps_grid, 'reverse_kl': eps_grid,
          'confidence': CONFIDENCE_GRID,
          'state_delta': state_delta_grid or default_grid(1e-4, 1.0, 9)}


def _variants(specs: dict, sems, *, check_every, min_loops, patience, eps_growth) -> dict:
  """The curves again per schedule variant (/pat, /g, /min, /every), then per semantics."""
  specs = dict(specs)
  specs.update({f'{n}/pat{k}': c._replace(patience=int(k)) for k in patience if int(k) > 1
                for n, c in list(specs.items()) if c.policy == 'state_delta'})
  specs.update({f'{n}/g{g:g}': c._replace(eps_growth=float(g)) for g in eps_growth
                if float(g) != 1.0 for n, c in list(specs.items())
                if c.policy != 'uniform'})
  specs.update({f'{n}/min{m}': c._replace(min_loops=int(m))
                for m in min_loops if int(m) > 1 for n, c in list(specs.items())})
  specs.update({f'{n}/every{k}': c._replace(check_every=int(k))
                for k in check_every if int(k) > 1 for n, c in list(specs.items())})
  return {(n if sem == Semantics.PARALLEL else f'{n}@{sem.value}'): c._replace(semantics=sem)
          for sem in sems for n, c in specs.items()}


def sweep(model: model_lib.LoopedLM, batches: Sequence[Mapping[str, Any]], rng: jax.Array,
          r_max: int, ref_depth: float, *, eps_grid: Optional[Sequence[float]] = None,
          delta: float = books.DEFAULT_DELTA, curves: Sequence[str] = ('kl',),
          state_delta_grid: Optional[Sequence[float]] = None,
          router: Optional[policies.Router] = None,
          router_grid: Optional[Sequence[float]] = None,
          kl_probes: Optional[Mapping[str, policies.KLProbe]] = None,
          extra_curves: Optional[Mapping[str, Curve]] = None,
          semantics: Sequence[str] = ('parallel',), gate: Optional[float] = None,
          trace: Optional[Trace] = None, timing_repeats: int = 3,
          check_every: Sequence[int] = (1,), min_loops: Sequence[int] = (1,),
          patience: Sequence[int] = (1,), eps_growth: Sequence[float] = (1.0,),
          progress: bool = False) -> dict:
  """A0 at depths 1..R and exit-policy curves, each with its headline against A0.

  Args:
    model, batches, rng, r_max: as in trace_batches (the same keys are used).
    ref_depth: training-mean depth (the A0 reference).
    eps_grid: thresholds of the KL curves (default: default_grid()).
    delta: loss tolerance of the headline, nats/token.
    curves: built-in curves among 'kl' (A1), 'gated_kl', 'reverse_kl', 'state_delta',
      'confidence' (1 - max_v p_i(v) < eps, thresholds 1e-4..0.5).
    state_delta_grid: thresholds of 'state_delta' (default 1e-4..1).
    router: an A2 probe; adds the 'router' curve over router_grid (default 0.05..0.95).
    kl_probes: {semantics: KLProbe fitted in it}; adds the 'kl_probe' curve over eps_grid,
      scored in each semantics with that semantics' probe (one for each is needed).
    extra_curves: {name: Curve} scored the same way (e.g. later probes).
    semantics: Semantics values; every curve is scored in each ('cached' curves are
      named '<curve>@cached' and judged against A0 in cached semantics, 'a0_cached').
    gate: gated_kl's gate (default: the median relative state change at loop 2).
    trace: a precomputed trace of the same batches and rng (else computed here).
    timing_repeats: the best point of each curve is timed against A0 at ref_depth
      (`wall_clock`, medians of this many interleaved runs; 0: not timed).
    check_every: for each k > 1, every curve again with checks every k loops
      (named '<curve>/every<k>').
    min_loops: for each m > 1, every curve again with no exit before loop m (named
      '<curve>/min<m>'); the books then also judge each check over all its min_loops
      (`books.check_books`: '<curve>/min*').
    patience: for each k > 1, every state_delta curve again exiting only after k
      consecutive loops below its threshold (named '<curve>/pat<k>').
    eps_growth: for each g != 1, every curve again with its threshold at loop i
      eps * g^(i - 2) (named '<curve>/g<g>'; the books also judge each check over all
      its growths: '<curve>/g*').
    progress: tqdm bars.
  Returns:
    JSON-friendly dict: 'r_max', 'ref_depth', 'delta', 'gate', 'tokens' (scored tokens),
    'a0' (`uniform_curve`), 'a0_cached' (`cached_uniform_curve`, with cached semantics
    only), 'curves' ({name: `policy_curve`'s dict}), 'headline' ({name: `books.headline`
    against A0 of its semantics, its best point with 'wall_clock' when timed}) and
    'check_books' (`books.check_books`).
  Raises:
    ValueError for an unknown curve or semantics, kl_probes missing a semantics, or an
    extra curve whose name holds '/' or '@' or is taken.
  """
  sems = [Semantics(x) for x in semantics]  # ValueError on an unknown one, before any run
  grids = _grids(curves, eps_grid, state_delta_grid)
  taken = set(curves) | {'router', 'kl_probe'}
  bad = [n for n in (extra_curves or {}) if '/' in n or '@' in n or n in taken]
  if bad:
    raise ValueError(f'extra curve name {bad[0]!r}: names are plain ("/" and "@" mark the '
                     "variants and semantics the sweep adds) and not another curve's")
  if trace is None:
    trace = trace_batches(model, batches, r_max, rng, progress)
  if gate is None:
    gate = float(np.median(trace.stats['delta'][min(1, r_max - 1)][trace.mask > 0]))
  specs = {c: Curve(c, grids[c], gate=gate) for c in curves}
  if router is not None:
    specs['router'] = Curve('router', router_grid or [float(x) for x in
                                                      np.linspace(0.05, 0.95, 10)], router)
  if kl_probes:
    missing = sorted(x.value for x in sems if x.value not in kl_probes)
    if missing:
      raise ValueError(f'kl_probe curve: no probe fitted in semantics {missing}')
    specs['kl_probe'] = Curve('kl_probe', grids['kl'])
  specs.update(extra_curves or {})
  specs = _variants(specs, sems, check_every=check_every, min_loops=min_loops,
                    patience=patience, eps_growth=eps_growth)
  specs = {n: c._replace(router=kl_probes[Semantics(c.semantics).value])
           if c.policy == 'kl_probe' and kl_probes else c for n, c in specs.items()}
  a0 = uniform_curve(trace, model.cfg)
  out = {'r_max': r_max, 'ref_depth': float(ref_depth), 'delta': float(delta), 'gate': gate,
         'tokens': int((trace.mask > 0).sum()), 'a0': a0, 'curves': {}, 'headline': {}}
  if Semantics.CACHED in sems:
    out['a0_cached'] = cached_uniform_curve(model, batches, rng, r_max, progress)
  for name, spec in specs.items():
    pts = policy_curve(model, batches, rng, spec, r_max, progress)
    out['curves'][name] = pts
    ref = out['a0_cached'] if Semantics(spec.semantics) == Semantics.CACHED else a0
    out['headline'][name] = h = books.headline(ref, pts, ref_depth, delta)
    if h['best'] is not None and timing_repeats > 0:
      h['best']['wall_clock'] = wall_clock(model, batches, rng, spec, h['best']['threshold'],
                                           ref_depth, r_max, timing_repeats)
  out['check_books'] = books.check_books(out, model.cfg, int(trace.inputs.shape[1]))
  return out


def wall_clock(model: model_lib.LoopedLM, batches: Sequence[Mapping[str, Any]],
               rng: jax.Array, curve: Curve, threshold: float, ref_depth: float,
               r_max: int, repeats: int = 3) -> dict:
  """Median seconds to score the batches: the curve's policy at threshold against A0 at
  the reference depth, in the curve's semantics and engine, interleaved in one run."""
  run = RUNS[Semantics(curve.semantics)]
  depth = max(1, int(round(ref_depth)))
  fns = {'policy': functools.partial(run, policy=ExitPolicy(curve.policy),
                                     min_loops=curve.min_loops, r_max=r_max,
                                     gate=float(curve.gate), mask_only=curve.mask_only,
                                     check_every=curve.check_every, patience=curve.patience,
                                     eps_growth=curve.eps_growth),
         'a0': functools.partial(run, policy=ExitPolicy.UNIFORM, min_loops=1, r_max=depth)}
  eps = {'policy': jnp.float32(threshold), 'a0': jnp.float32(0.0)}

  def once(name):
    for k, b in enumerate(batches):
      jax.block_until_ready(fns[name](
          model, jnp.asarray(b['inputs'], jnp.int32), jnp.asarray(b['targets'], jnp.int32),
          batch_key(rng, k), eps[name], curve.router, jnp.asarray(b['mask'], jnp.float32)))
  with jax.default_matmul_precision('highest'):  # one warm-up round compiles
    t = timing.interleaved({k: functools.partial(once, k) for k in fns}, repeats)
  med = {k: float(np.median(v)) for k, v in t.times.items()}
  return {'a0_depth': depth, 'a0_s': med['a0'], 'policy_s': med['policy'],
          'saving': 1.0 - med['policy'] / med['a0'], 'repeats': repeats}
