"""Inference on a frozen looped LM: teacher-forced scoring with per-token exit, and
autoregressive generation with a KV cache whose size does not depend on the loops.

Two semantics, both documented in WORKSPACE.md:
* Parallel (`score`): all positions run together; at loop i a token attends to
  every earlier token's keys/values of loop min(i, its exit depth). With no exit
  this is exactly the training computation at uniform depth.
* Cached (`decode_step`, `generate`, `score_cached`): one new token at a time; in
  every core block it attends to the keys/values that earlier tokens offered at
  their last executed loop (one cache slot per token and block, overwritten each
  loop: Huginn-style KV sharing). The prompt is prefilled in parallel semantics.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from elastic_depth import losses, policies, recurrence
from elastic_depth.config import ExitConfig, ExitEngine, ExitPolicy
from elastic_depth.model import LoopedLM


class ScoreResult(NamedTuple):
  """Teacher-forced scoring output."""
  logits: jax.Array   # [B, L, V] fp32
  depth: jax.Array    # [B, L] loops per token
  traces: Any         # dict of [R, B, L] per-loop stats (empty unless trace)
  kv: Any             # per core block (k, v) offered at the end
  e: jax.Array        # prelude output [B, L, D]
  state: jax.Array    # final state [B, L, D]
  prelude_kv: Any     # per prelude block (k, v)
  coda_kv: Any        # per coda block (k, v) of the final readout
  counts: Any = None  # Counts: the work this engine executed


class Counts(NamedTuple):
  """Work an engine executed, counted where it ran (final readout included).

  Batch passes run every row of the batch (B x L tokens in `score`, B in
  `decode_step`); per-token counts are the work done while the token was active
  (what an engine that runs active tokens only would execute).
  """
  core_passes: jax.Array   # core loops run over the batch, int32 []
  coda_passes: jax.Array   # coda + final-norm readouts over the batch, int32 []
  head_passes: jax.Array   # LM-head products over the batch, int32 []
  depth: jax.Array         # core loops per token, int32 [B, L]
  coda: jax.Array          # readouts per token, int32 [B, L]
  head: jax.Array          # head products per token, int32 [B, L]


def _counts(res: recurrence.ExitResult, final: int = 1) -> Counts:
  """Counts of an early_exit run (check carry: policies.CheckCarry) plus `final` readouts."""
  c = res.check
  return Counts(res.loops, c.coda + final, c.head + final, res.depth, c.coda_BxL + final,
                c.head_BxL + final)


def _freeze(kv_prev, active_BxL):
  """kv_fn that lets inactive tokens offer their frozen keys/values."""
  a = active_BxL[:, :, None, None]
  k_prev, v_prev = kv_prev
  return lambda k, v: (jnp.where(a, k, k_prev), jnp.where(a, v, v_prev), None)


def _max_loops(cfg: ExitConfig) -> int:
  return cfg.depth if cfg.policy == ExitPolicy.UNIFORM else cfg.max_loops


def score(model: LoopedLM, tokens_BxL: jax.Array, cfg: ExitConfig, rng: jax.Array, *,
          targets_BxL: Optional[jax.Array] = None,
          router: Optional[policies.Router] = None, trace: bool = False,
          exit_mask_BxL: Optional[jax.Array] = None) -> ScoreResult:
  """Scores a batch with per-token early exit in parallel semantics.

  Args:
    model: the frozen LM.
    tokens_BxL: int32 input tokens.
    cfg: exit policy, eps, min/max loops (A0 uses cfg.depth).
    rng: key for the initial recurrent state.
    targets_BxL: next tokens; with trace, per-loop NLL is recorded.
    router: A2 probe (policy 'router', or to trace its probability).
    trace: record per-loop stats (run with policy 'uniform' for full traces).
    exit_mask_BxL: tokens the policy may stop (None: all); the others run max_loops
      (e.g. the exit decision taken on answer tokens only).
  Returns:
    ScoreResult with logits_BxLxV computed by the coda on the final states.
  """
  engine = _ENGINES[ExitEngine(cfg.engine)]
  out = model.forward(tokens_BxL, rng, engine(cfg, router=router, targets_BxL=targets_BxL,
                                              trace=trace, exit_mask_BxL=exit_mask_BxL))
  res = out.aux
  return ScoreResult(out.logits, res.depth, res.traces, res.kv, out.e, out.state,
                     out.prelude_kv, out.coda_kv, res.counts)


def _masked_check(check_fn, exit_mask_BxL):
  """A check whose exit decisions are limited to the positions of exit_mask_BxL."""
  def check(*args):
    ex, carry, stats = check_fn(*args)
    return ex & exit_mask_BxL, carry, stats
  return check


def exit_loop(cfg: ExitConfig, *, router=None, targets_BxL=None, trace: bool = False,
              exit_mask_BxL=None, active_BxL=None, schedule_BxL=None):
  """Loop policy for LoopedLM.forward: per-token early exit in parallel semantics.

  With exit_mask_BxL, only tokens where it is True may exit early (the others run to the
  maximum); the rule is still evaluated everywhere.

  The aux output is the recurrence.ExitResult (depths, traces, offered keys/values).
  active_BxL: initial mask (padding starts inactive); schedule_BxL: benchmarks only,
  the policy's check still runs but a token exits at the first allowed loop >= schedule.
  """
  def loop(model: LoopedLM, s0, e, pos):
    b, l = s0.shape[:2]
    c = model.cfg
    zeros = jnp.zeros((b, l, c.num_kv_heads, c.head_dim), e.dtype)
    kv0 = [(zeros, zeros) for _ in range(c.n_core)]

    def masked_step(s, kv, active):
      return model.core_step(s, e, pos, [_freeze(kv[j], active) for j in range(c.n_core)])

    readout = lambda s: model.decode_state(s, pos)[0]
    check_fn, carry0 = policies.make_check_fn(
        cfg.policy, eps=cfg.eps, readout=readout, w_VxD=model.head_weight(),
        router=router, targets_BxL=targets_BxL, use_kernel=cfg.use_kernel, trace=trace,
        min_loops=cfg.min_loops, check_every=cfg.check_every, gate=cfg.gate)
    if exit_mask_BxL is not None:
      check_fn = _masked_check(check_fn, exit_mask_BxL)
    if schedule_BxL is not None:
      check_fn = policies.scheduled(check_fn, lambda: schedule_BxL)
    res = recurrence.early_exit(masked_step, check_fn, s0, kv0, carry0(s0),
                                min_loops=cfg.min_loops, max_loops=_max_loops(cfg),
                                check_every=cfg.check_every, active0=active_BxL,
                                trace=trace, return_check=True)
    return res.state, res._replace(counts=_counts(res))
  return loop


def _scatter_kv(kv_prev, idx_BxC, pos_BxL, pos_BxC):
  """kv_fn for gathered queries: their fresh (k, v) overwrite the row's buffers [B, L, G, K]."""
  def fn(k, v):
    ks = recurrence.scatter_rows(kv_prev[0], idx_BxC, k)
    vs = recurrence.scatter_rows(kv_prev[1], idx_BxC, v)
    return ks, vs, (pos_BxL[:, None, :] <= pos_BxC[:, :, None])[:, None]
  return fn


