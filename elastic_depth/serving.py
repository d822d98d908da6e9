"""Depth-wise batched generation: rows do not wait for the slowest row's depth.

`decoding.generate` decodes a batch in lockstep: every token of every row runs until
the batch's deepest token exits. Here each engine step runs ONE core loop over every
row's in-flight token. A row whose token exits (its KL check fires, or it reaches
max_loops) reads out its logits, picks its next token, runs the prelude on it and
starts that token's loop 1 at the next step, while the other rows keep looping on
their own tokens; a row that has produced its n_new tokens is idle. Rows therefore
sit at different positions: per-row positions, cache writes and attention masks. The
core runs over all B rows at every step (idle rows masked), except with wait_rows > 1
(below), where idle rows accumulate: there it runs on the rows in flight only, compacted
like the passes (`serving_rows.core`).

Per row the semantics are exactly `decoding.generate`'s (cached semantics, the same
initial states, exit rule, min_loops, check_every, max_loops, prefill, sampling keys of
the row's request seed): a row's tokens and depths do not depend on the other rows. Each
row may carry its own eps (a quality tier per request). The check is decode_step's: where
a row may exit (a check loop, and for gated_kl a state change below the gate) the coda and
head read the loop-(i-1) and loop-i states in one pass, and a firing check's logits are
the token's output; a token that stops at max_loops without a check at that loop gets a
final readout. These readouts and the admission (sampling, prelude and its cache writes,
initial state) run on the rows that need them only: `compaction.on_rows` gathers those
rows (their states, positions, logits and cache rows) into a buffer of the smallest of 0,
1, 2, 4, ..., B slots that holds them (one lax.switch branch each), runs the pass there
and scatters its results and fresh keys/values back (padding slots dropped). A pass only
reads the caches (its queries attend to the cache and to their own fresh keys,
`attention.attention_plus`); the caches are written after the switch, since an XLA
conditional that passes a cache through or scatters into it copies the whole cache (the
passes and the carry live in `serving_rows`). `run(..., compact=False)` runs them over all
B rows whenever any row needs them (the engine before compaction, a benchmark baseline). A
row's readout and admission run at the start of the step after its exit (`_flush`); for
checks that never read out (state_delta, uniform) every exit needs its final readout, so
the readout, the pick and the prelude run as ONE pass over the same buffer
(`_flush_fused`; `fuse=False`: two passes, the admission's buffer holding the rows that
continue, a baseline). With `wait_rows` > 1 an exited row idles until that many rows wait
(or none has a token in flight), so the passes run less often and fuller, at the price of
idle core slots (wait_rows = B: lockstep's schedule, with each row's own depths). The
Counts below record what executed.

Forced decoding (`generate(..., forced_BxN=...)`, like `decoding.generate`'s): each row's
next token is read from the given continuation instead of picked, and its NLL under the
logits it follows is recorded, so one run gives a workload's speed and its quality.
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from elastic_depth import compaction, decoding, inference, losses, policies, serving_rows
from elastic_depth import model as model_lib
from elastic_depth.config import ExitConfig, ExitPolicy, check_exit
from elastic_depth.model import LoopedLM, keep_kv
from elastic_depth.serving_rows import Pick, State

_POLICIES = (ExitPolicy.UNIFORM, ExitPolicy.KL, ExitPolicy.GATED_KL, ExitPolicy.STATE_DELTA)
_READING_CHECKS = (ExitPolicy.KL, ExitPolicy.GATED_KL)  # their check pass reads the outputs


class Counts(NamedTuple):
  """Work the engine executed (row passes: rows of the buffer a pass ran over).

  A compacted pass over n rows executes its bucket: the smallest power of two >= n,
  capped at B (0 when n = 0; B for every pass with compact=False).
  """
  steps: jax.Array         # engine steps (one core loop each), int32 []
  core_rows: jax.Array     # core loops x rows executed (B a step; wait_rows > 1: buckets)
  active_rows: jax.Array   # of which rows with a token in flight (= sum of depths), int32 []
  readout_rows: jax.Array  # coda + head readouts x bucket rows (a paired check: 2 per row)
  prelude_rows: jax.Array  # prelude passes x bucket rows (B for the first tokens)
  prefill: Any = None      # inference.Counts of the prompt's parallel prefill


class Generation(NamedTuple):
  """Output of `generate`."""
  tokens: jax.Array        # [B, P + n_new]: row b's prompt, then its n_new tokens at p_b..
  depth: jax.Array         # [B, n_new] loops per generated token
  prompt_depth: jax.Array  # [B, P] prefill depths (padding included)
  counts: Counts
  nll: Any = None          # [B, n_new] forced decoding: -log p(forced token) (else None)


def _is_check(cfg: ExitConfig, i):
  """Loops whose KL check decoding consults (as in decoding._gated_kl_check)."""
  return (i >= max(cfg.min_loops, 2)) & ((i - cfg.min_loops) % cfg.check_every == 0)


def _check(model: LoopedLM, cfg: ExitConfig, st: State, s_new, act, i, eps_i, caps, delta_B,
           run_B):
  """decode_step's paired check where a row may exit (gated_kl: delta_B < gate; state_delta:
  run_B >= patience), against the step's thresholds eps_i [B].

  Returns (fires, ran, logits of loop i, coda kv, readout rows executed).
  """
  want = act & _is_check(cfg, i)
  if cfg.policy == ExitPolicy.GATED_KL:
    want &= delta_B < cfg.gate
  b = act.shape[0]
  skip = (jnp.full((b,), jnp.inf), jnp.zeros((b, model.cfg.vocab_size), jnp.float32),
          serving_rows.zero_kv(model, b))
  none = jnp.zeros_like(act)
  if cfg.policy == ExitPolicy.UNIFORM:
    return none, none, skip[1], skip[2], jnp.int32(0)
  if cfg.policy == ExitPolicy.STATE_DELTA:  # no readout: an exit reads out when flushed
    return want & (run_B >= cfg.patience), none, skip[1], skip[2], jnp.int32(0)

  def pair(rows, kl, logits, kv):
    x = jnp.concatenate([rows.take(st.s), rows.take(s_new)], 1)
    out, fresh = serving_rows.readout(model, st, rows, x)
    return (rows.put(kl, losses.kl_from_logits(out[:, 1], out[:, 0])),
            rows.put(logits, out[:, 1]), jax.tree.map(rows.put, kv, fresh))
  (kl, logits, kv), cap = compaction.on_rows(want, caps, pair, lambda *a: a, *skip)
  return want & (kl < eps_i), want, logits, kv, 2 * cap  # a pair reads 2 states per row


def _flushed(st: State, wait_rows: int, force: bool):
  """The waiting rows whose readout and admission run now: all of them once wait_rows
  wait (or no row has a token in flight, or force), else none."""
  running = (st.n < st.depth.shape[1]) & ~st.wait
  go = jnp.any(st.wait) & ((jnp.sum(st.wait) >= wait_rows) | ~jnp.any(running) | force)
  return st.wait & go


def _read_out(model: LoopedLM, st: State, flushed, read, logits, kv, rows) -> tuple:
  """The flushed rows' readouts done (rows `read` wrote their coda keys/values; `rows`
  readout rows executed): (State, the flushed rows that admit a next token)."""
  c = st.counts
  st = st._replace(cache=st.cache._replace(coda=serving_rows.write_coda(model, st, kv, read)),
                   logits=logits, wait=st.wait & ~flushed, unread=st.unread & ~flushed,
                   counts=c._replace(readout_rows=c.readout_rows + rows))
  return st, flushed & (st.n < st.depth.shape[1])


def _flush(model: LoopedLM, st: State, caps, rng, pick: Pick, wait_rows: int,
           force: bool = False) -> State:
  """The waiting rows' final readouts and admissions (`_flushed`): one pass of each."""
  flushed = _flushed(st, wait_rows, force)
  need = flushed & st.unread
  (logits, kv), n_final = serving_rows.final(model, st, st.s, need, st.logits,
                                              serving_rows.zero_kv(model, st.s.shape[0]), caps)
  st, admit = _read_out(model, st, flushed, need, logits, kv, n_final)
  return serving_rows.admit(model, st, admit, st.pos + 1, rng, pick, caps)


