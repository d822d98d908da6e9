"""losses: the NLL and the fused LM head + cross-entropy (head_nll) against float64 numpy and
autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import kl_logits_np, nll_np
from elastic_depth import losses


def _np_head_nll(h_NxD, w_VxD, t_N, m_N):
  """Float64 numpy: the masked NLL sum and its gradients with respect to h and w."""
  logits = h_NxD @ w_VxD.T
  z = logits - logits.max(1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
  nll = -np.log(p[np.arange(len(t_N)), t_N])
  d = (p - np.eye(w_VxD.shape[0])[t_N]) * m_N[:, None]  # dloss/dlogits
  return np.sum(nll * m_N), d @ w_VxD, d.T @ h_NxD


def _case(n=37, d=8, v=29, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, d)), 0.5 * rng.normal(size=(v, d)), rng.integers(0, v, n),
          (rng.random(n) > 0.3).astype(np.float64))


@pytest.mark.parametrize('chunk', [1, 8, 37, 64])  # ragged, exact, larger than N
def test_head_nll_value_and_gradients_match_numpy(chunk):
  h, w, t, m = _case()
  want, want_dh, want_dw = _np_head_nll(h, w, t, m)
  f = lambda h, w: losses.head_nll(h, w, jnp.asarray(t, jnp.int32), jnp.asarray(m, jnp.float32),
                                   chunk)
  args = (jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32))
  got, (dh, dw) = jax.value_and_grad(f, argnums=(0, 1))(*args)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  np.testing.assert_allclose(float(f(*args)), want, rtol=1e-5)  # the primal path (no grads)
  np.testing.assert_allclose(np.asarray(dh), want_dh, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-5)


def test_head_nll_scales_with_the_cotangent_and_equals_plain_autodiff():
  """Under a scaled loss (the train step's 1 / token count), the same gradients as
  autodiff through masked_nll of the full logits, the plain path."""
  h, w, t, m = _case(n=20, d=6, v=11, seed=1)
  t32, m32 = jnp.asarray(t, jnp.int32), jnp.asarray(m, jnp.float32)
  fused = lambda h, w: 0.25 * losses.head_nll(h, w, t32, m32, 6)
  plain = lambda h, w: 0.25 * losses.masked_nll((h @ w.T)[None], t32[None], m32[None])[0]
  args = (jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32))
  got = jax.grad(fused, argnums=(0, 1))(*args)
  want = jax.grad(plain, argnums=(0, 1))(*args)
  for g, wnt in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(wnt), rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(got[0]).max()) > 1e-3  # not trivially zero


def test_nll_and_masked_nll_match_float64():
  """Per-token NLL in fp32 from bf16 logits too, masked to 0; the masked sum and count."""
  g = np.random.default_rng(3)
  logits = g.normal(size=(2, 7, 13)) * 4
  t, m = g.integers(0, 13, (2, 7)), (g.random((2, 7)) > 0.4).astype(np.float64)
  for dt in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(logits, dt)
    want = nll_np(np.asarray(x.astype(jnp.float32), np.float64), t)
    got = losses.nll(x, jnp.asarray(t, jnp.int32))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got = losses.nll(x, jnp.asarray(t, jnp.int32), jnp.asarray(m, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want * m, rtol=1e-5, atol=1e-5)
    total, count = losses.masked_nll(x, jnp.asarray(t, jnp.int32), jnp.asarray(m, jnp.float32))
    assert float(total) == pytest.approx(np.sum(want * m), rel=1e-5) and float(count) == m.sum()


def test_head_nll_in_bf16_keeps_the_loss_fp32_and_the_gradients_within_bf16():
  """bf16 h and w: the loss equals float64 on the rounded inputs (fp32 logits and softmax);
  the gradients, whose logit gradient is rounded to bf16, stay within 1% of float64."""
  h, w, t, m = _case(n=64, d=16, v=48, seed=2)
  hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  rounded = [np.asarray(x.astype(jnp.float32), np.float64) for x in (hb, wb)]
  want, want_dh, want_dw = _np_head_nll(*rounded, t, m)
  f = lambda h, w: losses.head_nll(h, w, jnp.asarray(t, jnp.int32), jnp.asarray(m, jnp.float32),
                                   16)
  got, (dh, dw) = jax.value_and_grad(f, argnums=(0, 1))(hb, wb)
  assert got.dtype == jnp.float32 and dh.dtype == dw.dtype == jnp.bfloat16
  assert float(got) == pytest.approx(want, rel=1e-5)
  for g_, wnt in ((dh, want_dh), (dw, want_dw)):
    err = np.linalg.norm(np.asarray(g_.astype(jnp.float32)) - wnt) / np.linalg.norm(wnt)
    assert err < 1e-2, err


def test_argmax_rows_equals_numpy_argmax():
  """The chunked argmax: first maximum, ties across and inside chunks, padding, NaN."""
  rs = np.random.default_rng(0)
  for v in (7, 256, 300, 1024, 2049):
    x = rs.standard_normal((9, v)).astype(np.float32)
    x[1, :] = 1.0                                     # all tied: index 0
    x[2, [5, v - 1]] = 9.0                            # tie across chunks: the first
    x[3, [v // 2, v // 2 + 1]] = 9.0                  # tie inside a chunk
    x[4, v - 1] = 9.0                                 # the max in the padded last chunk
    x[5, [3, v - 2]] = np.nan                         # NaN wins, the first one
    x[8, [1, 4]] = [np.inf, np.nan]                   # NaN beats +inf
    x[6, :] = -np.inf
    x[7, 2] = np.inf
    got = np.asarray(jax.jit(losses.argmax_rows)(jnp.asarray(x)))
    want = np.argmax(x.astype(np.float64), -1)
    np.testing.assert_array_equal(got, want)
    assert want[5] == 3 and want[8] == 4
    np.testing.assert_array_equal(  # without NaN (the chunked path)
        np.asarray(jax.jit(losses.argmax_rows)(jnp.asarray(x[:5]))), want[:5])
  x3 = np.random.default_rng(1).standard_normal((2, 3, 700)).astype(np.float32)  # [B, L, V]
  np.testing.assert_array_equal(np.asarray(losses.argmax_rows(jnp.asarray(x3))),
                                np.argmax(x3, -1))


def test_kl_from_logits_is_kl_of_the_new_distribution_from_the_old():
  """KL(p_new || p_old) per row against float64 numpy; the two directions differ here."""
  new = np.log(np.array([[0.98, 0.01, 0.01], [0.2, 0.3, 0.5]]))
  old = np.log(np.array([[1 / 3, 1 / 3, 1 / 3], [0.6, 0.3, 0.1]])) + 1.7  # shifted logits
  p, q = np.exp(new), np.exp(old - 1.7)
  want = (p * (np.log(p) - np.log(q))).sum(1)
  reverse = (q * (np.log(q) - np.log(p))).sum(1)
  assert np.all(np.abs(want - reverse) > 0.05)  # a swapped direction cannot pass
  got = losses.kl_from_logits(jnp.asarray(new, jnp.float32), jnp.asarray(old, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_kl_from_logits_reads_bf16_logits_in_fp32():
  """bf16 logits (the compute dtype): KL in fp32 equal to float64 on the bf16 values."""
  r = np.random.default_rng(5)
  new = jnp.asarray(r.normal(size=(6, 40)) * 3, jnp.bfloat16)
  old = jnp.asarray(r.normal(size=(6, 40)) * 3, jnp.bfloat16)
  want = kl_logits_np(*(np.asarray(x.astype(jnp.float32)) for x in (new, old)))
  for got in (losses.kl_from_logits(new, old),
              losses.kl_from_logits(new, old.astype(jnp.float32))):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_head_nll_rounds_the_logit_gradient_to_the_hidden_dtype():
  """bf16 hidden, fp32 head: dw = (p - onehot)^T h with p - onehot rounded to bf16 (the
  compute dtype) before the matmul, against float64 numpy doing the same rounding."""
  h, w, t, m = _case(n=64, d=16, v=48, seed=4)
  hb = jnp.asarray(h, jnp.bfloat16)
  h64 = np.asarray(hb.astype(jnp.float32), np.float64)
  logits = h64 @ w.astype(np.float32).astype(np.float64).T
  z = logits - logits.max(1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
  d = (p - np.eye(w.shape[0])[t]) * m[:, None]
  d_rounded = np.asarray(jnp.asarray(d, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                         np.float64)
  want, unrounded = d_rounded.T @ h64, d.T @ h64
  f = lambda w_: losses.head_nll(hb, w_, jnp.asarray(t, jnp.int32), jnp.asarray(m, jnp.float32),
                                 16)
  dw = np.asarray(jax.grad(f)(jnp.asarray(w, jnp.float32)), np.float64)
  gap = np.linalg.norm(want - unrounded)
  assert gap > 3e-4 * np.linalg.norm(want)  # the rounding is visible in fp32
  assert np.linalg.norm(dw - want) < 0.1 * gap, (np.linalg.norm(dw - want), gap)


def test_argmax_rows_of_negative_rows_ignores_the_padding():
  """Rows below 0 everywhere (logits often are), V not a multiple of the chunk, no NaN in
  the batch (the chunked path): the padded tail of the last chunk never wins."""
  rs = np.random.default_rng(6)
  for v in (300, 2049):
    x = rs.standard_normal((5, v)).astype(np.float32) - 20.0
    x[1, :] = -np.inf  # all -inf: index 0, as numpy
    x[2, v - 1] = -1.0  # the max in the padded last chunk
    got = np.asarray(jax.jit(losses.argmax_rows)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x.astype(np.float64), -1))
    assert np.all(got < v)
