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
                     out.prelude_kv, out.coda_kv)


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
        router=router, targets_BxL=targets_BxL, use_kernel=cfg.use_kernel, trace=trace)
    if exit_mask_BxL is not None:
      check_fn = _masked_check(check_fn, exit_mask_BxL)
    if schedule_BxL is not None:
      check_fn = policies.scheduled(check_fn, lambda: schedule_BxL)
    res = recurrence.early_exit(masked_step, check_fn, s0, kv0, carry0(s0),
                                min_loops=cfg.min_loops, max_loops=_max_loops(cfg),
                                check_every=cfg.check_every, active0=active_BxL,
                                trace=trace)
    return res.state, res
  return loop


def _scatter_kv(kv_prev, idx_BxC, pos_BxL, pos_BxC):
  """kv_fn for gathered queries: their fresh (k, v) overwrite the row's buffers [B, L, G, K]."""
  def fn(k, v):
    ks = recurrence.scatter_rows(kv_prev[0], idx_BxC, k)
    vs = recurrence.scatter_rows(kv_prev[1], idx_BxC, v)
    return ks, vs, (pos_BxL[:, None, :] <= pos_BxC[:, :, None])[:, None]
  return fn


def compact_exit_loop(cfg: ExitConfig, *, router=None, targets_BxL=None, trace: bool = False,
                      exit_mask_BxL=None, active_BxL=None, schedule_BxL=None,
                      steps: int = 8):
  """Loop policy: the same per-token exit as `exit_loop`, run on the active tokens only.

  Each loop gathers every row's active tokens into a buffer of one of
  `recurrence.capacities(L, steps)` slots; the core runs on them (queries) against the
  whole row's keys/values (fresh ones scattered into the per-block frozen buffers),
  and so do the exit check's head and KL. With at most one coda block the coda is
  compacted too (an exited token's coda keys/values depend on its frozen state only);
  with more, later coda blocks' keys/values depend on other tokens, so the coda runs
  on all tokens and its output is gathered. Depths and logits equal exit_loop's.
  The aux output has .depth, .kv, .loops, .slots (executed query slots), .traces ({}).
  """
  del targets_BxL  # only read by traces
  if trace:
    raise ValueError('error: per-loop traces need exit.engine=masked')
  policy = ExitPolicy(cfg.policy)
  needs_head = policy in (ExitPolicy.KL, ExitPolicy.REVERSE_KL)

  def loop(model: LoopedLM, s0, e, pos):
    c = model.cfg
    zeros = jnp.zeros(s0.shape[:2] + (c.num_kv_heads, c.head_dim), e.dtype)
    compact_coda = needs_head and c.n_coda <= 1
    coda_kv0 = model.decode_state(s0, pos)[1] if compact_coda else []
    h0 = jnp.zeros_like(s0) if needs_head else jnp.zeros((), s0.dtype)
    check_fn, _ = policies.make_check_fn(policy, eps=cfg.eps, readout=lambda x: x,
                                         w_VxD=model.head_weight(), router=router,
                                         use_kernel=cfg.use_kernel)

    def step(idx, s, carry, i):
      kv, coda_kv, h = carry
      g = lambda x: recurrence.gather_rows(x, idx)
      pos_c, s_c = g(pos), g(s)
      s_new, kv = model.core_step(s_c, g(e), pos_c,
                                  [_scatter_kv(x, idx, pos, pos_c) for x in kv])
      h_new = h
      if compact_coda:
        h_new, coda_kv = model.decode_state(
            s_new, pos_c, [_scatter_kv(x, idx, pos, pos_c) for x in coda_kv])
      elif needs_head:
        h_new = g(model.decode_state(recurrence.scatter_rows(s, idx, s_new), pos)[0])
      # KL policies read h through the identity readout (their state change is unused)
      want, _, _ = check_fn(h_new if needs_head else s_new, s_c,
                            g(h) if needs_head else h, i)
      if exit_mask_BxL is not None:
        want = want & g(exit_mask_BxL)
      if schedule_BxL is not None:
        want = i >= g(schedule_BxL)
      if needs_head:
        h = recurrence.scatter_rows(h, idx, h_new)
      return s_new, want, (kv, coda_kv, h)

    res = recurrence.early_exit_compacted(
        step, s0, ([(zeros, zeros) for _ in range(c.n_core)], coda_kv0, h0),
        caps=recurrence.capacities(s0.shape[1], steps), min_loops=cfg.min_loops,
        max_loops=_max_loops(cfg), check_every=cfg.check_every, active0=active_BxL)
    return res.state, CompactAux(res.depth, res.carry[0], res.loops, res.slots, {})
  return loop


