"""The looped LM: prelude blocks, a weight-tied core applied r times, coda blocks, head.

Every block is a sandwich-norm pre/post-norm block (Huginn's form):
  x = norm2(x + attn(norm1(x)));  x = norm4(x + mlp(norm3(x))).
One core step is `adapter(concat(state, e))` followed by the core blocks, where
`e` is the prelude output re-injected at every loop. The adapter's product is split:
concat(s, e) @ W = s @ W[:D] + e @ W[D:], and the injection e @ W[D:] (`inject`) is
computed once per forward rather than at every loop; loops and engines carry it.

Attention takes an optional `kv_fn(k, v) -> (k_all, v_all, mask)` hook that the
recurrence uses to freeze the keys/values of exited tokens or to read and write a
KV cache; every block returns the keys/values it actually attended to. The mask may
instead be a function attend(q, k_all, v_all) -> o that attends itself (the compacted
scorer's keys/values are kv-group-major, `compaction.compact_attention`).
"""

import itertools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np
from flax import nnx

from elastic_depth import recurrence
from elastic_depth.attention import (ATTN_LSE, ATTN_OUT, ROTATED_QK, Rotary, apply_rope,
                                     attention_chunks, attention_fn, rope_tables)
from elastic_depth.config import (AttentionImpl, AttentionIn, DepthConfig, InitState, ModelConfig,
                                  RematPolicy, trained_buckets, validate_model)

KVFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, Any]]  # mask: array/None/fn

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}

# What jax.checkpoint keeps of a core loop (depth.remat_policy): `dense` is a 2-D dot (no
# batch dims), the attention scores/outputs are batched dots; the names are the rotated
# queries/keys and the chunked attention's output and log-sum-exp, all its backward needs.
_ATTENTION_NAMES = jax.checkpoint_policies.save_only_these_names(ROTATED_QK, ATTN_OUT, ATTN_LSE)
REMAT_POLICIES = {
    RematPolicy.NOTHING: None,
    RematPolicy.DOTS: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _ATTENTION_NAMES),
    RematPolicy.ALL_DOTS: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, _ATTENTION_NAMES),
}


def dense(x, w, n_in: int = 1, **kw) -> jax.Array:
  """x[..., *in] @ w[*in, *out] as one 2-D matmul (leading dims of x flattened).

  Same result as the einsum ('BLD,DF->BLF', 'BLHK,HKD->BLD', ...), but XLA:CPU lowers
  the weight gradient of a multi-dim einsum (contracting B and L) to a transposed copy;
  a 2-D dot avoids it (2.3x faster MLP backward, 1.55x faster train step at shape S).
  """
  lead, ins = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
  m = math.prod(ins)
  y = jnp.dot(x.reshape(-1, m), w.reshape(m, -1), **kw)
  return y.reshape(*lead, *w.shape[n_in:])


def projections(x, ws: Sequence[jax.Array], fuse: bool) -> list[jax.Array]:
  """x[..., D] @ each w[D, ...]; with fuse, one matmul over the weights side by side."""
  if not fuse:
    return [dense(x, w) for w in ws]
  y = dense(x, jnp.concatenate([w.reshape(w.shape[0], -1) for w in ws], axis=1))
  ends = itertools.accumulate(math.prod(w.shape[1:]) for w in ws[:-1])
  return [p.reshape(*x.shape[:-1], *w.shape[1:])
          for p, w in zip(jnp.split(y, list(ends), axis=-1), ws)]


def _normal(rngs: nnx.Rngs, shape, std: float) -> nnx.Param:
  return nnx.Param(std * jax.random.truncated_normal(rngs.params(), -3.0, 3.0, shape,
                                                     jnp.float32))


class RMSNorm(nnx.Module):
  """RMS normalisation in fp32 with a learned scale."""

  def __init__(self, cfg: ModelConfig):
    self.scale = nnx.Param(jnp.ones((cfg.d_model,), jnp.float32))
    self.eps = cfg.norm_eps
    self.dtype = DTYPES[cfg.dtype]

  @jax.named_scope('norm')
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...]).astype(self.dtype)


