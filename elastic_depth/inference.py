"""Teacher-forced scoring of a frozen looped LM with per-token early exit.

Parallel semantics (`score`, documented in WORKSPACE.md): all positions run together;
at loop i a token attends to every earlier token's keys/values of loop min(i, its exit
depth). With no exit this is exactly the training computation at uniform depth. Three
engines run it: `exit_loop` (masked), `compact_exit_loop` (active tokens only, per-row
buffers) and `pooled_exit_loop` (one buffer for the whole batch).
Cached decoding (one token at a time over a KV cache) is in `decoding`.
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from elastic_depth import compaction, policies, recurrence
from elastic_depth import model as model_lib
from elastic_depth.config import ExitConfig, ExitEngine, ExitPolicy, check_exit
from elastic_depth.model import LoopedLM, keep_kv


class ScoreResult(NamedTuple):
  """Teacher-forced scoring output."""
  logits: jax.Array   # [B, L, V] fp32
  depth: jax.Array    # [B, L] loops per token
  traces: Any         # dict of [R, B, L] per-loop stats (empty unless trace)
  kv: Any             # per core block (k, v) offered at the end
  inj: jax.Array      # the injection [B, L, D] (model.inject of the prelude output)
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
  core_keys: Any = None    # keys per query the core's attention multiplied, float32 []


def exit_counts(res: recurrence.ExitResult, final: int = 1, core_keys=None) -> Counts:
  """Counts of an early_exit run (check carry: policies.CheckCarry) plus `final` readouts."""
  c = res.check
  keys = None if core_keys is None else jnp.float32(core_keys)
  return Counts(res.loops, c.coda + final, c.head + final, res.depth, c.coda_BxL + final,
                c.head_BxL + final, keys)


def _freeze(kv_prev, active_BxL):
  """kv_fn that lets inactive tokens offer their frozen keys/values."""
  a = active_BxL[:, :, None, None]
  k_prev, v_prev = kv_prev
  return lambda k, v: (jnp.where(a, k, k_prev), jnp.where(a, v, v_prev), None)


def loop_cap(cfg: ExitConfig) -> int:
  """The most loops a token may run under cfg (uniform: cfg.depth)."""
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
  Raises:
    ValueError (ConfigError) for tokens out of shape, length or vocabulary, or an exit
    config the engines cannot honour.
  """
  model_lib.check_tokens(model.cfg, tokens_BxL)
  check_exit(cfg)
  engine = _ENGINES[ExitEngine(cfg.engine)]
  out = model.forward(tokens_BxL, rng, engine(cfg, router=router, targets_BxL=targets_BxL,
                                              trace=trace, exit_mask_BxL=exit_mask_BxL))
  res = out.aux
  return ScoreResult(out.logits, res.depth, res.traces, res.kv, out.inj, out.state,
                     out.prelude_kv, out.coda_kv, res.counts)


def _masked_check(check_fn, exit_mask_BxL):
  """A check whose exit decisions are limited to the positions of exit_mask_BxL."""
  def check(*args):
    ex, carry, stats = check_fn(*args)
    return ex & exit_mask_BxL, carry, stats
  return check


