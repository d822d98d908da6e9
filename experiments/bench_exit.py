"""Teacher-forced scoring speed: uniform depth (A0) vs per-token exit, masked vs compacted.

  python -m experiments.bench_exit                        # random models at S and P
  python -m experiments.bench_exit --shapes=S --repeats=5 --fake_exit_fraction=0.25
  python -m experiments.bench_exit --workdir=DIR
      # a trained checkpoint on its validation tokens, A1 at the eps that matches A0's
      # quality (training-mean depth) within 0.01 nats

Variants, timed interleaved (A0, masked, compacted, A0, ...; medians; --settle=N: each
timed call right after N untimed calls of the same variant, see timing.interleaved):
  a0          uniform depth (--depth, or the checkpoint's training mean), no checks;
  a1_masked   exit_loop: every loop runs all B x L tokens, exited ones masked;
  a1_compact  compact_exit_loop: every loop runs only the active tokens (per-row buffers);
  a1_pooled   pooled_exit_loop: the same with one buffer for the whole batch's tokens
              (for many short rows: `--batch=256 --seq_len=16`).
On a random model exits mean nothing, so --fake_exit_fraction (default) imposes a
synthetic schedule: after each loop that share of the still-active tokens exits
(random tokens, geometric depths capped at --depth). The check still runs at every
loop with a threshold no statistic reaches (eps = -1), and its decision is OR-ed with
the schedule's, so XLA cannot compile its work away: its cost is real. Without a
schedule, --eps decides.

Executed FLOPs come from the engines' own counts (`inference.Counts`, checked against
an event log in tests/accounting_test.py) through `books.executed_flops`
(model.flops_per_token pieces): loops, readouts (only where a check reads one) and head
products as each engine ran them, the compacted engine's buffer padding included
(`active_gflop`: the active tokens' share alone).
realized/FLOP = wall-clock saving / executed-FLOP saving, against A0 and against masked
(ratios `vs_a0`, `vs_a1_masked` for the compacted engine, `pooled_vs_...` for the pooled).
Each variant also records every timed call's user and kernel CPU seconds and minor page
faults (`timing.Usage`): kernel time is where this VM's refetch of freed memory shows.
This main keeps freed memory in the process by default (experiments/host_setup.py,
`ED_KEEP_MEMORY=0` to turn it off) and runs --warmup_rounds untimed rounds first.
"""

import dataclasses
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from elastic_depth import analysis, books, config, frontier, inference, recurrence, timing
from elastic_depth import model as model_lib
from experiments import bench_util, flags_util

_SHAPES = flags.DEFINE_list('shapes', ['S', 'P'], 'Random-model shapes (bench_util.MODEL_SHAPES).')
_WORKDIR = flags.DEFINE_string('workdir', '', 'A trained run directory (instead of shapes).')
_BATCH = flags.DEFINE_integer('batch', 16, 'Rows per batch.', lower_bound=1)
_SEQ = flags.DEFINE_integer('seq_len', 256, 'Tokens per row.', lower_bound=2)
_DEPTH = flags.DEFINE_integer('depth', 8, 'A0 depth and max loops (random models).',
                              lower_bound=1)
_EPS = flags.DEFINE_float('eps', 1e-3, 'KL threshold (used when no fake schedule).')
_FAKE = flags.DEFINE_float('fake_exit_fraction', 0.25,
                           'Share of active tokens exiting after each loop (0: use eps).')
_POLICY = flags.DEFINE_enum('policy', 'kl', ['kl', 'state_delta'],
                            'Exit check run at every loop (state_delta: no coda/head).')
_STEPS = flags.DEFINE_integer('compact_steps', 8, 'exit.compact_steps: the compacted '
                              'buffers are multiples of L / this (and powers of two below).',
                              lower_bound=1)
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Interleaved timed repeats (median).',
                                lower_bound=1)
_SETTLE = flags.DEFINE_integer('settle', 0, 'Untimed calls of each variant right before its '
                               'timed one in every round (timing.interleaved: warm, as '
                               'back-to-back batches run; it did not narrow the spread at P '
                               'on 2026-12-04, WORKSPACE.md).', lower_bound=0)