class CompactAux(NamedTuple):
  """Aux output of compact_exit_loop (the fields score and prefill read, and slots)."""
  depth: jax.Array
  kv: Any
  loops: jax.Array
  slots: jax.Array
  traces: Any


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
                router=None):
  """One new token at scalar position pos: returns (logits_BxV, cache, depth_B).

  For the KL policy the exit check reads the loop-(i-1) and loop-i states in one
  pass over the coda and head (one weight read for both), runs only when the
  relative state change is below cfg.gate (when cfg.gate > 0), and the logits of a
  successful check are the token's output, so the final readout costs nothing extra.
  """
  tok = token_B[:, None]
  pos_Bx1 = jnp.full(tok.shape, pos, jnp.int32)
  e, pre_kv = model.encode(tok, pos_Bx1, [_cached(kv, pos) for kv in cache.prelude])
  s0 = model.initial_state(e, jax.random.fold_in(rng, pos))

  def masked_step(s, core_kv, active_Bx1):
    fns = [_cached(kv, pos, keep_B=~active_Bx1[:, 0]) for kv in core_kv]
    return model.core_step(s, e, pos_Bx1, fns)

  def readout(s):
    return model.decode_state(s, pos_Bx1, [_cached(kv, pos) for kv in cache.coda])

  fast = cfg.policy == ExitPolicy.KL and router is None
  if fast:
    check_fn, carry = _gated_kl_check(model, cache, pos, cfg, token_B.shape[0])
  else:
    check_fn, carry0 = policies.make_check_fn(
        cfg.policy, eps=cfg.eps, readout=lambda s: readout(s)[0],
        w_VxD=model.head_weight(), router=router, use_kernel=cfg.use_kernel)
    carry = carry0(s0)
  res = recurrence.early_exit(masked_step, check_fn, s0, cache.core, carry,
                              min_loops=cfg.min_loops, max_loops=_max_loops(cfg),
                              check_every=cfg.check_every, return_check=True)

  def final_readout(_):
    h, coda_kv = readout(res.state)
    take = lambda x: lax.dynamic_slice_in_dim(x, pos, 1, 1)
    return model.logits(h)[:, 0], [(take(k), take(v)) for k, v in coda_kv]
  if fast:
    logits_c, kv_c, fresh = res.check
    logits, new_kv = lax.cond(jnp.all(fresh), lambda _: (logits_c, kv_c), final_readout,
                              None)
  else:
    logits, new_kv = final_readout(None)
  coda = [_write(c, kv, pos) for c, kv in zip(cache.coda, new_kv)]
  return logits, Cache(pre_kv, list(res.kv), coda), res.depth[:, 0]


def _gated_kl_check(model: LoopedLM, cache: Cache, pos, cfg: ExitConfig, batch: int):
  """The decode-time A1 check: carry = (logits_BxV, coda (k, v) of the token, fresh_B)."""
  c = model.cfg
  pos_Bx2 = jnp.full((batch, 2), pos, jnp.int32)

  def pair(s_old, s_new):
    x = jnp.concatenate([s_old, s_new], axis=1)  # [B, 2, D]: loop i-1 and loop i
    h, kvs = model.decode_state(x, pos_Bx2, [_pair_cached(kv, pos) for kv in cache.coda])
    logits = model.logits(h)
    n = cache.coda[0][0].shape[1] if cache.coda else 0
    kv_new = [(k[:, n + 1:n + 2], v[:, n + 1:n + 2]) for k, v in kvs]
    return losses.kl_from_logits(logits[:, 1], logits[:, 0]), logits[:, 1], kv_new

  def check_fn(s_new, s_old, carry, i, active_Bx1):
    logits_c, kv_c, fresh = carry
    delta = policies.relative_change(s_new, s_old)[:, 0]
    may = (i >= max(cfg.min_loops, 2)) & ((i - cfg.min_loops) % cfg.check_every == 0)
    gate = delta < cfg.gate if cfg.gate > 0 else jnp.ones_like(delta, bool)
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
    return ((kl < cfg.eps) & gate)[:, None], (logits_c, kv_c, fresh), {}

  z = jnp.zeros((batch, 1, c.num_kv_heads, c.head_dim), model.dtype)
  carry = (jnp.zeros((batch, c.vocab_size), jnp.float32), [(z, z) for _ in range(c.n_coda)],
           jnp.zeros((batch,), bool))
  return check_fn, carry


def score_cached(model: LoopedLM, tokens_BxL, prompt_len: int, cfg: ExitConfig, rng,
                 router=None):
  """Teacher-forced scoring in cached semantics: prefill the prompt, then one token at a time.

  Returns logits [B, L - prompt_len + 1, V] predicting tokens prompt_len.. and the
  depths [B, L - prompt_len] of tokens prompt_len.. (the prompt's own depths first).
  """
  l = tokens_BxL.shape[1]
  cache, last, pdepth = prefill(model, tokens_BxL[:, :prompt_len], cfg, rng, l, router)

  def body(cache, t):
    tok = lax.dynamic_index_in_dim(tokens_BxL, t, 1, keepdims=False)
    logits, cache, d = decode_step(model, cache, tok, t, cfg, rng, router)
    return cache, (logits, d)

  _, (logits, depth) = lax.scan(body, cache, jnp.arange(prompt_len, l))
  logits = jnp.concatenate([last[None], logits[:-1]], 0) if l > prompt_len else last[None]
  return jnp.swapaxes(logits, 0, 1), jnp.swapaxes(depth, 0, 1), pdepth


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
