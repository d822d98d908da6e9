"""Tests for elastic_depth.model against float64 numpy references written here."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from elastic_depth import attention as attention_lib
from elastic_depth import config as config_lib
from elastic_depth import model as model_lib

# ----------------------------------------------------------------------------
# Float64 numpy reference of the architecture (written from the module docstring).


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def np_rmsnorm(x_BxLxD, scale_D, eps):
  x = np.asarray(x_BxLxD, np.float64)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale_D


def np_rope(x_BxLxHxK, pos_BxL, theta):
  """Rotate the pair (i, i + K/2) by the angle pos * theta^(-2i/K)."""
  x = np.asarray(x_BxLxHxK, np.float64)
  k = x.shape[-1]
  half = k // 2
  out = np.empty_like(x)
  for i in range(half):
    ang_BxLx1 = (np.asarray(pos_BxL, np.float64) * theta ** (-2.0 * i / k))[:, :, None]
    c, s = np.cos(ang_BxLx1), np.sin(ang_BxLx1)
    out[..., i] = x[..., i] * c - x[..., i + half] * s
    out[..., i + half] = x[..., i + half] * c + x[..., i] * s
  return out


def np_attention(x_BxLxD, p, pos_BxL, theta, see_LxL=None):
  """GQA: query head h reads kv head h // (H / G); causal unless query t sees key j where
  see_LxL[t, j]; q/k biases (qk_bias) added before RoPE. Returns (out, (k, v))."""
  wq, wk, wv, wo = p['wq'], p['wk'], p['wv'], p['wo']
  b, l, _ = x_BxLxD.shape
  h, kd = wq.shape[1], wq.shape[2]
  g = wk.shape[1]
  see = np.tril(np.ones((l, l), bool)) if see_LxL is None else see_LxL
  q = np_rope(np.einsum('bld,dhk->blhk', x_BxLxD, wq) + p.get('q_bias', 0.0), pos_BxL, theta)
  k = np_rope(np.einsum('bld,dgk->blgk', x_BxLxD, wk) + p.get('k_bias', 0.0), pos_BxL, theta)
  v = np.einsum('bld,dgk->blgk', x_BxLxD, wv)
  o = np.zeros((b, l, h, kd))
  for bi in range(b):
    for hi in range(h):
      gi = hi // (h // g)
      for t in range(l):
        js = [j for j in range(l) if see[t, j]]
        scores = np.array([q[bi, t, hi] @ k[bi, j, gi] for j in js])
        scores /= np.sqrt(kd)
        w = np.exp(scores - scores.max())
        w /= w.sum()
        o[bi, t, hi] = sum(wj * v[bi, j, gi] for wj, j in zip(w, js))
  return np.einsum('blhk,hkd->bld', o, wo), (k, v)


def np_mlp(x_BxLxD, p):
  gate = x_BxLxD @ p['gate']
  silu = gate / (1.0 + np.exp(-gate))
  return (silu * (x_BxLxD @ p['up'])) @ p['down']


def np_block(x, p, pos, theta, eps):
  a, _ = np_attention(np_rmsnorm(x, p['n1'], eps), p['attn'], pos, theta)
  x = np_rmsnorm(x + a, p['n2'], eps)
  return np_rmsnorm(x + np_mlp(np_rmsnorm(x, p['n3'], eps), p['mlp']), p['n4'], eps)


def attn_params(attn):
  p = dict(wq=f64(attn.wq_DxHxK[...]), wk=f64(attn.wk_DxGxK[...]),
           wv=f64(attn.wv_DxGxK[...]), wo=f64(attn.wo_HxKxD[...]))
  if attn.qk_bias:
    p.update(q_bias=f64(attn.q_bias_HxK[...]), k_bias=f64(attn.k_bias_GxK[...]))
  return p


def mlp_params(mlp):
  return dict(gate=f64(mlp.w_gate_DxF[...]), up=f64(mlp.w_up_DxF[...]),
              down=f64(mlp.w_down_FxD[...]))


def block_params(block):
  return dict(n1=f64(block.norm1.scale[...]), n2=f64(block.norm2.scale[...]),
              n3=f64(block.norm3.scale[...]), n4=f64(block.norm4.scale[...]),
              attn=attn_params(block.attn), mlp=mlp_params(block.mlp))


def np_looped_lm(mdl, tokens_BxL, s0_BxLxD, r):
  """Logits of the whole LM: embed (times embed_scale), prelude, r core loops with
  re-injection, (final norm with norm_before_coda,) coda, head."""
  cfg = mdl.cfg
  th, eps = cfg.rope_theta, cfg.norm_eps
  pos = np.broadcast_to(np.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
  emb = f64(mdl.embed_VxD[...])
  e = emb[np.asarray(tokens_BxL)] * cfg.embed_scale
  for blk in mdl.prelude:
    e = np_block(e, block_params(blk), pos, th, eps)
  s = f64(s0_BxLxD)
  adapter = f64(mdl.adapter_2DxD[...])
  for _ in range(r):
    s = np.concatenate([s, e], axis=-1) @ adapter
    for blk in mdl.core:
      s = np_block(s, block_params(blk), pos, th, eps)
  if cfg.norm_before_coda:
    s = np_rmsnorm(s, f64(mdl.final_norm.scale[...]), eps)
  for blk in mdl.coda:
    s = np_block(s, block_params(blk), pos, th, eps)
  h = np_rmsnorm(s, f64(mdl.final_norm.scale[...]), eps)
  head = emb if cfg.tie_embeddings else f64(mdl.head_VxD[...])
  return h @ head.T


def randomise(module, seed, std=0.3):
  """Replaces every parameter by N(0, std^2) (scales of 1 + N(0, std^2) for norms)."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Param):
      shape = var[...].shape
      if path[-1] == 'scale':
        var[...] = jnp.asarray(1.0 + std * rng.normal(size=shape), jnp.float32)
      else:
        fan_in = shape[0]
        var[...] = jnp.asarray(rng.normal(size=shape) / np.sqrt(fan_in), jnp.float32)


