"""Losses and divergences from logits, all in fp32."""

import jax
import jax.numpy as jnp


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