_WARMUP = flags.DEFINE_integer('warmup_rounds', 1, 'Untimed interleaved rounds after each '
                               'variant\'s first call (a kept heap grows to its size there).',
                               lower_bound=0)
_MIN_TOKENS = flags.DEFINE_integer('min_tokens', 4096, 'With --workdir: validation tokens '
                                   'per timed batch, at least.', lower_bound=1)
_OUT = flags.DEFINE_string('out', 'runs/bench_exit.json', 'JSON output (markdown beside it).')
flags_util.require('eps', lambda x: 0 <= x < float('inf'), 'a finite number >= 0')


def _schedule(shape, frac: float, depth: int, seed: int = 0):
  """Synthetic exit loops: geometric with success `frac` per loop, in [1, depth]."""
  r = np.random.default_rng(seed).geometric(frac, shape)
  return jnp.asarray(np.minimum(r, depth), jnp.int32)


def _passes(depth: int, counts: dict) -> dict:
  """Core loops, coda readouts and head products per token position each variant executed:
  A0's `depth` loops and one readout; the engines' batch passes (compacted: buffer slots /
  tokens, padding included); 'a1_compact_active' the active tokens' own (their means)."""
  out = {'a0': dict(core=float(depth), coda=1.0, head=1.0)}
  out.update({k: dict(core=float(c.core_passes), coda=float(c.coda_passes),
                      head=float(c.head_passes)) for k, c in counts.items()})
  c = counts['a1_compact']  # (the pooled engine's active tokens do the same work)
  out['a1_compact_active'] = {k: float(np.mean(np.asarray(x))) for k, x in
                              (('core', c.depth), ('coda', c.coda), ('head', c.head))}
  return out


def _books(mcfg, l: int, n: int, passes: dict, keys: dict) -> dict:
  """Executed forward FLOPs of each variant: books.executed_flops of its passes x tokens,
  the core's attention at the keys per query it multiplied (`Counts.core_keys`; A0's
  scan: `model.causal_keys`)."""
  outer = books.OUTER_KEYS[config.Semantics.PARALLEL](l, l)  # every variant is parallel
  return {k: n * float(books.executed_flops(mcfg, p['core'], p['coda'], p['head'], l, keys[k],
                                            outer))
          for k, p in passes.items()}


def _variants(mdl, depth: int, ecfg, sched):
  key = jax.random.key(0)
  run = lambda loop: jax.jit(lambda t: mdl.forward(t, key, loop))
  return {'a0': run(model_lib.fixed(depth, remat=False)),
          'a1_masked': run(inference.exit_loop(ecfg, schedule_BxL=sched)),
          'a1_compact': run(inference.compact_exit_loop(ecfg, schedule_BxL=sched)),
          'a1_pooled': run(inference.pooled_exit_loop(ecfg, schedule_BxL=sched))}


def paired_saving(times, base_times) -> float:
  """Median over repeats of 1 - t / t_base within the same interleaved round (robust to
  load that drifts between rounds)."""
  return statistics.median(1.0 - t / b for t, b in zip(times, base_times))


def _ratio(times: dict, flops: dict, variant: str, base: str) -> dict:
  """Wall-clock and executed-FLOP savings of variant against base, and their ratios."""
  saving = lambda a, b: 1.0 - a / b
  w = saving(statistics.median(times[variant]), statistics.median(times[base]))
  w_min = saving(min(times[variant]), min(times[base]))
  w_pair = paired_saving(times[variant], times[base])
  fl = saving(flops[variant], flops[base])
  per = lambda x: x / fl if fl > 0 else None
  return dict(wall_saving=w, flop_saving=fl, wall_saving_min=w_min, wall_saving_paired=w_pair,
              realized_over_flop_paired=per(w_pair), realized_over_flop=per(w),
              realized_over_flop_min=per(w_min))