def assert_close(got, want, rtol=2e-5):
  """Float32 result against a float64 reference, absolute tolerance on the output scale."""
  want = np.asarray(want, np.float64)
  np.testing.assert_allclose(f64(got), want, rtol=rtol,
                             atol=rtol * max(np.abs(want).max(), 1e-30))


# ----------------------------------------------------------------------------
# Layers.


def test_rmsnorm_matches_numpy(model_cfg):
  norm = model_lib.RMSNorm(model_cfg)
  rng = np.random.default_rng(0)
  scale = 1.0 + 0.5 * rng.normal(size=model_cfg.d_model)
  norm.scale[...] = jnp.asarray(scale, jnp.float32)
  x = rng.normal(size=(2, 5, model_cfg.d_model)) * np.array([[[1e-2]], [[30.0]]])
  got = norm(jnp.asarray(x, jnp.float32))
  assert got.dtype == jnp.float32
  assert_close(got, np_rmsnorm(f64(x.astype(np.float32)), f64(scale.astype(np.float32)),
                               model_cfg.norm_eps))


def test_attention_matches_numpy_gqa(model_cfg):
  cfg = dataclasses.replace(model_cfg, num_heads=6, num_kv_heads=2)  # 3 queries per kv head
  attn = model_lib.Attention(cfg, nnx.Rngs(0))
  randomise(attn, 2)
  rng = np.random.default_rng(3)
  x = rng.normal(size=(2, 7, cfg.d_model)).astype(np.float32)
  pos = np.stack([np.arange(7), 11 + np.arange(7)]).astype(np.int32)
  out, (k, v) = attn(jnp.asarray(x), jnp.asarray(pos))
  want, (wk, wv) = np_attention(f64(x), attn_params(attn), pos, cfg.rope_theta)
  assert_close(out, want)
  assert_close(k, wk)
  assert_close(v, wv)
  # The test is only meaningful if the heads differ: mapping query heads to the
  # wrong kv head (h % G instead of h // (H/G)) must change the result.
  p = attn_params(attn)
  p_wrong = dict(p, wk=p['wk'][:, [1, 0]], wv=p['wv'][:, [1, 0]])
  wrong, _ = np_attention(f64(x), p_wrong, pos, cfg.rope_theta)
  assert np.abs(wrong - want).max() > 1e-2 * np.abs(want).max()


