"""Dataclass configs for models, depth sampling, data, training and exit (no jax import)."""

import dataclasses
import enum
import math


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
  REVERSE_KL = 'reverse_kl'    # KL(p_{i-1} || p_i) < eps
  STATE_DELTA = 'state_delta'  # ||s_i - s_{i-1}|| / ||s_i|| < eps
  ROUTER = 'router'            # A2: linear probe P(change) < eps


class AttentionIn(str, enum.Enum):
  """Which blocks mix positions (the others are MLP-only)."""
  ALL = 'all'    # every block has attention
  CORE = 'core'  # only the shared core: prelude and coda are MLP-only, so every step
                 # of work between positions has to be done by the loops


class NanPolicy(str, enum.Enum):
  """What the training loop does on a non-finite loss or gradient."""
  STOP = 'stop'
  SKIP = 'skip'


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
  init_state: str = InitState.RANDOM.value
  attention: str = AttentionIn.ALL.value  # all | core (MLP-only prelude and coda)
  init_std: float = 0.02
  state_std: float = 1.0  # std of the random initial state (before truncation)
  norm_eps: float = 1e-6
  dtype: str = 'float32'  # compute dtype; parameters are always fp32


@dataclasses.dataclass
class DepthConfig:
  """Randomised-depth training: r ~ Poisson(exp(tau)) + 1, tau ~ N(mu, sigma).

  mu = log(mean - 1) - sigma^2 / 2, so E[exp(tau)] = mean - 1 and E[r] = mean
  before clipping to [1, r_max] and rounding to the nearest bucket.
  """
  mean: float = 8.0
  sigma: float = 0.5
  r_max: int = 32
  buckets: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32)
  backprop_depth: int = 0  # 0: backprop through every loop; k: only the last k
  remat: bool = True


@dataclasses.dataclass
class DataConfig:
  """Where tokens come from (see elastic_depth/data)."""
  source: str = 'synthetic'  # synthetic | text | hf | tfds
  paths: str = ''            # file, glob or comma-separated list (text source)
  val_paths: str = ''        # optional separate validation files
  text_field: str = 'text'   # jsonl key / parquet column
  separator: str = '<|endoftext|>'
  hf_name: str = ''          # e.g. HuggingFaceFW/fineweb-edu
  hf_config: str = ''        # e.g. sample-10BT
  tfds_name: str = ''
  tfds_data_dir: str = ''    # where the TFDS dataset was prepared (array_record)
  tokenizer: str = 'train'   # 'train' (byte-level BPE on the corpus), a path, or a hub name
  val_fraction: float = 0.05
  max_docs: int = 0          # 0: all
  seed: int = 0
  # synthetic generator (see elastic_depth/data/synthetic.py)
  synth_task: str = 'compose'  # compose (k permutations in order) | binding (k-hop lookup)
  loss_on: str = 'all'         # all | answers (synthetic: only targets with difficulty > 0)
  synth_examples: int = 4000
  synth_max_hops: int = 6
  synth_num_vars: int = 16
  synth_num_ops: int = 4       # compose: fixed digit permutations (op symbols)
  synth_curriculum: int = 0    # compose: training windows per curriculum stage; stage j
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
  schedule: str = Schedule.COSINE.value
  decay_frac: float = 0.2
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  eval_every: int = 200
  eval_batches: int = 4
  eval_depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
  ckpt_every: int = 200
  keep_checkpoints: int = 3
  log_every: int = 20
  nan_policy: str = NanPolicy.STOP.value
  max_skips: int = 10


@dataclasses.dataclass
class ExitConfig:
  """Inference-time exit policy."""
  policy: str = ExitPolicy.KL.value
  eps: float = 1e-3
  depth: int = 8             # A0 depth
  min_loops: int = 1
  max_loops: int = 32
  check_every: int = 1
  gate: float = 0.0          # decode: run the KL check only when the relative state
                             # change is below this (0: check every eligible loop)
  use_kernel: bool = False   # fused Pallas KL (GPU); reference jnp otherwise


