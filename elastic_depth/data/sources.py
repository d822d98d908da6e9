"""Document sources: DataConfig.source -> loader returning train and validation documents."""

import dataclasses
import enum
import glob
import itertools
import json
import os
import pathlib
import socket
import urllib.parse
from typing import Iterator

import numpy as np

from elastic_depth.data import synthetic
from elastic_depth.data.errors import UNREACHABLE_HINT, DataError

CHUNK_BYTES = 1 << 22  # text files are read in 4 MiB chunks
VAL_SPLITS = ('validation', 'valid', 'val', 'test')  # tfds splits tried for validation, in order


class Source(str, enum.Enum):
  """Values of DataConfig.source."""
  SYNTHETIC = 'synthetic'
  TEXT = 'text'
  HF = 'hf'
  TFDS = 'tfds'
  TOKENS = 'tokens'  # shards written by experiments.prepare_data (see shards.py)


@dataclasses.dataclass
class Corpus:
  """Train and validation documents (never overlapping) and where they came from."""
  train: list[str]
  val: list[str]
  origin: str


def _decode(data: bytes, path, offset: int) -> str:
  """UTF-8 text of `data` read at byte `offset` of path; DataError naming the bad byte."""
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: not valid UTF-8 at byte offset {offset + e.start} '
                    f'(byte 0x{data[e.start]:02x})') from None


def _read_txt(path: pathlib.Path, cfg) -> Iterator[str]:
  """Documents of a text file split by cfg.separator, read in chunks (streaming)."""
  sep = cfg.separator.encode('utf-8')
  buf, offset = b'', 0  # offset: file position of buf[0]
  with open(path, 'rb') as f:
    while True:
      chunk = f.read(CHUNK_BYTES)
      buf += chunk
      parts = buf.split(sep) if sep else [buf]
      if chunk:
        parts, buf = parts[:-1], parts[-1]
      for part in parts:
        yield _decode(part, path, offset)
        offset += len(part) + len(sep)
      if not chunk:
        return


def _read_jsonl(path: pathlib.Path, cfg) -> Iterator[str]:
  """Field cfg.text_field of each JSON line, read line by line (streaming)."""
  offset = 0
  with open(path, 'rb') as f:
    for n, raw in enumerate(f, 1):
      line = _decode(raw, path, offset)
      offset += len(raw)
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f'{path}:{n}: invalid JSON ({e.msg})') from None
      if not isinstance(row, dict) or not isinstance(row.get(cfg.text_field), str):
        raise DataError(f'{path}:{n}: no string field {cfg.text_field!r} (data.text_field)')
      yield row[cfg.text_field]


def _read_parquet(path: pathlib.Path, cfg) -> Iterator[str]:
  """Column cfg.text_field of a parquet file (nulls dropped), batch by batch."""
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
  for batch in pq.ParquetFile(path).iter_batches(columns=[cfg.text_field]):
    yield from (d for d in batch.column(0).to_pylist() if d is not None)


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


def iter_files(spec: str, cfg, setting: str = 'data.paths') -> Iterator[str]:
  """Stripped, non-empty documents of every file in `spec`, streamed file by file.

  The paths and file types are checked now; the files are read as the stream is consumed.
  """
  files = expand_paths(spec, setting)
  bad = [p for p in files if p.suffix not in READERS]
  if bad:
    raise DataError(f'{bad[0]}: unsupported file type {bad[0].suffix!r}; '
                    f'expected one of {sorted(READERS)}')
  return _stream_files(files, cfg, setting)


def _stream_files(files: list[pathlib.Path], cfg, setting: str) -> Iterator[str]:
  """The generator behind iter_files."""
  found = False
  for path in files:
    for doc in READERS[path.suffix](path, cfg):
      doc = doc.strip()
      if doc:
        found = True
        yield doc
  if not found:
    raise DataError(f'empty corpus: {setting} ({", ".join(map(str, files))}) '
                    'holds no non-empty document')


def capped(docs: Iterator[str], cfg) -> list[str]:
  """The first cfg.max_docs documents of a stream (all when max_docs is 0)."""
  return list(itertools.islice(docs, cfg.max_docs or None))


def check_disjoint(paths: str, val_paths: str) -> None:
  """DataError if data.paths and data.val_paths name a file in common (the validation
  documents would be trained on): checked where a run trains (pretrain, prepare_data), not
  where a frozen model is scored."""
  val = {p.resolve() for p in expand_paths(val_paths, 'data.val_paths')}
  shared = sorted(str(p) for p in expand_paths(paths) if p.resolve() in val)
  if shared:
    raise DataError(f'data.paths and data.val_paths share {len(shared)} file(s) ({shared[0]}'
                    f'{", ..." if len(shared) > 1 else ""}): the validation documents would '
                    'be trained on; narrow data.paths')


def read_documents(spec: str, cfg, setting: str = 'data.paths') -> list[str]:
  """Stripped, non-empty documents of every file in `spec` (capped at cfg.max_docs)."""
  return capped(iter_files(spec, cfg, setting), cfg)


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
  """Synthetic programs as space-separated strings (prepare_data's synthetic source)."""
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


