"""Control flow over the shared core: fixed scan, bucketed switch, early-exit while_loop.

Nothing here knows about attention or vocabularies; the model enters through
closures:
  step_fn(s) -> s                             (training / uniform depth)
  masked_step_fn(s, kv, active) -> (s, kv)    (early exit; kv: per core block (k, v))
  check_fn(s_new, s_old, carry, i, active) -> (exit_BxL, carry, stats)

Early-exit semantics (teacher-forced, all positions in parallel): at loop i every
still-active token runs the core; an exited token's state is frozen and the keys
and values it offers the other tokens in each core block are those of its last
executed loop. `masked_step_fn` implements the freezing of keys/values (see
`elastic_depth.inference`); this module freezes states, counts depths and decides
when to stop: at `max_loops`, or as soon as no token is active.
"""

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def fixed_depth(step_fn: Callable, s: Any, n: int, *, remat: bool = True,
                policy: Callable | None = None, unroll: int = 1) -> Any:
  """Applies step_fn n times (static n) with a lax.scan; remat (with a jax policy) on the step."""
  if n == 0:
    return s
  body = jax.checkpoint(step_fn, policy=policy) if remat else step_fn
  s, _ = lax.scan(lambda c, _: (body(c), None), s, None, length=n, unroll=min(unroll, n))
  return s


def dynamic_depth(step_fn: Callable, s: Any, n: jax.Array) -> Any:
  """Applies step_fn a traced number of times (forward only: a while loop)."""
  return lax.fori_loop(0, n, lambda _, c: step_fn(c), s)


def bucketed_depth(step_fn: Callable, s: Any, bucket_idx: jax.Array,
                   buckets: Sequence[int], *, backprop_depth: int = 0,
                   remat: bool = True, policy: Callable | None = None,
                   unroll: int = 1) -> Any:
  """Runs buckets[bucket_idx] loops: one lax.switch branch per bucket, each a fixed scan.

  Args:
    step_fn: one recurrence step, s -> s.
    s: initial state (any pytree).
    bucket_idx: traced int32 scalar in [0, len(buckets)).
    buckets: static loop counts.
    backprop_depth: if > 0, only the last backprop_depth loops receive gradient.
    remat: jax.checkpoint each step (much less memory, and faster on CPU).
    policy: what remat keeps for the backward pass (a jax.checkpoint_policies entry;
      None: nothing, every step is recomputed).
    unroll: loops per scan iteration (lax.scan's unroll; the result is the same).
  Returns:
    The state after buckets[bucket_idx] steps.
  """
  def branch(b: int):
    k = b if backprop_depth <= 0 else min(b, backprop_depth)

    def run(s):
      if b > k:
        s = lax.stop_gradient(fixed_depth(step_fn, s, b - k, remat=remat, policy=policy,
                                          unroll=unroll))
      return fixed_depth(step_fn, s, k, remat=remat, policy=policy, unroll=unroll)
    return run

  branches = [branch(b) for b in buckets]
  if len(branches) == 1:
    return branches[0](s)
  return lax.switch(jnp.asarray(bucket_idx, jnp.int32), branches, s)


class ExitResult(NamedTuple):
  """Output of early_exit."""
  state: jax.Array         # final states, [B, L, D]
  kv: Any                  # per core block (k, v) offered at the end (last executed loop)
  depth: jax.Array         # loops executed per token, int32 [B, L]
  loops: jax.Array         # loops the while_loop ran (max over tokens), int32 []
  traces: Any              # per-loop stats [R, B, L] (zeros unless trace=True)
  check: Any = None        # final carry of check_fn (with return_check=True)
  counts: Any = None       # executed work (inference.exit_loop fills it: Counts)