def _flush_fused(model: LoopedLM, st: State, caps, rng, pick: Pick, wait_rows: int,
                 force: bool = False) -> State:
  """`_flush` where every waiting row's readout is pending (checks that never read out):
  the readout and the admission in one pass over the same rows."""
  flushed = _flushed(st, wait_rows, force)
  t = st.tokens.shape[1]
  def run(rows, logits, kv, *args):
    out, fresh = serving_rows.readout(model, st, rows, rows.take(st.s))
    pos_C = jnp.minimum(rows.take(st.pos) + 1, t - 1)
    res = serving_rows.admission(model, st, rows, pos_C, rng, pick, out[:, 0])
    return (rows.put(logits, out[:, 0]), jax.tree.map(rows.put, kv, fresh),
            *serving_rows.put_admission(rows, res, *args))
  (logits, kv, *out), cap = compaction.on_rows(
      flushed, caps, run, lambda *a: a, st.logits, serving_rows.zero_kv(model, st.s.shape[0]),
      *serving_rows.admit_args(model, st, pick))
  st, admit = _read_out(model, st, flushed, flushed, logits, kv, cap)
  return serving_rows.admitted(st, admit, st.pos + 1, pick, out, cap)


def _step(model: LoopedLM, cfg: ExitConfig, eps_B, flush, caps, core_caps,
          st: State) -> State:
  """One engine step: the waiting rows' readouts and admissions (`_flush`), then a core loop
  for every in-flight token and its exit check; exits wait for the next flush."""
  st = flush(st)
  n_new = st.depth.shape[1]
  act = (st.n < n_new) & ~st.wait
  i = st.loop + act.astype(jnp.int32)
  if core_caps:  # waiting rows idle: the core runs on the rows in flight only
    s_new, core, n_core = serving_rows.core(model, st, act, core_caps)
  else:
    s_new, kvs = model.core_step(st.s, st.inj, st.pos[:, None],
                                 [serving_rows.row_kv(c, st.pos, act) for c in st.cache.core],
                                 serving_rows.rot(st, st.pos))
    core, n_core = keep_kv(model.core, kvs, st.cache.core), act.shape[0]
    s_new = jnp.where(act[:, None, None], s_new, st.s)
  delta = policies.relative_change(s_new, st.s)[:, 0]  # once per step: gate and run read it
  eps_i = policies.threshold(eps_B, cfg.eps_growth, i)
  run = policies.run_below(delta, eps_i, i, st.run, act)
  fire, ran, logits, kv, n_pair = _check(model, cfg, st, s_new, act, i, eps_i, caps, delta, run)
  done = fire | (act & (i >= inference.loop_cap(cfg)))
  rows = jnp.arange(act.shape[0])
  depth = st.depth.at[rows, jnp.where(done, st.n, n_new)].set(i, mode='drop')
  c = st.counts
  counts = c._replace(steps=c.steps + 1, core_rows=c.core_rows + n_core,
                      active_rows=c.active_rows + jnp.sum(act.astype(jnp.int32)),
                      readout_rows=c.readout_rows + n_pair)
  read = done & ran  # a firing check's logits and coda keys/values are the token's
  coda = (serving_rows.write_coda(model, st, kv, read) if cfg.policy in _READING_CHECKS
          else st.cache.coda)  # the others never read out at a check (ran is all False)
  return st._replace(cache=st.cache._replace(core=core, coda=coda),
                     s=s_new, loop=i, run=run, n=st.n + done.astype(jnp.int32),
                     logits=jnp.where(read[:, None], logits, st.logits), depth=depth,
                     counts=counts, wait=st.wait | done, unread=st.unread | (done & ~ran))


