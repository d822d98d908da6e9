"""The serving engine's row passes (`serving`): its carry, the per-row cache reads and
writes, the admission of a row's next token, the coda readouts and the compacted core loop.

Every pass here runs on a `compaction.Rows` buffer (or on all B rows) and only reads the
caches: its queries attend to the cache and to their own fresh keys
(`attention.attention_plus`), and the fresh keys/values are written after the pass
(`put_fresh`), outside any lax.switch branch, since an XLA conditional that passes a cache
through or scatters into it copies the whole cache.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from elastic_depth import compaction, decoding, losses
from elastic_depth.attention import Rotary, attention_plus
from elastic_depth.model import LoopedLM, keep_kv


class Pick(NamedTuple):
  """How an admitted token is chosen (static): sampled at `temperature` (0: greedy), or
  forced: read from the State's token buffer, with its NLL under the exited logits."""
  temperature: float = 0.0
  forced: bool = False


class State(NamedTuple):
  """The while_loop carry: the cache and each row's in-flight token."""
  cache: decoding.Cache
  s: jax.Array             # [B, 1, D] state of the in-flight token
  inj: jax.Array           # [B, 1, D] its injection (model.inject of its prelude output)
  pos: jax.Array           # [B] its position
  loop: jax.Array          # [B] loops it has run
  n: jax.Array             # [B] tokens exited so far (generated and decoded)
  logits: jax.Array        # [B, V] output of each row's last exited token
  tokens: jax.Array        # [B, T]
  depth: jax.Array         # [B, n_new]
  init: jax.Array          # [T, 1, D] initial state of a token at each position
  counts: Any              # serving.Counts
  run: jax.Array           # [B] state_delta: loops in a row with the change below eps
  wait: jax.Array          # [B] its token exited; its readout and next admission pending
  unread: jax.Array        # [B] of which the final readout of s is pending (no check's)
  rot: Rotary              # [T, 1, 1, K/2] RoPE tables at each position (computed once)
  nll: jax.Array           # [B, n_new] forced decoding: each token's NLL (else zeros)
  seed: jax.Array          # [B] each row's sampling seed, its request's (decoding.pick)


def _put_rows(c_BxGxSxK, rows, pos, x_Bx1xGxK):
  """Row rows[j] of a group-major cache gets token-major x[j] at pos[j] (out of range: dropped)."""
  return c_BxGxSxK.at[rows, :, pos].set(x_Bx1xGxK[:, 0].astype(c_BxGxSxK.dtype), mode='drop')


def read_kv(cache_kv, pos_B, fresh: list):
  """kv_fn reading, not writing, the cache: row b's Q queries see its keys before pos_B[b]
  and each its own fresh key (`attention.attention_plus`); the last query's fresh (k, v)
  [B, 1, G, K] go to `fresh`, for `put_fresh` (writing them outside any branch: no copy
  of the cache)."""
  def fn(k, v):  # token-major [B, Q, G, K]
    fresh.append((k[:, -1:], v[:, -1:]))
    s = cache_kv[0].shape[2]
    old = (jnp.arange(s)[None, :] < pos_B[:, None])[:, None, :]
    see = jnp.eye(k.shape[1], dtype=bool)
    return k, v, lambda q, k_, v_: attention_plus(q, *cache_kv, old, k_, v_, see)
  return fn


def row_kv(cache_kv, pos_B, write_B):
  """kv_fn: row b writes its (k, v) at pos_B[b] (where write_B) and attends to <= pos_B[b]
  (the core step, outside any branch: written in place, then read)."""
  def fn(k, v):
    s = cache_kv[0].shape[2]
    new = put_fresh([cache_kv], pos_B, write_B, [(k, v)])[0]
    return (*new, decoding.attend((jnp.arange(s)[None, :] <= pos_B[:, None])[:, None, :]))
  return fn


def run_cached(call, caches, pos_B):
  """call(kv_fns) -> (x, kvs) over per-row caches (read only): (x, each block's fresh
  (k, v) [B, 1, G, K], None for blocks without attention)."""
  fresh = [[] for _ in caches]
  x, _ = call([read_kv(c, pos_B, f) for c, f in zip(caches, fresh)])
  return x, [f[0] if f else None for f in fresh]