def bench(name: str, mdl, depth: int, toks, eps: float, fake: float) -> dict:
  """Times the three variants interleaved and does the books."""
  b, l = toks.shape
  n = b * l
  sched = _schedule((b, l), fake, depth) if fake > 0 else None
  # synthetic exits: a threshold no statistic reaches, so the schedule decides
  ecfg = config.ExitConfig(policy=_POLICY.value, eps=-1.0 if sched is not None else eps,
                           max_loops=depth, compact_steps=_STEPS.value)
  fns = _variants(mdl, depth, ecfg, sched)
  outs, first_s = {}, {}
  for k, f in fns.items():  # compile + warm, with progress (minutes at P on a GPU)
    t0 = time.perf_counter()
    outs[k] = jax.block_until_ready(f(toks))
    first_s[k] = time.perf_counter() - t0
    print(f'{name}: {k} compiled and run once in {first_s[k]:.1f} s', flush=True)
  timed = timing.interleaved({k: functools.partial(f, toks) for k, f in fns.items()},
                             _REPEATS.value, warmup=_WARMUP.value, settle=_SETTLE.value)
  times, loads = timed.times, timed.loads
  med = {k: statistics.median(v) for k, v in times.items()}
  aux = {k: outs[k].aux for k in ('a1_masked', 'a1_compact', 'a1_pooled')}
  for k, a in aux.items():
    assert np.array_equal(np.asarray(a.depth), np.asarray(aux['a1_masked'].depth)), k
  passes = _passes(depth, {k: jax.device_get(a.counts) for k, a in aux.items()})
  keys = {'a0': model_lib.causal_keys(l),  # per core query, as executed
          **{k: float(a.counts.core_keys) for k, a in aux.items()}}
  keys['a1_compact_active'] = keys['a1_compact']
  flops = _books(mdl.cfg, l, n, passes, keys)
  mean_loops = float(np.mean(np.asarray(aux['a1_compact'].depth)))
  ratios = {f'{prefix}vs_{base}': dict(_ratio(times, flops, v, base), variant=v, base=base)
            for prefix, v in (('', 'a1_compact'), ('pooled_', 'a1_pooled'))
            for base in ('a0', 'a1_masked')}
  rows = {k: dict(median_s=med[k], min_s=min(times[k]), times_s=times[k],
                  tokens_per_s=n / med[k], core_keys=keys[k], passes=passes[k],
                  first_call_s=first_s[k], executed_gflop=flops[k] / 1e9,
                  **bench_util.usage_fields(timed.usage[k]))
          for k in fns}
  print(f'{name}: load {statistics.median(loads):.1f}  mean loops {mean_loops:.2f}'
        f' of {depth}', flush=True)
  for k, r in rows.items():
    print(f'  {k:10s} {r["median_s"]:7.3f} s  {r["tokens_per_s"]:9.0f} tok/s  '
          f'{r["executed_gflop"]:8.1f} GFLOP  cpu {r["user_s_median"]:.2f} user + '
          f'{r["sys_s_median"]:.2f} sys s, {r["minor_faults_median"]:.0f} faults', flush=True)
  for k, r in ratios.items():
    print(f'  {k}: wall saving {r["wall_saving"]:.1%}, FLOP saving '
          f'{r["flop_saving"]:.1%}, realized/FLOP {r["realized_over_flop"]} (min-based '
          f'{r["realized_over_flop_min"]})', flush=True)
  return dict(model=dataclasses.asdict(mdl.cfg), batch=b, seq_len=l, tokens=n, depth=depth,
              policy=_POLICY.value,
              fake_exit_fraction=fake, eps=ecfg.eps, variants=rows,
              active_gflop=flops['a1_compact_active'] / 1e9,
              active_passes=passes['a1_compact_active'], mean_loops=mean_loops, ratios=ratios,
              loadavg_per_repeat=loads, compact_steps=_STEPS.value, settle=_SETTLE.value,
              warmup_rounds=_WARMUP.value,
              capacities=recurrence.capacities(l, _STEPS.value))