def early_exit(masked_step_fn: Callable, check_fn: Callable, s0: jax.Array, kv0: Any,
               check0: Any, *, min_loops: int, max_loops: int, check_every: int = 1,
               active0: jax.Array | None = None, trace: bool = False,
               return_check: bool = False) -> ExitResult:
  """Per-token early exit: a lax.while_loop with an active mask over B x L tokens.

  Args:
    masked_step_fn: (s, kv, active_BxL) -> (s_new, kv_new): one core loop in which
      inactive tokens offer their frozen keys/values `kv`.
    check_fn: (s_new, s_old, carry, i, active) -> (exit_BxL, carry, stats of [B, L]);
      i is the 1-based index of the loop just run.
    s0: initial state [B, L, D].
    kv0: initial per-block (k, v) buffers (any values: every token runs loop 1).
    check0: initial carry of check_fn.
    min_loops: no token exits before this many loops.
    max_loops: hard cap.
    check_every: the criterion is consulted at loops min_loops, min_loops + n, ...
    active0: optional initial mask (e.g. padding positions start inactive).
    trace: record check_fn's stats at every loop (shape [max_loops, B, L, ...]).
    return_check: also return check_fn's final carry.
  Returns:
    ExitResult.
  """
  b, l = s0.shape[:2]
  active = jnp.ones((b, l), bool) if active0 is None else active0
  depth = jnp.zeros((b, l), jnp.int32)
  _, _, stats_shape = jax.eval_shape(check_fn, s0, s0, check0, jnp.int32(1), active)
  traces = {k: jnp.zeros((max_loops if trace else 0,) + v.shape, v.dtype)
            for k, v in stats_shape.items()}

  def cond(c):
    i, _, _, active, *_ = c
    return (i < max_loops) & jnp.any(active)

  def body(c):
    i, s, kv, active, depth, check, traces = c
    s_new, kv = masked_step_fn(s, kv, active)
    s_new = jnp.where(active[..., None], s_new, s)
    i = i + 1
    depth = depth + active.astype(jnp.int32)
    want, check, stats = check_fn(s_new, s, check, i, active)
    may = (i >= min_loops) & ((i - min_loops) % check_every == 0)
    active = active & ~(want & may)
    if trace:
      traces = {k: lax.dynamic_update_index_in_dim(traces[k], stats[k], i - 1, 0)
                for k in traces}
    return i, s_new, kv, active, depth, check, traces

  init = (jnp.int32(0), s0, kv0, active, depth, check0, traces)
  i, s, kv, _, depth, check, traces = lax.while_loop(cond, body, init)
  return ExitResult(state=s, kv=kv, depth=depth, loops=i, traces=traces,
                    check=check if return_check else None)


# ----------------------------------------------------------------------------
# Compacted early exit: the core runs on the still-active tokens only.


class CompactExitResult(NamedTuple):
  """Output of early_exit_compacted."""
  state: jax.Array         # final states, [B, L, D]
  depth: jax.Array         # loops executed per token, int32 [B, L]
  loops: jax.Array         # loops the while_loop ran, int32 []
  slots: jax.Array         # query slots executed, sum over loops of B x capacity, int32 []
  carry: Any               # final carry of step_fn
  phase_slots: Any = None  # slots at each capacity of caps (sum: slots), int32 [len(caps)]