def _concrete(x) -> bool:
  return x is not None and not isinstance(x, jax.core.Tracer)


def _check_args(model: LoopedLM, cfg: ExitConfig, prompt_BxP, n_new: int, eps_B,
                prompt_len_B, forced_BxN, seed_B) -> None:
  """ValueError for arguments `start` cannot honour (values only where not traced)."""
  if ExitPolicy(cfg.policy) not in _POLICIES:
    raise ValueError(f'error: serving supports policies {[p.value for p in _POLICIES]}, '
                     f'not {cfg.policy!r}')
  if n_new < 1:
    raise ValueError(f'error: n_new must be >= 1, got {n_new}')
  check_exit(cfg)
  model_lib.check_tokens(model.cfg, prompt_BxP, 'prompt', extra=n_new)
  b, p = prompt_BxP.shape
  for name, x, want in (('eps_B', eps_B, (b,)), ('prompt_len_B', prompt_len_B, (b,)),
                        ('forced_BxN', forced_BxN, (b, n_new)), ('seed_B', seed_B, (b,))):
    if x is not None and tuple(jnp.shape(x)) != want:
      raise ValueError(f'error: {name} must have shape {want}, got {jnp.shape(x)}')
  for name, x, what in (('prompt_len_B', prompt_len_B, 'lengths'), ('seed_B', seed_B, 'seeds')):
    if x is not None and not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f'error: {name} must hold integer {what}')
  if _concrete(prompt_len_B) and not np.all((np.asarray(prompt_len_B) >= 1)
                                            & (np.asarray(prompt_len_B) <= p)):
    raise ValueError(f'error: prompt_len_B must lie in [1, {p}], got {np.asarray(prompt_len_B)}')
  if _concrete(eps_B) and not np.all(np.isfinite(np.asarray(eps_B, np.float64))):
    raise ValueError(f'error: eps_B must be finite, got {np.asarray(eps_B)}')