def exit_loop(cfg: ExitConfig, *, router=None, targets_BxL=None, trace: bool = False,
              exit_mask_BxL=None, active_BxL=None, schedule_BxL=None,
              trace_states: bool = False):
  """Loop policy for LoopedLM.forward: per-token early exit in parallel semantics.

  Args:
    cfg: exit policy, eps, min/max loops (uniform: cfg.depth), check_every, gate.
    router: the state probe of policies router and kl_probe.
    targets_BxL: int32 [B, L] next tokens; with trace, per-loop NLL is recorded.
    trace: record the check's statistics at every loop.
    exit_mask_BxL: bool [B, L]: only tokens where it is True may exit early (the others
      run to the maximum); the rule is still evaluated everywhere.
    active_BxL: bool [B, L] initial mask (padding starts inactive).
    schedule_BxL: int32 [B, L], benchmarks only: a token also exits at the first allowed
      loop >= schedule (`policies.scheduled`).
    trace_states: with trace, the traces hold each loop's states too ('state', [R, B, L, D]).
  Returns:
    loop(model, s0_BxLxD, inj_BxLxD, pos_BxL) -> (s_BxLxD, aux): the final states and the
    recurrence.ExitResult (int32 depths [B, L], per-loop traces [R, B, L(, D)] with trace
    (else {}), per core block the offered keys/values [B, L, G, K], the check's final
    carry, and `Counts`: batch passes int32 [], per-token arrays int32 [B, L], core_keys
    float32 [] = L).
  """
  def loop(model: LoopedLM, s0, inj, pos):
    b, l = s0.shape[:2]
    c = model.cfg
    zeros = jnp.zeros((b, l, c.num_kv_heads, c.head_dim), inj.dtype)
    kv0 = [(zeros, zeros) for _ in range(c.n_core)]
    rot = model.rotary(pos)  # once, outside the while_loop

    def masked_step(s, kv, active):
      return model.core_step(s, inj, pos, [_freeze(kv[j], active) for j in range(c.n_core)],
                             rot=rot)

    readout = lambda s: model.decode_state(s, pos)[0]
    check_fn, carry0 = policies.make_check_fn(
        cfg.policy, eps=cfg.eps, readout=readout, w_VxD=model.head_matrix(),
        router=router, targets_BxL=targets_BxL, use_kernel=cfg.use_kernel, trace=trace,
        min_loops=cfg.min_loops, check_every=cfg.check_every, gate=cfg.gate,
        max_loops=loop_cap(cfg), patience=cfg.patience, eps_growth=cfg.eps_growth,
        trace_states=trace_states)
    if exit_mask_BxL is not None:
      check_fn = _masked_check(check_fn, exit_mask_BxL)
    if schedule_BxL is not None:
      check_fn = policies.scheduled(check_fn, lambda: schedule_BxL)
    res = recurrence.early_exit(masked_step, check_fn, s0, kv0, carry0(s0),
                                min_loops=cfg.min_loops, max_loops=loop_cap(cfg),
                                check_every=cfg.check_every, active0=active_BxL,
                                trace=trace, return_check=True)
    # the frozen-kv hook's jax.nn.dot_product_attention multiplies all L keys per query
    return res.state, res._replace(counts=exit_counts(res, core_keys=s0.shape[1]))
  return loop


def _scatter_kv(kv_prev, idx_BxC, pos_BxL, pos_BxC):
  """kv_fn for a buffer's queries: their fresh (k, v) overwrite the rows' kv-group-major
  buffers [B, G, L, K] at idx (slots pointing past the row write nothing), and they
  attend there (`compaction.compact_attention`)."""
  rows = jnp.arange(idx_BxC.shape[0])[:, None]
  put = lambda x, y: x.at[rows, :, idx_BxC].set(y.astype(x.dtype), mode='drop')
  attend = lambda q, k, v: compaction.compact_attention(q, k, v, pos_BxC, pos_BxL)
  return lambda k, v: (put(kv_prev[0], k), put(kv_prev[1], v), attend)


def _pooled_kv(kv_prev, idx_1xC, pos_BxL):
  """_scatter_kv for a pooled buffer (flat token indices b L + l) over per-row buffers
  [B, G, L, K] (`compaction.pooled_attention`)."""
  l = pos_BxL.shape[1]
  r_C, c_C = idx_1xC[0] // l, idx_1xC[0] % l
  put = lambda x, y: x.at[r_C, :, c_C].set(y[0].astype(x.dtype), mode='drop')
  attend = lambda q, k, v: compaction.pooled_attention(q, k, v, idx_1xC, pos_BxL)
  return lambda k, v: (put(kv_prev[0], k), put(kv_prev[1], v), attend)


class _Layout(NamedTuple):
  """Where a compacted run's tokens are: the model's rows (per-row buffers) or one pool."""
  pos: jax.Array       # the model's positions [B, L]
  kv_fn: Callable      # (kv buffers, put_idx, the buffer's positions) -> a block's kv_fn
  to_rows: Callable    # the run's [B', L', ...] -> the model's rows [B, L, ...]
  from_rows: Callable  # the inverse
  keys: Callable       # capacity -> mean keys per buffer slot of the core's attention


def _row_layout(pos_BxL) -> _Layout:
  same = lambda x: x
  return _Layout(pos_BxL, lambda kv, idx, p: _scatter_kv(kv, idx, pos_BxL, p), same, same,
                 lambda c: compaction.compact_keys(c, pos_BxL.shape[1]))


def _pooled_layout(pos_BxL) -> _Layout:
  b, l = pos_BxL.shape
  return _Layout(pos_BxL, lambda kv, idx, p: _pooled_kv(kv, idx, pos_BxL),
                 lambda x: x.reshape((b, l) + x.shape[2:]),
                 lambda x: x.reshape((1, b * l) + x.shape[2:]),
                 lambda c: compaction.pooled_keys(c, b, l))


def _group_major(kv):
  """Per block (k, v) [B, L, G, K] <-> [B, G, L, K]."""
  return [(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)) for k, v in kv]