class Attention(nnx.Module):
  """Causal grouped-query attention with RoPE."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.wq_DxHxK = _normal(rngs, (d, h, k), cfg.init_std)
    self.wk_DxGxK = _normal(rngs, (d, g, k), cfg.init_std)
    self.wv_DxGxK = _normal(rngs, (d, g, k), cfg.init_std)
    self.wo_HxKxD = _normal(rngs, (h, k, d), cfg.init_std)
    if cfg.qk_bias:  # Huginn's qk_bias: added to q and k before RoPE
      self.q_bias_HxK = nnx.Param(jnp.zeros((h, k), jnp.float32))
      self.k_bias_GxK = nnx.Param(jnp.zeros((g, k), jnp.float32))
    self.qk_bias = cfg.qk_bias
    self.theta = cfg.rope_theta
    self.impl = AttentionImpl(cfg.attention_impl)
    self.dtype = DTYPES[cfg.dtype]
    self.fuse = cfg.fuse_projections

  @jax.named_scope('attention')
  def __call__(self, x_BxLxD, pos_BxL, kv_fn: Optional[KVFn] = None,
               rot: Optional[Rotary] = None):
    dt = self.dtype
    q, k, v = projections(x_BxLxD, [w[...].astype(dt) for w in (  # BLD,DHK->BLHK; DGK->BLGK
        self.wq_DxHxK, self.wk_DxGxK, self.wv_DxGxK)], self.fuse)
    if self.qk_bias:
      q = q + self.q_bias_HxK[...].astype(dt)
      k = k + self.k_bias_GxK[...].astype(dt)
    rot = rope_tables(pos_BxL, q.shape[-1], self.theta) if rot is None else rot
    q, k = (checkpoint_name(apply_rope(x, rot), ROTATED_QK) for x in (q, k))
    with jax.named_scope('sdpa'):
      if kv_fn is None:  # training and full-sequence forwards: plain causal attention
        o = attention_fn(self.impl)(q, k, v)
      else:
        k, v, mask = kv_fn(k, v)
        o = (mask(q, k, v) if callable(mask) else
             jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None))
    out = dense(o, self.wo_HxKxD[...].astype(dt), n_in=2)  # BLHK,HKD->BLD
    return out, (k, v)


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    self.w_gate_DxF = _normal(rngs, (d, f), cfg.init_std)
    self.w_up_DxF = _normal(rngs, (d, f), cfg.init_std)
    self.w_down_FxD = _normal(rngs, (f, d), cfg.init_std)
    self.dtype = DTYPES[cfg.dtype]
    self.fuse = cfg.fuse_projections

  @jax.named_scope('mlp')
  def __call__(self, x_BxLxD):
    dt = self.dtype
    gate, up = projections(x_BxLxD, [self.w_gate_DxF[...].astype(dt),  # BLD,DF->BLF
                                      self.w_up_DxF[...].astype(dt)], self.fuse)
    return dense(jax.nn.silu(gate) * up, self.w_down_FxD[...].astype(dt))  # BLF,FD->BLD


class Block(nnx.Module):
  """Sandwich-norm transformer block (MLP-only when attention=False)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attention: bool = True):
    self.norm3, self.norm4 = RMSNorm(cfg), RMSNorm(cfg)
    self.has_attn = attention
    if attention:
      self.norm1, self.norm2 = RMSNorm(cfg), RMSNorm(cfg)
      self.attn = Attention(cfg, rngs)
    self.mlp = MLP(cfg, rngs)
    self.kv_shape = (cfg.num_kv_heads, cfg.head_dim)

  def __call__(self, x_BxLxD, pos_BxL, kv_fn: Optional[KVFn] = None,
               rot: Optional[Rotary] = None):
    if self.has_attn:
      a, kv = self.attn(self.norm1(x_BxLxD), pos_BxL, kv_fn, rot)
      x = self.norm2(x_BxLxD + a)
    else:  # no mixing between positions; zero keys/values keep the cache layout
      x, z = x_BxLxD, jnp.zeros(x_BxLxD.shape[:2] + self.kv_shape, x_BxLxD.dtype)
      kv = (z, z)
    x = self.norm4(x + self.mlp(self.norm3(x)))
    return x, kv


def keep_kv(blocks, new: list, old: list) -> list:
  """Per block: the new (k, v) where the block has attention; a block without keeps its
  buffers (its keys/values are zeros that nothing reads, returned token-major)."""
  return [n if b.has_attn else o for b, n, o in zip(blocks, new, old)]


