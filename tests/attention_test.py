"""Tests for elastic_depth.attention: RoPE and the causal attentions, against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import jaxpr_dots
from elastic_depth import attention as attention_lib
from elastic_depth import config as config_lib
from elastic_depth import model as model_lib


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def complex_rope(x_BxLxHxK, pos_BxL, theta):
  """RoPE as complex multiplication: (x_i + j x_{i+K/2}) e^{j pos theta^(-2i/K)}."""
  x = np.asarray(x_BxLxHxK, np.float64)
  half = x.shape[-1] // 2
  z = x[..., :half] + 1j * x[..., half:]
  freq = theta ** (-2.0 * np.arange(half) / x.shape[-1])
  z = z * np.exp(1j * np.asarray(pos_BxL, np.float64)[:, :, None, None] * freq)
  return np.concatenate([z.real, z.imag], axis=-1)


def test_rope_matches_numpy_and_is_relative():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 6, 3, 16)).astype(np.float32)
  pos = np.stack([np.arange(6), rng.integers(0, 1000, 6)]).astype(np.int32)
  got = attention_lib.rope(jnp.asarray(x), jnp.asarray(pos), 10000.0)
  np.testing.assert_allclose(f64(got), complex_rope(x, pos, 10000.0), rtol=1e-5,
                             atol=1e-4)  # fp32 angles at positions up to 1,000
  # A rotation: norms are kept, and <rope(q, m), rope(k, n)> depends on m - n only.
  np.testing.assert_allclose(np.linalg.norm(f64(got), axis=-1),
                             np.linalg.norm(f64(x), axis=-1), rtol=1e-5)
  q = jnp.asarray(np.broadcast_to(x[:1, :1], (1, 6, 3, 16)))
  k = jnp.asarray(np.broadcast_to(x[1:, :1], (1, 6, 3, 16)))
  p0 = jnp.arange(6, dtype=jnp.int32)[None]
  dots = [jnp.einsum('blhk,blhk->blh', attention_lib.rope(q, p0 + off, 500.0),
                     attention_lib.rope(k, p0 + off + 3, 500.0)) for off in (0, 17, 250)]
  np.testing.assert_allclose(f64(dots[0]), f64(dots[1]), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(f64(dots[0]), f64(dots[2]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('l', [8, 128, 256])  # 1, 2 and 4 query chunks
def test_causal_attention_matches_numpy_and_its_gradient_jax(l):
  rng = np.random.default_rng(l)
  q, k, v = (rng.normal(size=(2, l, h, 16)).astype(np.float32) for h in (6, 2, 2))
  got = attention_lib.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  kk, vv = np.repeat(f64(k), 3, axis=2), np.repeat(f64(v), 3, axis=2)  # GQA: h // 3
  s = np.einsum('bqhk,bshk->bhqs', f64(q), kk) / 4.0
  s = np.where(np.tril(np.ones((l, l), bool)), s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum('bhqs,bshk->bqhk', w / w.sum(-1, keepdims=True), vv)
  np.testing.assert_allclose(f64(got), want, rtol=1e-4, atol=1e-5)
  loss = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2))(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  sdpa = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  for g, want_g in zip(loss(attention_lib.causal_attention), loss(sdpa)):
    np.testing.assert_allclose(f64(g), f64(want_g), rtol=1e-4, atol=1e-5)


def test_causal_attention_bf16_gradient_matches_float32_sdpa():
  """The custom VJP in bf16 (fp32 scores, probabilities and accumulation inside) against
  XLA's fp32 attention's gradient, GQA 6/2 heads, 4 query chunks."""
  rng = np.random.default_rng(3)
  q, k, v = (rng.normal(size=(2, 256, h, 16)).astype(np.float32) for h in (6, 2, 2))
  wo = jnp.asarray(rng.normal(size=(2, 256, 6, 16)), jnp.float32)
  grad = lambda fn, dt: jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * wo),
                                 argnums=(0, 1, 2))(*(jnp.asarray(x, dt) for x in (q, k, v)))
  sdpa = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  got, want = grad(attention_lib.causal_attention, jnp.bfloat16), grad(sdpa, jnp.float32)
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(f64(g), f64(w), rtol=3e-2, atol=3e-2 * np.abs(f64(w)).max())


def _batched_dots(jaxpr) -> int:
  """dot_generals with batch dimensions in a jaxpr and every jaxpr nested in it."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == 'dot_general' and bool(eqn.params['dimension_numbers'][1][0])
    for val in eqn.params.values():
      for sub in val if isinstance(val, (list, tuple)) else [val]:
        if hasattr(sub, 'jaxpr') or hasattr(sub, 'eqns'):
          n += _batched_dots(getattr(sub, 'jaxpr', sub))
  return n


