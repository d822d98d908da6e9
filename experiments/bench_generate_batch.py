"""bench_generate --batch_sizes: depth-wise batched generation (A1) against uniform depth (A0).

  python -m experiments.bench_generate --batch_sizes=1,8,32 --workdir=runs/tiny
  python -m experiments.bench_generate --batch_sizes=1,8,32    # random init: no quality

Per batch size, on the same prompts and in one process: A0 at uniform depth
(decoding.generate, lockstep: nothing to wait for), A1 through serving.generate (each
row exits per token on its own; readouts and admissions compacted to the rows that need
them), the same engine with exited rows waiting for one shared pass (--wait_rows;
serving.run's wait_rows), the same engine with its passes over all B rows (compact=False,
the engine before compaction) and A1 in lockstep (decoding.generate: every token runs to
the batch's deepest). Reported: tokens/s, mean loops, the loop saving
1 - loops(A1) / loops(A0), the realized time saving 1 - t(A1) / t(A0) and their ratio,
end to end (prefill included) and per phase: each variant's prefill (the prompt in parallel
semantics; A1's through --prefill_engine, compacted by default, so the prompt costs what
its tokens' depths cost) is timed on its own in the same interleaved rounds, and the
decode phase is the call minus its prefill (paired per round). The decode phase's loop
saving is the generated tokens'; the end-to-end one counts the prompt's tokens too.
The decode phase's FLOPs are booked as executed (`books.decode_flops` of each engine's
counts: lockstep runs every row to the step's deepest row, the depth-wise engine its
compacted buckets), beside its time saving (realized / FLOP) and the FLOP saving of an
engine that ran each token's own loops with one readout and a free check (own loops):
prelude, coda and head do not shrink with depth, so that is the most a loop saving can
buy where time follows FLOPs.
With --workdir, A1's eps is the most aggressive of --eps_grid whose loss is within
--quality_tol nats of A0's, measured in the semantics of the timed calls: with
--decode_tokens=forced, forced decoding of every validation window (its first --prompt_len
tokens prefilled in parallel semantics, the next --new_tokens decoded in cached semantics);
else teacher forcing in cached semantics (analysis.cached_outputs, token 0 prefilled) on
the validation batches. Both losses are reported. Without a workdir a random-init shape
gives throughput only, labelled "no quality".
The frontier (with --workdir): A1 is also judged against the smallest uniform decode depth
whose loss (the same measure, the prompt prefilled at A0's depth: the strongest uniform
baseline, as a shallow prefill costs quality) is within the same tolerance of A0's,
decoded in the same rounds ('a0_match', lockstep decoding.generate with prefill_cfg A0's)
when it is below A0's depth; each A1 engine reports its speed against it (`speed_vs_match`,
`decode_speed_vs_match`: the uniform depth's time over A1's).
Uniform depth runs through both engines ('a0_depthwise', 'a0_match_depthwise':
serving.generate with the uniform policy, the prompt prefilled as A0's), and the faster one
is the baseline (`match_engine`; `realized_over_loop_best_a0` beside the lockstep A0's
realized / loop): on a one-head model (head_dim 128) XLA:CPU ran lockstep decoding's cache
at 0.55x the depth-wise engine's speed at B = 32 (2026-12-08), which would have credited the
exits with the engines' difference.
A loop saving against A0 that uniform depth alone reaches at matched quality is not one
the exits bought.
--decode_tokens=forced (with --workdir): every engine decodes the validation text that
follows each prompt instead of its own picks (forced decoding), so the exits are the
data's, and each engine's loss on those tokens (masked as in training) comes from the very
calls that are timed.
"""

import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from flax import nnx

from elastic_depth import books, config, decoding, model as model_lib, serving, timing
from experiments import bench_generate_quality, bench_generate_report, bench_util, common
from experiments import flags_util

_BATCHES = flags.DEFINE_list('batch_sizes', [], 'Batch sizes of the depth-wise comparison '
                             '(e.g. 1,8,32; empty: the batch-1 shape benchmark).')
_EPS_GRID = flags.DEFINE_list('eps_grid', None, 'A1 eps candidates (default: KL 1e-1..1e-5; '
                              'state_delta 0.5..0.01).')
