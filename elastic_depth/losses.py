"""Losses, divergences and argmaxes from logits, all in fp32."""

import functools

import jax
import jax.numpy as jnp
from jax import lax


ARGMAX_CHUNK = 128  # entries per chunk of `argmax_rows`


def argmax_rows(x_NxV: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first maximum, or the first NaN), int32 [...].

  XLA:CPU runs argmax's two-operand reduction as scalar code: 3.4 ms for [32, 49152],
  2.3x the head matmul that produced it (2026-12-05, Zen 5). Here one max per chunk of
  ARGMAX_CHUNK entries (a plain reduction, vectorised), the argmax over the chunk maxima,
  and the argmax within the chosen chunk. The vectorised max may drop NaN, so a row sum
  (which keeps it) sends an input with NaN to jnp.argmax itself. Leading axes are rows.
  """
  v = x_NxV.shape[-1]
  if v <= 2 * ARGMAX_CHUNK:
    return jnp.argmax(x_NxV, -1).astype(jnp.int32)
  x = x_NxV.reshape(-1, v)
  n = x.shape[0]
  x_NxCxK = jnp.pad(x, ((0, 0), (0, -v % ARGMAX_CHUNK)),
                    constant_values=-jnp.inf).reshape(n, -1, ARGMAX_CHUNK)
  chunk_N = jnp.argmax(jnp.max(x_NxCxK, -1), -1)
  within_NxK = jnp.take_along_axis(x_NxCxK, chunk_N[:, None, None], 1)[:, 0]
  fast_N = chunk_N * ARGMAX_CHUNK + jnp.argmax(within_NxK, -1)
  nan = jnp.any(jnp.isnan(jnp.sum(x, -1)))
  out_N = lax.cond(nan, lambda: jnp.argmax(x, -1), lambda: fast_N).astype(jnp.int32)
  return out_N.reshape(x_NxV.shape[:-1])


def nll(logits_BxLxV, targets_BxL, mask_BxL=None) -> jax.Array:
  """Per-token negative log-likelihood in fp32 [B, L] (masked to 0)."""
  logits = logits_BxLxV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
  out = lse - tgt
  return out if mask_BxL is None else out * mask_BxL


def masked_nll(logits_BxLxV, targets_BxL, mask_BxL):
  """(sum of NLL over unmasked targets, number of targets), fp32."""
  return jnp.sum(nll(logits_BxLxV, targets_BxL, mask_BxL)), jnp.sum(mask_BxL)


def kl_from_logits(logits_new_NxV, logits_old_NxV) -> jax.Array:
  """KL(p_new || p_old) per row [N], fp32, clamped at 0 (rounding)."""
  a = jax.nn.log_softmax(logits_new_NxV.astype(jnp.float32), -1)
  b = jax.nn.log_softmax(logits_old_NxV.astype(jnp.float32), -1)
  return jnp.maximum(jnp.sum(jnp.exp(a) * (a - b), -1), 0.0)


def _head_chunks(h_NxD, targets_N, mask_N, chunk: int):
  """Pads N to a multiple of chunk (mask 0) and splits into [N / chunk, chunk, ...]."""
  n = h_NxD.shape[0]
  pad = -n % chunk
  split = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(
      (-1, chunk) + x.shape[1:])
  return split(h_NxD), split(targets_N), split(mask_N.astype(jnp.float32))


def _chunk_nll(h_CxD, w_VxD, tgt_C, m_C):
  """Logits of one chunk (fp32) and its masked NLL sum."""
  logits_CxV = jnp.dot(h_CxD, w_VxD.T, preferred_element_type=jnp.float32)
  lse_C = jax.nn.logsumexp(logits_CxV, axis=-1)
  nll_C = lse_C - jnp.take_along_axis(logits_CxV, tgt_C[:, None], axis=-1)[:, 0]
  return logits_CxV, lse_C, jnp.sum(nll_C * m_C)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def head_nll(h_NxD, w_VxD, targets_N, mask_N, chunk: int) -> jax.Array:
  """Sum over unmasked tokens of -log softmax(h @ w^T)[target], chunk tokens at a time.

  The LM head and cross-entropy fused: equal to masked_nll(dense(h, w.T), ...)[0], but
  the [N, V] logits exist one chunk at a time, and the gradients are formed in the
  forward pass (no logits kept for the backward; the same matmuls as plain autodiff).
  Logits, softmax and loss are fp32; the logit gradient p - onehot is rounded to the
  compute dtype before its two matmuls, as every layer's backward rounds its cotangent
  under bf16 (plain autodiff keeps this one fp32: dw differs by ~1e-3 relative in bf16).

  Args:
    h_NxD: final hidden states (compute dtype).
    w_VxD: head weight (compute dtype).
    targets_N: int32 targets.
    mask_N: weights of the tokens (0 or 1).
    chunk: tokens per chunk (static).
  Returns:
    The masked NLL sum, fp32 [].
  """
  return _head_nll_fwd(h_NxD, w_VxD, targets_N, mask_N, chunk, grads=False)[0]


def _head_nll_fwd(h_NxD, w_VxD, targets_N, mask_N, chunk: int, grads: bool = True):
  """(loss, (dloss/dh, dloss/dw)): one scan over chunks; the gradients only when grads."""
  hs, ts, ms = _head_chunks(h_NxD, targets_N, mask_N, chunk)

  def body(dw_VxD, xs):
    h_CxD, tgt_C, m_C = xs
    logits_CxV, lse_C, total = _chunk_nll(h_CxD, w_VxD, tgt_C, m_C)
    if not grads:
      return dw_VxD, (total, h_CxD[:0])
    p_CxV = jnp.exp(logits_CxV - lse_C[:, None])
    d_CxV = (p_CxV - jax.nn.one_hot(tgt_C, p_CxV.shape[-1], dtype=p_CxV.dtype)) * m_C[:, None]
    d_CxV = d_CxV.astype(h_CxD.dtype)
    dh_CxD = jnp.dot(d_CxV, w_VxD, preferred_element_type=jnp.float32).astype(h_CxD.dtype)
    return dw_VxD + jnp.dot(d_CxV.T, h_CxD, preferred_element_type=jnp.float32), (total, dh_CxD)

  dw0 = jnp.zeros(w_VxD.shape, jnp.float32)
  dw_VxD, (totals, dh) = lax.scan(body, dw0, (hs, ts, ms))
  loss = jnp.sum(totals)
  if not grads:
    return loss, None
  dh_NxD = dh.reshape((-1, h_NxD.shape[1]))[:h_NxD.shape[0]]
  return loss, (dh_NxD, dw_VxD.astype(w_VxD.dtype))


def _head_nll_bwd(chunk, res, g):
  """Scales the gradients formed in the forward; targets and mask (data) get none."""
  del chunk
  dh, dw = res
  return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None, None


head_nll.defvjp(_head_nll_fwd, _head_nll_bwd)