def capacities(l: int, steps: int = 8) -> tuple[int, ...]:
  """Static per-row buffer sizes: multiples of ceil(l / steps), and powers of two below."""
  caps = {-(-l * k // steps) for k in range(1, steps + 1)}
  j = 1
  while j < l / steps:
    caps.add(j)
    j *= 2
  return tuple(sorted(caps))


def gather_rows(x_BxL: jax.Array, idx_BxC: jax.Array) -> jax.Array:
  """x[b, idx[b, c], ...] (out-of-range indices read the last position)."""
  idx = idx_BxC.reshape(idx_BxC.shape + (1,) * (x_BxL.ndim - 2))
  return jnp.take_along_axis(x_BxL, idx, axis=1, mode='clip')


def scatter_rows(x_BxL: jax.Array, idx_BxC: jax.Array, y_BxC: jax.Array) -> jax.Array:
  """x with x[b, idx[b, c]] = y[b, c]; out-of-range indices (padding slots) are dropped."""
  rows = jnp.arange(x_BxL.shape[0])[:, None]
  return x_BxL.at[rows, idx_BxC].set(y_BxC.astype(x_BxL.dtype), mode='drop')


def right_aligned(active_BxL: jax.Array, cap: int) -> jax.Array:
  """Per row, the positions of the active tokens in increasing order, in the last slots
  of a [B, cap] buffer; the leading padding slots hold L.

  So slot c holds a position <= L - cap + c in every row (what lets compacted attention
  skip the keys no query of a slot range can see).
  """
  l = active_BxL.shape[1]
  rev = jax.vmap(lambda a: jnp.nonzero(a[::-1], size=cap, fill_value=-1)[0])(active_BxL)
  return (l - 1 - rev)[:, ::-1]


def early_exit_compacted(phase_fn: Callable, s0: jax.Array, carry0: Any, *,
                         caps: Sequence[int], min_loops: int, max_loops: int,
                         check_every: int = 1,
                         active0: jax.Array | None = None) -> CompactExitResult:
  """Per-token early exit that runs each loop on the active tokens only.

  A loop runs on a [B, C] buffer of each row's active tokens, C the smallest of `caps`
  that holds the fullest row. Rows only lose tokens, so C never grows: the loops run
  in phases, one lax.while_loop per capacity from the largest down. A phase gathers its
  tokens once (`right_aligned` slots; padding slots point at position L and are dropped
  when results are scattered back) and keeps them while C is still the capacity needed:
  a token that exits inside the phase keeps its slot, frozen (its state is kept, its
  keys/values are no longer written). Its loops run on the buffer's states only: no
  per-loop gather or scatter of [B, L] arrays, no copies of the carried buffers. The
  states go back at the phase's end. Decisions follow `early_exit`.

  Args:
    phase_fn: (idx_BxC, s_BxLxD) -> step, once per phase (idx: the buffer's positions,
      s: the states at the phase's start; it gathers what stays fixed in the phase);
      step(live_BxC, s_BxCxD, carry, i) -> (s_new_BxCxD, exit_BxC, carry) runs one loop
      (i: 1-based loop index) of the buffer's slots; only the live ones may write into
      the carry (full-size buffers).
    s0: initial state [B, L, D].
    carry0: initial carry of step.
    caps: static capacities, increasing, the last >= L.
    min_loops, max_loops, check_every, active0: as in `early_exit`.
  Returns:
    CompactExitResult.
  """
  b, l = s0.shape[:2]
  caps_C = jnp.asarray(caps, jnp.int32)
  # the capacity index a buffer needs (a sum, not searchsorted: that is a while loop)
  needed = lambda live: jnp.sum(caps_C < jnp.max(jnp.sum(live, axis=1)))

  def phase(k: int, cap: int, i, s, active, depth, carry):
    idx = right_aligned(active, cap)
    step = phase_fn(idx, s)

    def cond(c):
      i, _, live = c[:3]
      return (i < max_loops) & jnp.any(live) & (needed(live) == k)

    def body(c):
      i, s_c, live, depth_c, carry = c
      i = i + 1
      s_new, want, carry = step(live, s_c, carry, i)
      s_c = jnp.where(live[..., None], s_new, s_c)
      depth_c = depth_c + live.astype(jnp.int32)
      may = (i >= min_loops) & ((i - min_loops) % check_every == 0)
      return i, s_c, live & ~(want & may), depth_c, carry

    live = gather_rows(active, idx) & (idx < l)
    init = (i, gather_rows(s, idx), live, gather_rows(depth, idx), carry)
    i_end, s_c, live, depth_c, carry = lax.while_loop(cond, body, init)
    return (i_end, scatter_rows(s, idx, s_c), scatter_rows(active, idx, live),
            scatter_rows(depth, idx, depth_c), carry), (i_end - i) * (b * cap)

  active = jnp.ones((b, l), bool) if active0 is None else active0
  c = (jnp.int32(0), s0, active, jnp.zeros((b, l), jnp.int32), carry0)
  phase_slots = [None] * len(caps)
  for k in reversed(range(len(caps))):
    c, phase_slots[k] = phase(k, caps[k], *c)
  i, s, _, depth, carry = c
  phase_slots = jnp.stack(phase_slots)
  return CompactExitResult(state=s, depth=depth, loops=i, slots=jnp.sum(phase_slots),
                           carry=carry, phase_slots=phase_slots)