_POLICY = flags.DEFINE_enum('exit_policy', 'kl', ['kl', 'state_delta'],
                            'A1\'s exit check: KL (paired readout) or the relative state '
                            'change (no readout until the exit).')
_GRIDS = {'kl': ['1e-1', '3e-2', '1e-2', '3e-3', '1e-3', '3e-4', '1e-4', '3e-5', '1e-5'],
          'state_delta': ['0.5', '0.4', '0.3', '0.2', '0.15', '0.1', '0.05', '0.03', '0.01']}
_TOL = flags.DEFINE_float('quality_tol', 0.01, 'Matched quality: A1 loss <= A0 loss + this.')
_SHAPE = flags.DEFINE_string('serve_shape', 'S', 'Random-init shape without --workdir.')
flags_util.require('serve_shape', lambda v: v in bench_util.MODEL_SHAPES,
                   f'one of {sorted(bench_util.MODEL_SHAPES)}')
flags_util.require('quality_tol', lambda v: 0 <= v < float('inf'), 'a finite number >= 0')
flags_util.require('eps_grid', lambda v: all(float(x) >= 0 for x in v), 'numbers >= 0')
flags_util.require('batch_sizes', lambda v: all(int(x) >= 1 for x in v), 'integers >= 1')
_PREFILL_ENGINE = flags.DEFINE_enum_class('prefill_engine', config.ExitEngine.COMPACTED,
                                          config.ExitEngine, 'A1\'s prefill engine '
                                          '(exit.engine; A0 runs every prompt token to its depth).')
_WAIT = flags.DEFINE_integer('wait_rows', 0, 'The waiting depth-wise variant: exited rows idle '
                             'until this many wait, then one readout and admission pass '
                             'takes them all (serving.run\'s wait_rows; 0: the whole batch).',
                             lower_bound=0)
_PREFILL_STEPS = flags.DEFINE_integer('prefill_compact_steps', 4, 'exit.compact_steps of A1\'s '
                                      'compacted prefill (buffers: multiples of P / this).',
                                      lower_bound=1)
_DECODE = flags.DEFINE_enum('decode_tokens', 'generated', ['generated', 'forced'],
                            'generated: each engine picks its tokens (greedy); forced: the '
                            'validation text after each prompt is fed (needs --workdir) and '
                            'each engine\'s loss on it is reported from the timed calls.')
_F = flags.FLAGS


def requested() -> bool:
  return bool(_BATCHES.value)


def _val_pool(data, p: int, n: int) -> dict:
  """Validation windows: prompts [N, P], and for forced decoding the next n tokens and
  their loss weights (the mask of the targets they are)."""
  val = list(data.val_batches())
  pool = dict(prompt=np.concatenate([np.asarray(b['inputs'])[:, :p] for b in val]))
  if _DECODE.value == 'forced':
    width = np.asarray(val[0]['inputs']).shape[1]
    if p + n > width:
      raise SystemExit(f'error: --decode_tokens=forced needs --prompt_len + --new_tokens <= '
                       f'the validation windows\' {width} tokens, got {p} + {n}')
    pool['forced'] = np.concatenate([np.asarray(b['inputs'])[:, p:p + n] for b in val])
    pool['weight'] = np.concatenate([np.asarray(b['mask'], np.float64)[:, p - 1:p - 1 + n]
                                     for b in val])
  return pool


