"""Compaction: a pass runs on the rows (or tokens) that need it, in a static-size buffer.

`on_rows` gathers the rows of a mask into a buffer of the smallest capacity (from a few
static sizes, one `lax.switch` branch each) that holds them, runs a pass there and lets
it scatter its results back; capacity 0 skips the pass. Padding slots point at row B:
scatters drop them (`mode='drop'`), gathers read row B - 1 (`mode='clip'`) and their
results are discarded. A capacity-B buffer is the batch itself (no gather; scatters keep
the unmasked rows). `recurrence.early_exit_compacted` does the same per position within
rows (the compacted scorer); this is its batch-row counterpart (the serving engine).
`compact_attention` is the compacted scorer's attention: a buffer's queries against
their whole rows' keys/values; `pooled_attention` is the pooled scorer's (one buffer for
the whole batch's tokens).
"""

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from elastic_depth import attention as attention_lib


def pow2_capacities(b: int) -> tuple[int, ...]:
  """0 (skip), the powers of two below b, then b."""
  caps, j = [0], 1
  while j < b:
    caps.append(j)
    j *= 2
  return tuple(caps + [b])


class Rows:
  """The rows of a pass: idx_C into the batch (padding: B), and how to take and put rows."""

  def __init__(self, mask_B: jax.Array, cap: int):
    b = mask_B.shape[0]
    self.full = cap == b  # the buffer is the batch in order: no gather
    self.mask = mask_B
    self.idx = (jnp.where(mask_B, jnp.arange(b), b) if self.full
                else jnp.nonzero(mask_B, size=cap, fill_value=b)[0])

  def take(self, x_B: jax.Array) -> jax.Array:
    """x's rows of the buffer [C, ...] (padding slots: row B - 1)."""
    return x_B if self.full else jnp.take(x_B, self.idx, axis=0, mode='clip')

  def put(self, x_B: jax.Array, y_C: jax.Array) -> jax.Array:
    """x with the buffer's rows set to y (padding slots dropped)."""
    if self.full:
      return jnp.where(self.mask.reshape((-1,) + (1,) * (x_B.ndim - 1)), y_C.astype(x_B.dtype),
                       x_B)
    return x_B.at[self.idx].set(y_C.astype(x_B.dtype), mode='drop')


def on_rows(mask_B: jax.Array, caps: tuple[int, ...], run: Callable, skip: Callable, *args):
  """run(Rows, *args) on mask_B's rows in the smallest of caps that holds them.

  Args:
    mask_B: bool [B], the rows the pass needs.
    caps: static capacities, increasing, from 0 (skip) to B.
    run: (Rows, *args) -> full-batch results (scattered back with Rows.put).
    skip: (*args) -> the same structure when no row needs the pass.
    *args: operands of run and skip.
  Returns:
    (results, the capacity used: int32 [], the rows the pass executed).
  """
  caps_K = jnp.asarray(caps, jnp.int32)
  k = jnp.sum(caps_K < jnp.sum(mask_B.astype(jnp.int32)))  # (searchsorted: a while loop)
  branch = lambda cap: skip if cap == 0 else (lambda *a: run(Rows(mask_B, cap), *a))
  return lax.switch(k, [branch(c) for c in caps], *args), caps_K[k]


def compact_keys(c: int, l: int) -> float:
  """Mean keys per query that `compact_attention` multiplies for a C-slot buffer over L."""
  if c < l:  # one chunk over every key
    return float(l)
  n = attention_lib.attention_chunks(c, min_chunk=16)
  return l - c + (c // n) * (n + 1) / 2


def compact_attention(q_BxCxHxK, k_BxGxLxK, v_BxGxLxK, qpos_BxC, kpos_BxL) -> jax.Array:
  """Softmax attention of a right-aligned buffer's queries over their rows' keys/values.

  Args:
    q_BxCxHxK: queries of C slots per row (`recurrence.right_aligned`: slot c holds a
      position <= L - C + c; padding slots may hold anything but a position before the
      row's first key).
    k_BxGxLxK, v_BxGxLxK: the rows' keys/values, kv-group-major.
    qpos_BxC, kpos_BxL: positions of the queries and keys (increasing along L): a query
      sees the keys at positions <= its own.
  Returns:
    o_BxCxHxK in v's dtype (the scores are computed in fp32), the query heads of a kv
    head stacked. A buffer of fewer slots
    than L multiplies every key (`attention.masked_attention`: at shape S on XLA:CPU the
    per-chunk key slices cost more than the scores they skip); a full buffer (C = L) runs
    `attention.grouped_attention`'s query chunks, chunk i of n meeting the keys before
    (i + 1) L / n.
  """
  c, l = q_BxCxHxK.shape[1], k_BxGxLxK.shape[2]
  if c < l:
    see_BxCxL = kpos_BxL[:, None, :] <= qpos_BxC[:, :, None]
    return attention_lib.masked_attention(q_BxCxHxK, k_BxGxLxK, v_BxGxLxK, see_BxCxL)
  n = attention_lib.attention_chunks(c, min_chunk=16)
  w = c // n
  see = lambda i, end: kpos_BxL[:, None, :end] <= qpos_BxC[:, i * w:(i + 1) * w, None]
  return attention_lib.grouped_attention(q_BxCxHxK, k_BxGxLxK, v_BxGxLxK, n,
                                         lambda i: l - c + (i + 1) * w, see)


def pooled_attention(q_1xCxHxK, k_BxGxLxK, v_BxGxLxK, idx_1xC, pos_BxL) -> jax.Array:
  """Attention of a pooled buffer's queries (flat token indices b L + l) over their rows.

  The queries go back to their rows (an all-zero [B, L] grid elsewhere), every row runs
  its causal attention (`compact_attention` with a full buffer) and the buffer's outputs
  are gathered: B x L queries of L keys whatever the buffer's size C, which is cheap
  beside the buffer's projections when L is small against the model width (many short
  rows: what the pooled engine is for). Padding slots (index B x L) read row B - 1.

  Args:
    q_1xCxHxK: the buffer's queries.
    k_BxGxLxK, v_BxGxLxK: the rows' keys/values, kv-group-major.
    idx_1xC: int32 flat token index of each slot (padding: B x L).
    pos_BxL: the rows' positions (a query sees the keys at positions <= its own).
  Returns:
    o_1xCxHxK.
  """
  b, l = pos_BxL.shape
  r_C, c_C = idx_1xC[0] // l, idx_1xC[0] % l
  q_BxLxHxK = jnp.zeros((b, l) + q_1xCxHxK.shape[2:], q_1xCxHxK.dtype)
  q_BxLxHxK = q_BxLxHxK.at[r_C, c_C].set(q_1xCxHxK[0], mode='drop')
  o_BxLxHxK = compact_attention(q_BxLxHxK, k_BxGxLxK, v_BxGxLxK, pos_BxL, pos_BxL)
  return o_BxLxHxK.at[r_C, c_C].get(mode='clip')[None]


def pooled_keys(c: int, b: int, l: int) -> float:
  """Mean keys per buffer slot that `pooled_attention` multiplies for a C-slot buffer."""
  return b * l * compact_keys(l, l) / c if c else 0.0
