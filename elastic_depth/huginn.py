"""Import Huginn-0125 (RavenForCausalLM, seal-rg/recurrent-pretraining) into a workdir.

The Huginn conventions (written down in ../shared/fixtures/huginn_tiny/README.md) map
onto a LoopedLM as follows; everything else is already ours:
  * embeddings times sqrt(n_embd)          -> ModelConfig.embed_scale
  * qk_bias added to q and k before RoPE   -> ModelConfig.qk_bias
  * ln_f on the core state, then coda, ln_f -> ModelConfig.norm_before_coda
  * interleaved RoPE pairs (2i, 2i+1)      -> Q/K rows (and qk_bias) permuted within each
    head to [0, 2, .., K-2, 1, 3, .., K-1], which our half-split RoPE rotates identically
  * initial state: truncated normal, std init_values.std * embed_scale -> state_std
  * torch Linear [out, in] -> our [in, out]; fused Wqkv and fc (gate, up) split.
The checkpoint written holds parameters only (checkpoint.WEIGHTS_ONLY).
"""

import json
import math
import os
import re
import shutil
from typing import Callable

import numpy as np

from elastic_depth import snapshot
from elastic_depth.config import (Config, DataConfig, DepthConfig, ExitConfig, ExitPolicy,
                                  ModelConfig, TrainConfig, validate)

CONFIG_FILE = snapshot.CONFIG_FILE
TOKENIZER_FILE = 'tokenizer.json'
BUFFERS = ('freqs_cis',)  # persistent non-parameter buffers (RoPE table): ignored
STACKS = {'prelude': 'prelude', 'core_block': 'core', 'coda': 'coda'}
_BLOCK_KEY = re.compile(r'transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)$')

# Huginn settings the converter reproduces; any other value is refused.
SUPPORTED = {'block_class_name': 'SandwichBlock', 'norm_class_name': 'RMSNorm_llama',
             'mlp_class_name': 'GatedMLP', 'nonlin_name': 'SiLU', 'injection_type': 'linear',
             'state_init': 'like-init', 'bias': False}


class HuginnError(snapshot.SourceError):
  """A Huginn source that cannot be converted (names the key or setting)."""


def _get(hf: dict, *names, default=None):
  for n in names:
    if n in hf:
      return hf[n]
  if default is None:
    raise HuginnError(f'{CONFIG_FILE} lacks {" / ".join(names)}')
  return default


def model_config(hf: dict) -> ModelConfig:
  """Our ModelConfig for a Huginn config.json dict (HuginnError if unsupported)."""
  try:
    return _model_config(hf)
  except (TypeError, ValueError, AttributeError) as e:
    if isinstance(e, HuginnError):
      raise
    raise HuginnError(f'{CONFIG_FILE}: a field has an unusable value ({e})') from None