def start(model: LoopedLM, prompt_BxP, n_new: int, cfg: ExitConfig, rng, *,
          eps_B=None, prompt_len_B=None, temperature: float = 0.0,
          forced_BxN=None, seed_B=None, prefill_cfg: ExitConfig | None = None) -> State:
  """Prefills the prompts (parallel semantics, per-row eps) and admits each row's first token.

  Args:
    model: the frozen LM.
    prompt_BxP: int32 prompts, right-padded when prompt_len_B is given.
    n_new: tokens to generate per row.
    cfg: exit policy (uniform, kl, gated_kl or state_delta), min/max loops, check_every, gate.
    rng: key of the initial recurrent states (and of sampling).
    eps_B: per-row exit thresholds, KL in nats or the relative state change by cfg.policy
      (default cfg.eps for every row).
    prompt_len_B: per-row prompt lengths (default P).
    temperature: 0 for greedy; else sampling with `decoding.pick`'s keys (seed, position).
    forced_BxN: forced decoding: row b's tokens after its prompt are forced_BxN[b] (at
      p_b..), not picked, and each one's NLL is recorded (`run` with forced=True).
    seed_B: int [B] each request's sampling seed, kept in the State (`State.seed`) for
      every admission: a row's samples depend on its prompt, eps and seed, not on its
      batch. Default arange(B), the row index (as `decoding.generate`: rows sample apart).
    prefill_cfg: the prompt's exit config, as `decoding.generate`'s (e.g. a deep prompt
      and shallow tokens); default cfg with the rows' eps_B.
  Returns:
    (State with each row's first token admitted, prompt depths [B, P], eps_B); `run`
    advances the State.
  """
  _check_args(model, cfg, prompt_BxP, n_new, eps_B, prompt_len_B, forced_BxN, seed_B)
  b, p = prompt_BxP.shape
  eps_B = jnp.full((b,), cfg.eps, jnp.float32) if eps_B is None else jnp.asarray(eps_B)
  plen_B = jnp.full((b,), p, jnp.int32) if prompt_len_B is None else jnp.asarray(prompt_len_B)
  pcfg = (dataclasses.replace(cfg, eps=eps_B[:, None]) if prefill_cfg is None  # kl < eps per row
          else prefill_cfg)
  res = inference.score(model, prompt_BxP, pcfg, rng)
  cache = decoding.init_cache(model, b, p + n_new)
  rows = jnp.arange(b)
  fill = lambda caches, kvs: [tuple(c.at[:, :, :p].set(decoding.group_major(x).astype(c.dtype))
                                     for c, x in zip(ck, kv)) for ck, kv in zip(caches, kvs)]
  cache = decoding.Cache(fill(cache.prelude, res.prelude_kv), fill(cache.core, res.kv),
                         fill(cache.coda, res.coda_kv))
  zero = jnp.int32(0)
  init = decoding.initial_states(model, rng, p + n_new)  # drawn once per position
  tokens = jnp.zeros((b, p + n_new), jnp.int32).at[:, :p].set(prompt_BxP)
  if forced_BxN is not None:  # row b's continuation from p_b (right-padded prompts)
    idx = jnp.clip(jnp.arange(p + n_new)[None, :] - plen_B[:, None], 0, n_new - 1)
    cont = jnp.take_along_axis(jnp.asarray(forced_BxN, jnp.int32), idx, axis=1)
    tokens = jnp.where(jnp.arange(p + n_new)[None, :] >= plen_B[:, None], cont, tokens)
  st = State(cache, res.state[:, :1], res.inj[:, :1], plen_B, jnp.zeros((b,), jnp.int32),
             jnp.zeros((b,), jnp.int32), res.logits[rows, plen_B - 1], tokens,
             jnp.zeros((b, n_new), jnp.int32), init,
             Counts(zero, zero, zero, zero, zero, res.counts), jnp.zeros((b,), jnp.int32),
             jnp.zeros((b,), bool), jnp.zeros((b,), bool),
             model.rotary(jnp.arange(p + n_new)[:, None]), jnp.zeros((b, n_new)),
             decoding.request_seeds(seed_B, b))
  pick = Pick(temperature, forced_BxN is not None)
  st = serving_rows.admit(model, st, jnp.ones((b,), bool), plen_B, rng, pick, (b,))
  return st, res.depth, eps_B