def _setup(calibrate):
  """(model, prompt source (`_val_pool`), A0 depth, A1 max loops, quality dict, label)."""
  p = _F.prompt_len
  if _F.workdir:
    loaded = common.load(common.options_from_flags())
    mdl = loaded.model
    a0_depth, r_max = int(round(loaded.cfg.depth.mean)), loaded.r_max
    pool = _val_pool(loaded.data, p, _F.new_tokens)
    if loaded.cfg.data.loss_on == 'answers' and _DECODE.value == 'generated':
      print('note: this model was trained on answer tokens only, so its own continuations '
            'leave the task after the first answer; --decode_tokens=forced decodes the '
            'task\'s text instead', flush=True)
    rng = jax.random.key(_F.seed)
    loss, on = bench_generate_quality.quality_fn(mdl, loaded.batches, pool, rng)
    grid = _EPS_GRID.value or _GRIDS[_POLICY.value]
    q = dict(bench_generate_quality.matched(loss, a0_depth, r_max, _POLICY.value, grid,
                                            _TOL.value), quality_on=on)
    return mdl, pool, a0_depth, r_max, q, f'{_F.workdir} step {loaded.step}'
  if _DECODE.value == 'forced':
    raise SystemExit('error: --decode_tokens=forced needs --workdir (it feeds validation text)')
  mcfg = config.ModelConfig(max_len=bench_util.random_model_len(p, _F.new_tokens),
                            **bench_util.MODEL_SHAPES[_SHAPE.value])
  mdl = model_lib.LoopedLM(mcfg, nnx.Rngs(0))
  pool = np.asarray(jax.random.randint(jax.random.key(1), (64, p), 0, mcfg.vocab_size))
  eps, _ = calibrate(mdl, jnp.asarray(pool[:1]), _F.target_loops)
  return (mdl, dict(prompt=pool), 8, 8, dict(eps=eps, matched=None),
          f'random init {_SHAPE.value}: no quality')


def _row(n_tok: int, sec: float, depth, a0=None) -> dict:
  r = dict(seconds=sec, tokens_per_s=n_tok / sec, mean_loops=float(np.mean(depth)))
  if a0 is not None:
    r['loop_saving'] = 1 - r['mean_loops'] / a0['mean_loops']
    r['time_saving'] = 1 - sec / a0['seconds']
    r['realized_over_loop'] = (r['time_saving'] / r['loop_saving'] if r['loop_saving'] > 0
                               else None)
  return r


def _digest(computed, depth, p: int):
  """(prompt depths, one float over the rest of a prefill's output): caches [B, G, S, K]
  are read at the prompt's P slots only, so the timed call returns no S-slot caches."""
  return depth, sum(jnp.sum(x[:, :, :p] if x.ndim == 4 else x, dtype=jnp.float32)
                    for x in jax.tree.leaves(computed) if jnp.issubdtype(x.dtype, jnp.floating))


def _prefills(mdl, n: int, a0_cfg, a1_cfg, rng, served: dict) -> dict:
  """Each variant's prefill phase (the depth-wise engines': serving.start's with their
  served {key: (cfg, prefill_cfg)}), timed to a digest of its output: returning the whole
  cache from a call of its own cost 0.7 ms more than building it inside generate (B = 32,
  80 slots, 2026-12-05), which the decode phase (call - prefill) would then have lacked."""
  total, p = _F.prompt_len + n, _F.prompt_len
  cached = lambda cfg: jax.jit(lambda x, f: (lambda o: _digest(o[:2], o[2], p))(
      decoding.prefill(mdl, x, cfg, rng, total)))
  start = lambda cfg, pre: jax.jit(lambda x, f: (lambda o: _digest(o[0], o[1], p))(
      serving.start(mdl, x, n, cfg, rng, forced_BxN=f, prefill_cfg=pre)))
  return {'a0': cached(a0_cfg), 'a1_lockstep': cached(a1_cfg),
          **{k: start(cfg, pre) for k, (cfg, pre) in served.items()}}


def _phase_fields(row: dict, total_s, prefill_s, n_tok: int, prompt_depth, a0=None) -> dict:
  """Per-phase fields of one variant: decode = call - prefill, paired per round.

  Where the noise is larger than the decode phase (decode <= 0, e.g. a few tokens and one
  repeat) the decode fields are None: no figure rather than a wrong one.
  """
  decode = bench_util.paired_remainder(total_s, prefill_s)
  row.update(prefill_s=statistics.median(prefill_s), decode_s=decode,
             decode_tokens_per_s=None if decode is None else n_tok / decode,
             prompt_mean_loops=float(np.mean(prompt_depth)))
  if a0 is not None:
    ok = decode is not None and a0['decode_s'] is not None
    row['decode_time_saving'] = 1 - decode / a0['decode_s'] if ok else None
    row['prefill_time_saving'] = 1 - row['prefill_s'] / a0['prefill_s']
    row['prompt_loop_saving'] = 1 - row['prompt_mean_loops'] / a0['prompt_mean_loops']
    row['decode_realized_over_loop'] = (row['decode_time_saving'] / row['loop_saving']
                                        if ok and row['loop_saving'] > 0 else None)
    p, g = row['prompt_mean_loops'] * _F.prompt_len, row['mean_loops'] * _F.new_tokens
    p0, g0 = a0['prompt_mean_loops'] * _F.prompt_len, a0['mean_loops'] * _F.new_tokens
    row['loop_saving_all_tokens'] = 1 - (p + g) / (p0 + g0)
    row['realized_over_loop_all_tokens'] = (row['time_saving'] / row['loop_saving_all_tokens']
                                            if row['loop_saving_all_tokens'] > 0 else None)
  return row


