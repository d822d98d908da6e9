"""Dataclass configs for models, depth sampling, data, training and exit (no jax import)."""

import dataclasses
import enum
import math

import numpy as np


class InitState(str, enum.Enum):
  """How the recurrent state is initialised before the first loop."""
  RANDOM = 'random'  # scaled truncated normal, as in Huginn
  ZEROS = 'zeros'


class Schedule(str, enum.Enum):
  """Learning-rate schedule after linear warmup."""
  COSINE = 'cosine'
  WSD = 'wsd'  # warmup-stable-decay (linear decay over the last `decay_frac`)


class ExitPolicy(str, enum.Enum):
  """Per-token exit criteria (see policies.py)."""
  UNIFORM = 'uniform'          # A0: fixed depth
  KL = 'kl'                    # A1: KL(p_i || p_{i-1}) < eps
  GATED_KL = 'gated_kl'        # A1 where the relative state change < exit.gate
  REVERSE_KL = 'reverse_kl'    # KL(p_{i-1} || p_i) < eps
  STATE_DELTA = 'state_delta'  # ||s_i - s_{i-1}|| / ||s_i|| < eps
  ROUTER = 'router'            # A2: linear probe P(change) < eps
  KL_PROBE = 'kl_probe'        # the KL estimated from the state (policies.KLProbe) < eps
  CONFIDENCE = 'confidence'    # 1 - max_v p_i(v) < eps (no previous loop needed)


class Semantics(str, enum.Enum):
  """How teacher-forced quality is measured (inference.py's two semantics)."""
  PARALLEL = 'parallel'  # inference.score: all positions together
  CACHED = 'cached'      # decoding.score_cached: token by token through decode_step


class AttentionIn(str, enum.Enum):
  """Which blocks mix positions (the others are MLP-only)."""
  ALL = 'all'    # every block has attention
  CORE = 'core'  # only the shared core: prelude and coda are MLP-only, so every step
                 # of work between positions has to be done by the loops


class AttentionImpl(str, enum.Enum):
  """How full-sequence causal attention (training, scoring without hooks) is computed."""
  AUTO = 'auto'        # chunked on CPU; cuDNN flash attention on a GPU for bf16/fp16
                       # heads it takes, else XLA (attention.auto_attention_impl)
  CHUNKED = 'chunked'  # attention.causal_attention: kv-group-major, causal query chunks
  XLA = 'xla'          # jax.nn.dot_product_attention(implementation='xla')
  CUDNN = 'cudnn'      # jax.nn.dot_product_attention(implementation='cudnn'), GPU only


class ExitEngine(str, enum.Enum):
  """How teacher-forced scoring runs the exit loop (see inference.py)."""
  MASKED = 'masked'        # every loop runs all B x L tokens; exited ones are masked
  COMPACTED = 'compacted'  # every loop gathers the active tokens and runs only those
  POOLED = 'pooled'        # compacted over the whole batch at once (many short rows)


class RematPolicy(str, enum.Enum):
  """What jax.checkpoint keeps of each core loop for the backward pass (depth.remat on)."""
  NOTHING = 'nothing'    # recompute the whole loop in the backward pass (least memory)
  DOTS = 'dots'          # keep the projection/MLP matmul outputs, the rotated q/k and the
                         # chunked attention's output and log-sum-exp; recompute the rest
  ALL_DOTS = 'all_dots'  # also keep the batched matmuls (attention scores and outputs)


class NanPolicy(str, enum.Enum):
  """What the training loop does on a non-finite loss or gradient."""
  STOP = 'stop'
  SKIP = 'skip'


# The paper's SmolLM2-135M-shaped blocks, prelude/core/coda 2/4/2 (benchmarks' shape P).
BLOCKS_135M = dict(vocab_size=49152, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64,
                   mlp_dim=1536, n_prelude=2, n_core=4, n_coda=2)