def _model_config(hf: dict) -> ModelConfig:
  bad = {k: hf.get(k) for k, v in SUPPORTED.items() if k in hf and hf[k] != v}
  if float(hf.get('test_time_noise', 0) or 0) != 0:
    bad['test_time_noise'] = hf['test_time_noise']
  if bad:
    raise HuginnError(f'unsupported Huginn settings {bad}; supported: {SUPPORTED}, '
                      'test_time_noise=0')
  d = int(_get(hf, 'n_embd', 'hidden_size'))
  heads = int(_get(hf, 'n_heads', 'num_attention_heads'))
  kv_heads = int(_get(hf, 'num_key_value_heads', default=heads))
  if kv_heads != heads:
    raise HuginnError(f'num_key_value_heads={kv_heads} != n_heads={heads}: Huginn\'s qk_bias '
                      'is per query head, only multi-head attention is supported')
  init = hf.get('init_values') or {}
  if not isinstance(init, dict):
    raise HuginnError(f'{CONFIG_FILE}: init_values={init!r} is not a mapping')
  scale = math.sqrt(d)  # Huginn scales by sqrt(n_embd) whatever init_values.embed_scale says
  std = float(init.get('std', math.sqrt(2 / (5 * d))))
  return ModelConfig(
      vocab_size=int(_get(hf, 'padded_vocab_size', 'vocab_size')), d_model=d,
      num_heads=heads, num_kv_heads=kv_heads,
      head_dim=int(_get(hf, 'head_dim', default=d // heads)),
      mlp_dim=int(_get(hf, 'intermediate_size')),
      n_prelude=int(_get(hf, 'n_layers_in_prelude')),
      n_core=int(_get(hf, 'n_layers_in_recurrent_block')),
      n_coda=int(_get(hf, 'n_layers_in_coda')), max_len=int(_get(hf, 'block_size')),
      rope_theta=float(_get(hf, 'rope_base')),
      tie_embeddings=bool(_get(hf, 'tie_embeddings', 'tie_word_embeddings')),
      init_state='random', state_std=std * scale, norm_eps=float(_get(hf, 'norm_eps')),
      embed_scale=scale, qk_bias=bool(hf.get('qk_bias', False)), norm_before_coda=True)


def full_config(hf: dict, r_max: int = 32, seq_len: int = 0, batch_size: int = 8,
                dtype: str = 'float32') -> Config:
  """The Config of an imported workdir: model, depth prior, text data with its tokenizer."""
  m = model_config(hf)
  m.dtype = dtype
  if r_max < 1:  # else depth.mean = min(mean, r_max) is named, not the setting given
    raise HuginnError(f'r_max={r_max} must be >= 1')
  seq_len = seq_len or min(1024, m.max_len)  # 0: the default evaluation length
  if seq_len > m.max_len:
    raise HuginnError(f'seq_len={seq_len} exceeds the model\'s block_size={m.max_len}')
  mean = float(hf.get('mean_recurrence', 32))
  buckets = tuple(b for b in DepthConfig().buckets if b < r_max) + (r_max,)
  cfg = Config(model=m,
               depth=DepthConfig(mean=min(mean, r_max), r_max=r_max, buckets=buckets),
               data=DataConfig(source='text', tokenizer='train'),
               train=TrainConfig(seq_len=seq_len, batch_size=batch_size),
               exit=ExitConfig(max_loops=r_max, depth=min(int(mean), r_max)))
  validate(cfg)
  return cfg


def expected_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every Huginn state-dict key a source must hold, with its shape."""
  d, h, g, k, f, v = (m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim,
                      m.vocab_size)
  out = {'transformer.wte.weight': (v, d), 'transformer.adapter.weight': (d, 2 * d),
         'transformer.ln_f.weight': (d,)}
  if not m.tie_embeddings:
    out['lm_head.weight'] = (v, d)
  for stack, n in (('prelude', m.n_prelude), ('core_block', m.n_core), ('coda', m.n_coda)):
    for i in range(n):
      p = f'transformer.{stack}.{i}.'
      out.update({p + f'norm_{j}.weight': (d,) for j in range(1, 5)})
      out[p + 'attn.Wqkv.weight'] = ((h + 2 * g) * k, d)
      out[p + 'attn.proj.weight'] = (d, h * k)
      if m.qk_bias:
        out[p + 'attn.qk_bias'] = (2, 1, h, k)
      out[p + 'mlp.fc.weight'] = (2 * f, d)
      out[p + 'mlp.proj.weight'] = (d, f)
  return out


def rope_permutation(k: int) -> np.ndarray:
  """Within-head order that turns interleaved RoPE pairs into half-split pairs."""
  return np.concatenate([np.arange(0, k, 2), np.arange(1, k, 2)])


def _qkv(w, m: ModelConfig) -> dict:
  h, g, k, d = m.num_heads, m.num_kv_heads, m.head_dim, m.d_model
  perm = rope_permutation(k)
  q, kk, v = np.split(w, [h * k, (h + g) * k])
  return {('attn', 'wq_DxHxK'): q.reshape(h, k, d)[:, perm].transpose(2, 0, 1),
          ('attn', 'wk_DxGxK'): kk.reshape(g, k, d)[:, perm].transpose(2, 0, 1),
          ('attn', 'wv_DxGxK'): v.reshape(g, k, d).transpose(2, 0, 1)}


def _qk_bias(b, m: ModelConfig) -> dict:
  perm = rope_permutation(m.head_dim)
  return {('attn', 'q_bias_HxK'): b[0, 0][:, perm], ('attn', 'k_bias_GxK'): b[1, 0][:, perm]}


def _norm(j: int) -> Callable:
  return lambda w, m: {(f'norm{j}', 'scale'): w}


BLOCK_CONVERTERS = {
    'attn.Wqkv.weight': _qkv,
    'attn.qk_bias': _qk_bias,
    'attn.proj.weight': lambda w, m: {('attn', 'wo_HxKxD'): w.T.reshape(
        m.num_heads, m.head_dim, m.d_model)},
    'mlp.fc.weight': lambda w, m: dict(zip([('mlp', 'w_gate_DxF'), ('mlp', 'w_up_DxF')],
                                           (x.T for x in np.split(w, 2)))),
    'mlp.proj.weight': lambda w, m: {('mlp', 'w_down_FxD'): w.T},
    **{f'norm_{j}.weight': _norm(j) for j in range(1, 5)},
}
TOP_CONVERTERS = {
    'transformer.wte.weight': lambda w, m: {('embed_VxD',): w},
    'transformer.adapter.weight': lambda w, m: {('adapter_2DxD',): w.T},
    'transformer.ln_f.weight': lambda w, m: {('final_norm', 'scale'): w},
    'lm_head.weight': lambda w, m: {} if m.tie_embeddings else {('head_VxD',): w},
}


def convert_tensor(name: str, w: np.ndarray, m: ModelConfig) -> dict:
  """Our parameter paths -> fp32 arrays for one Huginn tensor."""
  w = np.asarray(w, np.float32)
  if name in TOP_CONVERTERS:
    return TOP_CONVERTERS[name](w, m)
  stack, i, rest = _BLOCK_KEY.match(name).groups()
  return {(STACKS[stack], int(i)) + path: np.ascontiguousarray(x)
          for path, x in BLOCK_CONVERTERS[rest](w, m).items()}


def _listing(items: list[str], n: int = 12) -> str:
  return ', '.join(items[:n]) + (f' (and {len(items) - n} more)' if len(items) > n else '')


def check_keys(found: dict, m: ModelConfig) -> None:
  """HuginnError naming every unknown, missing, mis-shaped or non-float key."""
  want = expected_shapes(m)
  optional = {b: None for b in BUFFERS}
  if m.tie_embeddings:  # tied: lm_head.weight may be stored (equal to wte) or left out
    optional['lm_head.weight'] = (m.vocab_size, m.d_model)
  problems = []
  unknown = sorted(k for k in found if k not in want and k not in optional)
  missing = sorted(k for k in want if k not in found)
  shapes = {**want, **{k: v for k, v in optional.items() if v is not None}}
  bad = sorted(f'{k} {list(found[k][1])} (expected {list(v)})' for k, v in shapes.items()
               if k in found and found[k][1] != v)
  floats = ('F64', 'F32', 'F16', 'BF16')
  dtypes = sorted(f'{k} {found[k][2]}' for k in shapes if k in found and found[k][2] not in floats)
  for what, items in (('unknown', unknown), ('missing', missing), ('mis-shaped', bad),
                      ('non-float', dtypes)):
    if items:
      problems.append(f'{len(items)} {what} key(s): {_listing(items)}')
  if problems:
    raise HuginnError('the source does not match its config.json: ' + '; '.join(problems))


def _put(tree: dict, path: tuple, x: np.ndarray) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = x


def convert(found: dict, m: ModelConfig, log: Callable[[str], None] = lambda s: None) -> dict:
  """Our fp32 parameter tree (host jax arrays), read shard by shard and tensor by tensor:
  peak host memory is the output plus a few copies of the largest tensor."""
  import jax  # pylint: disable=g-import-not-at-top
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  cpu = jax.devices('cpu')[0]  # host arrays that orbax saves without another copy
  params = {}
  for path in sorted({v[0] for v in found.values()}):
    with safe_open(path, framework='numpy') as h:
      for k in h.keys():
        if k not in BUFFERS:
          for p, x in convert_tensor(k, h.get_tensor(k), m).items():
            _put(params, p, jax.device_put(x, cpu))
    log(f'converted {os.path.basename(path)}')
  _check_tree(params, m)
  return params


def _check_tree(params: dict, m: ModelConfig) -> None:
  """The converted tree has exactly the shapes of LoopedLM(m)'s parameters."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from elastic_depth.model import LoopedLM  # pylint: disable=g-import-not-at-top
  abstract = nnx.state(nnx.eval_shape(lambda: LoopedLM(m, nnx.Rngs(0))), nnx.Param)
  want = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(abstract))
  got = jax.tree.map(lambda x: tuple(x.shape), params)
  if want != got:
    raise HuginnError(f'internal: converted parameters {got} differ from the model {want}')


def _check_workdir(workdir: str) -> None:
  """HuginnError unless workdir is new or an empty folder (nothing in it is overwritten)."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise HuginnError(f'--workdir={workdir} is a file, not a folder: choose a new folder')
  taken = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []
  if taken:
    raise HuginnError(f'--workdir={workdir} already holds {taken[:5]}: choose a new or empty '
                      'folder (nothing is overwritten)')


def _tokenizer(snap: str, m: ModelConfig):
  """The source's tokenizer.json loaded as the data pipeline will load it, or None."""
  path = os.path.join(snap, TOKENIZER_FILE)
  if not os.path.isfile(path):
    return None, None
  from elastic_depth.data import DataError, tokenizer  # pylint: disable=g-import-not-at-top
  try:
    return path, tokenizer.get(path, [], m.vocab_size)
  except DataError as e:
    raise HuginnError(f'{path}: {e} (the data pipeline adds {tokenizer.EOS!r} when a '
                      'tokenizer lacks it)') from None


def import_huginn(src: str, workdir: str, *, r_max: int = 32, seq_len: int = 0,
                  batch_size: int = 8, dtype: str = 'float32',
                  log: Callable[[str], None] = print) -> dict:
  """Converts a Huginn checkpoint into a workdir that experiments load like a trained run.

  Args:
    src: snapshot folder, .safetensors file (beside config.json) or hub name.
    workdir: new folder; receives config.json, checkpoints/ (step 0, parameters only)
      and the source's tokenizer.json when it has one.
    r_max: largest depth the experiments evaluate by default (depth.r_max, exit.max_loops).
    seq_len, batch_size: default evaluation shape (train.seq_len, train.batch_size);
      seq_len 0 is 1024 capped at the model's block_size, a larger one is refused.
    dtype: compute dtype recorded in the config (parameters are always fp32).
    log: progress printer.

  Returns:
    A summary dict (source, parameter count, tokenizer). Every check (config, keys,
    shapes, tokenizer, workdir) runs before any tensor is read; otherwise
    snapshot.SourceError (HuginnError for Huginn-specific problems).
  """
  from elastic_depth import checkpoint, model, train_step  # pylint: disable=g-import-not-at-top
  snap, files = snapshot.resolve_source(src)
  cfg = full_config(snapshot.read_hf_config(snap), r_max, seq_len, batch_size, dtype)
  found = snapshot.scan(files)
  check_keys(found, cfg.model)
  _check_workdir(workdir)
  tok_path, tok = _tokenizer(snap, cfg.model)
  log(f'{len(found)} tensors in {len(files)} shard(s), {model.count_params(cfg.model):,} '
      f'parameters; converting to float32')
  params = convert(found, cfg.model, log)
  os.makedirs(workdir, exist_ok=True)
  if tok_path:
    shutil.copyfile(tok_path, os.path.join(workdir, TOKENIZER_FILE))
  meta = {'config': train_step.config_dict(cfg), checkpoint.WEIGHTS_ONLY: True,
          'source': f'huginn import of {os.path.abspath(snap)}'}
  if tok is not None:
    meta['tokenizer'] = checkpoint.tokenizer_info(tok)
  mngr = checkpoint.manager(workdir, keep=1, async_save=False)
  try:
    checkpoint.save(mngr, 0, train_step.TrainState(np.int32(0), params, None), meta, force=True)
    checkpoint.wait(mngr)
  finally:
    mngr.close()
  with open(os.path.join(workdir, CONFIG_FILE), 'w', encoding='utf-8') as f:
    json.dump(train_step.config_dict(cfg), f, indent=1)
  summary = {'source': os.path.abspath(snap), 'shards': len(files), 'tensors': len(found),
             'params': model.count_params(cfg.model),
             'tokenizer': meta.get('tokenizer'), 'workdir': os.path.abspath(workdir)}
  log(f'wrote {workdir} (config.json, checkpoints/0'
      + (', tokenizer.json)' if tok_path else '; no tokenizer.json in the source: '
         'evaluate with --data_tokenizer=PATH)'))
  return summary


def memory_plan(cfg: Config, batch_size: int, seq_len: int) -> dict:
  """GB of arguments / outputs / temporaries of the programs the experiments run (the
  traced uniform-depth pass and the per-token KL-exit pass to depth cfg.depth.r_max),
  compiled on abstract shapes for this machine's backend: nothing is allocated."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from elastic_depth import analysis, model  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model.LoopedLM(cfg.model, nnx.Rngs(0))))
  tok = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  eps = jax.ShapeDtypeStruct((), jnp.float32)
  r = cfg.depth.r_max
  out = {'params': model.count_params(cfg.model), 'backend': jax.default_backend(),
         'batch_size': batch_size, 'seq_len': seq_len, 'r_max': r}
  runs = (('trace', lambda st, *a: analysis.trace_outputs(nnx.merge(graphdef, st), *a,
                                                          r_max=r), (state, tok, tok, key)),
          ('exit', lambda st, *a: analysis.policy_outputs(
              nnx.merge(graphdef, st), *a, policy=ExitPolicy.KL, min_loops=1, r_max=r),
           (state, tok, tok, key, eps, None)))
  for kind, fn, args in runs:
    fn = jax.jit(fn)
    with jax.default_matmul_precision('highest'):  # as analysis runs them
      m = fn.lower(*args).compile().memory_analysis()
    gb = {f: getattr(m, f'{f}_size_in_bytes') / 1e9 for f in ('argument', 'output', 'temp')}
    out[kind] = dict(gb, total=sum(gb.values()))
  return out
