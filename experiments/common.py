"""Shared pieces of the measurement experiments: flags, loading a trained workdir, errors.

A workdir written by experiments.pretrain holds config.json (the full Config),
checkpoints/ (orbax) and, for text sources, the trained tokenizer.json. `load`
rebuilds the model in fp32 from the latest (or a given) checkpoint and the
validation batches of the saved data config, optionally overridden to evaluate on
another corpus with the model's own tokenizer.
"""

import dataclasses
import enum
import json
import os
import re
import sys
from typing import Any, Callable, Optional

from absl import flags, logging

from elastic_depth.config import Config, ConfigError, validate
from experiments import flags_util

def _define(kind: str, name: str, default, help_: str, **bounds) -> str:
  """Defines a shared flag unless a module imported in the same process already did
  (experiments.pretrain defines --workdir and --quiet); returns its name."""
  if name not in flags.FLAGS:
    getattr(flags, f'DEFINE_{kind}')(name, default, help_, **bounds)
  return name


_F = flags.FLAGS
_define('string', 'workdir', None, 'Trained run directory (from experiments.pretrain).')
_define('integer', 'step', None, 'Checkpoint step (default: the latest).')
_define('integer', 'max_depth', 0, 'Largest depth R evaluated (0: the training depth.r_max, '
        'at most 32); may exceed r_max to extrapolate.', lower_bound=0)
_define('integer', 'batches', 8, 'Validation batches (0: all).', lower_bound=0)
_define('integer', 'batch_size', 0, 'Sequences per batch (0: the training batch size).',
        lower_bound=0)
_define('integer', 'seq_len', 0, 'Tokens per sequence (0: the training seq_len).',
        lower_bound=0)
_define('integer', 'seed', 0, 'Seed of the initial recurrent states.')
_define('string', 'tag', '', 'Suffix of the report names (e.g. the corpus).')
_define('bool', 'quiet', False, 'No progress bars.')
_define('string', 'data_source', None, 'Override data.source (synthetic|text|hf|tfds).')
_define('string', 'data_paths', None, 'Override data.paths.')
_define('string', 'data_val_paths', None, 'Override data.val_paths.')
_define('string', 'data_tokenizer', None, 'Override data.tokenizer (default for text-like '
        'sources: the tokenizer.json trained in the workdir).')
_define('multi_string', 'data_set', [], 'Any other data override, FIELD=VALUE (e.g. '
        'synth_max_hops=8, hf_name=..., text_field=...).')


class SetupError(RuntimeError):
  """A workdir, checkpoint or data setting that cannot be evaluated."""


@dataclasses.dataclass
class Options:
  """The settings every measurement experiment shares (tests build it directly)."""
  workdir: str
  step: Optional[int] = None
  max_depth: int = 0
  batches: int = 8
  batch_size: int = 0
  seq_len: int = 0
  seed: int = 0
  tag: str = ''
  progress: bool = True
  data: dict = dataclasses.field(default_factory=dict)  # DataConfig overrides, FIELD: text


def options_from_flags() -> Options:
  """Options from the shared flags."""
  if not _F.workdir:
    raise SetupError('--workdir is required (a directory trained by experiments.pretrain)')
  data = {k: _F[f'data_{k}'].value for k in DATA_FLAGS if _F[f'data_{k}'].value is not None}
  for item in _F.data_set:
    if '=' not in item:
      raise SetupError(f'--data_set={item!r} must be FIELD=VALUE')
    k, v = item.split('=', 1)
    data[k.strip()] = v
  if not flags_util.tag_fits_file_name(_F.tag):
    raise SetupError(f'--tag={_F.tag!r}: letters, digits, _ . - only (it ends report file '
                     'names)')
  if re.match(r'(cached|parallel)(_|$)', _F.tag):  # kl_probe + _cached names the cached probe
    raise SetupError(f'--tag={_F.tag!r} would name another semantics\' files '
                     '(kl_probe_cached...); choose a tag not starting with cached or parallel')
  return Options(workdir=_F.workdir, step=_F.step, max_depth=_F.max_depth,
                 batches=_F.batches, batch_size=_F.batch_size, seq_len=_F.seq_len,
                 seed=_F.seed, tag=_F.tag, progress=not _F.quiet, data=data)