def parts(mdl, toks, repeats: int) -> dict:
  """Where a compacted loop's time goes: ms for one core loop on all tokens, on a buffer of
  half of each row (as a phase of compact_exit_loop runs it: states, injection and RoPE
  rows gathered once per phase, fresh keys/values scattered into the rows'), and on a
  plain half batch (the first half of each row)."""
  b, l = toks.shape
  pos = model_lib.positions(toks)
  e = mdl.inject(mdl.encode(toks, pos)[0])
  c = mdl.cfg
  z = jnp.zeros((b, c.num_kv_heads, l, c.head_dim), e.dtype)
  idx = recurrence.right_aligned(jnp.broadcast_to(jnp.arange(l) % 2 == 0, (b, l)), l // 2)
  g = lambda x: recurrence.gather_rows(x, idx)
  rot, half = mdl.rotary(pos), lambda x: x[:, :l // 2]

  def compact(s_c):
    fns = [inference._scatter_kv((z, z), idx, pos, g(pos)) for _ in range(c.n_core)]  # pylint: disable=protected-access
    return mdl.core_step(s_c, g(e), g(pos), fns, rot=jax.tree.map(g, rot))[0]
  fns = {'loop_all_ms': (lambda s: mdl.core_step(s, e, pos, rot=rot)[0], e),
         'loop_half_compacted_ms': (compact, g(e)),
         'loop_half_plain_ms': (lambda s: mdl.core_step(s, half(e), half(pos),
                                                        rot=jax.tree.map(half, rot))[0], half(e))}
  return {k: 1e3 * bench_util.time_fn(jax.jit(f), (x,), repeats)['median_s']
          for k, (f, x) in fns.items()}


def matched_eps(mdl, batches, depth: int, policy: str, grid, tol: float = 0.01) -> dict:
  """The most aggressive threshold whose loss is within tol of A0 at depth (A1 capped at
  depth, parallel semantics, the same batches): {'eps', 'a0_loss', 'loss', 'mean_loops'}."""
  rng = jax.random.key(0)
  run = lambda c: frontier.policy_curve(mdl, batches, rng, c, depth)
  a0 = run(frontier.Curve('uniform', [0.0]))['loss'][0]
  cur = run(frontier.Curve(policy, list(grid)))
  ok = [i for i, x in enumerate(cur['loss']) if x <= a0 + tol]
  if not ok:
    raise SystemExit(f'error: no {policy} threshold in {list(grid)} is within {tol} nats '
                     f'of uniform depth {depth} ({a0:.4f})')
  i = min(ok, key=lambda j: (cur['mean_loops'][j], cur['loss'][j]))
  return {'eps': cur['threshold'][i], 'a0_loss': a0, 'loss': cur['loss'][i],
          'mean_loops': cur['mean_loops'][i], 'tol': tol}


def _checkpoint_run(workdir: str):
  """A trained checkpoint on its own validation tokens (>= 4,096 per batch): A1 at the
  eps whose quality matches A0 at the training mean within 0.01 nats."""
  from experiments import common  # pylint: disable=g-import-not-at-top
  cfg = common.load_config(workdir)
  rows = -(-_MIN_TOKENS.value // cfg.train.seq_len)
  ld = common.load(common.Options(workdir=workdir, batches=1, batch_size=rows,
                                  progress=False))
  depth = max(1, round(cfg.depth.mean))
  grid = analysis.default_grid() if _POLICY.value == 'kl' else analysis.default_grid(1e-4, 1, 9)
  quality = matched_eps(ld.model, ld.batches, depth, _POLICY.value, grid)
  print(f'{workdir}@{ld.step}: {_POLICY.value} eps={quality["eps"]:.3g} matches uniform depth '
        f'{depth} within 0.01 nats ({quality["loss"]:.4f} vs {quality["a0_loss"]:.4f}, '
        f'{quality["mean_loops"]:.2f} mean loops)', flush=True)
  toks = jnp.asarray(ld.batches[0]['inputs'], jnp.int32)
  res = bench('ckpt', ld.model, depth, toks, quality['eps'], 0.0)
  res['quality'] = quality
  return f'{workdir}@{ld.step}', res


def markdown(out: dict) -> str:
  """The figures as a markdown table."""
  lines = [f'# bench_exit ({out["date"]}, {out["machine"]})', '',
           '| shape | policy | variant | median s | min s | tokens/s | executed GFLOP | load | '
           'sys s / faults per call (median) |',
           '|---|---|---|---|---|---|---|---|---|']
  for name, r in out['runs'].items():
    load = statistics.median(r['loadavg_per_repeat'])
    for k, v in r['variants'].items():
      lines.append(f'| {name} | {r["policy"]} | {k} | {v["median_s"]:.3f} | {v["min_s"]:.3f} | '
                   f'{v["tokens_per_s"]:.0f} | '
                   f'{v["executed_gflop"]:.1f} | {load:.1f} | '
                   f'{v.get("sys_s_median", float("nan")):.2f} / '
                   f'{v.get("minor_faults_median", float("nan")):.0f} |')
  for name, r in out['runs'].items():
    q = r.get('quality')
    if q:
      lines += ['', f'{name}: {r["policy"]} eps={q["eps"]:.3g}, loss {q["loss"]:.4f} at '
                f'{q["mean_loops"]:.2f} mean loops vs uniform depth {r["depth"]} '
                f'{q["a0_loss"]:.4f} (matched within {q["tol"]} nats, same tokens)']
  lines += ['', '| shape | mean loops | engine vs | wall saving (median) | FLOP saving | '
            'realized/FLOP (median) | realized/FLOP (min) |', '|---|---|---|---|---|---|---|']
  for name, r in out['runs'].items():
    for v in r['ratios'].values():
      fmt = lambda x: '-' if x is None else f'{x:.2f}'
      lines.append(f'| {name} | {r["mean_loops"]:.2f} | {v["variant"]} vs {v["base"]} | '
                   f'{v["wall_saving"]:.1%} | {v["flop_saving"]:.1%} | '
                   f'{fmt(v["realized_over_flop"])} | {fmt(v["realized_over_flop_min"])} |')
  return '\n'.join(lines) + '\n'


def main(argv):
  flags_util.no_arguments(argv)
  from experiments import common  # pylint: disable=g-import-not-at-top (after this module's flags)
  if _FAKE.value < 0 or _FAKE.value >= 1:
    raise common.SetupError(f'--fake_exit_fraction={_FAKE.value} must be in [0, 1)')
  bad = sorted(set(_SHAPES.value) - set(bench_util.MODEL_SHAPES))
  if bad and not _WORKDIR.value:
    raise common.SetupError(f'--shapes: unknown {bad}; known: {sorted(bench_util.MODEL_SHAPES)}')
  runs = {}
  rng = np.random.default_rng(0)
  if _WORKDIR.value:
    name, res = _checkpoint_run(_WORKDIR.value)
    runs[name] = res
  for name in ([] if _WORKDIR.value else _SHAPES.value):
    mcfg = config.ModelConfig(max_len=_SEQ.value, **bench_util.MODEL_SHAPES[name])
    mdl = model_lib.LoopedLM(mcfg, nnx.Rngs(0))
    toks = jnp.asarray(rng.integers(0, mcfg.vocab_size, (_BATCH.value, _SEQ.value)),
                       jnp.int32)
    runs[name] = bench(name, mdl, _DEPTH.value, toks, _EPS.value, _FAKE.value)
    runs[name]['parts_ms'] = parts(mdl, toks, _REPEATS.value)
    print(f'  parts (ms): {runs[name]["parts_ms"]}', flush=True)
  out = dict(backend=jax.default_backend(), machine=bench_util.machine_description(),
             cpu_count=os.cpu_count(), loadavg=os.getloadavg(),
             glibc_tunables=bench_util.glibc_tunables(),
             date=time.strftime('%Y-%m-%d %H:%M'), runs=runs)
  bench_util.write_json(_OUT.value, out)
  md = os.path.splitext(_OUT.value)[0] + '.md'
  with open(md, 'w', encoding='utf-8') as f:
    f.write(markdown(out))
  print(f'wrote {_OUT.value} and {md}')


if __name__ == '__main__':
  from experiments import common  # pylint: disable=g-import-not-at-top
  app.run(common.one_line_errors(main),  # after this module's flags: common skips --workdir
          flags_parser=flags_util.parse_or_fail)