def test_fused_projections_give_the_same_model_with_fewer_matmuls(model_cfg):
  """model.fuse_projections: q/k/v and gate/up as one matmul each, same values and grads."""
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, model_cfg.vocab_size, (2, 9)))
  out, dots = {}, {}
  for fuse in (False, True):
    cfg = dataclasses.replace(model_cfg, fuse_projections=fuse)
    graphdef, params = nnx.split(model_lib.build_model(cfg, seed=0), nnx.Param)
    def loss(p):
      m = nnx.merge(graphdef, p)
      return jnp.sum(jnp.sin(m.forward(tokens, jax.random.key(0), model_lib.fixed(2)).logits))
    out[fuse] = jax.value_and_grad(loss)(params)
    x = jnp.ones((2, 9, cfg.d_model))
    pos = model_lib.positions(jnp.zeros((2, 9), jnp.int32))
    mlp, attn = model_lib.MLP(cfg, nnx.Rngs(0)), model_lib.Attention(cfg, nnx.Rngs(0))
    dots[fuse] = [jax.jit(f).lower().as_text().count('dot_general') for f in (
        lambda: mlp(x), lambda: attn(x, pos)[0])]
  np.testing.assert_allclose(float(out[True][0]), float(out[False][0]), rtol=1e-6)
  chex.assert_trees_all_close(jax.tree.map(f64, out[True][1]), jax.tree.map(f64, out[False][1]),
                              rtol=1e-4, atol=1e-5)  # fp32 reassociation
  assert [u - f for u, f in zip(dots[False], dots[True])] == [1, 2]  # gate+up; q+k+v


def test_attention_impls_agree_on_the_model_and_its_gradient(model_cfg):
  """model.attention_impl: auto (chunked on CPU), chunked and xla give one model."""
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, model_cfg.vocab_size, (2, 9)))
  out = {}
  for impl in ('auto', 'chunked', 'xla'):
    mdl = model_lib.build_model(dataclasses.replace(model_cfg, attention_impl=impl), seed=0)
    graphdef, params = nnx.split(mdl, nnx.Param)
    def loss(p):
      m = nnx.merge(graphdef, p)
      return jnp.sum(jnp.sin(m.forward(tokens, jax.random.key(0), model_lib.fixed(2)).logits))
    out[impl] = jax.value_and_grad(loss)(params)
  for impl in ('auto', 'xla'):
    np.testing.assert_allclose(float(out[impl][0]), float(out['chunked'][0]), rtol=1e-5)
    chex.assert_trees_all_close(jax.tree.map(f64, out[impl][1]),
                                jax.tree.map(f64, out['chunked'][1]), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError):
    attention_lib.attention_fn('flash')


def test_attention_explicit_causal_mask_via_kv_fn(model_cfg):
  attn = model_lib.Attention(model_cfg, nnx.Rngs(0))
  randomise(attn, 4)
  x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 6, model_cfg.d_model)),
                  jnp.float32)
  pos = model_lib.positions(jnp.zeros((2, 6), jnp.int32))
  mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]
  out_mask, _ = attn(x, pos, lambda k, v: (k, v, mask))
  out_causal, _ = attn(x, pos)
  np.testing.assert_allclose(np.asarray(out_mask), np.asarray(out_causal), rtol=1e-5,
                             atol=1e-6)