def run(model: LoopedLM, st: State, cfg: ExitConfig, rng, eps_B, *, until=None,
        temperature: float = 0.0, compact: bool = True, wait_rows: int = 1,
        forced: bool = False, fuse: bool = True) -> State:
  """Engine steps until every row has produced `until` tokens (default: all n_new).

  Args:
    model: the frozen LM.
    st: the State from `start` (or an earlier `run`) of B rows.
    cfg: the exit config `start` was given.
    rng: key of sampling (`decoding.pick`'s keys: each row's State.seed and position).
    eps_B: [B] per-row exit thresholds (`start`'s third output).
    until: tokens per row to stop at (capped at n_new; default n_new).
    temperature: 0 for greedy; else sampling, as `start`.
    compact: False runs the readouts and admissions over all B rows whenever any row
      needs them (the engine before compaction; a benchmark baseline).
    wait_rows: a row whose token exited idles until that many rows wait (or none has a
      token in flight), then their readouts and admissions run as one pass each: fewer,
      fuller passes for idle core slots (1: every step's exits at the next step, as soon
      as possible; > 1: the core loop runs compacted to the rows in flight). Tokens and
      depths do not depend on it.
    forced: the State came from `start` with forced_BxN (forced decoding).
    fuse: for checks that never read out, the final readout and the admission in one pass
      (False: two passes; same tokens and depths).
  Returns:
    The State advanced, every pending readout and admission flushed: tokens int32
    [B, P + n_new], depth int32 [B, n_new] (at least each row's first `until` tokens
    filled), the executed Counts and nll fp32 [B, n_new] (forced decoding; else zeros).
  """
  n_new, b = st.depth.shape[1], st.depth.shape[0]
  pick = Pick(temperature, forced)
  until = n_new if until is None else until
  caps = compaction.pow2_capacities(b) if compact else (0, b)
  fn = _flush_fused if fuse and cfg.policy not in _READING_CHECKS else _flush
  flush = lambda st, force=False: fn(model, st, caps, rng, pick, wait_rows, force)
  cond = lambda st: jnp.any(st.n < jnp.minimum(until, n_new))
  core_caps = caps if compact and wait_rows > 1 else ()
  st = lax.while_loop(cond, lambda st: _step(model, cfg, eps_B, flush, caps, core_caps, st), st)
  return flush(st, force=True)


def generate(model: LoopedLM, prompt_BxP, n_new: int, cfg: ExitConfig, rng, *,
             eps_B=None, prompt_len_B=None, temperature: float = 0.0,
             compact: bool = True, wait_rows: int = 1, forced_BxN=None,
             fuse: bool = True, seed_B=None, prefill_cfg: ExitConfig | None = None
             ) -> Generation:
  """Depth-wise batched generation; per row equal to decoding.generate with its eps.

  Args:
    model: the frozen LM.
    prompt_BxP: int32 [B, P] prompts, right-padded when prompt_len_B is given.
    n_new: tokens to generate per row (>= 1).
    cfg: exit policy (uniform, kl, gated_kl or state_delta), min/max loops, check_every, gate.
    rng: key of the initial recurrent states (and of sampling).
    eps_B: float [B] per-row exit thresholds (default cfg.eps for every row), as `start`.
    prompt_len_B: int [B] per-row prompt lengths in [1, P] (default P).
    temperature: 0 for greedy; else sampling with `decoding.pick`'s keys (seed, position).
    compact, wait_rows, fuse: as `run`.
    forced_BxN: int [B, n_new] forced decoding: row b's tokens after its prompt are
      forced_BxN[b], not picked, and the NLL of each forced token is recorded.
    seed_B: int [B] each request's sampling seed, as `start` (default arange(B)).
    prefill_cfg: the prompt's exit config, as `start` (default cfg).
  Returns:
    Generation: tokens int32 [B, P + n_new] (row b's prompt, then its n_new tokens at
    p_b..), depth int32 [B, n_new] loops per generated token, prompt_depth int32 [B, P]
    (padding included), the executed Counts and, with forced_BxN, nll fp32 [B, n_new]
    (else None).
  Raises:
    ValueError for arguments `start` cannot honour.
  """
  st, pdepth, eps_B = start(model, prompt_BxP, n_new, cfg, rng, eps_B=eps_B,
                            prompt_len_B=prompt_len_B, temperature=temperature,
                            forced_BxN=forced_BxN, seed_B=seed_B, prefill_cfg=prefill_cfg)
  st = run(model, st, cfg, rng, eps_B, temperature=temperature, compact=compact,
           wait_rows=wait_rows, forced=forced_BxN is not None, fuse=fuse)
  return Generation(st.tokens, st.depth, pdepth, st.counts,
                    st.nll if forced_BxN is not None else None)
