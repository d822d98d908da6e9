"""A compiled training step that times itself, and its FLOP books (bench_train, profile_train)."""

import time

import jax
import numpy as np

from elastic_depth import attention
from elastic_depth import config as config_lib
from elastic_depth import distributed
from elastic_depth import dry_run
from elastic_depth import model as model_lib
from elastic_depth import train_step
from experiments import bench_util


def attention_impl(cfg: config_lib.Config) -> config_lib.AttentionImpl:
  """The attention implementation the step runs (AUTO resolved for this backend)."""
  m = cfg.model
  impl = config_lib.AttentionImpl(m.attention_impl)
  if impl != config_lib.AttentionImpl.AUTO:
    return impl
  return attention.auto_attention_impl(jax.default_backend(), model_lib.DTYPES[m.dtype],
                                       m.head_dim)


def flop_counts(cfg: config_lib.Config, r: int) -> dict:
  """Per-token FLOPs: model (3x forward) and hardware (plus what the backward recomputes)."""
  fwd = model_lib.flops_per_token(cfg.model, r, cfg.train.seq_len)
  model = 3 * fwd['total']
  m, impl = cfg.model, attention_impl(cfg)
  scores = m.num_heads * m.head_dim * cfg.train.seq_len  # one causal QK^T product per token
  kept = {  # matmul FLOPs per token of one loop that remat recomputes in the backward pass
      config_lib.RematPolicy.NOTHING: fwd['loop'],
      # DOTS: the attention scores/outputs, except the chunked attention's (names kept)
      config_lib.RematPolicy.DOTS: (0.0 if impl == config_lib.AttentionImpl.CHUNKED
                                    else m.n_core * 2 * scores),
      config_lib.RematPolicy.ALL_DOTS: 0.0}
  recompute = r * kept[cfg.depth.remat_policy] if cfg.depth.remat else 0.0
  if impl in (config_lib.AttentionImpl.CHUNKED, config_lib.AttentionImpl.CUDNN):
    # a flash-style backward recomputes the scores of every attention block
    outer = m.n_prelude + m.n_coda if config_lib.AttentionIn(m.attention) == (
        config_lib.AttentionIn.ALL) else 0
    recompute += scores * (r * m.n_core + outer)
  return dict(forward=float(fwd['total']), model=float(model),
              remat_recompute=float(recompute), hw=float(model + recompute),
              head_fraction=float(fwd['head'] / fwd['total']))


def random_batch(cfg: config_lib.Config, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  shape = (cfg.train.batch_size, cfg.train.seq_len)
  v = cfg.model.vocab_size
  return dict(inputs=rng.integers(0, v, shape).astype(np.int32),
              targets=rng.integers(0, v, shape).astype(np.int32),
              mask=np.ones(shape, np.float32))


class TimedStep(bench_util.StepTimer):
  """The library's train step of one Config, compiled; times steps on demand."""

  def __init__(self, name: str, cfg: config_lib.Config, timed: bool):
    """`name` labels the shape; timed=False compiles abstractly (nothing allocated)."""
    super().__init__()
    self.name, self.cfg, self.r = name, cfg, cfg.depth.r_max  # a single bucket (r,)
    self.remat = (config_lib.RematPolicy(cfg.depth.remat_policy).value if cfg.depth.remat
                  else 'off')
    self.accum = config_lib.grad_accum_steps(cfg.train)
    self.tokens = self.accum * cfg.train.batch_size * cfg.train.seq_len
    mesh = distributed.make_mesh(jax.devices()[:1])
    t0 = time.perf_counter()
    if timed:
      graphdef, state = train_step.init_state(cfg, cfg.train.seed)
      self.state = train_step.place_state(state, mesh)
      self.batch = distributed.shard_batch(
          [random_batch(cfg, i) for i in range(self.accum)], mesh, self.accum)
      step_fn = train_step.make_train_step(graphdef, cfg, mesh)
      self.compiled = step_fn.lower(self.state, self.batch).compile()
    else:  # nothing allocated: FLOPs and memory only
      self.compiled = dry_run.compile_abstract(cfg, mesh)
    self.compile_s = time.perf_counter() - t0
    self.depths = set()

  def step(self) -> float:
    """One step (blocks on its loss); records the depth bucket it ran."""
    self.state, m = self.compiled(self.state, self.batch)
    loss = float(m['loss'])
    self.depths.add(int(m['bucket']))
    return loss

  def compiled_figures(self) -> dict:
    """XLA's cost (FLOPs per step, incl. remat) and memory analysis of the compiled step."""
    out = {}
    try:
      cost = self.compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      # XLA's count: a scan's loop body is counted once, not r times
      out['compiled_flops_per_step'] = float(cost.get('flops', 0.0))
      out['compiled_bytes_accessed_per_step'] = float(cost.get('bytes accessed', 0.0))
    except Exception:  # pylint: disable=broad-except  not every backend reports it
      pass
    try:
      mem = dry_run.memory_of(self.compiled)
      out.update(temp_bytes=mem['temp_size_in_bytes'],
                 argument_bytes=mem['argument_size_in_bytes'], peak_bytes=mem['peak_bytes'])
    except Exception:  # pylint: disable=broad-except
      pass
    return out

  def result(self) -> dict:
    """The shape's JSON record (timing fields only when steps were run)."""
    cfg, tokens = self.cfg, self.tokens
    fl = flop_counts(cfg, self.r)
    res = dict(
        shape=self.name, depth=self.r, dtype=cfg.model.dtype, remat=self.remat,
        loss_chunk=cfg.train.loss_chunk, attention_impl=str(cfg.model.attention_impl.value),
        attention_impl_run=attention_impl(cfg).value,
        unroll=cfg.depth.unroll, fuse_projections=cfg.model.fuse_projections,
        params=int(model_lib.count_params(cfg.model)), batch_size=cfg.train.batch_size,
        seq_len=cfg.train.seq_len, grad_accum=self.accum, tokens_per_step=tokens,
        config=train_step.config_dict(cfg), compile_s=self.compile_s,
        flops_per_token=fl['model'], flops_per_token_forward=fl['forward'],
        flops_per_token_remat_recompute=fl['remat_recompute'],
        flops_per_token_hw=fl['hw'], head_flop_fraction=fl['head_fraction'],
        timed=bool(self.times), **self.compiled_figures())
    if 'compiled_flops_per_step' in res:
      res['compiled_flops_per_token'] = res['compiled_flops_per_step'] / tokens
    if not self.times:
      return res
    res.update(self.timing(tokens))
    med = res['step_s_median']
    res.update(
        tokens_per_s_best=tokens / min(self.times),
        model_flops_per_s=fl['model'] * tokens / med,
        all_finite=bool(np.all(np.isfinite(self.losses))), depths_run=sorted(self.depths),
        hw_flops_per_s=fl['hw'] * tokens / med)
    return res
