"""Tests for the fused KL halting kernel (CPU: Pallas interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_depth.kernels import kl_halting as klh

ON_GPU = jax.default_backend() == 'gpu'
INTERPRET = not ON_GPU
ATOL_LARGE_KL = 2e-2  # logits ~1e4 in fp32 are rounded by ~1e-3 each
ATOL_LARGE_LSE = 1e-2


def np_logits(h_NxD, w_VxD):
  """Float64 logits a = h w^T."""
  return np.einsum('nd,vd->nv', np.asarray(h_NxD, np.float64),
                   np.asarray(w_VxD, np.float64))


def np_kl_from_logits(a_NxV, b_NxV):
  """Float64 (KL(softmax a || softmax b), argmax a, lse a)."""
  a_NxV = np.asarray(a_NxV, np.float64)
  b_NxV = np.asarray(b_NxV, np.float64)

  def log_softmax(x_NxV):
    m_N = x_NxV.max(axis=1, keepdims=True)
    lse_N = m_N + np.log(np.exp(x_NxV - m_N).sum(axis=1, keepdims=True))
    return x_NxV - lse_N, lse_N[:, 0]

  logp_NxV, lse_a_N = log_softmax(a_NxV)
  logq_NxV, _ = log_softmax(b_NxV)
  kl_N = (np.exp(logp_NxV) * (logp_NxV - logq_NxV)).sum(axis=1)
  return kl_N, a_NxV.argmax(axis=1), lse_a_N


def to_f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def make_inputs(seed, n, d, v, *, logit_scale=1.0, delta=0.3,
                dtype=jnp.float32):
  """Random h, hprev = h + delta * noise, w with logits of std ~logit_scale."""
  rng = np.random.default_rng(seed)
  h_NxD = rng.normal(size=(n, d))
  hprev_NxD = h_NxD + delta * rng.normal(size=(n, d))
  w_VxD = rng.normal(size=(v, d)) * logit_scale / np.sqrt(d)
  return tuple(jnp.asarray(x, dtype) for x in (h_NxD, hprev_NxD, w_VxD))


def expected(h_NxD, hprev_NxD, w_VxD):
  w64_VxD = to_f64(w_VxD)
  return np_kl_from_logits(np_logits(to_f64(h_NxD), w64_VxD),
                           np_logits(to_f64(hprev_NxD), w64_VxD))


def assert_argmax_close(got_N, a_NxV, want_N, min_gap):
  """Argmax must match where the top-2 logit gap is above rounding noise."""
  top2_Nx2 = -np.sort(-a_NxV, axis=1)[:, :2]
  clear_N = (top2_Nx2[:, 0] - top2_Nx2[:, 1]) > min_gap
  assert clear_N.mean() > 0.5
  np.testing.assert_array_equal(np.asarray(got_N)[clear_N], want_N[clear_N])


# (n, d, v, block_n, block_v, block_d): N and V not multiples of the blocks,
# exact multiples, a chunked contraction, and tiny shapes.
SHAPES = [
    (70, 48, 1000, 32, 256, None),
    (64, 64, 1024, 64, 256, None),
    (100, 96, 2500, 64, 512, 32),
    (5, 16, 37, 64, 128, None),
]


@pytest.mark.parametrize('n,d,v,block_n,block_v,block_d', SHAPES)
def test_kl_halting_matches_numpy(n, d, v, block_n, block_v, block_d):
  h, hprev, w = make_inputs(n + v, n, d, v, logit_scale=3.0)
  kl_N, argmax_N, lse_N = klh.kl_halting(
      h, hprev, w, block_n=block_n, block_v=block_v, block_d=block_d,
      interpret=INTERPRET)
  want_kl, want_argmax, want_lse = expected(h, hprev, w)
  assert kl_N.shape == (n,) and argmax_N.dtype == jnp.int32
  assert want_kl.mean() > 0.05  # non-trivial KL
  np.testing.assert_allclose(kl_N, want_kl, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(lse_N, want_lse, rtol=1e-5, atol=1e-5)
  a_NxV = np_logits(to_f64(h), to_f64(w))
  assert_argmax_close(argmax_N, a_NxV, want_argmax, 1e-4)


@pytest.mark.parametrize('v_splits', [1, 3, None])
def test_vocab_splits_match_numpy(v_splits):
  """Splits merged by _combine; with 3 splits of V=1000 / 128 the last holds a padded
  tile and a tile of padding alone."""
  n, d, v = 40, 32, 1000
  h, hprev, w = make_inputs(11, n, d, v, logit_scale=3.0)
  kl_N, argmax_N, lse_N = klh.kl_halting(h, hprev, w, block_n=16, block_v=128,
                                         v_splits=v_splits, interpret=INTERPRET)
  want_kl, want_argmax, want_lse = expected(h, hprev, w)
  np.testing.assert_allclose(kl_N, want_kl, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(lse_N, want_lse, rtol=1e-5, atol=1e-5)
  assert_argmax_close(argmax_N, np_logits(to_f64(h), to_f64(w)), want_argmax, 1e-4)


@pytest.mark.parametrize('n_blocks,tiles,want', [(1, 384, 384), (8, 384, 64), (128, 384, 4),
                                                 (1000, 384, 1), (1, 8, 8), (2, 7, 7)])
def test_vocab_splits_cover_every_tile_and_none_is_empty(n_blocks, tiles, want):
  splits, per = klh.vocab_splits(n_blocks, tiles)
  assert splits == want and splits * per >= tiles and (splits - 1) * per < tiles
  assert klh.vocab_splits(n_blocks, 8, 3) == (3, 3)  # 3 splits of 3 tiles: 1 tile padding


@pytest.mark.parametrize('n,d,v', [(33, 40, 777), (16, 576, 300)])
def test_reference_matches_numpy(n, d, v):
  h, hprev, w = make_inputs(7 * n, n, d, v, logit_scale=3.0)
  kl_N, argmax_N, lse_N = jax.jit(klh.reference_kl_halting)(h, hprev, w)
  want_kl, want_argmax, want_lse = expected(h, hprev, w)
  np.testing.assert_allclose(kl_N, want_kl, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(lse_N, want_lse, rtol=1e-5, atol=1e-5)
  assert_argmax_close(argmax_N, np_logits(to_f64(h), to_f64(w)), want_argmax,
                      1e-4)


def test_large_magnitude_logits_from_hidden():
  # Logits with std ~5e3 (extremes beyond +-1e4): must stay finite and exact
  # up to fp32 rounding of the logits themselves (~1e-3 absolute here). Half
  # the rows move hprev far (KL in the hundreds: atol bounds the error there),
  # half barely (KL ~0: the result must not be lost to cancellation).
  h, hprev_far, w = make_inputs(3, 40, 64, 900, logit_scale=5e3, delta=1.0)
  _, hprev_near, _ = make_inputs(3, 40, 64, 900, logit_scale=5e3, delta=1e-4)
  hprev = jnp.concatenate([hprev_far[:20], hprev_near[20:]])
  want_kl, want_argmax, want_lse = expected(h, hprev, w)
  assert np.abs(np_logits(to_f64(h), to_f64(w))).max() > 1e4
  assert np.sum(want_kl[:20] > 1e3) >= 15  # most far rows change their argmax
  for fn in (
      lambda: klh.kl_halting(h, hprev, w, block_n=32, block_v=256,
                             interpret=INTERPRET),
      lambda: klh.reference_kl_halting(h, hprev, w)):
    kl_N, argmax_N, lse_N = fn()
    assert np.all(np.isfinite(kl_N)) and np.all(np.isfinite(lse_N))
    np.testing.assert_allclose(kl_N, want_kl, rtol=0, atol=ATOL_LARGE_KL)
    np.testing.assert_allclose(lse_N, want_lse, rtol=0, atol=ATOL_LARGE_LSE)
    np.testing.assert_array_equal(argmax_N, want_argmax)


def test_large_magnitude_logits_exact():
  # Exactly representable logits of +-1e4 with a small perturbation: KL is
  # small, so subtracting lse_a - lse_b (~1e4 each) would lose everything.
  rng = np.random.default_rng(11)
  a_NxV = np.round(rng.uniform(-1e4, 1e4, size=(24, 700)))
  a_NxV[:, 5] = 1e4  # a clear maximum so p is not one-hot on rounding noise
  a_NxV[:, 6] = 1e4 - 1.0
  a_NxV[:, 400] = 1e4 - 0.5
  b_NxV = a_NxV + rng.choice([-0.5, 0.0, 0.25], size=a_NxV.shape)
  want_kl, want_argmax, want_lse = np_kl_from_logits(a_NxV, b_NxV)
  a32, b32 = jnp.asarray(a_NxV, jnp.float32), jnp.asarray(b_NxV, jnp.float32)
  kl_N, argmax_N, lse_N = klh.reference_kl_from_logits(a32, b32)
  np.testing.assert_allclose(kl_N, want_kl, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(lse_N, want_lse, rtol=1e-7, atol=1e-3)
  np.testing.assert_array_equal(argmax_N, want_argmax)


@pytest.mark.parametrize('logit_scale', [3.0, 5e3])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_identical_inputs_give_zero(logit_scale, dtype):
  h, _, w = make_inputs(5, 50, 32, 600, logit_scale=logit_scale, dtype=dtype)
  for kl_N, _, _ in (
      klh.kl_halting(h, h, w, block_n=32, block_v=256, interpret=INTERPRET),
      klh.reference_kl_halting(h, h, w)):
    assert np.all(np.asarray(kl_N) >= 0.0)
    np.testing.assert_allclose(kl_N, 0.0, atol=1e-6)


def test_bf16_inputs():
  h, hprev, w = make_inputs(9, 80, 64, 1500, logit_scale=3.0,
                            dtype=jnp.bfloat16)
  # The expectation uses the exact bf16 values in float64: only the fp32
  # accumulation order differs, so the tolerance is close to fp32's.
  want_kl, want_argmax, want_lse = expected(h, hprev, w)
  a_NxV = np_logits(to_f64(h), to_f64(w))
  for kl_N, argmax_N, lse_N in (
      klh.kl_halting(h, hprev, w, block_n=64, block_v=512,
                     interpret=INTERPRET),
      klh.reference_kl_halting(h, hprev, w)):
    assert kl_N.dtype == jnp.float32 and lse_N.dtype == jnp.float32
    np.testing.assert_allclose(kl_N, want_kl, rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(lse_N, want_lse, rtol=1e-4, atol=1e-4)
    assert_argmax_close(argmax_N, a_NxV, want_argmax, 1e-2)
  # Mixed precision (fp32 hidden, bf16 head) is promoted, not rejected.
  kl_N, _, _ = klh.kl_halting(h.astype(jnp.float32), hprev, w, block_n=64,
                              block_v=512, interpret=INTERPRET)
  np.testing.assert_allclose(kl_N, want_kl, rtol=2e-3, atol=1e-4)


def test_argmax_ties_first_index():
  # Small integers keep every dot product exact, so ties are exact.
  rng = np.random.default_rng(4)
  n, d, v = 6, 8, 1000
  h_NxD = rng.integers(1, 4, size=(n, d)).astype(np.float32)
  w_VxD = rng.integers(-3, 4, size=(v, d)).astype(np.float32)
  h_NxD[3:] = 0.0  # all-equal logits: argmax must be 0
  w_VxD[[130, 7, 131, 700, 999]] = 5.0  # max row; ties in and across tiles
  h, w = jnp.asarray(h_NxD), jnp.asarray(w_VxD)
  want_argmax_N = np.array([7, 7, 7, 0, 0, 0])
  np.testing.assert_array_equal(np_logits(h_NxD, w_VxD).argmax(1),
                                want_argmax_N)
  for _, argmax_N, _ in (
      klh.kl_halting(h, h, w, block_n=16, block_v=128, v_splits=1, interpret=INTERPRET),
      klh.kl_halting(h, h, w, block_n=16, block_v=128, v_splits=8, interpret=INTERPRET),
      klh.reference_kl_halting(h, h, w)):
    np.testing.assert_array_equal(argmax_N, want_argmax_N)
  # First occurrence only in a later tile, with a tie in the padded last tile
  # (V=300, block_v=128): logits are column 0 of w, exactly.
  w_VxD = np.zeros((300, 8), np.float32)
  w_VxD[[200, 257, 299], 0] = 2.0
  h = jnp.zeros((4, 8), jnp.float32).at[:, 0].set(1.0)
  _, argmax_N, _ = klh.kl_halting(h, h, jnp.asarray(w_VxD), block_n=16, block_v=128,
                                  interpret=INTERPRET)
  np.testing.assert_array_equal(argmax_N, [200] * 4)


@pytest.mark.parametrize('backend,use_kernel,want', [('gpu', True, 'kernel'),
                                                     ('gpu', False, 'reference'),
                                                     ('cpu', True, 'reference'),
                                                     ('cpu', False, 'reference')])
def test_auto_dispatch(backend, use_kernel, want, monkeypatch):
  # The kernel runs only on a GPU backend with use_kernel set, with the Triton
  # block_d for D; either way the result matches float64 numpy.
  h, hprev, w = make_inputs(2, 20, 48, 300, logit_scale=3.0)
  calls = []
  real_kernel, real_reference = klh.kl_halting, klh.reference_kl_halting

  def kernel(*args, **kw):
    calls.append(('kernel', kw))
    return real_kernel(*args, **dict(kw, interpret=True))

  def reference(*args):
    calls.append(('reference', {}))
    return real_reference(*args)

  monkeypatch.setattr(klh, 'kl_halting', kernel)
  monkeypatch.setattr(klh, 'reference_kl_halting', reference)
  monkeypatch.setattr(klh.jax, 'default_backend', lambda: backend)
  kl_N, _, _ = klh.kl_halting_auto(h, hprev, w, use_kernel=use_kernel)
  assert [c[0] for c in calls] == [want]
  if want == 'kernel':
    assert calls[0][1]['block_d'] == 64  # D=48 is not a power of two: chunks of 64
  np.testing.assert_allclose(kl_N, expected(h, hprev, w)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason='compiled Pallas needs a GPU')
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_compiled_gpu(dtype):
  # D=576 (not a power of two) exercises the chunked contraction on Triton.
  h, hprev, w = make_inputs(1, 300, 576, 4100, logit_scale=3.0, dtype=dtype)
  want_kl, _, want_lse = expected(h, hprev, w)
  kl_N, _, lse_N = klh.kl_halting(h, hprev, w, block_n=64, block_v=128,
                                  block_d=klh.gpu_block_d(576))
  # fp32 inputs may use TF32 tensor cores by default: loose tolerance.
  np.testing.assert_allclose(kl_N, want_kl, rtol=2e-2, atol=2e-3)
  np.testing.assert_allclose(lse_N, want_lse, rtol=1e-3, atol=1e-3)
  kl_auto_N, _, _ = klh.kl_halting_auto(h, hprev, w, use_kernel=True)
  np.testing.assert_allclose(kl_auto_N, kl_N, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('n,d,v,block_d', [(8192, 576, 49152, 64),
                                           (300, 128, 1000, None)])
def test_triton_lowering_without_gpu(n, d, v, block_d):
  # Lowers (does not compile) the kernel for CUDA through Triton: catches
  # non-power-of-two tiles and primitives Triton cannot lower, on any host.
  params = klh.pltriton.CompilerParams(num_warps=8, num_stages=2)
  specs = (jax.ShapeDtypeStruct((n, d), jnp.bfloat16),) * 2 + (
      jax.ShapeDtypeStruct((v, d), jnp.bfloat16),)
  fn = jax.jit(lambda h, hprev, w: klh.kl_halting(
      h, hprev, w, block_n=64, block_v=128, block_d=block_d,
      compiler_params=params))
  try:
    lowered = fn.trace(*specs).lower(lowering_platforms=('cuda',))
  except ImportError as e:  # jaxlib without the Triton dialect
    pytest.skip(f'no Triton lowering in this jaxlib: {e}')
  assert 'triton' in lowered.as_text().lower()


def test_reference_kl_with_masked_logits_is_finite_and_exact():
  """A -inf logit of p (a token it can never emit) adds 0 log 0 = 0 to KL(p || q)."""
  rng = np.random.default_rng(3)
  a = rng.normal(size=(4, 50)) * 2
  b = rng.normal(size=(4, 50)) * 2
  a[:, :7] = -np.inf  # p has no mass there; q does
  kl_N, argmax_N, lse_N = klh.reference_kl_from_logits(jnp.asarray(a, jnp.float32),
                                                       jnp.asarray(b, jnp.float32))
  lp = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
  lq = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
  p = np.exp(lp)
  want = np.sum(p * np.where(p > 0, lp - lq, 0.0), axis=-1)  # 0 log 0 = 0
  assert np.all(np.isfinite(np.asarray(kl_N)))
  np.testing.assert_allclose(kl_N, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(argmax_N, np.argmax(a, -1))
  np.testing.assert_allclose(lse_N, np.logaddexp.reduce(a, axis=-1), rtol=1e-6)


@pytest.mark.parametrize('v_splits', [1, 3])
def test_kernel_with_a_minus_inf_logit_in_p_and_q_is_finite(v_splits):
  """A head row that overflows to -inf for both states: the kernel's KL equals the
  reference's finite one (it was 0 * (-inf - -inf) = NaN, so such tokens never exited)."""
  rng = np.random.default_rng(5)
  h_NxD = jnp.asarray(np.abs(rng.normal(size=(6, 24))) + 0.5, jnp.float32)
  hprev_NxD = jnp.asarray(np.abs(rng.normal(size=(6, 24))) + 0.5, jnp.float32)
  w = rng.normal(size=(65, 24)).astype(np.float32)
  w[20] = -3e38  # h > 0, so this logit is -inf in fp32 for p and q
  w_VxD = jnp.asarray(w)
  assert np.all(np.isneginf(np.asarray(klh.head_logits(h_NxD, w_VxD))[:, 20]))
  kl_N, argmax_N, lse_N = klh.kl_halting(h_NxD, hprev_NxD, w_VxD, block_v=16,
                                         v_splits=v_splits, interpret=INTERPRET)
  keep = np.arange(65) != 20  # float64 numpy without the masked token
  want_kl, want_arg, want_lse = np_kl_from_logits(
      np_logits(to_f64(h_NxD), to_f64(w_VxD)[keep]),
      np_logits(to_f64(hprev_NxD), to_f64(w_VxD)[keep]))
  assert np.all(np.isfinite(np.asarray(kl_N)))
  np.testing.assert_allclose(kl_N, want_kl, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(argmax_N, np.where(want_arg >= 20, want_arg + 1, want_arg))
  np.testing.assert_allclose(lse_N, want_lse, rtol=1e-5)


def test_reference_reads_bf16_logits_in_fp32():
  """bf16 logits: KL and lse computed in fp32, equal to float64 on the bf16 values."""
  rng = np.random.default_rng(12)
  a = jnp.asarray(rng.normal(size=(8, 300)) * 3, jnp.bfloat16)
  b = jnp.asarray(np.asarray(a, np.float64) + 0.5 * rng.normal(size=(8, 300)), jnp.bfloat16)
  want_kl, want_argmax, want_lse = np_kl_from_logits(to_f64(a), to_f64(b))
  kl_N, argmax_N, lse_N = klh.reference_kl_from_logits(a, b)
  assert kl_N.dtype == lse_N.dtype == jnp.float32
  np.testing.assert_allclose(kl_N, want_kl, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(lse_N, want_lse, rtol=1e-6)
  np.testing.assert_array_equal(argmax_N, want_argmax)


def test_kl_is_never_negative_for_nearly_equal_distributions():
  """KL >= 0 (documented) where rounding alone decides its sign: q a hair away from p."""
  rng = np.random.default_rng(13)
  a = rng.normal(size=(256, 500)) * 4
  b = a + 1e-6 * rng.normal(size=a.shape)
  a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  for kl_N, _, _ in (klh.reference_kl_from_logits(a32, b32),
                     klh.reference_kl_from_logits(b32, a32)):
    assert np.all(np.asarray(kl_N) >= 0.0)
    np.testing.assert_allclose(kl_N, 0.0, atol=1e-5)