def hf_origin(cfg) -> str:
  """hf:NAME[/CONFIG]."""
  return f'hf:{cfg.hf_name}' + (f'/{cfg.hf_config}' if cfg.hf_config else '')


def iter_hf(cfg) -> Iterator[str]:
  """Streams every document of a Hugging Face dataset's train split (`datasets` package)."""
  if not cfg.hf_name:
    raise DataError('data.source=hf needs --config.data.hf_name (e.g. HuggingFaceFW/fineweb-edu)')
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError('data.source=hf needs the optional `datasets` package: '
                    'pip install datasets') from None
  origin = hf_origin(cfg)
  if not hub_reachable():
    raise DataError(f'{origin}: cannot stream, {UNREACHABLE_HINT}')
  return _stream_hf(datasets, cfg, origin)


def _stream_hf(datasets, cfg, origin: str) -> Iterator[str]:
  """The generator behind iter_hf (its checks run before the first document)."""
  found = False
  try:
    stream = datasets.load_dataset(cfg.hf_name, cfg.hf_config or None, split='train',
                                   streaming=True)
    for row in stream:
      text = _text_of(row, cfg.text_field, origin).strip()
      if text:
        found = True
        yield text
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'{origin}: streaming failed ({type(e).__name__}: {e}); maybe '
                    f'{UNREACHABLE_HINT}') from None
  if not found:
    raise DataError(f'empty corpus: {origin} yielded no non-empty document')


def load_hf(cfg) -> Corpus:
  """Streams the train split of a Hugging Face dataset (max_docs of them; 0: all)."""
  docs = capped(iter_hf(cfg), cfg)
  return holdout_split(docs, cfg, hf_origin(cfg))


def _iter_tfds_split(source, cfg, origin: str) -> Iterator[str]:
  """Stripped, non-empty texts of one random-access split, in order."""
  for i in range(len(source)):
    text = _text_of(source[i], cfg.text_field, origin).strip()
    if text:
      yield text


def tfds_splits(cfg) -> tuple[str, dict]:
  """(origin, {'train': source, 'val': source or absent}) of a locally prepared TFDS dataset."""
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
  out = {'train': splits['train']}
  val_name = next((s for s in VAL_SPLITS if s in splits), None)
  if val_name is not None:
    out['val'] = splits[val_name]
  return origin, out


def iter_tfds(cfg) -> tuple[str, dict]:
  """(origin, {split: (number of records, document stream)}) of a prepared TFDS dataset."""
  origin, splits = tfds_splits(cfg)
  return origin, {k: (len(v), _iter_tfds_split(v, cfg, origin)) for k, v in splits.items()}


def load_tfds(cfg) -> Corpus:
  """A locally prepared (array_record) TFDS dataset via tfds.data_source; never downloads."""
  origin, splits = iter_tfds(cfg)
  train = capped(splits['train'][1], cfg)
  if not train:
    raise DataError(f'empty corpus: {origin} train split holds no non-empty document')
  if 'val' not in splits:
    return holdout_split(train, cfg, origin)
  return Corpus(train, capped(splits['val'][1], cfg), origin)


def _no_documents(cfg) -> Corpus:
  """The tokens source holds token ids, not documents."""
  raise DataError(f'data.source=tokens ({cfg.paths}) holds prepared token ids, not documents; '
                  'read it with data.build')


LOADERS = {  # text-like sources; synthetic data is generated in ids (pipeline.build)
    Source.TEXT: load_text,
    Source.HF: load_hf,
    Source.TFDS: load_tfds,
    Source.TOKENS: _no_documents,
}


def source_of(cfg) -> Source:
  """DataConfig.source as a Source; DataError if unknown."""
  try:
    return Source(cfg.source)
  except ValueError:
    raise DataError(f'data.source={cfg.source!r} not in '
                    f'{[s.value for s in Source]}') from None


def check_loss_on(cfg) -> None:
  """DataError for data.loss_on=answers with a source that has no difficulty labels."""
  source = source_of(cfg)
  if getattr(cfg, 'loss_on', 'all') == 'answers' and source != Source.SYNTHETIC:
    held = ('prepared shards hold token ids only' if source == Source.TOKENS
            else 'its documents are plain text')
    raise DataError(f'data.loss_on=answers with data.source={source.value}: the loss on '
                    f'answers needs the difficulty labels that only data.source=synthetic '
                    f'has ({held}); give --config.data.loss_on=all')


def load(cfg) -> Corpus:
  """Train and validation documents of the configured text-like source.

  Args:
    cfg: a DataConfig whose source is text, hf or tfds.

  Returns:
    Corpus with disjoint lists of document strings `train` and `val`.
  """
  source = source_of(cfg)
  if source not in LOADERS:
    raise DataError(f'data.source={source.value!r} has no text documents; use data.build')
  return LOADERS[source](cfg)