class _Buffer(NamedTuple):
  """A phase's buffer: positions idx_BxC in the rows, and what it gathered once."""
  idx: jax.Array      # [B, C] (padding slots: L)
  s: jax.Array        # full states at the phase's start [B, L, D]
  pos: jax.Array      # [B, C]
  inj: jax.Array      # [B, C, D] the slots' injections
  rot: Any            # RoPE tables of the slots


def _compact_readout(model, buf: _Buffer, put_idx, s_new, lay: _Layout, coda_kv, compact_coda,
                     needs_head, read):
  """(h of the buffer's tokens, coda kv buffers) at a loop whose p_i a check reads.

  Elsewhere (read False) h is zeros and the buffers are unchanged; without a KL policy
  there is no readout. put_idx: idx with the slots of exited tokens pointing past the row.
  """
  if compact_coda:
    def run():
      fns = [lay.kv_fn(x, put_idx, buf.pos) for x in coda_kv]
      h, kv = model.decode_state(s_new, buf.pos, fns)
      return h, keep_kv(model.coda, kv, coda_kv)
    return lax.cond(read, run, lambda: (jnp.zeros_like(s_new), coda_kv))
  if needs_head:  # later coda blocks depend on every token: run all, gather
    full = lambda: lay.from_rows(model.decode_state(
        lay.to_rows(recurrence.scatter_rows(buf.s, buf.idx, s_new)), lay.pos)[0])
    return lax.cond(read, lambda: recurrence.gather_rows(full(), buf.idx),
                    lambda: jnp.zeros_like(s_new)), coda_kv
  return jnp.zeros((), s_new.dtype), coda_kv


def _gathered_check(check_fn, chk: policies.CheckCarry, idx, put_idx, s_new, s_c, i, live):
  """check_fn on the buffer's live tokens, with the gathered part of its full-size carry.

  Returns (exit_BxC, the carry scattered back at put_idx, readouts and head products it ran).
  """
  g = lambda x: recurrence.gather_rows(x, idx)
  put = lambda x, y: recurrence.scatter_rows(x, put_idx, y)
  per_token = chk.prev.ndim >= 2  # p_{i-1}'s logits, or state_delta's run below eps
  c = policies.CheckCarry(g(chk.prev) if per_token else chk.prev, jnp.int32(0),
                          jnp.int32(0), g(chk.coda_BxL), g(chk.head_BxL))
  want, c, _ = check_fn(s_new, s_c, c, i, live)
  chk = policies.CheckCarry(put(chk.prev, c.prev) if per_token else chk.prev, chk.coda,
                            chk.head, put(chk.coda_BxL, c.coda_BxL), put(chk.head_BxL, c.head_BxL))
  return want, chk, c.coda, c.head


def _compact_phase(model: LoopedLM, cfg: ExitConfig, inj, pos, lay: _Layout, compact_coda: bool,
                   *, router, exit_mask_BxL, schedule_BxL):
  """compact_exit_loop's phase_fn: gathers a phase's buffer once; its step runs one loop
  of the buffer's live tokens and their exit check.

  The carry is (core kv buffers, coda kv buffers, CheckCarry, coda token passes, head
  token passes); a step returns (new buffer states, exit_BxC, carry).
  """
  policy = ExitPolicy(cfg.policy)
  needs_head = policy in policies.HEAD_POLICIES
  _, reads = policies.check_schedule(policy, cfg.min_loops, cfg.check_every, loop_cap(cfg))
  b, l = pos.shape
  rot = model.rotary(pos)  # once, outside the while_loop; each phase gathers its rows

  def phase(idx, s):
    g = lambda x: recurrence.gather_rows(x, idx)
    buf = _Buffer(idx, s, g(pos), g(inj), jax.tree.map(g, rot))
    exit_c = None if exit_mask_BxL is None else g(exit_mask_BxL)
    eps = cfg.eps if jnp.shape(cfg.eps)[1:] in ((), (1,)) else g(cfg.eps)  # per token: gather
    sched_c = None if schedule_BxL is None else g(schedule_BxL)

    def step(live, s_c, carry, i):
      kv, coda_kv, chk, n_coda, n_head = carry
      put_idx = jnp.where(live, idx, l)  # exited slots write nothing
      s_new, kv = model.core_step(s_c, buf.inj, buf.pos,
                                  [lay.kv_fn(x, put_idx, buf.pos) for x in kv], rot=buf.rot)
      s_new = jnp.where(live[..., None], s_new, s_c)
      h_new, coda_kv = _compact_readout(model, buf, put_idx, s_new, lay, coda_kv, compact_coda,
                                        needs_head, reads(i))
      check_fn, _ = policies.make_check_fn(
          policy, eps=eps, readout=lambda _: h_new, w_VxD=model.head_matrix(),
          router=router, use_kernel=cfg.use_kernel, min_loops=cfg.min_loops,
          check_every=cfg.check_every, gate=cfg.gate, max_loops=loop_cap(cfg),
          patience=cfg.patience, eps_growth=cfg.eps_growth)
      if exit_c is not None:  # as exit_loop: the mask, then the schedule
        check_fn = _masked_check(check_fn, exit_c)
      if sched_c is not None:
        check_fn = policies.scheduled(check_fn, lambda: sched_c)
      want, chk, coda_n, head_n = _gathered_check(check_fn, chk, idx, put_idx, s_new, s_c, i,
                                                  live)
      n_coda += coda_n * b * (idx.shape[1] if compact_coda else l)
      n_head += head_n * b * idx.shape[1]
      return s_new, want, (kv, coda_kv, chk, n_coda, n_head)
    return step
  return phase