def config_from_dict(d: dict, cls=Config) -> Any:
  """Rebuilds a (nested) config dataclass from config_dict output; unknown keys warned."""
  base = cls()
  kw = {}
  for k, v in d.items():
    if not hasattr(base, k):
      logging.warning('ignoring unknown config field %s.%s', cls.__name__, k)
      continue
    cur = getattr(base, k)
    if dataclasses.is_dataclass(cur):
      kw[k] = config_from_dict(v, type(cur))
    elif isinstance(cur, tuple):
      kw[k] = tuple(v)
    elif isinstance(cur, enum.Enum):
      kw[k] = type(cur)(v)
    else:
      kw[k] = v
  return cls(**kw)


def resolve_data(cfg: Config, workdir: str, overrides: dict):
  """The DataConfig to evaluate on, and the workdir to hand to data.build (or None).

  Overrides replace fields of the saved data config. A text-like source is always
  tokenized with the model's own tokenizer: the saved tokenizer.json of the workdir
  (never a freshly trained one), unless --data_tokenizer names one.
  """
  saved = cfg.data
  bad = [k for k in overrides if not hasattr(saved, k)]
  if bad:
    raise SetupError(f'unknown data override(s) {bad}; fields: '
                     f'{[f.name for f in dataclasses.fields(saved)]}')
  argv = ['experiment'] + [f'--config.data.{k}={v}' for k, v in overrides.items()]
  try:  # typed exactly as pretrain types the same flags
    d = flags_util.parse_config(argv, dataclasses.replace(cfg, data=saved)).data
  except (flags.Error, ValueError, TypeError) as e:
    raise SetupError(f'bad data override: {e}') from None
  if d.source == 'synthetic':
    return d, None
  if 'paths' in overrides and 'val_paths' not in overrides and saved.val_paths:
    raise SetupError(f'--data_paths names another corpus, but these experiments score '
                     f'validation text, which the checkpoint\'s data.val_paths '
                     f'({saved.val_paths}) would still give: name the text to score with '
                     '--data_val_paths=FILE (the same file as --data_paths scores all of '
                     'it), or --data_val_paths= for a held-out split of --data_paths')
  if 'tokenizer' not in overrides:
    if saved.source == 'synthetic':
      raise SetupError(f'{workdir} was trained on the synthetic vocabulary: it cannot score '
                       f'{d.source} data (train on a text corpus first, or name a matching '
                       'tokenizer with --data_tokenizer)')
    if d.tokenizer == 'train' or saved.source == 'tokens':  # tokens: the shards' tokenizer
      tok = os.path.join(workdir, 'tokenizer.json')
      if not os.path.isfile(tok):
        raise SetupError(f'{workdir} has no tokenizer.json (the trained tokenizer of this '
                         'text model); pass --data_tokenizer=PATH')
      d = dataclasses.replace(d, tokenizer=tok)
  return d, None


@dataclasses.dataclass
class Loaded:
  """A trained model and its validation batches."""
  cfg: Config
  model: Any
  step: int
  workdir: str
  data_cfg: Any
  data: Any
  batches: list
  r_max: int

  def checkpoint_info(self) -> dict:
    return {'workdir': os.path.abspath(self.workdir), 'step': self.step,
            'data': self.data.describe(), 'train_mean_depth': self.cfg.depth.mean,
            'train_r_max': self.cfg.depth.r_max, 'data_config': dataclasses.asdict(self.data_cfg)}


def load_config(workdir: str) -> Config:
  """The Config saved in <workdir>/config.json."""
  if not os.path.isdir(workdir):
    raise SetupError(f'workdir {workdir!r} does not exist')
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise SetupError(f'no config.json in {workdir!r}: not a run directory of '
                     'experiments.pretrain (or training never started)')
  try:
    with open(path, encoding='utf-8') as f:
      saved = json.load(f)
  except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise SetupError(f'{path} is not readable JSON ({e}): the run config that '
                     'experiments.pretrain writes') from None
  if not isinstance(saved, dict):
    raise SetupError(f'{path} holds a {type(saved).__name__}, not a run config')
  try:
    cfg = config_from_dict(saved)
    validate(cfg)
  except (ValueError, TypeError, AttributeError) as e:  # ConfigError is a ValueError
    raise SetupError(f'{path} is not a valid run config: {e}') from None
  return cfg