def _outputs(out, forced: bool) -> tuple:
  """(depths [B, n], NLL [B, n] (forced decoding, else None), lockstep's counts or None)."""
  if isinstance(out, serving.Generation):
    return out.depth, out.nll, None
  return out[1], out[2] if forced else None, out[-1]  # tokens, depth[, nll], counts


def _per_token_counts(out, b: int, n: int, checked: bool) -> dict:
  """Passes the decode phase executed per generated token: serving's row counts (buckets),
  or lockstep's batch passes (every row runs each step's deepest row's loops)."""
  if isinstance(out, serving.Generation):
    c, rows = out.counts, b * n
    core, reads = int(c.core_rows) / rows, int(c.readout_rows) / rows
    return dict(prelude=int(c.prelude_rows) / rows, core=core, coda=reads, head=reads,
                checks=core if checked else 0.0)
  c = out[-1]  # decoding.generate(with_counts=True): its counts come last
  core = float(np.sum(c.core_passes)) / n
  return dict(prelude=1.0, core=core, coda=float(np.sum(c.coda_passes)) / n,
              head=float(np.sum(c.head_passes)) / n, checks=core if checked else 0.0)


def _flop_fields(row: dict, counts: dict, mcfg, cache_len: int, a0=None) -> dict:
  """The decode phase's FLOP books (books.decode_flops) beside its time saving.

  own_loops: the FLOP saving of an engine that ran each token's own loops with one
  readout and a free check: the most time any engine can save, as a fraction of the
  loop saving, when time follows FLOPs (prelude, coda and head do not shrink with depth).
  """
  row['decode_counts'] = counts
  row['decode_flops'] = float(books.decode_flops(mcfg, **counts, cache_len=cache_len))
  if a0 is not None:
    saving = 1 - row['decode_flops'] / a0['decode_flops']
    ts = row['decode_time_saving']
    own = float(books.decode_flops(mcfg, 1, row['mean_loops'], 1, 1, 0, cache_len))
    row.update(decode_flop_saving=saving,
               decode_realized_over_flops=ts / saving if ts is not None and saving > 0 else None,
               own_loops_flop_saving=1 - own / a0['decode_flops'])
    row['own_loops_over_loop'] = (row['own_loops_flop_saving'] / row['loop_saving']
                                  if row['loop_saving'] > 0 else None)
  return row