def put_fresh(caches, pos_B, write_B, fresh: list) -> list:
  """The caches with row b's fresh (k, v) at pos_B[b] where write_B (None: kept)."""
  rows = jnp.arange(pos_B.shape[0])
  put = lambda c, x: _put_rows(c, rows, jnp.where(write_B, pos_B, c.shape[2]), x)
  return [c if f is None else tuple(put(x, y) for x, y in zip(c, f))
          for c, f in zip(caches, fresh)]


def rot(st: State, pos_C) -> Rotary:
  """RoPE tables at positions pos_C [C], [C, 1, 1, K/2]: gathered, no sin/cos in a step."""
  return Rotary(*(jnp.take(t, pos_C, axis=0) for t in st.rot))


def _next_token(st: State, rows, pos_C, rng, pick: Pick, logits_C=None):
  """(token [C], its NLL [C] under the row's exited logits (default: st.logits' rows):
  forced decoding only, else ())."""
  logits_C = rows.take(st.logits) if logits_C is None else logits_C
  if not pick.forced:
    return decoding.pick(logits_C, pos_C, rng, pick.temperature, rows.take(st.seed)), ()
  tok_C = jnp.take_along_axis(rows.take(st.tokens), pos_C[:, None], axis=1)[:, 0]
  return tok_C, (losses.nll(logits_C, tok_C),)


def admission(model: LoopedLM, st: State, rows, pos_C, rng, pick: Pick, logits_C=None):
  """The admission pass on a buffer's rows at pos_C: (token, initial state, injection,
  prelude fresh (k, v), NLL tuple) [C, ...]."""
  tok_C, nll_C = _next_token(st, rows, pos_C, rng, pick, logits_C)
  pre = [tuple(rows.take(c) for c in ck) for ck in st.cache.prelude]
  e_C, fresh = run_cached(
      lambda f: model.encode(tok_C[:, None], pos_C[:, None], f, rot(st, pos_C)), pre, pos_C)
  return tok_C, jnp.take(st.init, pos_C, axis=0, mode='clip'), model.inject(e_C), fresh, nll_C


def _fresh0(model: LoopedLM, blocks, b: int) -> list:
  """Per block, zero fresh (k, v) [B, 1, G, K] for a pass's results (None: no attention)."""
  z = jnp.zeros((b, 1, model.cfg.num_kv_heads, model.cfg.head_dim), model.dtype)
  return [(z, z) if blk.has_attn else None for blk in blocks]


def admit_args(model: LoopedLM, st: State, pick: Pick) -> tuple:
  """The admission's full-batch operands: token, state, injection, prelude kv, NLL."""
  b = st.s.shape[0]
  nll0 = (jnp.zeros((b,)),) if pick.forced else ()
  return (jnp.zeros((b,), jnp.int32), st.s, st.inj, _fresh0(model, model.prelude, b), *nll0)


def put_admission(rows, res, tok, s, inj, kv, *nll) -> tuple:
  """The full-batch operands with the buffer's admission results."""
  tok_C, s_C, inj_C, fresh, nll_C = res
  return (rows.put(tok, tok_C), rows.put(s, s_C), rows.put(inj, inj_C),
          jax.tree.map(rows.put, kv, fresh), *map(rows.put, nll, nll_C))