def _compact_readout(model, s, s_new, idx, pos, coda_kv, compact_coda, needs_head, read):
  """(h of the gathered tokens, coda kv buffers) at a loop whose p_i a check reads.

  Elsewhere (read False) h is zeros and the buffers are unchanged; without a KL policy
  there is no readout.
  """
  if compact_coda:
    pos_c = recurrence.gather_rows(pos, idx)
    return lax.cond(read, lambda: model.decode_state(
        s_new, pos_c, [_scatter_kv(x, idx, pos, pos_c) for x in coda_kv]),
                    lambda: (jnp.zeros_like(s_new), coda_kv))
  if needs_head:  # later coda blocks depend on every token: run all, gather
    full = lambda: model.decode_state(recurrence.scatter_rows(s, idx, s_new), pos)[0]
    return lax.cond(read, lambda: recurrence.gather_rows(full(), idx),
                    lambda: jnp.zeros_like(s_new)), coda_kv
  return jnp.zeros((), s_new.dtype), coda_kv


def _gathered_check(check_fn, chk: policies.CheckCarry, idx, s_new, s_c, i, needs_head):
  """check_fn on the gathered tokens, with the gathered part of its full-size carry.

  Returns (exit_BxC, the carry scattered back, readouts and head products it ran).
  """
  g = lambda x: recurrence.gather_rows(x, idx)
  put = lambda x, y: recurrence.scatter_rows(x, idx, y)
  c = policies.CheckCarry(g(chk.prev) if needs_head else chk.prev, jnp.int32(0),
                          jnp.int32(0), g(chk.coda_BxL), g(chk.head_BxL))
  valid = idx < chk.coda_BxL.shape[1]  # padding slots point past the row
  want, c, _ = check_fn(s_new, s_c, c, i, valid)
  chk = policies.CheckCarry(put(chk.prev, c.prev) if needs_head else chk.prev, chk.coda,
                            chk.head, put(chk.coda_BxL, c.coda_BxL), put(chk.head_BxL, c.head_BxL))
  return want, chk, c.coda, c.head