@dataclasses.dataclass
class Config:
  """Everything an experiment needs."""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  depth: DepthConfig = dataclasses.field(default_factory=DepthConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  exit: ExitConfig = dataclasses.field(default_factory=ExitConfig)


class ConfigError(ValueError):
  """A configuration that cannot work, found before any compilation."""


def validate(cfg: Config) -> None:
  """Raises ConfigError naming the first inconsistent setting."""
  m, d, t, e = cfg.model, cfg.depth, cfg.train, cfg.exit
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(f'model.num_heads={m.num_heads} is not a multiple of '
                      f'model.num_kv_heads={m.num_kv_heads}')
  if m.head_dim % 2:
    raise ConfigError(f'model.head_dim={m.head_dim} must be even for RoPE')
  if min(m.n_prelude, m.n_core, m.n_coda) < 0 or m.n_core < 1:
    raise ConfigError('model needs n_core >= 1 and n_prelude, n_coda >= 0')
  valid = {x.value for x in InitState}
  if m.init_state not in valid:
    raise ConfigError(f'model.init_state={m.init_state!r} not in {sorted(valid)}')
  if m.attention not in {x.value for x in AttentionIn}:
    raise ConfigError(f'model.attention={m.attention!r} not in '
                      f'{sorted(x.value for x in AttentionIn)}')
  if m.dtype not in ('float32', 'bfloat16', 'float16'):
    raise ConfigError(f'model.dtype={m.dtype!r} not in float32/bfloat16/float16')
  if not d.mean >= 1 or not math.isfinite(d.mean):
    raise ConfigError(f'depth.mean={d.mean} must be >= 1')
  if d.sigma < 0:
    raise ConfigError(f'depth.sigma={d.sigma} must be >= 0')
  if d.r_max < 1:
    raise ConfigError(f'depth.r_max={d.r_max} must be >= 1')
  b = tuple(d.buckets)
  if not all(isinstance(x, int) for x in b):
    raise ConfigError(f'depth.buckets={b} must be integers')
  if not b or list(b) != sorted(set(b)) or b[0] < 1:
    raise ConfigError(f'depth.buckets={b} must be strictly increasing and >= 1')
  if b[-1] < d.r_max:
    raise ConfigError(f'depth.buckets={b} do not cover depth.r_max={d.r_max}')
  if d.backprop_depth < 0:
    raise ConfigError(f'depth.backprop_depth={d.backprop_depth} must be >= 0')
  if t.seq_len > m.max_len:
    raise ConfigError(f'train.seq_len={t.seq_len} > model.max_len={m.max_len}')
  if t.steps < 1 or t.batch_size < 1 or t.grad_accum < 1:
    raise ConfigError('train.steps, train.batch_size, train.grad_accum must be >= 1')
  if t.tokens_per_step and t.tokens_per_step % (t.batch_size * t.seq_len):
    raise ConfigError(f'train.tokens_per_step={t.tokens_per_step} is not a multiple '
                      f'of batch_size*seq_len={t.batch_size * t.seq_len}')
  if cfg.data.loss_on not in ('all', 'answers'):
    raise ConfigError(f'data.loss_on={cfg.data.loss_on!r} not in all/answers')
  if t.schedule not in {x.value for x in Schedule}:
    raise ConfigError(f'train.schedule={t.schedule!r} unknown')
  if t.nan_policy not in {x.value for x in NanPolicy}:
    raise ConfigError(f'train.nan_policy={t.nan_policy!r} unknown')
  if not t.lr > 0:
    raise ConfigError(f'train.lr={t.lr} must be > 0')
  if e.policy not in {x.value for x in ExitPolicy}:
    raise ConfigError(f'exit.policy={e.policy!r} not in '
                      f'{sorted(x.value for x in ExitPolicy)}')
  if not e.eps >= 0:
    raise ConfigError(f'exit.eps={e.eps} must be >= 0')
  if not 1 <= e.min_loops <= e.max_loops:
    raise ConfigError(f'exit.min_loops={e.min_loops} must be in [1, exit.max_loops='
                      f'{e.max_loops}]')
  if not e.gate >= 0:
    raise ConfigError(f'exit.gate={e.gate} must be >= 0')
  if e.check_every < 1:
    raise ConfigError(f'exit.check_every={e.check_every} must be >= 1')


def grad_accum_steps(t: TrainConfig) -> int:
  """Micro-batches per optimizer step."""
  if t.tokens_per_step:
    return t.tokens_per_step // (t.batch_size * t.seq_len)
  return t.grad_accum