def _run_blocks(blocks, x, pos, kv_fns: Optional[Sequence[Optional[KVFn]]],
                rot: Optional[Rotary] = None):
  """Applies blocks in order; returns the output and the per-block (k, v)."""
  kvs = []
  for j, block in enumerate(blocks):
    x, kv = block(x, pos, None if kv_fns is None else kv_fns[j], rot)
    kvs.append(kv)
  return x, kvs


class LoopedLM(nnx.Module):
  """Prelude -> weight-tied core (r loops, input re-injection) -> coda -> head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.d_model
    self.dtype = DTYPES[cfg.dtype]
    self.embed_VxD = _normal(rngs, (cfg.vocab_size, d), cfg.init_std)
    outer = AttentionIn(cfg.attention) == AttentionIn.ALL  # attention outside the core
    self.prelude = nnx.List([Block(cfg, rngs, outer) for _ in range(cfg.n_prelude)])
    self.adapter_2DxD = _normal(rngs, (2 * d, d), cfg.init_std)
    self.core = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_core)])
    self.coda = nnx.List([Block(cfg, rngs, outer) for _ in range(cfg.n_coda)])
    self.final_norm = RMSNorm(cfg)
    if not cfg.tie_embeddings:
      self.head_VxD = _normal(rngs, (cfg.vocab_size, d), cfg.init_std)

  def head_weight(self) -> jax.Array:
    """LM head matrix [V, D] (the embedding when tied)."""
    return (self.embed_VxD if self.cfg.tie_embeddings else self.head_VxD)[...]

  def encode(self, tokens_BxL, pos_BxL, kv_fns=None, rot: Optional[Rotary] = None):
    """Embedding and prelude; returns the injection e_BxLxD and prelude (k, v)."""
    x = jnp.take(self.embed_VxD[...], tokens_BxL, axis=0)
    if self.cfg.embed_scale != 1.0:
      x = x * self.cfg.embed_scale
    x = x.astype(self.dtype)
    return _run_blocks(self.prelude, x, pos_BxL, kv_fns, rot)

  def initial_state(self, e_BxLxD, rng: jax.Array, pos_BxL: jax.Array) -> jax.Array:
    """Recurrent state before the first loop: truncated normal or zeros.

    Token-wise a pure function of (rng, position): independent of the token's row, the
    batch size and later tokens, so prefixes, batches and cached decoding start from
    the same states. (Keying it by the sequence's content as well stalled training on
    the main job at chance: WORKSPACE.md, "Early-exit semantics".)
    """
    if self.cfg.init_state == InitState.ZEROS:
      return jnp.zeros_like(e_BxLxD)
    d = e_BxLxD.shape[-1]

    def draw(p):
      return jax.random.truncated_normal(jax.random.fold_in(rng, p), -3.0, 3.0, (d,),
                                         jnp.float32)
    s = jax.vmap(jax.vmap(draw))(pos_BxL)
    return (self.cfg.state_std * s).astype(e_BxLxD.dtype)

  def forward(self, tokens_BxL: jax.Array, key: jax.Array, loop: 'LoopFn', *,
              s0_BxLxD: Optional[jax.Array] = None, head: bool = True) -> 'Forward':
    """The one forward pass: prelude, the core under a loop policy, coda and head.

    Args:
      tokens_BxL: int32 input tokens.
      key: key of the random initial recurrent state.
      loop: how the core runs, (model, s0_BxLxD, inj_BxLxD, pos_BxL) -> (s_BxLxD, aux):
        `fixed`, `bucketed`, `dynamic` below, or an early-exit loop (inference); inj is
        `inject(e)`, the injection each loop adds.
      s0_BxLxD: an explicit initial state (default: `initial_state(e, key)`).
      head: False skips the LM head (logits None; the loss reads `hidden` itself).
    Returns:
      Forward with logits_BxLxV (fp32), the final state, the loop's aux output, the
      prelude/coda keys and values, and the hidden h_BxLxD the head reads.
    """
    pos = positions(tokens_BxL)
    e, pre_kv = self.encode(tokens_BxL, pos)
    s0 = self.initial_state(e, key, pos) if s0_BxLxD is None else s0_BxLxD.astype(e.dtype)
    inj = self.inject(e)
    s, aux = loop(self, s0, inj, pos)
    h, coda_kv = self.decode_state(s, pos)
    return Forward(self.logits(h) if head else None, s, aux, inj, pre_kv, coda_kv, h)

  def step_fn(self, inj_BxLxD, pos_BxL) -> Callable[[jax.Array], jax.Array]:
    """One core loop as s -> s (no key/value hooks), for the fixed-depth loops.

    RoPE's tables are computed here, once, outside the loop: computed inside it, XLA
    fuses cos/sin into every rotation and re-evaluates them per element and per loop.
    """
    rot = self.rotary(pos_BxL)
    return lambda s: self.core_step(s, inj_BxLxD, pos_BxL, rot=rot)[0]

  def rotary(self, pos_BxL) -> Rotary:
    """RoPE tables at pos_BxL, to pass to core_step in a loop."""
    return rope_tables(pos_BxL, self.cfg.head_dim, self.cfg.rope_theta)

  @jax.named_scope('adapter')
  def inject(self, e_BxLxD) -> jax.Array:
    """The loop-invariant half of the adapter, e @ W[D:] (once per forward)."""
    d = self.cfg.d_model
    return dense(e_BxLxD, self.adapter_2DxD[d:].astype(self.dtype))  # BLD,DD->BLD

  def core_step(self, s_BxLxD, inj_BxLxD, pos_BxL, kv_fns=None, rot: Optional[Rotary] = None):
    """One loop of the shared core on the injection `inject(e)`; the new state, block (k, v)."""
    with jax.named_scope('adapter'):
      d = self.cfg.d_model
      x = dense(s_BxLxD, self.adapter_2DxD[:d].astype(self.dtype)) + inj_BxLxD  # BLD,DD->BLD
    return _run_blocks(self.core, x, pos_BxL, kv_fns, rot)

  def decode_state(self, s_BxLxD, pos_BxL, kv_fns=None, rot: Optional[Rotary] = None):
    """Coda and final norm: the hidden h_BxLxD that the head reads, and coda (k, v).

    With cfg.norm_before_coda the same final norm is applied to the state first (Huginn).
    """
    if self.cfg.norm_before_coda:
      s_BxLxD = self.final_norm(s_BxLxD)
    x, kvs = _run_blocks(self.coda, s_BxLxD, pos_BxL, kv_fns, rot)
    return self.final_norm(x), kvs

  @jax.named_scope('head')
  def head_matrix(self) -> jax.Array:
    """The head matrix [V, D] in the compute dtype: what the output logits and every exit
    check multiply (so all paths read the same p_i)."""
    return self.head_weight().astype(self.dtype)

  def logits(self, h_BxLxD) -> jax.Array:
    """LM head in fp32: logits_BxLxV."""
    return dense(h_BxLxD, self.head_matrix().T, preferred_element_type=jnp.float32)


class Forward(NamedTuple):
  """Output of LoopedLM.forward."""
  logits: jax.Array   # [B, L, V] fp32
  state: jax.Array    # final recurrent state [B, L, D]
  aux: Any            # what the loop policy returned beside the state
  inj: jax.Array      # the injection [B, L, D]: inject(prelude output), added every loop
  prelude_kv: Any     # per prelude block (k, v)
  coda_kv: Any        # per coda block (k, v) of the final readout
  hidden: Any = None  # [B, L, D] the final norm's output, which the head reads


LoopFn = Callable[[LoopedLM, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def fixed(n: int, *, remat: bool = True) -> LoopFn:
  """Loop policy: n loops (static) as one lax.scan."""
  return lambda m, s0, inj, pos: (recurrence.fixed_depth(m.step_fn(inj, pos), s0, n,
                                                       remat=remat), None)


def bucketed(bucket_idx: jax.Array, depth: DepthConfig) -> LoopFn:
  """Loop policy for training: depth.buckets[bucket_idx] loops behind one lax.switch (one
  branch per bucket a draw can reach: config.trained_buckets)."""
  return lambda m, s0, inj, pos: (recurrence.bucketed_depth(
      m.step_fn(inj, pos), s0, bucket_idx, trained_buckets(depth),
      backprop_depth=depth.backprop_depth, remat=depth.remat,
      policy=REMAT_POLICIES[RematPolicy(depth.remat_policy)], unroll=depth.unroll), None)


def dynamic(n: jax.Array) -> LoopFn:
  """Loop policy: a traced number of loops (forward only), one executable for every n."""
  return lambda m, s0, inj, pos: (recurrence.dynamic_depth(m.step_fn(inj, pos), s0, n), None)


def build_model(cfg: ModelConfig, seed: int = 0) -> LoopedLM:
  """Instantiates the LM with fp32 parameters (ConfigError for a bad config)."""
  validate_model(cfg)
  return LoopedLM(cfg, nnx.Rngs(seed))


def abstract_params(cfg: ModelConfig):
  """(graphdef, parameter shapes as a pure dict of ShapeDtypeStructs); nothing allocated."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)
  return graphdef, nnx.to_pure_dict(params)