def load_model(workdir: str, step: Optional[int] = None):
  """(cfg, fp32 model, step, checkpoint meta) from the checkpoint of a workdir."""
  import jax  # pylint: disable=g-import-not-at-top
  from elastic_depth import checkpoint, train_step  # pylint: disable=g-import-not-at-top
  from elastic_depth import model as model_lib  # pylint: disable=g-import-not-at-top
  cfg = load_config(workdir)
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype='float32'))
  graphdef, _ = model_lib.abstract_params(cfg.model)
  # the checkpoint holds the whole TrainState (its checksum covers all of it): restore
  # against its abstract shape (eval_shape: no optimizer state is allocated)
  abstract = jax.eval_shape(lambda: train_step.init_state(cfg)[1])
  state, meta = checkpoint.load_state(workdir, abstract, cfg, step)
  return cfg, model_lib.bind(graphdef, state.params), int(state.step), meta


def load(opts: Options) -> Loaded:
  """Model, config and validation batches for an experiment."""
  from elastic_depth import checkpoint, data as data_lib  # pylint: disable=g-import-not-at-top
  cfg, model, step, meta = load_model(opts.workdir, opts.step)
  if (opts.seq_len or cfg.train.seq_len) > cfg.model.max_len:
    raise SetupError(f'--seq_len={opts.seq_len} exceeds the model\'s max_len='
                     f'{cfg.model.max_len} (positions it was built for)')
  data_cfg, data_workdir = resolve_data(cfg, opts.workdir, opts.data)
  ds = data_lib.build(data_cfg, seq_len=opts.seq_len or cfg.train.seq_len,
                      batch_size=opts.batch_size or cfg.train.batch_size,
                      vocab_size=cfg.model.vocab_size, workdir=data_workdir)
  # the ids must mean what they meant in training (older checkpoints carry no fingerprint)
  checkpoint.check_tokenizer(meta.get('tokenizer'), ds.tokenizer,
                             f'{opts.workdir} step {step}')
  batches = ds.val_batches(opts.batches or None)
  r_max = opts.max_depth or min(cfg.depth.r_max, 32)
  return Loaded(cfg, model, step, opts.workdir, data_cfg, ds, batches, r_max)


def train_mean(cfg: Config) -> float:
  """The mean depth training ran at: depth.mean, unless r_max clipped every draw below it."""
  return min(cfg.depth.mean, cfg.depth.r_max)


def check_reaches_mean(ld: Loaded, what: str) -> None:
  """SetupError when the loop cap is below the training mean depth `what` compares with."""
  if ld.r_max < train_mean(ld.cfg):
    raise SetupError(f'--max_depth={ld.r_max} is below the training mean depth '
                     f'{train_mean(ld.cfg):g}, which {what} compares against; raise '
                     '--max_depth')


def report_name(base: str, opts: Options) -> str:
  return f'{base}_{opts.tag}' if opts.tag else base


def flag_record(opts: Options, loaded: Loaded, experiment: Any = None) -> dict:
  """The settings to store next to the numbers (shared and the experiment's own)."""
  rec = dataclasses.asdict(opts)
  if experiment is not None:
    rec.update(dataclasses.asdict(experiment))
  rec['r_max'] = loaded.r_max
  return rec


def main(run: Callable[..., Any], experiment_options: Optional[Callable[[], Any]] = None
         ) -> Callable:
  """An absl main: run(options[, the experiment's own typed options]); setup errors -> one line.

  Args:
    run: the experiment, run(Options) or run(Options, its options dataclass).
    experiment_options: builds the experiment's options dataclass from its flags.
  """
  def _main(argv):
    flags_util.no_arguments(argv)
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    opts = options_from_flags()
    if experiment_options is None:
      run(opts)
    else:
      run(opts, experiment_options())
  return one_line_errors(_main)


def setup_errors() -> tuple:
  """What a bad flag, workdir, checkpoint or corpus raises before the expensive work."""
  from elastic_depth import checkpoint, data as data_lib  # pylint: disable=g-import-not-at-top
  return (SetupError, ConfigError, checkpoint.CheckpointError, data_lib.DataError)


DATA_FLAGS = ('source', 'paths', 'val_paths', 'tokenizer')  # --data_<field>; else --data_set


def own_flags(msg: str) -> str:
  """An error naming pretrain's --config.data.X flags, in these mains' data flags."""
  def flag(m):
    field = m.group(1)
    return f'--data_{field}' if field in DATA_FLAGS else f'--data_set={field}'
  return re.sub(r'--config\.data\.(\w+)', flag, msg)


def one_line_errors(main_fn: Callable) -> Callable:
  """An absl main whose setup errors print one line, 'error: ...', and exit 2."""
  def _main(argv):
    try:
      return main_fn(argv)
    except setup_errors() as e:
      print(f'error: {own_flags(str(e))}', file=sys.stderr)
      sys.exit(2)
  return _main