def admitted(st: State, mask_B, pos_B, pick: Pick, out, cap) -> State:
  """Rows in mask_B start their token at pos_B at loop 0 (out: `put_admission`'s)."""
  tok, s, inj, kv, *nll = out
  m, rows_B = mask_B, jnp.arange(mask_B.shape[0])
  tokens = st.tokens.at[rows_B, jnp.where(m, pos_B, st.tokens.shape[1])].set(tok, mode='drop')
  if pick.forced:
    st = st._replace(nll=st.nll.at[rows_B, jnp.where(m, st.n, st.nll.shape[1])].set(
        nll[0], mode='drop'))
  keep = lambda new, old: jnp.where(m.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
  return st._replace(cache=st.cache._replace(prelude=put_fresh(st.cache.prelude, pos_B, m, kv)),
                     s=keep(s, st.s), inj=keep(inj, st.inj), pos=jnp.where(m, pos_B, st.pos),
                     loop=jnp.where(m, 0, st.loop), run=jnp.where(m, 0, st.run), tokens=tokens,
                     counts=st.counts._replace(prelude_rows=st.counts.prelude_rows + cap))


def admit(model: LoopedLM, st: State, mask_B, pos_B, rng, pick: Pick, caps) -> State:
  """Rows in mask_B pick (or read) their token at pos_B and start it at loop 0."""
  def run(rows, *args):  # the pass returns rows; caches are written in admitted
    return put_admission(rows, admission(model, st, rows, rows.take(pos_B), rng, pick),
                          *args)
  out, cap = compaction.on_rows(mask_B, caps, run, lambda *a: a, *admit_args(model, st, pick))
  return admitted(st, mask_B, pos_B, pick, out, cap)


def coda(model: LoopedLM, st: State, caches, pos_B, x, kv_fn):
  """Coda + head over x [B, Q, D] with per-block kv_fn(cache, fresh list): logits, fresh (k, v)."""
  fresh = [[] for _ in caches]
  pos = jnp.broadcast_to(pos_B[:, None], x.shape[:2])
  h, kvs = model.decode_state(x, pos, [kv_fn(c, f) for c, f in zip(caches, fresh)],
                              rot(st, pos_B))
  z = jnp.zeros((x.shape[0], 1, model.cfg.num_kv_heads, model.cfg.head_dim), model.dtype)
  return model.logits(h), [f[0] if f else (z, z) for f in fresh]


def readout(model: LoopedLM, st: State, rows, x_CxQxD):
  """Coda + head of the buffer's rows over states x [C, Q, D] at each row's position,
  reading (not writing) the coda caches: (logits [C, Q, V], fresh coda (k, v))."""
  pos_C = rows.take(st.pos)
  caches = [tuple(rows.take(c) for c in ck) for ck in st.cache.coda]
  return coda(model, st, caches, pos_C, x_CxQxD, lambda c, f: read_kv(c, pos_C, f))


def zero_kv(model: LoopedLM, b: int) -> list:
  """Per coda block, zero fresh (k, v) [B, 1, G, K]: what a row that read nothing offers."""
  z = jnp.zeros((b, 1, model.cfg.num_kv_heads, model.cfg.head_dim), model.dtype)
  return [(z, z)] * model.cfg.n_coda


def final(model: LoopedLM, st: State, s_new, need_B, logits, kv, caps):
  """Rows in need_B (exits without a fresh check) read out their final state."""
  def run(rows, logits, kv):
    out, fresh = readout(model, st, rows, rows.take(s_new))
    return rows.put(logits, out[:, 0]), jax.tree.map(rows.put, kv, fresh)
  return compaction.on_rows(need_B, caps, run, lambda *a: a, logits, kv)


def write_coda(model: LoopedLM, st: State, kv, rows_B) -> list:
  """The coda caches with rows_B's fresh (k, v) at their positions (blocks without
  attention keep their caches, which nothing reads, as in decode_step)."""
  return keep_kv(model.coda, put_fresh(st.cache.coda, st.pos, rows_B, kv), st.cache.coda)


def core(model: LoopedLM, st: State, act, caps):
  """One core loop of the rows in act, in the smallest of caps that holds them (the others
  keep their state): (new states [B, 1, D], core caches with the fresh keys/values, rows)."""
  def run(rows, s, kv):
    pos_C = rows.take(st.pos)
    caches = [tuple(rows.take(c) for c in ck) for ck in st.cache.core]
    x, fresh = run_cached(lambda f: model.core_step(
        rows.take(st.s), rows.take(st.inj), pos_C[:, None], f, rot(st, pos_C)), caches, pos_C)
    return rows.put(s, x), jax.tree.map(rows.put, kv, fresh)
  kv0 = _fresh0(model, model.core, act.shape[0])
  (s_new, kv), cap = compaction.on_rows(act, caps, run, lambda *a: a, st.s, kv0)
  return s_new, put_fresh(st.cache.core, st.pos, act, kv), cap
