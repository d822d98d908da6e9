"""Document sources: DataConfig.source -> loader returning train and validation documents."""

import dataclasses
import enum
import glob
import json
import os
import pathlib
import socket
import urllib.parse

import numpy as np

from elastic_depth.data import synthetic
from elastic_depth.data.errors import UNREACHABLE_HINT, DataError

STREAM_DEFAULT_DOCS = 50_000  # hf/tfds documents read when data.max_docs is 0
VAL_SPLITS = ('validation', 'valid', 'val', 'test')  # tfds splits tried for validation, in order


class Source(str, enum.Enum):
  """Values of DataConfig.source."""
  SYNTHETIC = 'synthetic'
  TEXT = 'text'
  HF = 'hf'
  TFDS = 'tfds'


@dataclasses.dataclass
class Corpus:
  """Train and validation documents (never overlapping) and where they came from."""
  train: list[str]
  val: list[str]
  origin: str


def _read_utf8(path: pathlib.Path) -> str:
  """Whole file as text; DataError naming the byte offset of invalid UTF-8."""
  data = path.read_bytes()
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: not valid UTF-8 at byte offset {e.start} '
                    f'(byte 0x{data[e.start]:02x})') from None


def _read_txt(path: pathlib.Path, cfg) -> list[str]:
  """Documents of a text file split by cfg.separator."""
  return _read_utf8(path).split(cfg.separator)