def bench_batch(mdl, pool: dict, b: int, a0_depth: int, r_max: int, eps: float,
                match_depth: int | None = None) -> dict:
  """A0, A1 depth-wise (compacted, waiting, all-rows) and A1 lockstep at batch b (medians);
  forced decoding where the pool has the tokens after each prompt (`_val_pool`); with a
  match_depth below A0's, uniform depth match_depth too ('a0_match', `_vs_match`); uniform
  depth also through the depth-wise engine ('<key>_depthwise', `_vs_best_a0`)."""
  n, rng = _F.new_tokens, jax.random.key(_F.seed)
  rows_of = lambda x: jnp.asarray(np.resize(x, (b, x.shape[1])))
  prompts = rows_of(pool['prompt'])
  forced = rows_of(pool['forced']) if 'forced' in pool else None
  a0_cfg = config.ExitConfig(policy='uniform', depth=a0_depth)
  a1_cfg = config.ExitConfig(policy=_POLICY.value, eps=eps, max_loops=r_max,
                             engine=_PREFILL_ENGINE.value,
                             compact_steps=_PREFILL_STEPS.value)
  counted = lambda cfg, pre=None: jax.jit(lambda p, f: decoding.generate(
      mdl, p, n, cfg, rng, with_counts=True, forced_BxN=f, prefill_cfg=pre))
  served_by = lambda cfg, pre=None, **kw: jax.jit(lambda p, f: serving.generate(
      mdl, p, n, cfg, rng, forced_BxN=f, prefill_cfg=pre, **kw))
  served = lambda **kw: served_by(a1_cfg, **kw)
  # uniform depth through both engines: the faster one is the baseline (`_faster`)
  starts = {'a0_depthwise': (a0_cfg, None), 'a1_depthwise': (a1_cfg, None)}
  fns = {'a0': counted(a0_cfg), 'a0_depthwise': served_by(a0_cfg)}
  match = match_depth is not None and match_depth < a0_depth
  if match:  # the prompt prefilled as A0's (`bench_generate_quality.cheapest_uniform`)
    match_cfg = config.ExitConfig(policy='uniform', depth=match_depth)
    fns['a0_match'] = counted(match_cfg, a0_cfg)
    fns['a0_match_depthwise'] = served_by(match_cfg, a0_cfg)
    starts['a0_match_depthwise'] = (match_cfg, a0_cfg)
  exits = {'a1_depthwise': served(),  # the A1 engines: checks booked, compared with the match
           'a1_waiting': served(wait_rows=_WAIT.value or b), 'a1_allrows': served(compact=False),
           'a1_lockstep': counted(a1_cfg)}  # lockstep returns its counts (a few ints per step)
  fns.update(exits)
  pre = _prefills(mdl, n, a0_cfg, a1_cfg, rng, starts)
  calls = {k: functools.partial(f, prompts, forced) for k, f in fns.items()}
  calls.update({f'prefill:{k}': functools.partial(f, prompts, forced) for k, f in pre.items()})
  timed = timing.interleaved(calls, _F.repeats)
  times, rows = timed.times, {}
  for key, fn in fns.items():
    out = fn(prompts, forced)
    is_served = isinstance(out, serving.Generation)
    depth, nll, _ = _outputs(out, forced is not None)
    pdepth = out.prompt_depth if is_served else None
    pk = (key if key in starts else 'a1_depthwise') if is_served else (
        'a0' if key == 'a0_match' else key)
    if pdepth is None:
      pdepth = pre[pk](prompts, forced)[0]
    a0 = rows.get('a0')  # None while timing A0 itself
    rows[key] = _row(b * n, statistics.median(times[key]), depth, a0)
    rows[key]['min_s'] = min(times[key])
    rows[key].update(bench_util.usage_fields(timed.usage[key], per_call=False))
    _phase_fields(rows[key], times[key], times[f'prefill:{pk}'], b * n, pdepth, a0)
    _flop_fields(rows[key], _per_token_counts(out, b, n, key in exits), mdl.cfg,
                 _F.prompt_len + n, a0)
    if forced is not None:  # forced decoding: the loss of these very calls
      w = np.resize(pool['weight'], (b, n))
      rows[key]['forced_loss'] = float(np.sum(np.asarray(nll, np.float64) * w) / max(w.sum(), 1))
      rows[key]['forced_tokens'] = float(w.sum())
    if is_served:  # serving's books
      c = out.counts
      rows[key].update(engine_steps=int(c.steps),
                       row_utilisation=int(c.active_rows) / int(c.core_rows),
                       readout_rows=int(c.readout_rows), prelude_rows=int(c.prelude_rows))
    print(f'B={b:3d} {key:13s} {rows[key]["tokens_per_s"]:9.1f} tok/s  loops '
          f'{rows[key]["mean_loops"]:.2f}  decode '
          f'{rows[key]["decode_tokens_per_s"] or float("nan"):9.1f} tok/s'
          f'  prefill {rows[key]["prefill_s"] * 1e3:.2f} ms  kernel '
          f'{rows[key]["sys_s_median"]:.3f} s, {rows[key]["minor_faults_median"]:.0f} faults '
          f'per call', flush=True)
  return _vs_match(_vs_best_a0(rows, exits), 'a0_match' if match else 'a0', exits)


