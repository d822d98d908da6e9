"""Fused KL(p_i || p_{i-1}) halting statistic over the LM head, no [N, V].

Notation: N tokens, D model dim, V vocab. For hidden states h, hprev [N, D] and
the LM head w [V, D]:

  a = h @ w^T,  b = hprev @ w^T            (logits, [N, V], fp32)
  p = softmax(a), q = softmax(b)
  KL(p || q) = sum_v p_v (a_v - b_v) - lse(a) + lse(b)

The Pallas kernel runs one program per (token block, vocab split) and loops over
the split's vocab tiles inside the kernel (`lax.fori_loop` over `pl.ds` slices of a
full-V block of w), so only a [block_n, block_v] pair of logit tiles is ever live;
the splits' running states are merged afterwards (`_combine`, the same rescaling).
Splitting the vocabulary fills the GPU when there are few tokens (one program per
token block took 4.1 ms at N = 1,024 on an H200, 6x the unfused reference). Per token
it keeps running maxima m_a, m_b, rescaled sums s_a = sum exp(a - m_a),
s_b = sum exp(b - m_b), a cross term
t = sum exp(a - m_a) ((a - m_a) - (b - m_b)) and the running argmax of a.
Writing KL with the shifted logits cancels the (m_a - m_b) offsets
analytically:

  KL = t / s_a - log s_a + log s_b

so no two large-magnitude numbers are subtracted at the end (logits ~1e4 are
fine). When the maxima move to M_a, M_b the state is rescaled as

  s_a <- s_a exp(m_a - M_a)
  t   <- exp(m_a - M_a) (t + s_a ((m_a - M_a) - (m_b - M_b)))

Looping inside the kernel (rather than a sequential grid axis with output refs
as accumulators) keeps the grid fully parallel, which the Triton backend needs.
Triton also needs every loaded tile to have a power-of-two size: use
power-of-two block_n / block_v and, when D is not a power of two (e.g. 576),
a power-of-two block_d that chunks the contraction (D is zero-padded).
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

_F32 = jnp.float32


def _next_pow2(x):
  """Smallest power of two >= x (x >= 1)."""
  return 1 << max(0, int(x) - 1).bit_length()


def _common_dtype(*arrays):
  """Shared float dtype for the head matmul inputs."""
  dtype = jnp.result_type(*arrays)
  if not jnp.issubdtype(dtype, jnp.floating):
    dtype = _F32
  return dtype


# ---------------------------------------------------------------------------
# References (plain jnp, fp32 math).
# ---------------------------------------------------------------------------


def reference_kl_from_logits(a_NxV, b_NxV):
  """Unfused KL(softmax(a) || softmax(b)), argmax(a) and lse(a) in fp32.

  Args:
    a_NxV: logits of p, [N, V], any float dtype.
    b_NxV: logits of q, [N, V], any float dtype.

  Returns:
    (kl_N float32 >= 0, argmax_N int32 (first index on ties), lse_N float32).
  """
  a_NxV = a_NxV.astype(_F32)
  b_NxV = b_NxV.astype(_F32)
  # Work with max-shifted logits so that log p - log q never subtracts two
  # large lse values (|logits| ~1e4 would otherwise cost ~1e-3 absolute).
  m_a_N = jnp.max(a_NxV, axis=-1)
  sa_NxV = a_NxV - m_a_N[:, None]
  sb_NxV = b_NxV - jnp.max(b_NxV, axis=-1, keepdims=True)
  log_s_a_N = jnp.log(jnp.sum(jnp.exp(sa_NxV), axis=-1))
  log_s_b_N = jnp.log(jnp.sum(jnp.exp(sb_NxV), axis=-1))
  p_NxV = jnp.exp(sa_NxV - log_s_a_N[:, None])
  # 0 log 0 = 0: a -inf logit of p adds nothing (else 0 * -inf is NaN)
  kl_N = (jnp.sum(jnp.where(p_NxV > 0, p_NxV * (sa_NxV - sb_NxV), 0.0), axis=-1)
          - log_s_a_N + log_s_b_N)
  kl_N = jnp.maximum(kl_N, 0.0)
  lse_a_N = m_a_N + log_s_a_N
  argmax_N = jnp.argmax(a_NxV, axis=-1).astype(jnp.int32)
  return kl_N, argmax_N, lse_a_N


def reference_kl_halting(h_NxD, hprev_NxD, w_VxD):
  """Unfused KL(p || q) with p = softmax(h w^T), q = softmax(hprev w^T).

  Materialises both [N, V] logit arrays (fp32 accumulation); the baseline.

  Args:
    h_NxD: final-normed hidden states at loop i, [N, D] (fp32 or bf16).
    hprev_NxD: the same at loop i - 1, [N, D].
    w_VxD: LM head / tied embedding, [V, D].

  Returns:
    (kl_N float32 >= 0, argmax_N int32 of p's logits (first index on ties),
    lse_N float32 log-sum-exp of p's logits).
  """
  dtype = _common_dtype(h_NxD, hprev_NxD, w_VxD)
  return reference_kl_from_logits(head_logits(h_NxD, w_VxD, dtype),
                                  head_logits(hprev_NxD, w_VxD, dtype))


def head_logits(h_NxD, w_VxD, dtype=None):
  """One head product h w^T with fp32 accumulation: logits [N, V] (what the reference reads)."""
  dtype = _common_dtype(h_NxD, w_VxD) if dtype is None else dtype
  return jnp.einsum('nd,vd->nv', h_NxD.astype(dtype), w_VxD.astype(dtype),
                    preferred_element_type=_F32)


# ---------------------------------------------------------------------------
# Shared online-softmax pieces used inside the kernels.
# ---------------------------------------------------------------------------


def _init_state(block_n):
  """Empty running state: (m_a, s_a, m_b, s_b, t, idx), each [block_n]."""
  neg_inf_N = jnp.full((block_n,), -jnp.inf, _F32)
  zeros_N = jnp.zeros((block_n,), _F32)
  return (neg_inf_N, zeros_N, neg_inf_N, zeros_N, zeros_N,
          jnp.zeros((block_n,), jnp.int32))


def _online_update(state, a_NxV, b_NxV, v0, num_valid_v):
  """Folds one [block_n, block_v] fp32 logit tile pair into the running state.

  Columns with global index >= num_valid_v (vocab padding) are ignored;
  num_valid_v=None means the tile has no padding.
  """
  m_a_N, s_a_N, m_b_N, s_b_N, t_N, idx_N = state
  block_v = a_NxV.shape[1]
  col_NxV = lax.broadcasted_iota(jnp.int32, a_NxV.shape, 1)
  if num_valid_v is not None:
    valid_NxV = col_NxV + v0 < num_valid_v
    a_NxV = jnp.where(valid_NxV, a_NxV, -jnp.inf)
    b_NxV = jnp.where(valid_NxV, b_NxV, -jnp.inf)

  tile_max_a_N = jnp.max(a_NxV, axis=1)
  tile_max_b_N = jnp.max(b_NxV, axis=1)
  # First index of the tile maximum; strict '>' across tiles keeps the
  # earliest index on ties, like jnp.argmax.
  tile_idx_N = jnp.min(
      jnp.where(a_NxV == tile_max_a_N[:, None], col_NxV, block_v), axis=1)
  idx_N = jnp.where(tile_max_a_N > m_a_N, tile_idx_N + v0, idx_N)

  new_m_a_N = jnp.maximum(m_a_N, tile_max_a_N)
  new_m_b_N = jnp.maximum(m_b_N, tile_max_b_N)
  alpha_a_N = jnp.exp(m_a_N - new_m_a_N)  # 0 on the first tile (m = -inf)
  alpha_b_N = jnp.exp(m_b_N - new_m_b_N)

  sa_NxV = a_NxV - new_m_a_N[:, None]  # <= 0, -inf on padding
  sb_NxV = b_NxV - new_m_b_N[:, None]
  e_a_NxV = jnp.exp(sa_NxV)
  # 0 log 0 = 0: a -inf logit of p (in q too: -inf - -inf is NaN) adds nothing
  cross_NxV = jnp.where(e_a_NxV > 0, e_a_NxV * (sa_NxV - sb_NxV), 0.0)
  if num_valid_v is not None:
    cross_NxV = jnp.where(valid_NxV, cross_NxV, 0.0)

  # Re-express the old cross term against the new maxima; guarded because
  # s_a * (-inf) is NaN before the first tile.
  shift_N = jnp.where(s_a_N > 0,
                      (m_a_N - new_m_a_N) - (m_b_N - new_m_b_N), 0.0)
  t_N = alpha_a_N * (t_N + s_a_N * shift_N) + jnp.sum(cross_NxV, axis=1)
  s_a_N = alpha_a_N * s_a_N + jnp.sum(e_a_NxV, axis=1)
  s_b_N = alpha_b_N * s_b_N + jnp.sum(jnp.exp(sb_NxV), axis=1)
  return new_m_a_N, s_a_N, new_m_b_N, s_b_N, t_N, idx_N


def _combine(parts):
  """(kl, argmax, lse_a) from the running states of S vocab splits, each field [S, N].

  The splits' states are rescaled to the overall maxima as in the online update
  (`t` to the new offsets), so S = 1 is the plain finalisation.
  """
  m_a_SxN, s_a_SxN, m_b_SxN, s_b_SxN, t_SxN, idx_SxN = parts
  m_a_N, m_b_N = jnp.max(m_a_SxN, axis=0), jnp.max(m_b_SxN, axis=0)
  alpha_SxN = jnp.exp(m_a_SxN - m_a_N)
  s_a_N = jnp.sum(alpha_SxN * s_a_SxN, axis=0)
  s_b_N = jnp.sum(jnp.exp(m_b_SxN - m_b_N) * s_b_SxN, axis=0)
  shift_SxN = (m_a_SxN - m_a_N) - (m_b_SxN - m_b_N)
  t_N = jnp.sum(alpha_SxN * (t_SxN + s_a_SxN * shift_SxN), axis=0)
  # first split holding the maximum: its (first) index is the overall first one
  idx_N = jnp.take_along_axis(idx_SxN, jnp.argmax(m_a_SxN, axis=0)[None], axis=0)[0]
  log_s_a_N = jnp.log(s_a_N)
  kl_N = t_N / s_a_N - log_s_a_N + jnp.log(s_b_N)
  return jnp.maximum(kl_N, 0.0), idx_N, m_a_N + log_s_a_N


def _run_vocab_loop(tile_fn, block_n, block_v, tile0, num_tiles, num_valid_v, one_split):
  """Streams over vocab tiles tile0.. (+num_tiles); tile_fn(v0) -> (a, b) fp32 tiles."""
  def body(j, state, valid=None):
    v0 = pl.multiple_of((tile0 + j) * block_v, block_v)
    a_NxV, b_NxV = tile_fn(v0)
    return _online_update(state, a_NxV, b_NxV, v0, valid)

  state = _init_state(block_n)
  if num_valid_v is None:
    return lax.fori_loop(0, num_tiles, body, state)
  if not one_split:  # any tile of the last split may be padding: mask them all
    return lax.fori_loop(0, num_tiles, functools.partial(body, valid=num_valid_v), state)
  # One split: only the last tile carries padding; mask it alone, outside the loop.
  state = lax.fori_loop(0, num_tiles - 1, body, state)
  return body(num_tiles - 1, state, num_valid_v)


def _store(state, refs):
  """Writes one token block's running state (one split) to the output refs."""
  for ref, x_N in zip(refs, state):
    ref[...] = x_N


def _out_shapes_specs(n_pad, block_n, v_splits):
  """Shapes and [block_n] BlockSpecs of the six state outputs, [v_splits * n_pad] each."""
  n_blocks = n_pad // block_n
  shapes = tuple(jax.ShapeDtypeStruct((v_splits * n_pad,), dt)
                 for dt in (_F32,) * 5 + (jnp.int32,))
  spec = pl.BlockSpec((block_n,), lambda i, j: (j * n_blocks + i,))
  return shapes, (spec,) * 6


def _default_compiler_params(compiler_params, interpret):
  """Triton (not Mosaic GPU, the GPU default) unless params were given.

  Mosaic GPU stages every BlockSpec block in shared memory, which the full-V
  block of w cannot fit; Triton treats blocks as pointers into HBM.
  """
  if (compiler_params is None and not interpret
      and jax.default_backend() == 'gpu'):
    return pltriton.CompilerParams(num_warps=8, num_stages=2)
  return compiler_params


def _clip_block(block, size):
  """Block no larger than the padded problem (power of two, >= 16)."""
  return min(block, max(16, _next_pow2(size)))


# ---------------------------------------------------------------------------
# Fused kernel from hidden states.
# ---------------------------------------------------------------------------


def _kl_halting_kernel(h_ref, hprev_ref, w_ref, *out_refs, block_n, block_v, block_d,
                       tiles_per_split, one_split, num_d_chunks, num_valid_v):
  """One (token block, vocab split): loop over its tiles of w, both logit tiles per step."""

  def tile_fn(v0):
    def dot_chunk(d0):
      w_VxD = w_ref[pl.ds(v0, block_v), pl.ds(d0, block_d)]
      h_NxD = h_ref[:, pl.ds(d0, block_d)]
      hprev_NxD = hprev_ref[:, pl.ds(d0, block_d)]
      a_NxV = jnp.einsum('nd,vd->nv', h_NxD, w_VxD,
                         preferred_element_type=_F32)
      b_NxV = jnp.einsum('nd,vd->nv', hprev_NxD, w_VxD,
                         preferred_element_type=_F32)
      return a_NxV, b_NxV

    if num_d_chunks == 1:
      return dot_chunk(0)

    def d_body(k, acc):
      d0 = pl.multiple_of(k * block_d, block_d)
      a_NxV, b_NxV = dot_chunk(d0)
      return acc[0] + a_NxV, acc[1] + b_NxV

    zeros_NxV = jnp.zeros((block_n, block_v), _F32)
    return lax.fori_loop(0, num_d_chunks, d_body, (zeros_NxV, zeros_NxV))

  tile0 = pl.program_id(1) * tiles_per_split
  _store(_run_vocab_loop(tile_fn, block_n, block_v, tile0, tiles_per_split, num_valid_v,
                         one_split), out_refs)


@functools.partial(
    jax.jit, static_argnames=('block_n', 'block_v', 'block_d', 'v_splits', 'interpret',
                              'compiler_params'))
def kl_halting(h_NxD, hprev_NxD, w_VxD, *, block_n=64, block_v=128,
               block_d=None, v_splits=None, interpret=False, compiler_params=None):
  """Fused per-token KL(softmax(h w^T) || softmax(hprev w^T)) in Pallas.

  Never materialises [N, V]: one program per (token block, vocab split) streams
  over its vocab tiles of w with an online log-sum-exp for both distributions;
  the splits' [S, N] states are merged in jnp.

  Args:
    h_NxD: final-normed hidden states at loop i, [N, D] (fp32 or bf16).
    hprev_NxD: the same at loop i - 1, [N, D].
    w_VxD: LM head / tied embedding, [V, D]; the matmul accumulates in fp32.
    block_n: tokens per program (power of two for GPU); N is zero-padded to a
      multiple of it and the result sliced back. Clipped for small N.
    block_v: vocab tile per loop step (power of two for GPU); padded vocab
      columns are masked to -inf. Clipped for small V.
    block_d: contraction chunk; None: the whole D in interpret mode, else
      `gpu_block_d(D)` (Triton needs power-of-two tiles: a D such as 576 is
      then zero-padded to a multiple of 64).
    v_splits: vocab splits S, each its own program (a grid axis), so that few
      tokens still fill the GPU; None: enough for ~SPLIT_TARGET_PROGRAMS programs.
      V is padded to S x (tiles per split) x block_v.
    interpret: run the Pallas interpreter (required on CPU).
    compiler_params: optional backend compiler params passed to pallas_call;
      None on GPU means `pallas.triton.CompilerParams(num_warps=8,
      num_stages=2)` (the Triton backend, not Mosaic GPU).

  Returns:
    (kl_N float32 >= 0, argmax_N int32 of p's logits (first index on ties),
    lse_N float32 log-sum-exp of p's logits), each [N].
  """
  n, d = h_NxD.shape
  v, d_w = w_VxD.shape
  if hprev_NxD.shape != (n, d) or d_w != d:
    raise ValueError(f'shape mismatch: h {h_NxD.shape}, hprev '
                     f'{hprev_NxD.shape}, w {w_VxD.shape}')
  dtype = _common_dtype(h_NxD, hprev_NxD, w_VxD)
  block_n = _clip_block(block_n, n)
  block_v = _clip_block(block_v, v)
  if block_d is None:  # compiled (Triton): power-of-two chunks of D
    block_d = d if interpret else gpu_block_d(d)
  n_pad = pl.cdiv(n, block_n) * block_n
  v_splits, tiles_per_split = vocab_splits(n_pad // block_n, pl.cdiv(v, block_v), v_splits)
  v_pad = v_splits * tiles_per_split * block_v
  d_pad = pl.cdiv(d, block_d) * block_d

  def pad(x, rows, cols):
    x = x.astype(dtype)
    if x.shape == (rows, cols):
      return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))

  h_NxD = pad(h_NxD, n_pad, d_pad)
  hprev_NxD = pad(hprev_NxD, n_pad, d_pad)
  w_VxD = pad(w_VxD, v_pad, d_pad)  # no copy when already aligned

  kernel = functools.partial(
      _kl_halting_kernel, block_n=block_n, block_v=block_v, block_d=block_d,
      tiles_per_split=tiles_per_split, one_split=v_splits == 1,
      num_d_chunks=d_pad // block_d, num_valid_v=None if v_pad == v else v)
  out_shapes, out_specs = _out_shapes_specs(n_pad, block_n, v_splits)
  h_spec = pl.BlockSpec((block_n, d_pad), lambda i, j: (i, 0))
  w_spec = pl.BlockSpec((v_pad, d_pad), lambda i, j: (0, 0))  # looped in-kernel
  itemsize = jnp.dtype(dtype).itemsize
  cost = pl.CostEstimate(
      flops=2 * 2 * n_pad * d_pad * v_pad,
      transcendentals=3 * n_pad * v_pad,
      bytes_accessed=itemsize * (2 * v_splits * n_pad * d_pad
                                 + (n_pad // block_n) * v_pad * d_pad)
      + 24 * v_splits * n_pad)
  parts = pl.pallas_call(
      kernel,
      out_shape=out_shapes,
      grid=(n_pad // block_n, v_splits),
      in_specs=[h_spec, h_spec, w_spec],
      out_specs=out_specs,
      interpret=interpret,
      compiler_params=_default_compiler_params(compiler_params, interpret),
      cost_estimate=cost,
      name='kl_halting',
  )(h_NxD, hprev_NxD, w_VxD)
  kl_N, argmax_N, lse_N = _combine([x.reshape(v_splits, n_pad) for x in parts])
  return kl_N[:n], argmax_N[:n], lse_N[:n]


SPLIT_TARGET_PROGRAMS = 512  # ~4 per multiprocessor of an H100/H200 (132)


def vocab_splits(n_blocks: int, num_v_tiles: int, v_splits=None) -> tuple[int, int]:
  """(splits, tiles per split): none empty; None -> ~SPLIT_TARGET_PROGRAMS programs."""
  want = v_splits or -(-SPLIT_TARGET_PROGRAMS // n_blocks)
  want = max(1, min(int(want), num_v_tiles))
  per = -(-num_v_tiles // want)
  return -(-num_v_tiles // per), per


# ---------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------


def gpu_block_d(d):
  """Contraction chunk for Triton: whole D if a power of two, else 64."""
  return d if d == _next_pow2(d) and d <= 256 else 64


def kernel_active(use_kernel: bool) -> bool:
  """Whether kl_halting_auto takes the fused path (use_kernel on a GPU backend)."""
  return bool(use_kernel) and jax.default_backend() == 'gpu'


def kl_halting_auto(h_NxD, hprev_NxD, w_VxD, use_kernel=True):
  """Pallas kernel on GPU when use_kernel is set, else the jnp reference.

  Args:
    h_NxD: final-normed hidden states at loop i, [N, D].
    hprev_NxD: the same at loop i - 1, [N, D].
    w_VxD: LM head / tied embedding, [V, D].
    use_kernel: allow the fused Pallas path (taken only on a GPU backend).

  Returns:
    (kl_N, argmax_N, lse_N) as in `reference_kl_halting`.

  Both paths compute two head products per call (h and hprev): the fused kernel keeps
  no logits, so a caller that already holds p_{i-1}'s logits should call
  `reference_kl_from_logits` (one head product) instead; `policies.make_check_fn`
  does so off the kernel path and counts two head products per kernel check.
  """
  if kernel_active(use_kernel):
    return kl_halting(h_NxD, hprev_NxD, w_VxD, block_n=64, block_v=128,
                      block_d=gpu_block_d(h_NxD.shape[1]))
  return reference_kl_halting(h_NxD, hprev_NxD, w_VxD)