@dataclasses.dataclass
class ModelConfig:
  """Shape of the looped LM: prelude -> core x r -> coda -> head."""
  vocab_size: int = 512
  d_model: int = 128
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 384
  n_prelude: int = 1
  n_core: int = 2
  n_coda: int = 1
  max_len: int = 2048
  rope_theta: float = 10000.0
  tie_embeddings: bool = True
  init_state: InitState = InitState.RANDOM
  attention: AttentionIn = AttentionIn.ALL  # all | core (MLP-only prelude and coda)
  attention_impl: AttentionImpl = AttentionImpl.AUTO  # see AttentionImpl
  fuse_projections: bool = False  # q/k/v and gate/up each as one matmul (same parameters)
  init_std: float = 0.02
  state_std: float = 1.0  # std of the random initial state (before truncation)
  norm_eps: float = 1e-6
  dtype: str = 'float32'  # compute dtype; parameters are always fp32
  # Options for imported models (Huginn-0125: see elastic_depth/huginn.py); the defaults
  # are the behaviour of models trained here.
  embed_scale: float = 1.0        # token embeddings are multiplied by this (Huginn: sqrt(D))
  qk_bias: bool = False           # learned per-head bias on q and k, added before RoPE
  norm_before_coda: bool = False  # final_norm also on the core state before the coda


@dataclasses.dataclass
class DepthConfig:
  """Randomised-depth training: r ~ Poisson(exp(tau)) + 1, tau ~ N(mu, sigma).

  mu = log(mean - 1) - sigma^2 / 2, so E[exp(tau)] = mean - 1 and E[r] = mean
  before clipping to [1, r_max] and rounding to the nearest bucket (ties deeper). Buckets
  past the first at or above r_max are never reached and not compiled (trained_buckets).
  """
  mean: float = 8.0
  sigma: float = 0.5
  r_max: int = 32
  buckets: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32)
  backprop_depth: int = 0  # 0: backprop through every loop; k: only the last k
  remat: bool = True
  remat_policy: RematPolicy = RematPolicy.NOTHING  # what remat keeps (see RematPolicy)
  unroll: int = 1  # loops per iteration of the training scan (lax.scan unroll; same result)


def trained_buckets(d: DepthConfig) -> tuple[int, ...]:
  """The buckets a draw can round to: depth.buckets up to the first at or above r_max.

  A draw is at most r_max, so a deeper bucket is never the nearest: the training step's
  switch leaves those branches out (they cost compile time and memory, never loops).
  """
  b = tuple(d.buckets)
  k = next((i for i, x in enumerate(b) if x >= d.r_max), len(b) - 1)
  return b[:k + 1]


@dataclasses.dataclass
class DataConfig:
  """Where tokens come from (see elastic_depth/data)."""
  source: str = 'synthetic'  # synthetic | text | hf | tfds | tokens (prepared shards)
  paths: str = ''            # file, glob or comma-separated list (text); DIR (tokens)
  val_paths: str = ''        # optional separate validation files
  text_field: str = 'text'   # jsonl key / parquet column
  separator: str = '<|endoftext|>'
  hf_name: str = ''          # e.g. HuggingFaceFW/fineweb-edu
  hf_config: str = ''        # e.g. sample-10BT
  tfds_name: str = ''
  tfds_data_dir: str = ''    # where the TFDS dataset was prepared (array_record)
  tokenizer: str = 'train'   # 'train' (byte-level BPE on the corpus), a path, or a hub name
  val_fraction: float = 0.05
  max_docs: int = 0          # documents per part (paths, val_paths, split); 0: all
  seed: int = 0
  # synthetic generator (see elastic_depth/data/synthetic.py)
  synth_task: str = 'compose'  # compose (k permutations in order) | chain | digit_last | binding
  loss_on: str = 'all'         # all | answers (synthetic: only targets with difficulty > 0)
  synth_examples: int = 4000
  synth_max_hops: int = 6
  synth_num_vars: int = 16
  synth_num_ops: int = 4       # compose, chain, digit_last: fixed digit permutations (op symbols)
  synth_curriculum: int = 0    # op tasks: training windows per curriculum stage; stage j
                               # draws k from 1..min(2 + j, synth_max_hops) (0: no curriculum)