def bind(graphdef, params) -> LoopedLM:
  """Rebuilds the module from a pure parameter dict (inside or outside jit)."""
  state = nnx.State(jax.tree.map(lambda x: nnx.Param(x), params))
  return nnx.merge(graphdef, state)


def check_tokens(cfg: ModelConfig, tokens_BxL, what: str = 'tokens', extra: int = 0) -> None:
  """ValueError unless tokens are [B, L] integer ids with 1 <= L, L + extra <= cfg.max_len
  and, when their values are known here (not traced), every id in [0, vocab_size): an id
  out of range would gather a NaN embedding or wrap around, silently."""
  shape = jnp.shape(tokens_BxL)
  if len(shape) != 2 or not jnp.issubdtype(jnp.result_type(tokens_BxL), jnp.integer):
    raise ValueError(f'{what} must be [B, L] integer token ids, got shape {shape} of '
                     f'{jnp.result_type(tokens_BxL)}')
  if shape[1] < 1:
    raise ValueError(f'{what}: no positions (shape {shape}); at least one token is needed')
  if shape[1] + extra > cfg.max_len:
    raise ValueError(f'{what}: {shape[1]} positions' + (f' + {extra} new' if extra else '')
                     + f' exceed model.max_len={cfg.max_len}')
  if not isinstance(tokens_BxL, jax.core.Tracer) and 0 not in shape:
    ids = np.asarray(tokens_BxL)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= cfg.vocab_size:
      raise ValueError(f'{what}: ids must lie in [0, {cfg.vocab_size}) (model.vocab_size), '
                       f'got {lo}..{hi}')