def compact_exit_loop(cfg: ExitConfig, *, router=None, targets_BxL=None, trace: bool = False,
                      exit_mask_BxL=None, active_BxL=None, schedule_BxL=None,
                      steps: int = 8):
  """Loop policy: the same per-token exit as `exit_loop`, run on the active tokens only.

  Each loop gathers every row's active tokens into a buffer of one of
  `recurrence.capacities(L, steps)` slots; the core runs on them (queries) against the
  whole row's keys/values (fresh ones scattered into the per-block frozen buffers),
  and so do the exit check's readout, head and KL (only at the loops a check reads, as
  in `policies.make_check_fn`). With at most one coda block the coda is compacted too
  (an exited token's coda keys/values are those of its last readout, which ran on its
  final state); with more, later coda blocks' keys/values depend on other tokens, so the
  coda runs on all tokens and its output is gathered. Depths and logits equal exit_loop's.
  The aux output is a CompactAux (counts in executed token slots / (B x L)).
  """
  del targets_BxL  # only read by traces
  if trace:
    raise ValueError('error: per-loop traces need exit.engine=masked')
  policy = ExitPolicy(cfg.policy)
  needs_head = policy in policies.HEAD_POLICIES
  _, reads = policies.check_schedule(policy, cfg.min_loops, cfg.check_every)

  def loop(model: LoopedLM, s0, e, pos):
    c = model.cfg
    b, l = s0.shape[:2]
    zeros = jnp.zeros((b, l, c.num_kv_heads, c.head_dim), e.dtype)
    compact_coda = needs_head and c.n_coda <= 1
    # tokens inactive from the start offer the coda keys/values of their initial state
    pad = compact_coda and active_BxL is not None
    coda_kv0 = (model.decode_state(s0, pos)[1] if pad else
                [(zeros, zeros)] * c.n_coda if compact_coda else [])
    _, carry0 = policies.make_check_fn(policy, eps=cfg.eps, w_VxD=model.head_weight(),
                                       use_kernel=cfg.use_kernel)

    def step(idx, s, carry, i):
      kv, coda_kv, chk, n_coda, n_head = carry
      g = lambda x: recurrence.gather_rows(x, idx)
      pos_c, s_c = g(pos), g(s)
      s_new, kv = model.core_step(s_c, g(e), pos_c, [_scatter_kv(x, idx, pos, pos_c) for x in kv])
      h_new, coda_kv = _compact_readout(model, s, s_new, idx, pos, coda_kv, compact_coda,
                                        needs_head, reads(i))
      check_fn, _ = policies.make_check_fn(
          policy, eps=cfg.eps, readout=lambda _: h_new, w_VxD=model.head_weight(),
          router=router, use_kernel=cfg.use_kernel, min_loops=cfg.min_loops,
          check_every=cfg.check_every, gate=cfg.gate)
      want, chk, coda_n, head_n = _gathered_check(check_fn, chk, idx, s_new, s_c, i, needs_head)
      n_coda += coda_n * b * (idx.shape[1] if compact_coda else l)
      n_head += head_n * b * idx.shape[1]
      if exit_mask_BxL is not None:
        want = want & g(exit_mask_BxL)
      if schedule_BxL is not None:
        want = i >= g(schedule_BxL)
      return s_new, want, (kv, coda_kv, chk, n_coda, n_head)

    carry = ([(zeros, zeros) for _ in range(c.n_core)], coda_kv0, carry0(s0),
             jnp.int32(b * l if pad else 0), jnp.int32(0))
    res = recurrence.early_exit_compacted(
        step, s0, carry, caps=recurrence.capacities(l, steps), min_loops=cfg.min_loops,
        max_loops=_max_loops(cfg), check_every=cfg.check_every, active0=active_BxL)
    kv, _, chk, n_coda, n_head = res.carry
    per = lambda n: n.astype(jnp.float32) / (b * l) + 1.0  # + the final readout
    counts = Counts(res.slots.astype(jnp.float32) / (b * l), per(n_coda), per(n_head),
                    res.depth, chk.coda_BxL + 1, chk.head_BxL + 1)
    return res.state, CompactAux(res.depth, kv, res.loops, res.slots, {}, counts)
  return loop