@dataclasses.dataclass
class TrainConfig:
  """Optimiser, schedule, batch and loop bookkeeping."""
  seed: int = 0
  steps: int = 600
  batch_size: int = 16       # sequences per micro-batch
  seq_len: int = 128
  grad_accum: int = 1        # micro-batches per optimizer step
  tokens_per_step: int = 0   # if > 0, sets grad_accum = tokens_per_step / (batch*seq)
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 50
  schedule: Schedule = Schedule.COSINE
  decay_frac: float = 0.2
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  eval_every: int = 200
  eval_batches: int = 4
  eval_depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # validated up to depth.r_max (a note
  # names deeper ones; experiments.eval_depth scores them)
  ckpt_every: int = 200
  keep_checkpoints: int = 3
  log_every: int = 20
  nan_policy: NanPolicy = NanPolicy.STOP
  fsdp: int = 1              # devices over which parameters/optimizer state are split
  fsdp_axis: str = 'D'       # the logical axis (shape-suffix letter) split over fsdp
  peak_flops: float = 0.0    # device peak FLOP/s for the logged MFU (0: by device kind,
                             # none on CPU)
  max_skips: int = 10
  loss_chunk: int = 0        # > 0: the LM head and cross-entropy fused, this many tokens at
                             # a time (losses.head_nll: no [B, L, V] logits are kept)


@dataclasses.dataclass
class ExitConfig:
  """Inference-time exit policy."""
  policy: ExitPolicy = ExitPolicy.KL
  eps: float = 1e-3
  depth: int = 8             # A0 depth
  min_loops: int = 1
  max_loops: int = 32
  check_every: int = 1
  gate: float = 0.0          # gated_kl: consult the KL only where the relative state
                             # change is below this (0: never, so no token exits early)
  eps_growth: float = 1.0    # the threshold at loop i >= 2 is eps * eps_growth^(i - 2)
                             # (> 1: looser with depth; policies.threshold)
  patience: int = 1          # state_delta: exit once the change has stayed below eps for
                             # this many consecutive loops (counted from loop 2)
  use_kernel: bool = False   # fused Pallas KL (GPU); reference jnp otherwise
  engine: ExitEngine = ExitEngine.MASKED  # score/prefill: masked, compacted or pooled loop
  compact_steps: int = 8     # compacted (pooled): buffers are multiples of L (B L) / this
                             # (and powers of two below): one compiled phase per size


@dataclasses.dataclass
class Config:
  """Everything an experiment needs."""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  depth: DepthConfig = dataclasses.field(default_factory=DepthConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  exit: ExitConfig = dataclasses.field(default_factory=ExitConfig)


_SECTION_NAMES = {ModelConfig: 'model', DepthConfig: 'depth', DataConfig: 'data',
                  TrainConfig: 'train', ExitConfig: 'exit'}


class ConfigError(ValueError):
  """A configuration that cannot work, found before any compilation."""


def _check_enums(cfg: Config) -> None:
  """Turns enum fields given as strings (JSON, tests) into their enums, or names the bad one."""
  for section in (cfg.model, cfg.depth, cfg.data, cfg.train, cfg.exit):
    for f in dataclasses.fields(section):
      kind = f.type
      if isinstance(kind, type) and issubclass(kind, enum.Enum):
        value = getattr(section, f.name)
        try:
          setattr(section, f.name, kind(value))
        except ValueError:
          raise ConfigError(
              f'{_SECTION_NAMES[type(section)]}.{f.name}={value!r} not in '
              f'{sorted(x.value for x in kind)}') from None


@dataclasses.dataclass(frozen=True)
class Range:
  """An allowed interval for a numeric field (NaN and infinities never pass)."""
  lo: float = -math.inf
  hi: float = math.inf
  lo_open: bool = False
  hi_open: bool = False

  def holds(self, x) -> bool:
    """Whether x is finite and inside the interval."""
    if not math.isfinite(x):
      return False
    above = x > self.lo if self.lo_open else x >= self.lo
    below = x < self.hi if self.hi_open else x <= self.hi
    return above and below

  def __str__(self) -> str:
    if self.hi == math.inf:
      return f'{">" if self.lo_open else ">="} {self.lo:g}'
    return (f'in {"(" if self.lo_open else "["}{self.lo:g}, {self.hi:g}'
            f'{")" if self.hi_open else "]"}')


AT_LEAST_1 = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, lo_open=True)
UNIT = Range(0, 1)                         # a fraction, both ends allowed
OPEN_UNIT = Range(0, 1, lo_open=True, hi_open=True)
BETA = Range(0, 1, hi_open=True)           # Adam moment decay