def test_mlp_matches_numpy(model_cfg):
  mlp = model_lib.MLP(model_cfg, nnx.Rngs(0))
  randomise(mlp, 6)
  x = np.random.default_rng(7).normal(size=(2, 5, model_cfg.d_model)).astype(np.float32)
  assert_close(mlp(jnp.asarray(x)), np_mlp(f64(x), mlp_params(mlp)))


def test_block_matches_numpy(model_cfg):
  block = model_lib.Block(model_cfg, nnx.Rngs(0))
  randomise(block, 8)
  x = np.random.default_rng(9).normal(size=(2, 6, model_cfg.d_model)).astype(np.float32)
  pos = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))
  out, _ = block(jnp.asarray(x), jnp.asarray(pos))
  assert_close(out, np_block(f64(x), block_params(block), pos, model_cfg.rope_theta,
                             model_cfg.norm_eps), rtol=5e-5)


@pytest.mark.parametrize('tie', [True, False])
def test_whole_looped_lm_matches_numpy(make_config, tie):
  cfg = make_config(model=dict(tie_embeddings=tie))
  mdl = model_lib.build_model(cfg.model, seed=1)
  randomise(mdl, 10)
  tokens = jnp.asarray(np.random.default_rng(11).integers(0, 64, (2, 6)), jnp.int32)
  key = jax.random.key(3)
  idx = 2  # depth cfg.depth.buckets[2] = 3
  got = jax.jit(lambda m, t, i: m.forward(t, key, model_lib.bucketed(i, cfg.depth)).logits)(
      mdl, tokens, jnp.int32(idx))
  pos = model_lib.positions(tokens)
  s0 = mdl.initial_state(jnp.zeros((2, 6, cfg.model.d_model)), key, pos)
  want = np_looped_lm(mdl, np.asarray(tokens), s0, cfg.depth.buckets[idx])
  assert got.shape == (2, 6, cfg.model.vocab_size) and got.dtype == jnp.float32
  assert_close(got, want, rtol=1e-5)


def test_huginn_options_match_numpy(make_config):
  """embed_scale, qk_bias (random biases, before RoPE) and norm_before_coda, all at once,
  against the float64 reference."""
  cfg = make_config(model=dict(embed_scale=2.5, qk_bias=True, norm_before_coda=True))
  mdl = model_lib.build_model(cfg.model, seed=1)
  randomise(mdl, 12)
  assert np.abs(f64(mdl.core[0].attn.k_bias_GxK[...])).min() > 0  # biases really random
  tokens = jnp.asarray(np.random.default_rng(13).integers(0, 64, (2, 6)), jnp.int32)
  key = jax.random.key(3)
  got = jax.jit(lambda m, t: m.forward(t, key, model_lib.fixed(2)).logits)(mdl, tokens)
  pos = model_lib.positions(tokens)
  s0 = mdl.initial_state(jnp.zeros((2, 6, cfg.model.d_model)), key, pos)
  assert_close(got, np_looped_lm(mdl, np.asarray(tokens), s0, 2), rtol=2e-5)


def test_attention_kv_fn_mask_is_not_made_causal(model_cfg):
  """A kv_fn mask is the whole mask: a bidirectional one (and a cache-like one: query t
  sees keys t.. only) attends to later keys, as the float64 reference does."""
  attn = model_lib.Attention(model_cfg, nnx.Rngs(0))
  randomise(attn, 4)
  x = np.random.default_rng(15).normal(size=(2, 6, model_cfg.d_model)).astype(np.float32)
  pos = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))
  for see_LxL in (np.ones((6, 6), bool), np.triu(np.ones((6, 6), bool))):
    out, _ = attn(jnp.asarray(x), jnp.asarray(pos),
                  lambda k, v, m=jnp.asarray(see_LxL)[None, None]: (k, v, m))
    want, _ = np_attention(f64(x), attn_params(attn), pos, model_cfg.rope_theta, see_LxL)
    assert_close(out, want, rtol=1e-5)