class CompactAux(NamedTuple):
  """Aux output of compact_exit_loop (the fields score and prefill read, and slots)."""
  depth: jax.Array
  kv: Any
  loops: jax.Array
  slots: jax.Array
  traces: Any
  counts: Counts  # executed work; batch passes are token slots / (B x L)


_ENGINES = {ExitEngine.MASKED: exit_loop, ExitEngine.COMPACTED: compact_exit_loop}


# ----------------------------------------------------------------------------
# Cached decoding.


class Cache(NamedTuple):
  """Per block (k, v) of shape [B, S, G, K] for prelude, core and coda blocks."""
  prelude: list
  core: list
  coda: list


def init_cache(model: LoopedLM, batch: int, max_len: int) -> Cache:
  """An all-zero cache for max_len positions (size independent of the loop count)."""
  c = model.cfg
  z = lambda: (jnp.zeros((batch, max_len, c.num_kv_heads, c.head_dim), model.dtype),) * 2
  return Cache([z() for _ in range(c.n_prelude)], [z() for _ in range(c.n_core)],
               [z() for _ in range(c.n_coda)])


def _write(cache_kv, kv, start):
  k, v = cache_kv
  return (lax.dynamic_update_slice_in_dim(k, kv[0].astype(k.dtype), start, 1),
          lax.dynamic_update_slice_in_dim(v, kv[1].astype(v.dtype), start, 1))


def _cached(cache_kv, pos, keep_B=None):
  """kv_fn writing the new token's (k, v) at pos and attending to positions <= pos."""
  def fn(k, v):
    if keep_B is not None:  # inactive rows keep the slot of their last executed loop
      old_k = lax.dynamic_slice_in_dim(cache_kv[0], pos, 1, 1)
      old_v = lax.dynamic_slice_in_dim(cache_kv[1], pos, 1, 1)
      m = keep_B[:, None, None, None]
      k, v = jnp.where(m, old_k, k), jnp.where(m, old_v, v)
    ks, vs = _write(cache_kv, (k, v), pos)
    s = ks.shape[1]
    mask = (jnp.arange(s) <= pos)[None, None, None, :]
    return ks, vs, mask
  return fn


def prefill(model: LoopedLM, prompt_BxP, cfg: ExitConfig, rng, max_len: int,
            router=None):
  """Runs the prompt in parallel semantics and fills a cache of max_len positions."""
  res = score(model, prompt_BxP, cfg, rng, router=router)
  cache = init_cache(model, prompt_BxP.shape[0], max_len)
  cache = Cache([_write(c, kv, 0) for c, kv in zip(cache.prelude, res.prelude_kv)],
                [_write(c, kv, 0) for c, kv in zip(cache.core, res.kv)],
                [_write(c, kv, 0) for c, kv in zip(cache.coda, res.coda_kv)])
  return cache, res.logits[:, -1], res.depth


def _pair_cached(cache_kv, pos):
  """kv_fn for two queries at one position (states of loops i-1 and i) over the cache."""
  def fn(k, v):  # k, v: [B, 2, G, K]
    ks = jnp.concatenate([cache_kv[0], k.astype(cache_kv[0].dtype)], axis=1)
    vs = jnp.concatenate([cache_kv[1], v.astype(cache_kv[1].dtype)], axis=1)
    s = cache_kv[0].shape[1]
    old = jnp.broadcast_to(jnp.arange(s) < pos, (2, s))
    return ks, vs, jnp.concatenate([old, jnp.eye(2, dtype=bool)], axis=1)[None, None]
  return fn