# section -> field -> allowed range, for every numeric field (tuples: every element).
RANGES = {
    'model': dict(vocab_size=AT_LEAST_1, d_model=AT_LEAST_1, num_heads=AT_LEAST_1,
                  num_kv_heads=AT_LEAST_1, head_dim=Range(2), mlp_dim=AT_LEAST_1,
                  n_prelude=NON_NEGATIVE, n_core=AT_LEAST_1, n_coda=NON_NEGATIVE,
                  max_len=AT_LEAST_1, rope_theta=POSITIVE, init_std=POSITIVE,
                  state_std=NON_NEGATIVE, norm_eps=POSITIVE, embed_scale=POSITIVE),
    'depth': dict(mean=AT_LEAST_1, sigma=NON_NEGATIVE, r_max=AT_LEAST_1,
                  buckets=AT_LEAST_1, backprop_depth=NON_NEGATIVE,
                  unroll=AT_LEAST_1),
    'data': dict(val_fraction=OPEN_UNIT, max_docs=NON_NEGATIVE, seed=NON_NEGATIVE,
                 synth_examples=AT_LEAST_1, synth_max_hops=AT_LEAST_1,
                 synth_num_vars=AT_LEAST_1, synth_num_ops=AT_LEAST_1,
                 synth_curriculum=NON_NEGATIVE),
    'train': dict(seed=NON_NEGATIVE, steps=AT_LEAST_1, batch_size=AT_LEAST_1,
                  seq_len=AT_LEAST_1, grad_accum=AT_LEAST_1, tokens_per_step=NON_NEGATIVE,
                  lr=POSITIVE, min_lr_ratio=UNIT, warmup_steps=NON_NEGATIVE,
                  decay_frac=UNIT, weight_decay=NON_NEGATIVE, b1=BETA, b2=BETA,
                  grad_clip=POSITIVE, eval_every=AT_LEAST_1, eval_batches=AT_LEAST_1,
                  eval_depths=AT_LEAST_1, ckpt_every=AT_LEAST_1, keep_checkpoints=AT_LEAST_1,
                  log_every=AT_LEAST_1, max_skips=NON_NEGATIVE, fsdp=AT_LEAST_1,
                  peak_flops=NON_NEGATIVE, loss_chunk=NON_NEGATIVE),
    'exit': dict(eps=NON_NEGATIVE, depth=AT_LEAST_1, min_loops=AT_LEAST_1,
                 max_loops=AT_LEAST_1, check_every=AT_LEAST_1, gate=NON_NEGATIVE,
                 compact_steps=AT_LEAST_1, eps_growth=POSITIVE,
                 patience=AT_LEAST_1),
}


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _check_field(name: str, value, like, allowed: Range) -> None:
  """Raises ConfigError unless value has the type of `like` and lies in `allowed`."""
  if isinstance(like, tuple):
    if not value or not all(_is_int(x) and allowed.holds(x) for x in value):
      raise ConfigError(f'{name}={tuple(value)} must be a non-empty tuple of integers '
                        f'{allowed}')
    return
  number = _is_int(value) or (isinstance(value, float) and not _is_int(like))
  if not number or not allowed.holds(value):
    kind = 'an integer' if _is_int(like) else 'a finite number'
    raise ConfigError(f'{name}={value!r} must be {kind} {allowed}')


def _check_section(section: str, sub) -> None:
  """One section's numeric fields against RANGES."""
  default = type(sub)()
  for f, allowed in RANGES[section].items():
    _check_field(f'{section}.{f}', getattr(sub, f), getattr(default, f), allowed)


def validate_model(m: ModelConfig) -> None:
  """Raises ConfigError naming the first bad model setting (`build_model` runs it)."""
  _check_section('model', m)
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(f'model.num_heads={m.num_heads} is not a multiple of '
                      f'model.num_kv_heads={m.num_kv_heads}')
  if m.head_dim % 2:
    raise ConfigError(f'model.head_dim={m.head_dim} must be even for RoPE')
  for name in ('qk_bias', 'norm_before_coda'):
    if not isinstance(getattr(m, name), bool):
      raise ConfigError(f'model.{name}={getattr(m, name)!r} must be true or false')
  if m.dtype not in ('float32', 'bfloat16', 'float16'):
    raise ConfigError(f'model.dtype={m.dtype!r} not in float32/bfloat16/float16')