def test_initial_state_is_a_scaled_truncated_normal_per_position(model_cfg):
  """init_state random: per position a draw of std ~state_std (truncated at 3 sigma), the
  same in every row and batch, different across positions; init_state zeros: zeros."""
  e = jnp.asarray(np.random.default_rng(16).normal(size=(3, 64, model_cfg.d_model)),
                  jnp.float32)
  pos = model_lib.positions(jnp.zeros((3, 64), jnp.int32))
  key = jax.random.key(17)
  for std in (0.25, 2.0):
    mdl = model_lib.LoopedLM(dataclasses.replace(model_cfg, state_std=std), nnx.Rngs(0))
    s = f64(mdl.initial_state(e, key, pos))
    # a standard normal truncated at +-3 has std 0.9866; 2048 draws: ~2% sampling error
    assert abs(s[0].std() / std - 0.9866) < 0.06, s[0].std()
    assert np.abs(s).max() <= 3 * std * (1 + 1e-6)
    np.testing.assert_array_equal(s[0], s[2])  # the row does not matter
    np.testing.assert_array_equal(s[:1, :16], f64(mdl.initial_state(e[:1, :16], key, pos[:1, :16])))
    assert np.min(np.abs(s[0, 1:] - s[0, :-1]).max(-1)) > 0  # every position its own draw
  zeros = model_lib.LoopedLM(dataclasses.replace(model_cfg, init_state='zeros'), nnx.Rngs(0))
  np.testing.assert_array_equal(f64(zeros.initial_state(e, key, pos)), 0.0)


def test_bucketed_loop_honours_backprop_depth(make_config):
  """depth.backprop_depth=1: the training loop's gradient is that of a Python loop whose
  first r - 1 loops are under stop_gradient (and differs from the full gradient)."""
  cfg = make_config(depth=dict(backprop_depth=1, buckets=(1, 3), r_max=3))
  graphdef, params = nnx.split(model_lib.build_model(cfg.model, seed=1), nnx.Param)
  params = nnx.to_pure_dict(params)
  tokens = jnp.asarray(np.random.default_rng(18).integers(0, 64, (1, 5)), jnp.int32)
  idx = 1  # 3 loops (the switch's other branch: 1 loop)

  def python_loop(frozen):
    def loop(m, s, inj, pos):
      step = m.step_fn(inj, pos)
      for j in range(cfg.depth.buckets[idx]):
        s = jax.lax.stop_gradient(step(s)) if j < frozen else step(s)
      return s, None
    return loop

  grad = lambda loop: jax.grad(lambda p: jnp.sum(jnp.sin(model_lib.bind(graphdef, p).forward(
      tokens, jax.random.key(0), loop).logits)))(params)
  got = jax.jit(lambda i: grad(model_lib.bucketed(i, cfg.depth)))(jnp.int32(idx))
  want, full = jax.jit(lambda: (grad(python_loop(cfg.depth.buckets[idx] - 1)),
                                grad(python_loop(0))))()
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(want), jax.tree.leaves(full))) > 1e-4


def test_training_switch_has_a_branch_per_reachable_bucket_only(make_config):
  """r_max 10 with the default buckets (to 32): 9 branches, not 15 (the deeper ones cost
  compile time and, sized by the 32-loop branch, twice the step's temporaries)."""
  cfg = make_config()
  depth = dataclasses.replace(config_lib.DepthConfig(), r_max=10)
  mdl = model_lib.build_model(cfg.model, seed=1)
  tokens = jnp.zeros((1, 4), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda i: mdl.forward(tokens, jax.random.key(0),
                                               model_lib.bucketed(i, depth)).logits)(1)
  conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'cond']
  assert [len(e.params['branches']) for e in conds] == [9]  # (1, ..., 8, 10)


# ----------------------------------------------------------------------------
# Causality of the whole looped LM.