def decode_step(model: LoopedLM, cache: Cache, token_B, pos, cfg: ExitConfig, rng,
                router=None, with_counts: bool = False):
  """One new token at scalar position pos: returns (logits_BxV, cache, depth_B[, Counts]).

  For the KL policy the exit check reads the loop-(i-1) and loop-i states in one
  pass over the coda and head (one weight read for both), runs only when the
  relative state change is below cfg.gate (policy gated_kl), and the logits of a
  successful check are the token's output, so the final readout costs nothing extra.
  """
  tok = token_B[:, None]
  pos_Bx1 = jnp.full(tok.shape, pos, jnp.int32)
  e, pre_kv = model.encode(tok, pos_Bx1, [_cached(kv, pos) for kv in cache.prelude])
  s0 = model.initial_state(e, rng, pos_Bx1)  # as in the parallel forward

  def masked_step(s, core_kv, active_Bx1):
    fns = [_cached(kv, pos, keep_B=~active_Bx1[:, 0]) for kv in core_kv]
    return model.core_step(s, e, pos_Bx1, fns)

  def readout(s):
    return model.decode_state(s, pos_Bx1, [_cached(kv, pos) for kv in cache.coda])

  fast = cfg.policy in (ExitPolicy.KL, ExitPolicy.GATED_KL) and router is None
  if fast:
    check_fn, carry = _gated_kl_check(model, cache, pos, cfg, token_B.shape[0])
  else:
    check_fn, carry0 = policies.make_check_fn(
        cfg.policy, eps=cfg.eps, readout=lambda s: readout(s)[0],
        w_VxD=model.head_weight(), router=router, use_kernel=cfg.use_kernel,
        min_loops=cfg.min_loops, check_every=cfg.check_every)
    carry = carry0(s0)
  res = recurrence.early_exit(masked_step, check_fn, s0, cache.core, carry,
                              min_loops=cfg.min_loops, max_loops=_max_loops(cfg),
                              check_every=cfg.check_every, return_check=True)

  def final_readout(_):
    h, coda_kv = readout(res.state)
    take = lambda x: lax.dynamic_slice_in_dim(x, pos, 1, 1)
    return model.logits(h)[:, 0], [(take(k), take(v)) for k, v in coda_kv]
  if fast:
    logits_c, kv_c, fresh, books = res.check
    final = jnp.logical_not(jnp.all(fresh))
    logits, new_kv = lax.cond(final, final_readout, lambda _: (logits_c, kv_c), None)
    counts = _counts(res._replace(check=books), final.astype(jnp.int32))
  else:
    logits, new_kv = final_readout(None)
    counts = _counts(res)
  coda = [_write(c, kv, pos) for c, kv in zip(cache.coda, new_kv)]
  # blocks without attention (model.attention=core) return no cache: keep theirs
  pre_kv = [kv if kv[0].shape == c[0].shape else c for kv, c in zip(pre_kv, cache.prelude)]
  out = (logits, Cache(pre_kv, list(res.kv), coda), res.depth[:, 0])
  return out + (counts,) if with_counts else out