def check_exit(e: ExitConfig) -> None:
  """ConfigError for an exit config the engines cannot honour; concrete values (numbers,
  numpy or jax scalars and arrays) are checked, traced ones skipped. eps < 0 is allowed: a
  threshold no check reaches."""
  for f in ('depth', 'min_loops', 'max_loops', 'check_every', 'compact_steps', 'patience'):
    v = _concrete(getattr(e, f))
    if v is not None and not np.all(v >= 1):
      raise ConfigError(f'exit.{f}={getattr(e, f)!r} must be an integer >= 1')
  for f in ('eps', 'gate', 'eps_growth'):
    v = _concrete(getattr(e, f))
    if v is not None and not np.all(np.isfinite(v)):
      raise ConfigError(f'exit.{f}={getattr(e, f)!r} must be a finite number')
  growth = _concrete(e.eps_growth)
  if growth is not None and not np.all(growth > 0):
    raise ConfigError(f'exit.eps_growth={e.eps_growth} must be > 0')


def _concrete(v):
  """A number or concrete array (numpy, jax) as float64 numpy; None for a traced value."""
  try:
    return np.asarray(v, np.float64)
  except (TypeError, ValueError):  # a tracer (TracerArrayConversionError is a TypeError)
    return None


def _check_ranges(cfg: Config) -> None:
  """Every numeric field against RANGES, in declaration order."""
  for section in RANGES:
    _check_section(section, getattr(cfg, section))


def _check_relations(cfg: Config) -> None:
  """Constraints between fields (their ranges already hold)."""
  m, d, t, e = cfg.model, cfg.depth, cfg.train, cfg.exit
  validate_model(m)
  b = tuple(d.buckets)
  if list(b) != sorted(set(b)):
    raise ConfigError(f'depth.buckets={b} must be strictly increasing')
  if b[-1] < d.r_max:
    raise ConfigError(f'depth.buckets={b} do not cover depth.r_max={d.r_max}')
  if cfg.data.synth_num_vars < cfg.data.synth_max_hops:
    raise ConfigError(f'data.synth_num_vars={cfg.data.synth_num_vars} must be >= '
                      f'data.synth_max_hops={cfg.data.synth_max_hops}')
  if t.seq_len > m.max_len:
    raise ConfigError(f'train.seq_len={t.seq_len} > model.max_len={m.max_len}')
  if t.tokens_per_step and t.tokens_per_step % (t.batch_size * t.seq_len):
    raise ConfigError(f'train.tokens_per_step={t.tokens_per_step} is not a multiple '
                      f'of batch_size*seq_len={t.batch_size * t.seq_len}')
  if e.min_loops > e.max_loops:
    raise ConfigError(f'exit.min_loops={e.min_loops} must be in [1, exit.max_loops='
                      f'{e.max_loops}]')
  if e.patience > 1 and ExitPolicy(e.policy) != ExitPolicy.STATE_DELTA:
    raise ConfigError(f'exit.patience={e.patience} needs exit.policy=state_delta, '
                      f'not {ExitPolicy(e.policy).value}')


def validate(cfg: Config) -> None:
  """Raises ConfigError naming the first inconsistent setting."""
  _check_ranges(cfg)
  _check_relations(cfg)
  t = cfg.train
  _check_enums(cfg)
  if cfg.data.loss_on not in ('all', 'answers'):
    raise ConfigError(f'data.loss_on={cfg.data.loss_on!r} not in all/answers')
  if t.fsdp_axis not in ('D', 'F', 'V', 'H', 'K'):
    raise ConfigError(f'train.fsdp_axis={t.fsdp_axis!r} not in D/F/V/H/K')


def grad_accum_steps(t: TrainConfig) -> int:
  """Micro-batches per optimizer step."""
  if t.tokens_per_step:
    return t.tokens_per_step // (t.batch_size * t.seq_len)
  return t.grad_accum