@pytest.mark.parametrize('l', [128, 256])  # 2 and 4 query chunks
def test_dots_policy_keeps_what_the_attention_backward_needs(l):
  """Under RematPolicy.DOTS the backward recomputes no attention forward (its output and
  log-sum-exp are kept by name): 2 batched products per chunk fewer than NOTHING, and
  the same gradient as without remat."""
  rng = np.random.default_rng(l)
  q, k, v = (jnp.asarray(rng.normal(size=(2, l, h, 16)), jnp.float32) for h in (4, 2, 2))
  f = lambda q, k, v: jnp.sum(jnp.sin(attention_lib.causal_attention(q, k, v)))
  grads, dots = {}, {}
  for policy in (config_lib.RematPolicy.NOTHING, config_lib.RematPolicy.DOTS, None):
    g = f if policy is None else jax.checkpoint(f, policy=model_lib.REMAT_POLICIES[policy])
    g = jax.grad(g, argnums=(0, 1, 2))
    dots[policy], grads[policy] = _batched_dots(jax.make_jaxpr(g)(q, k, v).jaxpr), g(q, k, v)
  n = attention_lib.attention_chunks(l)
  assert dots[config_lib.RematPolicy.NOTHING] - dots[config_lib.RematPolicy.DOTS] == 2 * n
  assert dots[config_lib.RematPolicy.DOTS] == dots[None]
  for policy in (config_lib.RematPolicy.NOTHING, config_lib.RematPolicy.DOTS):
    for a, b in zip(grads[policy], grads[None]):
      np.testing.assert_allclose(f64(a), f64(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('backend,dtype,head_dim,want', [
    ('cpu', jnp.bfloat16, 64, 'chunked'), ('gpu', jnp.bfloat16, 64, 'cudnn'),
    ('gpu', jnp.float16, 128, 'cudnn'), ('gpu', jnp.float32, 64, 'xla'),
    ('gpu', jnp.bfloat16, 256, 'xla'), ('gpu', jnp.bfloat16, 60, 'xla'),
    ('tpu', jnp.bfloat16, 64, 'xla')])
def test_auto_attention_picks_cudnn_only_where_it_applies(backend, dtype, head_dim, want):
  assert attention_lib.auto_attention_impl(backend, dtype, head_dim) == want


@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='cuDNN attention needs a GPU')
def test_cudnn_attention_matches_xla_in_bf16():
  """AUTO's GPU choice (cuDNN, GQA 9/3 heads) against XLA's attention, fwd and grad (the
  chunked attention's gradient did not finish within 30 s on an H200)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 256, h, 64)), jnp.bfloat16) for h in (9, 3, 3))
  outs = {}
  for impl in ('cudnn', 'xla'):
    f = attention_lib.attention_fn(impl)
    loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)))
    outs[impl] = (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
  np.testing.assert_allclose(f64(outs['cudnn'][0]), f64(outs['xla'][0]), atol=3e-2)
  for a, b in zip(outs['cudnn'][1], outs['xla'][1]):  # bf16 gradients up to ~17: 2 ulps
    np.testing.assert_allclose(f64(a), f64(b), rtol=2 ** -6, atol=6e-2)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_masked_attention_equals_float64_reference(dtype):
  """One chunk under a per-row mask, normalized after the value product, with grouped
  heads (2 query heads per kv head), against a float64 softmax loop."""
  b, c, s, h, g, k = 2, 5, 9, 4, 2, 8
  rng = np.random.default_rng(7)
  q, kk, vv = (rng.normal(size=sh).astype(np.float32)
               for sh in ((b, c, h, k), (b, g, s, k), (b, g, s, k)))
  see = rng.random((b, c, s)) < 0.5
  see[:, :, 0] = True  # every query sees a key
  got = attention_lib.masked_attention(*(jnp.asarray(x, dtype) for x in (q, kk, vv)),
                                       jnp.asarray(see))
  assert got.shape == (b, c, h, k) and got.dtype == dtype
  q, kk, vv = (f64(jnp.asarray(x, dtype)) for x in (q, kk, vv))
  want = np.zeros((b, c, h, k))
  for bi in range(b):
    for ci in range(c):
      for hi in range(h):
        logit = kk[bi, hi // 2] @ q[bi, ci, hi] / np.sqrt(k)
        w = np.where(see[bi, ci], np.exp(logit - logit[see[bi, ci]].max()), 0.0)
        want[bi, ci, hi] = (w / w.sum()) @ vv[bi, hi // 2]
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(f64(got), want, atol=tol, rtol=tol)


def test_attention_plus_equals_float64_reference_over_both_key_sets():
  """Cached keys under a per-row mask plus fresh token-major keys under a per-query mask
  (one of them empty for a row), grouped heads, against a float64 softmax over the union."""
  b, c, s, n, h, g, k = 3, 2, 7, 2, 4, 2, 8
  rng = np.random.default_rng(11)
  q, kk, vv = (rng.normal(size=sh).astype(np.float32)
               for sh in ((b, c, h, k), (b, g, s, k), (b, g, s, k)))
  kn, vn = (rng.normal(size=(b, n, g, k)).astype(np.float32) for _ in range(2))
  see = rng.random((b, c, s)) < 0.5
  see[0] = False  # row 0 sees no cached key: only its fresh ones
  see_new = np.eye(c, n, dtype=bool)
  got = attention_lib.attention_plus(*(jnp.asarray(x) for x in (q, kk, vv, see, kn, vn)),
                                     jnp.asarray(see_new))
  assert got.shape == (b, c, h, k)
  want = np.zeros((b, c, h, k))
  for bi in range(b):
    for ci in range(c):
      for hi in range(h):
        keys = np.concatenate([kk[bi, hi // 2], kn[bi, :, hi // 2]]).astype(np.float64)
        vals = np.concatenate([vv[bi, hi // 2], vn[bi, :, hi // 2]]).astype(np.float64)
        sees = np.concatenate([see[bi, ci], see_new[ci]])
        logit = keys @ q[bi, ci, hi].astype(np.float64) / np.sqrt(k)
        w = np.where(sees, np.exp(logit - logit[sees].max()), 0.0)
        want[bi, ci, hi] = (w / w.sum()) @ vals
  np.testing.assert_allclose(f64(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('fn', ['grouped', 'causal'])
def test_bf16_attention_accumulates_its_products_in_fp32(fn):
  """Under bf16 both batched products (scores, values) accumulate in fp32: cached decoding's
  grouped attention rounds like the training attention, once, at its output."""
  q = jnp.zeros((2, 128, 4, 64), jnp.bfloat16)
  kv = jnp.zeros((2, 2, 128, 64), jnp.bfloat16)
  f = {'grouped': lambda q, k, v: attention_lib.grouped_attention(
           q, k, v, 2, lambda i: 128, lambda i, end: jnp.ones((1, 64, end), bool)),
       'causal': lambda q, k, v: attention_lib.causal_attention(
           q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))}[fn]
  dots = list(jaxpr_dots(jax.make_jaxpr(f)(q, kv, kv).jaxpr))
  assert len(dots) >= 4, len(dots)  # 2 chunks x (scores, values)
  assert all(e.params['preferred_element_type'] == jnp.float32 for e in dots), [
      e.params['preferred_element_type'] for e in dots]
  assert f(q, kv, kv).dtype == jnp.bfloat16


def _causal_f64(q, k, v):
  """Causal softmax attention in float64 ([B, L, H, K] queries, [B, L, G, K] keys/values)."""
  b, l, h, kd = q.shape
  rep = h // k.shape[2]
  s = np.einsum('bqhk,bshk->bhqs', q, np.repeat(k, rep, axis=2)) / np.sqrt(kd)
  s = np.where(np.tril(np.ones((l, l), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum('bhqs,bshk->bqhk', p, np.repeat(v, rep, axis=2))


@pytest.mark.parametrize('fn', ['causal', 'grouped', 'masked', 'plus'])
def test_bf16_scores_are_scaled_in_fp32_at_head_dim_32(fn):
  """At head_dim 32 K^-1/2 is not a power of two: scaling the bf16 queries would round them
  a second time, which large scores (|s| ~ 40 here) turn into visible probability errors.
  Every attention matches float64 on the bf16 inputs to the output's bf16 rounding."""
  b, l, h, g, kd = 2, 16, 4, 2, 32
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.normal(size=(b, l, n, kd)) * sc, jnp.bfloat16)
             for n, sc in ((h, 4.0), (g, 4.0), (g, 1.0)))
  kg, vg = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  causal = jnp.asarray(np.tril(np.ones((l, l), bool))[None].repeat(b, 0))
  f = {'causal': lambda: attention_lib.causal_attention(q, k, v),
       'grouped': lambda: attention_lib.grouped_attention(
           q, kg, vg, 2, lambda i: (i + 1) * l // 2,
           lambda i, end: causal[:1, i * l // 2:(i + 1) * l // 2, :end]),
       'masked': lambda: attention_lib.masked_attention(q, kg, vg, causal),
       'plus': lambda: attention_lib.attention_plus(
           q, kg[:, :, :-1], vg[:, :, :-1], causal[:, :, :-1], k[:, -1:], v[:, -1:],
           jnp.arange(l)[:, None] == l - 1)}[fn]
  got = f64(f())
  want = _causal_f64(f64(q), f64(k), f64(v))
  # the bf16 output's own rounding: 2^-8 relative, plus fp32 accumulation
  np.testing.assert_allclose(got, want, atol=2e-2, rtol=2 ** -8)