def compact_exit_loop(cfg: ExitConfig, *, router=None, targets_BxL=None, trace: bool = False,
                      exit_mask_BxL=None, active_BxL=None, schedule_BxL=None,
                      steps: Optional[int] = None, layout: Optional[_Layout] = None):
  """Loop policy: the same per-token exit as `exit_loop`, run on the active tokens only.

  Loops run in phases of one capacity (`recurrence.early_exit_compacted`: every row's
  active tokens in a buffer of one of `recurrence.capacities(L, steps)` slots, gathered
  once per phase); the core runs on the buffer (queries) against the whole rows'
  keys/values (kv-group-major buffers, the live tokens' fresh ones scattered in,
  `compaction.compact_attention`), and so do the exit check's readout, head and KL
  (only at the loops a check reads, as in `policies.make_check_fn`). With at most one
  coda block the coda is compacted too (an exited token's coda keys/values are those of
  its last readout, which ran on its final state); with more, later coda blocks'
  keys/values depend on other tokens, so the coda runs on all tokens and its output is
  gathered. Depths and logits equal exit_loop's.

  Args:
    cfg: exit policy, eps, min/max loops, check_every, gate, compact_steps.
    router: the state probe, as `exit_loop`.
    targets_BxL: ignored (only read by traces).
    trace: must be False (per-loop traces need the masked engine).
    exit_mask_BxL, active_BxL, schedule_BxL: as `exit_loop`, bool/bool/int32 [B, L].
    steps: buffer capacities `recurrence.capacities(L, steps)` (default cfg.compact_steps).
    layout: where the tokens are (`pooled_exit_loop`; default: the model's rows).
  Returns:
    loop(model, s0_BxLxD, inj_BxLxD, pos_BxL) -> (s_BxLxD, aux): the final states and a
    CompactAux (int32 depths [B, L], per core block the offered keys/values [B, L, G, K],
    loops and query slots run, int32 [], no traces, and `Counts` in executed token
    slots / (B x L): batch passes and core_keys float32 [], per-token arrays int32
    [B, L]). With a pooled layout the loop's arrays are [1, B x L, ...] (the keys/values
    stay [B, L, G, K]).
  Raises:
    ValueError with trace.
  """
  del targets_BxL  # only read by traces
  if trace:
    raise ValueError('error: per-loop traces need exit.engine=masked')
  steps = cfg.compact_steps if steps is None else steps
  policy = ExitPolicy(cfg.policy)
  needs_head = policy in policies.HEAD_POLICIES

  def loop(model: LoopedLM, s0, inj, pos):
    c = model.cfg
    b, l = s0.shape[:2]
    lay = _row_layout(pos) if layout is None else layout
    rows, cols = lay.pos.shape
    zeros = jnp.zeros((rows, c.num_kv_heads, cols, c.head_dim), inj.dtype)
    compact_coda = needs_head and c.n_coda <= 1
    # tokens inactive from the start offer the coda keys/values of their initial state
    pad = compact_coda and active_BxL is not None
    coda_kv0 = (_group_major(model.decode_state(lay.to_rows(s0), lay.pos)[1]) if pad else
                [(zeros, zeros)] * c.n_coda if compact_coda else [])
    _, carry0 = policies.make_check_fn(policy, eps=cfg.eps, w_VxD=model.head_matrix(),
                                       router=router, use_kernel=cfg.use_kernel,
                                       patience=cfg.patience)

    phase = _compact_phase(model, cfg, inj, pos, lay, compact_coda, router=router,
                           exit_mask_BxL=exit_mask_BxL, schedule_BxL=schedule_BxL)
    carry = ([(zeros, zeros) for _ in range(c.n_core)], coda_kv0, carry0(s0),
             jnp.int32(b * l if pad else 0), jnp.int32(0))
    res = recurrence.early_exit_compacted(
        phase, s0, carry, caps=recurrence.capacities(l, steps), min_loops=cfg.min_loops,
        max_loops=loop_cap(cfg), check_every=cfg.check_every, active0=active_BxL)
    kv, _, chk, n_coda, n_head = res.carry
    per = lambda n: n.astype(jnp.float32) / (b * l) + 1.0  # + the final readout
    counts = Counts(res.slots.astype(jnp.float32) / (b * l), per(n_coda), per(n_head),
                    res.depth, chk.coda_BxL + 1, chk.head_BxL + 1,
                    _compact_core_keys(res.phase_slots, recurrence.capacities(l, steps),
                                       lay.keys))
    return res.state, CompactAux(res.depth, _group_major(kv), res.loops, res.slots, {}, counts)
  return loop