def test_loss_at_t_has_zero_gradient_wrt_later_positions(model_cfg):
  mdl = model_lib.LoopedLM(model_cfg, nnx.Rngs(0))
  randomise(mdl, 12)
  b, l, r = 2, 8, 3
  rng = np.random.default_rng(13)
  tokens = jnp.asarray(rng.integers(0, model_cfg.vocab_size, (b, l)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, model_cfg.vocab_size, (b, l)), jnp.int32)
  pos = model_lib.positions(tokens)
  x0 = jnp.take(mdl.embed_VxD[...], tokens, axis=0)
  s0 = mdl.initial_state(x0, jax.random.key(0), pos)

  def nll_per_position(x_BxLxD):
    e = x_BxLxD
    for block in mdl.prelude:  # LoopedLM.encode after the embedding lookup
      e, _ = block(e, pos)
    s = s0
    for _ in range(r):
      s, _ = mdl.core_step(s, mdl.inject(e), pos)
    logits = mdl.logits(mdl.decode_state(s, pos)[0])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

  # The embedding-level forward is the model's own forward.
  depth_cfg = config_lib.Config(depth=config_lib.DepthConfig(buckets=(1, 2, r), r_max=r))
  logits = mdl.forward(tokens, jax.random.key(0), model_lib.bucketed(2, depth_cfg.depth)).logits
  mdl_loss = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None],
                                  axis=-1)[..., 0]
  np.testing.assert_allclose(np.asarray(nll_per_position(x0)), np.asarray(mdl_loss),
                             rtol=1e-5)

  jac = np.asarray(jax.jit(jax.jacrev(nll_per_position))(x0))  # [B, L, B, L, D]
  mag = np.abs(jac).max(axis=-1)  # [B, L, B, L]
  for bi in range(b):
    for t in range(l):
      for bj in range(b):
        for u in range(l):
          if bj != bi or u > t:
            assert mag[bi, t, bj, u] == 0.0, (bi, t, bj, u)
          else:
            assert mag[bi, t, bj, u] > 0.0, (bi, t, bj, u)


# ----------------------------------------------------------------------------
# Parameter and FLOP counts.

PAPER = dict(vocab_size=49152, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64,
             mlp_dim=1536, n_prelude=2, n_core=4, n_coda=2)


def hand_param_count(d, h, g, k, f, v, n_blocks, tied):
  attention = d * h * k + 2 * d * g * k + h * k * d   # q, k, v, o
  mlp = 3 * d * f                                     # gate, up, down
  norms = 4 * d                                       # sandwich norms
  block = attention + mlp + norms
  return (n_blocks * block + v * d + 2 * d * d + d     # blocks, embed, adapter, final norm
          + (0 if tied else v * d))


# jnp.size on a ShapeDtypeStruct is deprecated and will become an error in JAX.
@pytest.mark.filterwarnings('error::DeprecationWarning')
@pytest.mark.parametrize('tied', [True, False])
def test_count_params_paper_shape_is_abstract(monkeypatch, tied):
  cfg = dataclasses.replace(model_lib.ModelConfig(), tie_embeddings=tied, **PAPER)
  created = []
  real = jax.random.truncated_normal

  def spy(*args, **kwargs):
    out = real(*args, **kwargs)
    created.append(isinstance(out, jax.core.Tracer))
    return out

  monkeypatch.setattr(jax.random, 'truncated_normal', spy)
  n = model_lib.count_params(cfg)
  want = hand_param_count(576, 9, 3, 64, 1536, 49152, 8, tied)
  assert n == want
  assert abs(n - (57.3e6 if tied else 85.6e6)) < 0.05e6
  assert created and all(created), 'count_params materialised parameters'