def _read_jsonl(path: pathlib.Path, cfg) -> list[str]:
  """Field cfg.text_field of each JSON line."""
  docs = []
  for n, line in enumerate(_read_utf8(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f'{path}:{n}: invalid JSON ({e.msg})') from None
    if not isinstance(row, dict) or not isinstance(row.get(cfg.text_field), str):
      raise DataError(f'{path}:{n}: no string field {cfg.text_field!r} (data.text_field)')
    docs.append(row[cfg.text_field])
  return docs


def _read_parquet(path: pathlib.Path, cfg) -> list[str]:
  """Column cfg.text_field of a parquet file (nulls dropped)."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    schema = pq.read_schema(path)
  except (pa.ArrowException, OSError) as e:
    raise DataError(f'{path}: not a readable parquet file ({e})') from None
  if cfg.text_field not in schema.names:
    raise DataError(f'{path}: no column {cfg.text_field!r} (data.text_field); '
                    f'columns: {schema.names}')
  field_type = schema.field(cfg.text_field).type
  if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
    raise DataError(f'{path}: column {cfg.text_field!r} has type {field_type}, not string')
  column = pq.read_table(path, columns=[cfg.text_field]).column(0)
  return [d for d in column.to_pylist() if d is not None]


READERS = {'.txt': _read_txt, '.jsonl': _read_jsonl, '.parquet': _read_parquet}


def expand_paths(spec: str, setting: str = 'data.paths') -> list[pathlib.Path]:
  """Files named by a file, directory, glob or comma-separated list of those."""
  parts = [p.strip() for p in spec.split(',') if p.strip()]
  if not parts:
    raise DataError(f'{setting} is empty: give a file, glob or comma-separated list '
                    f'of {sorted(READERS)} files')
  files = []
  for part in parts:
    if glob.has_magic(part):
      matched = sorted(glob.glob(os.path.expanduser(part), recursive=True))
      if not matched:
        raise DataError(f'{setting}: glob {part!r} matches no file')
      files += [pathlib.Path(m) for m in matched if os.path.isfile(m)]
      continue
    path = pathlib.Path(part).expanduser()
    if path.is_dir():
      found = sorted(p for p in path.iterdir() if p.suffix in READERS)
      if not found:
        raise DataError(f'{setting}: directory {path} holds no {sorted(READERS)} file')
      files += found
    elif path.is_file():
      files.append(path)
    else:
      raise DataError(f'{setting}: no such file or directory: {path}')
  return files


def read_documents(spec: str, cfg, setting: str = 'data.paths') -> list[str]:
  """Stripped, non-empty documents of every file in `spec` (capped at cfg.max_docs)."""
  files = expand_paths(spec, setting)
  docs = []
  for path in files:
    reader = READERS.get(path.suffix)
    if reader is None:
      raise DataError(f'{path}: unsupported file type {path.suffix!r}; '
                      f'expected one of {sorted(READERS)}')
    docs += [d.strip() for d in reader(path, cfg) if d.strip()]
    if cfg.max_docs and len(docs) >= cfg.max_docs:
      return docs[:cfg.max_docs]
  if not docs:
    raise DataError(f'empty corpus: {setting} ({", ".join(map(str, files))}) '
                    'holds no non-empty document')
  return docs


def holdout_split(docs: list[str], cfg, origin: str) -> Corpus:
  """Deterministic (seeded) split of `docs` into disjoint train and validation sets."""
  if not 0 < cfg.val_fraction < 1:
    raise DataError(f'data.val_fraction={cfg.val_fraction} must be in (0, 1)')
  if len(docs) < 2:
    raise DataError(f'{origin}: {len(docs)} document(s); at least 2 are needed to hold out '
                    'a validation set (or give data.val_paths)')
  n_val = min(len(docs) - 1, max(1, int(round(len(docs) * cfg.val_fraction))))
  is_val = np.zeros(len(docs), bool)
  is_val[np.random.default_rng(cfg.seed).permutation(len(docs))[:n_val]] = True
  train = [d for d, v in zip(docs, is_val) if not v]
  val = [d for d, v in zip(docs, is_val) if v]
  return Corpus(train, val, origin)


def load_synthetic(cfg) -> Corpus:
  """Synthetic programs as space-separated strings (see synthetic.py)."""
  train, val, vocab = synthetic.load(cfg.synth_examples, cfg.synth_max_hops,
                                     cfg.synth_num_vars, cfg.seed, cfg.val_fraction,
                                     getattr(cfg, 'synth_task', 'binding'),
                                     getattr(cfg, 'synth_num_ops', 4))
  return Corpus(train.docs(vocab), val.docs(vocab), 'synthetic')


def load_text(cfg) -> Corpus:
  """Local .txt/.jsonl/.parquet files; validation from val_paths or a val_fraction split."""
  if not cfg.paths:
    raise DataError('data.source=text needs --config.data.paths=FILE|GLOB|A,B,...')
  docs = read_documents(cfg.paths, cfg)
  if cfg.val_paths:
    return Corpus(docs, read_documents(cfg.val_paths, cfg, 'data.val_paths'), cfg.paths)
  return holdout_split(docs, cfg, cfg.paths)


def hub_reachable(timeout_s: float = 3.0) -> bool:
  """Whether a TCP connection to the Hugging Face hub (HF_ENDPOINT) opens quickly."""
  if os.environ.get('HF_HUB_OFFLINE', '0') not in ('', '0'):
    return False
  url = urllib.parse.urlparse(os.environ.get('HF_ENDPOINT', 'https://huggingface.co'))
  port = url.port or (443 if url.scheme == 'https' else 80)
  try:
    with socket.create_connection((url.hostname, port), timeout=timeout_s):
      return True
  except OSError:
    return False


def _text_of(row, field: str, origin: str) -> str:
  """The text field of one streamed record as str."""
  if not isinstance(row, dict) or field not in row:
    raise DataError(f'{origin}: record has no field {field!r} (data.text_field)')
  value = row[field]
  if isinstance(value, bytes):
    try:
      return value.decode('utf-8')
    except UnicodeDecodeError as e:
      raise DataError(f'{origin}: record not valid UTF-8 at byte offset {e.start}') from None
  return str(value)


def load_hf(cfg) -> Corpus:
  """Streams the train split of a Hugging Face dataset (optional `datasets` package)."""
  if not cfg.hf_name:
    raise DataError('data.source=hf needs --config.data.hf_name (e.g. HuggingFaceFW/fineweb-edu)')
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError('data.source=hf needs the optional `datasets` package: '
                    'pip install datasets') from None
  origin = f'hf:{cfg.hf_name}' + (f'/{cfg.hf_config}' if cfg.hf_config else '')
  if not hub_reachable():
    raise DataError(f'{origin}: cannot stream, {UNREACHABLE_HINT}')
  limit = cfg.max_docs or STREAM_DEFAULT_DOCS
  docs = []
  try:
    stream = datasets.load_dataset(cfg.hf_name, cfg.hf_config or None, split='train',
                                   streaming=True)
    for row in stream:
      text = _text_of(row, cfg.text_field, origin).strip()
      if text:
        docs.append(text)
      if len(docs) >= limit:
        break
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'{origin}: streaming failed ({type(e).__name__}: {e}); maybe '
                    f'{UNREACHABLE_HINT}') from None
  if not docs:
    raise DataError(f'empty corpus: {origin} yielded no non-empty document')
  return holdout_split(docs, cfg, origin)


def _read_tfds_split(source, cfg, origin: str) -> list[str]:
  """Up to max_docs (or STREAM_DEFAULT_DOCS) stripped, non-empty texts of one split."""
  limit = min(len(source), cfg.max_docs or STREAM_DEFAULT_DOCS)
  docs = [_text_of(source[i], cfg.text_field, origin).strip() for i in range(limit)]
  return [d for d in docs if d]


def load_tfds(cfg) -> Corpus:
  """A locally prepared (array_record) TFDS dataset via tfds.data_source; never downloads."""
  if not cfg.tfds_name:
    raise DataError('data.source=tfds needs --config.data.tfds_name')
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError('data.source=tfds needs: pip install tensorflow-datasets') from None
  data_dir = getattr(cfg, 'tfds_data_dir', '') or None
  origin = f'tfds:{cfg.tfds_name}'
  try:
    builder = tfds.builder(cfg.tfds_name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'{origin}: unknown dataset ({type(e).__name__}: {str(e)[:200]})') from None
  if not builder.is_prepared():
    raise DataError(f'{origin}: not prepared under {builder.data_dir}; this loader never '
                    f'downloads ({UNREACHABLE_HINT}). Prepare it where the network works: '
                    f'tfds build {cfg.tfds_name} --file_format=array_record')
  try:
    splits = tfds.data_source(cfg.tfds_name, data_dir=data_dir, download=False)
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'{origin}: no random-access source ({type(e).__name__}: '
                    f'{str(e)[:200]}); rebuild with --file_format=array_record') from None
  if 'train' not in splits:
    raise DataError(f'{origin}: no train split; splits: {sorted(splits)}')
  train = _read_tfds_split(splits['train'], cfg, origin)
  if not train:
    raise DataError(f'empty corpus: {origin} train split holds no non-empty document')
  val_name = next((s for s in VAL_SPLITS if s in splits), None)
  if val_name is None:
    return holdout_split(train, cfg, origin)
  return Corpus(train, _read_tfds_split(splits[val_name], cfg, origin), origin)


LOADERS = {
    Source.SYNTHETIC: load_synthetic,
    Source.TEXT: load_text,
    Source.HF: load_hf,
    Source.TFDS: load_tfds,
}


def source_of(cfg) -> Source:
  """DataConfig.source as a Source; DataError if unknown."""
  try:
    return Source(cfg.source)
  except ValueError:
    raise DataError(f'data.source={cfg.source!r} not in '
                    f'{[s.value for s in Source]}') from None


def load(cfg) -> Corpus:
  """Train and validation documents of the configured source.

  Args:
    cfg: a DataConfig.

  Returns:
    Corpus with disjoint lists of document strings `train` and `val`.
  """
  return LOADERS[source_of(cfg)](cfg)