def positions(tokens_BxL) -> jax.Array:
  """Positions 0..L-1 broadcast over the batch."""
  b, l = tokens_BxL.shape
  return jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))


def count_params(cfg: ModelConfig) -> int:
  """Unique parameter count, computed abstractly (nothing allocated)."""
  return sum(int(x.size) for x in jax.tree.leaves(abstract_params(cfg)[1]))


def causal_keys(l: int) -> float:
  """Mean keys per query that `causal_attention` multiplies over l tokens (its chunks)."""
  n = attention_chunks(l)
  return l * (n + 1) / (2 * n)


def flops_per_token(cfg: ModelConfig, r: float, seq_len: int, core_keys=None,
                    outer_keys=None) -> dict:
  """Forward matmul FLOPs per token at depth r.

  Attention scores are counted causally (seq_len / 2 keys per query, the model-FLOP
  convention) except where an engine's executed keys per query are given: core_keys in
  the core loop, outer_keys in the prelude and coda blocks (scalars or arrays).
  """
  d, h, g, k, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  proj = 2 * d * (2 * h * k + 2 * g * k)
  per_key = 2 * 2 * h * k  # QK^T and AV, per key a query meets
  attn = per_key * (seq_len / 2 if outer_keys is None else outer_keys)
  mlp = 2 * 3 * d * f
  block = proj + attn + mlp
  outer = block if AttentionIn(cfg.attention) == AttentionIn.ALL else mlp
  prelude = cfg.n_prelude * outer
  keys = seq_len / 2 if core_keys is None else core_keys
  # the adapter: s @ W[:D] every loop, the injection e @ W[D:] once (in the prelude's part)
  loop = cfg.n_core * (proj + per_key * keys + mlp) + 2 * d * d
  prelude = prelude + 2 * d * d
  head = 2 * d * cfg.vocab_size
  check = cfg.n_coda * outer + head
  total = prelude + r * loop + cfg.n_coda * outer + head
  return dict(prelude=prelude, loop=loop, coda_head=check, head=head, total=total)