@pytest.mark.filterwarnings('error::DeprecationWarning')
def test_count_params_equals_allocated_tiny(model_cfg):
  for tied in (True, False):
    cfg = dataclasses.replace(model_cfg, tie_embeddings=tied)
    _, params = nnx.split(model_lib.LoopedLM(cfg, nnx.Rngs(0)), nnx.Param)
    allocated = sum(x.size for x in jax.tree.leaves(params))
    assert model_lib.count_params(cfg) == allocated
    assert allocated == hand_param_count(cfg.d_model, cfg.num_heads, cfg.num_kv_heads,
                                         cfg.head_dim, cfg.mlp_dim, cfg.vocab_size,
                                         cfg.n_prelude + cfg.n_core + cfg.n_coda, tied)


def test_flops_per_token_hand_count(model_cfg):
  cfg = dataclasses.replace(model_cfg, num_heads=6, num_kv_heads=3, n_prelude=2,
                            n_core=3, n_coda=1)
  d, h, g, k, f, v = 32, 6, 3, 8, 64, 64
  seq = 16
  mm = lambda fan_in, fan_out: 2 * fan_in * fan_out  # multiply-adds of x @ W per token
  per_block = (mm(d, h * k) + mm(d, g * k) + mm(d, g * k) + mm(h * k, d)  # q, k, v, o
               + mm(d, f) + mm(d, f) + mm(f, d)                           # SwiGLU
               + 2 * (2 * h * k * seq / 2))      # q.k and p.v over L/2 keys on average
  head = mm(d, v)
  for r in (1, 2.5, 7):
    got = model_lib.flops_per_token(cfg, r, seq)
    # the adapter: the injection e @ W[D:] once (prelude), s @ W[:D] every loop
    assert got['prelude'] == pytest.approx(2 * per_block + mm(d, d))
    assert got['loop'] == pytest.approx(3 * per_block + mm(d, d))
    assert got['head'] == pytest.approx(head)
    assert got['coda_head'] == pytest.approx(per_block + head)
    assert got['total'] == pytest.approx(2 * per_block + mm(d, d) + r * (3 * per_block + mm(d, d))
                                         + per_block + head)


def test_attention_only_in_the_core(model_cfg):
  """model.attention=core: prelude and coda mix no positions; params and FLOPs drop by
  exactly their attention (and its two norms)."""
  cfg = dataclasses.replace(model_cfg, attention='core')
  mdl = model_lib.LoopedLM(cfg, nnx.Rngs(0))
  randomise(mdl, 13)
  rng = np.random.default_rng(14)
  tok = rng.integers(0, 64, (1, 6)).astype(np.int32)
  other = tok.copy()
  other[0, :5] = (tok[0, :5] + 1) % 64  # change every token but the last
  pos = jnp.asarray(np.arange(6, dtype=np.int32)[None])
  e1, _ = mdl.encode(jnp.asarray(tok), pos)
  e2, _ = mdl.encode(jnp.asarray(other), pos)
  assert_close(e1[0, 5], e2[0, 5], rtol=0)  # the last position sees only its own token
  s = jnp.asarray(rng.normal(size=(1, 6, cfg.d_model)).astype(np.float32))
  h1, _ = mdl.decode_state(s, pos)
  h2, _ = mdl.decode_state(s.at[0, :5].set(0.0), pos)
  assert_close(h1[0, 5], h2[0, 5], rtol=0)
  d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  attn_params = d * h * k + 2 * d * g * k + h * k * d + 2 * d  # wq, wk, wv, wo, norm1/2
  outer = cfg.n_prelude + cfg.n_coda
  assert model_lib.count_params(model_cfg) - model_lib.count_params(cfg) == outer * attn_params
  seq = 16
  attn_flops = 2 * attn_params - 4 * d + 2 * (2 * h * k * seq / 2)
  full, core = (model_lib.flops_per_token(c, 3, seq) for c in (model_cfg, cfg))
  assert full['total'] - core['total'] == pytest.approx(outer * attn_flops)