def _faster(rows: dict, key: str) -> str:
  """Of uniform depth's lockstep row `key` and its depth-wise twin, the faster end to end."""
  return min((key, key + '_depthwise'), key=lambda k: rows[k]['seconds'])


def _engine(key: str) -> str:
  """The engine of a uniform row `_faster` picked: its depth-wise twin or lockstep."""
  return 'depthwise' if key.endswith('_depthwise') else 'lockstep'


def _vs_best_a0(rows: dict, exits) -> dict:
  """Each A1 engine's time saving against the faster A0 engine over its loop saving, end to
  end and in the decode phase (the main table's realized / loop is against lockstep A0)."""
  best = _faster(rows, 'a0')
  u = rows[best]
  for k in exits:
    r, ls = rows[k], rows[k]['loop_saving']
    r['best_a0_engine'] = _engine(best)
    r['realized_over_loop_best_a0'] = (1 - r['seconds'] / u['seconds']) / ls if ls > 0 else None
    ok = ls > 0 and u['decode_s'] is not None and r['decode_s'] is not None
    r['decode_realized_over_loop_best_a0'] = (1 - r['decode_s'] / u['decode_s']) / ls if ok else None
  return rows


def _vs_match(rows: dict, key: str, exits) -> dict:
  """Each A1 engine's (the rows named in exits) speed against the cheapest matched uniform
  depth, on the faster of its two engines (rows[key] lockstep, rows[key + '_depthwise']):
  its time over A1's, end to end and in the decode phase (> 1: A1 is faster)."""
  best = _faster(rows, key)
  u = rows[best]
  for k in exits:
    r = rows[k]
    r['match_engine'] = _engine(best)
    r['speed_vs_match'] = u['seconds'] / r['seconds']
    ok = u['decode_s'] is not None and r['decode_s'] is not None
    r['decode_speed_vs_match'] = u['decode_s'] / r['decode_s'] if ok else None
  return rows


def main(calibrate) -> None:
  """Runs every batch size and writes JSON + markdown (calibrate: eps for a target depth)."""
  try:
    sizes = [int(x) for x in _BATCHES.value]
  except ValueError:
    raise SystemExit(f'error: --batch_sizes must be integers, got {_BATCHES.value}') from None
  if any(x < 1 for x in sizes):
    raise SystemExit(f'error: --batch_sizes must be >= 1, got {sizes}')
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  if _POLICY.value != 'kl' and not _F.workdir:
    raise SystemExit('error: --exit_policy=state_delta needs --workdir (its eps is matched '
                     'on validation quality; the random-init calibration is for KL)')
  mdl, pool, a0_depth, r_max, q, label = _setup(calibrate)
  q['policy'] = _POLICY.value
  doc = dict(date=time.strftime('%Y-%m-%d %H:%M'), model=label, quality=q,
             machine=f'{jax.default_backend()} {os.cpu_count()} cores', loadavg=os.getloadavg(),
             glibc_tunables=bench_util.glibc_tunables(),
             new_tokens=_F.new_tokens, prompt_len=_F.prompt_len, a0_depth=a0_depth, r_max=r_max,
             prefill_engine=_PREFILL_ENGINE.value.value,
             prefill_compact_steps=_PREFILL_STEPS.value, wait_rows=_WAIT.value,
             decode_tokens=_DECODE.value,
             match_key='a0_match' if q.get('match_depth', a0_depth) < a0_depth else 'a0',
             batches={b: bench_batch(mdl, pool, b, a0_depth, r_max, q['eps'],
                                     q.get('match_depth')) for b in sizes})
  doc['loadavg_end'] = os.getloadavg()
  out = _F.out if _F.out != 'runs/bench_generate.json' else 'runs/bench_generate_batch.json'
  bench_util.write_json(out, doc)
  with open(out[:-len('.json')] + '.md', 'w', encoding='utf-8') as f:
    f.write(bench_generate_report.markdown(doc))
  print(bench_generate_report.markdown(doc) + f'wrote {out}')