def _gated_kl_check(model: LoopedLM, cache: Cache, pos, cfg: ExitConfig, batch: int):
  """The decode-time A1 check: carry = (logits_BxV, coda (k, v), fresh_B, CheckCarry counts).

  Each check reads two states (loops i-1 and i) in one coda + head pass: counted as two.
  """
  c = model.cfg
  pos_Bx2 = jnp.full((batch, 2), pos, jnp.int32)

  def pair(s_old, s_new):
    x = jnp.concatenate([s_old, s_new], axis=1)  # [B, 2, D]: loop i-1 and loop i
    h, kvs = model.decode_state(x, pos_Bx2, [_pair_cached(kv, pos) for kv in cache.coda])
    logits = model.logits(h)
    kv_new = [(k[:, -1:], v[:, -1:]) for k, v in kvs]  # the loop-i query's (last) slot
    return losses.kl_from_logits(logits[:, 1], logits[:, 0]), logits[:, 1], kv_new

  def check_fn(s_new, s_old, carry, i, active_Bx1):
    logits_c, kv_c, fresh, books = carry
    delta = policies.relative_change(s_new, s_old)[:, 0]
    may = (i >= max(cfg.min_loops, 2)) & ((i - cfg.min_loops) % cfg.check_every == 0)
    gated = cfg.policy == ExitPolicy.GATED_KL
    gate = delta < cfg.gate if gated else jnp.ones_like(delta, bool)
    run = jnp.any(active_Bx1[:, 0] & gate) & may

    def full(_):
      kl, logits, kv = pair(s_old, s_new)
      return kl, logits, kv, jnp.ones_like(fresh)

    def skip(_):
      return jnp.full_like(delta, jnp.inf), logits_c, kv_c, jnp.zeros_like(fresh)
    kl, logits, kv, ran = lax.cond(run, full, skip, None)
    act = active_Bx1[:, 0]
    upd = lambda new, old, m: jnp.where(m.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    logits_c = upd(logits, logits_c, act)
    kv_c = jax.tree.map(lambda n, o: upd(n, o, act), kv, kv_c)
    fresh = jnp.where(act, ran, fresh)
    n = 2 * run.astype(jnp.int32)
    books = policies.CheckCarry((), books.coda + n, books.head + n,
                                books.coda_BxL + n * active_Bx1, books.head_BxL + n * active_Bx1)
    return ((kl < cfg.eps) & gate)[:, None], (logits_c, kv_c, fresh, books), {}

  z = jnp.zeros((batch, 1, c.num_kv_heads, c.head_dim), model.dtype)
  carry = (jnp.zeros((batch, c.vocab_size), jnp.float32), [(z, z) for _ in range(c.n_coda)],
           jnp.zeros((batch,), bool), policies.CheckCarry((), jnp.int32(0), jnp.int32(0),
                                                          *[jnp.zeros((batch, 1), jnp.int32)] * 2))
  return check_fn, carry


def score_cached(model: LoopedLM, tokens_BxL, prompt_len: int, cfg: ExitConfig, rng,
                 router=None, with_counts: bool = False):
  """Teacher-forced scoring in cached semantics: prefill the prompt, then one token at a time.

  Returns (logits, depth, prompt depth[, counts]): logits [B, L - prompt_len, V]
  predicting tokens prompt_len..L-1, the depths [B, L - prompt_len] of tokens
  prompt_len..L-1, the prompt's depths [B, prompt_len] and, with with_counts, the decode
  steps' Counts stacked over tokens (batch passes [T], per-token arrays [B, T]).
  """
  l = tokens_BxL.shape[1]
  cache, last, pdepth = prefill(model, tokens_BxL[:, :prompt_len], cfg, rng, l, router)

  def body(cache, t):
    tok = lax.dynamic_index_in_dim(tokens_BxL, t, 1, keepdims=False)
    logits, cache, d, n = decode_step(model, cache, tok, t, cfg, rng, router, with_counts=True)
    return cache, (logits, d, n)

  _, (logits, depth, n) = lax.scan(body, cache, jnp.arange(prompt_len, l))
  logits = jnp.concatenate([last[None], logits[:-1]], 0) if l > prompt_len else last[None]
  out = jnp.swapaxes(logits, 0, 1), jnp.swapaxes(depth, 0, 1), pdepth
  per_token = lambda x: jnp.swapaxes(x[..., 0], 0, 1)  # [T, B, 1] -> [B, T]
  n = n._replace(depth=per_token(n.depth), coda=per_token(n.coda), head=per_token(n.head))
  return out + (n,) if with_counts else out


def generate(model: LoopedLM, prompt_BxP, n_new: int, cfg: ExitConfig, rng, *,
             temperature: float = 0.0, router=None):
  """Samples n_new tokens (greedy at temperature 0); returns (tokens_BxL, depth_Bxn_new)."""
  b, p = prompt_BxP.shape
  total = p + n_new
  cache, logits, _ = prefill(model, prompt_BxP, cfg, rng, total, router)

  def pick(logits, key):
    if temperature <= 0:
      return jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

  def body(carry, t):
    cache, logits = carry
    tok = pick(logits, jax.random.fold_in(rng, 1_000_003 + t))
    logits, cache, d = decode_step(model, cache, tok, t, cfg, rng, router)
    return (cache, logits), (tok, d)

  _, (toks, depth) = lax.scan(body, (cache, logits), jnp.arange(p, total))
  tokens = jnp.concatenate([prompt_BxP, toks.T], axis=1)
  return tokens, depth.T