def _xla_flops(f, *args) -> float:
  """FLOPs XLA:CPU counts for the compiled f (matmuls and elementwise work)."""
  ca = jax.jit(f).lower(*args).compile().cost_analysis()
  return float((ca if isinstance(ca, dict) else ca[0])['flops'])


@pytest.mark.parametrize('l', [48, 64, 256])
def test_causal_keys_is_what_the_compiled_attention_multiplies(l):
  """causal_keys(L) x 4 H K FLOPs per query against XLA's own count (softmax adds ~2%)."""
  b, h, g, k = 1, 2, 1, 64
  q, kv = jnp.zeros((b, l, h, k)), jnp.zeros((b, l, g, k))
  per_key = 4 * b * h * l * k
  got = _xla_flops(attention_lib.causal_attention, q, kv, kv) / per_key
  assert model_lib.causal_keys(l) <= got <= 1.05 * model_lib.causal_keys(l)
  if attention_lib.attention_chunks(l) > 1:
    assert model_lib.causal_keys(l) > l / 2  # the chunks multiply some masked scores
  full = _xla_flops(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True), q, kv, kv)
  assert l <= full / per_key <= 1.05 * l  # the frozen-kv hook's attention: all L keys


def test_bad_tokens_and_model_configs_are_named_not_computed():
  """Out-of-range ids would gather NaN embeddings (or wrap around) silently: refused where
  their values are known; shapes, dtypes and lengths always; build_model validates."""
  cfg = config_lib.ModelConfig(vocab_size=32, d_model=32, num_heads=2, num_kv_heads=1,
                               head_dim=16, mlp_dim=64, n_prelude=1, n_core=1, n_coda=1,
                               max_len=16)
  model_lib.check_tokens(cfg, np.array([[0, 31, 5]]))  # in range: no error
  for toks, words in [(np.array([[1, 32]]), r'\[0, 32\).*got 1\.\.32'),
                      (np.array([[-1, 3]]), r'got -1\.\.3'),
                      (np.zeros((2, 17), np.int32), '17 positions exceed model.max_len=16'),
                      (np.array([1, 2]), r'\[B, L\] integer'),
                      (np.array([[1.0, 2.0]]), r'\[B, L\] integer'),
                      (np.zeros((2, 0), np.int32), 'no positions')]:  # was a numpy error
    with pytest.raises(ValueError, match=words):
      model_lib.check_tokens(cfg, toks)
  with pytest.raises(ValueError, match=r'10 positions \+ 7 new exceed'):
    model_lib.check_tokens(cfg, np.zeros((1, 10), np.int32), extra=7)
  # traced ids: values unknown, so only the static checks run
  jax.jit(lambda t: model_lib.check_tokens(cfg, t) or t)(jnp.array([[99]]))
  for bad, words in [(dict(num_heads=3, num_kv_heads=2), 'not a multiple'),
                     (dict(head_dim=15), 'even for RoPE'), (dict(dtype='float64x'), 'dtype'),
                     (dict(n_core=0), 'n_core=0'), (dict(init_std=float('nan')), 'init_std')]:
    with pytest.raises(config_lib.ConfigError, match=words):
      model_lib.build_model(dataclasses.replace(cfg, **bad))


def test_check_tokens_accepts_exactly_max_len_positions():
  """The bound is inclusive: L == max_len, and L + extra == max_len, are accepted (one
  position more is refused, as the suite already checks)."""
  cfg = config_lib.ModelConfig(vocab_size=32, d_model=32, num_heads=2, num_kv_heads=1,
                               head_dim=16, mlp_dim=64, n_prelude=1, n_core=1, n_coda=1,
                               max_len=16)
  model_lib.check_tokens(cfg, np.zeros((2, 16), np.int32))
  model_lib.check_tokens(cfg, np.zeros((1, 10), np.int32), extra=6)
  with pytest.raises(ValueError, match='exceed model.max_len=16'):
    model_lib.check_tokens(cfg, np.zeros((1, 10), np.int32), extra=7)