def _compact_core_keys(phase_slots_K, caps, keys: Callable) -> jax.Array:
  """Keys per query over a compacted run's core slots (keys(capacity) per slot)."""
  keys_K = jnp.asarray([keys(c) for c in caps], jnp.float32)
  n_K = phase_slots_K.astype(jnp.float32)
  return jnp.sum(n_K * keys_K) / jnp.maximum(jnp.sum(n_K), 1.0)


def pooled_exit_loop(cfg: ExitConfig, *, router=None, targets_BxL=None, trace: bool = False,
                     exit_mask_BxL=None, active_BxL=None, schedule_BxL=None,
                     steps: Optional[int] = None):
  """compact_exit_loop with one buffer for the whole batch's active tokens (exit.engine=pooled).

  Per-row buffers hold each row's fullest count, so a batch of short rows (prompts) keeps
  them nearly full while most tokens have exited; here the batch's B x L tokens are one
  pool, and a loop runs the buffer's projections on the batch's active tokens
  (`recurrence.capacities(B x L, steps)`) while attention stays per row
  (`compaction.pooled_attention`: all B x L queries, cheap for short rows). Depths,
  logits and keys/values equal exit_loop's.

  Args:
    cfg, router, targets_BxL, trace, exit_mask_BxL, active_BxL, schedule_BxL: as
      `compact_exit_loop` (masks and schedule [B, L], pooled here).
    steps: pool capacities `recurrence.capacities(B x L, steps)` (default
      cfg.compact_steps).
  Returns:
    loop(model, s0_BxLxD, inj_BxLxD, pos_BxL) -> (s_BxLxD, aux): the final states and a
    CompactAux as `compact_exit_loop`'s (depths and per-token counts [B, L], keys/values
    [B, L, G, K]).
  Raises:
    ValueError with trace.
  """
  del targets_BxL  # only read by traces
  if trace:
    raise ValueError('error: per-loop traces need exit.engine=masked')
  flat = lambda x: None if x is None else x.reshape((1, -1) + x.shape[2:])

  def loop(model: LoopedLM, s0, inj, pos):
    lay = _pooled_layout(pos)
    eps = cfg.eps if jnp.ndim(cfg.eps) == 0 else flat(jnp.broadcast_to(cfg.eps, pos.shape))
    inner = compact_exit_loop(dataclasses.replace(cfg, eps=eps), router=router,
                              exit_mask_BxL=flat(exit_mask_BxL), active_BxL=flat(active_BxL),
                              schedule_BxL=flat(schedule_BxL), steps=steps, layout=lay)
    s, aux = inner(model, flat(s0), flat(inj), flat(pos))
    n = aux.counts
    n = n._replace(depth=lay.to_rows(n.depth), coda=lay.to_rows(n.coda),
                   head=lay.to_rows(n.head))
    return lay.to_rows(s), aux._replace(depth=lay.to_rows(aux.depth), counts=n)
  return loop


class CompactAux(NamedTuple):
  """Aux output of compact_exit_loop (the fields score and prefill read, and slots)."""
  depth: jax.Array
  kv: Any
  loops: jax.Array
  slots: jax.Array
  traces: Any
  counts: Counts  # executed work; batch passes are token slots / (B x L)


_ENGINES = {ExitEngine.MASKED: exit_loop, ExitEngine.COMPACTED: compact_exit_loop,
            ExitEngine.POOLED: pooled_exit_loop}
