"""data.source=tokens: training windows read from prepared shards (see shards.py) by np.memmap.

Memory does not grow with the corpus: a window is one or two slices of memory-mapped files,
grain shuffles window indices lazily, and the pages read are unmapped again every
RELEASE_EVERY reads (they stay in the page cache).
"""

import mmap
import os
import pathlib
import shutil

import numpy as np

from elastic_depth.data import pipeline, shards
from elastic_depth.data import tokenizer as tokenizer_lib
from elastic_depth.data.errors import DataError


# Every this many reads the mapped pages are released: without it a process's RSS (its
# file-backed part) grows by ~8 KiB per window read until it maps the whole corpus.
RELEASE_EVERY = 1024


class ShardWindows(pipeline.Windows):
  """Windows (same packing as pipeline.Windows) over the concatenated shards of one split."""

  def __init__(self, directory: pathlib.Path, shard_list: list[dict], dtype: str,
               seq_len: int):
    self.directory, self.files = directory, [s['file'] for s in shard_list]
    sizes = np.array([s['tokens'] for s in shard_list], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(sizes)])  # [n_shards + 1]
    self.dtype = np.dtype(dtype).newbyteorder('<')
    self.seq_len, self.answers_only = seq_len, False
    self._maps = [None] * len(self.files)
    self._reads = 0
    for f, n in zip(self.files, sizes):
      size = (directory / f).stat().st_size if (directory / f).is_file() else -1
      if size != n * self.dtype.itemsize:
        raise DataError(f'{directory / f}: {size} bytes, expected {n} {dtype} tokens '
                        f'({n * self.dtype.itemsize} bytes); the directory is damaged: '
                        'prepare it again')

  @property
  def num_tokens(self) -> int:
    return int(self.starts[-1])

  def __getstate__(self):  # memory maps are reopened after pickling (grain workers)
    return {**self.__dict__, '_maps': [None] * len(self.files)}

  def _map(self, k: int) -> np.ndarray:
    if self._maps[k] is None:
      m = np.memmap(self.directory / self.files[k], self.dtype, mode='r')
      if hasattr(mmap, 'MADV_RANDOM'):  # no readahead: it would map ~128 KiB per window
        m._mmap.madvise(mmap.MADV_RANDOM)  # pylint: disable=protected-access
      self._maps[k] = m
    return self._maps[k]

  def _release(self) -> None:
    """Unmaps the pages read so far (they stay in the page cache) so that RSS stays flat."""
    for m in self._maps:
      if m is not None and hasattr(mmap, 'MADV_DONTNEED'):
        m._mmap.madvise(mmap.MADV_DONTNEED)  # pylint: disable=protected-access

  def tokens(self, start: int, stop: int) -> np.ndarray:
    """int32 ids of stream[start:stop], across shard boundaries."""
    self._reads += 1
    if self._reads % RELEASE_EVERY == 0:
      self._release()
    stop = min(stop, self.num_tokens)
    k = int(np.searchsorted(self.starts, start, side='right')) - 1
    pieces = []
    while start < stop:
      lo, hi = start - self.starts[k], min(stop, self.starts[k + 1]) - self.starts[k]
      pieces.append(self._map(k)[lo:hi])
      start, k = self.starts[k] + hi, k + 1
    return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)

  def difficulty(self, start: int, stop: int) -> np.ndarray:
    """Prepared text carries no difficulty: -1 everywhere."""
    return np.full(min(stop, self.num_tokens) - start, pipeline.NO_DIFFICULTY, np.int32)


def open_index(directory) -> dict:
  """The index of a completely prepared directory; DataError naming what is wrong."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise DataError(f'data.source=tokens: no such directory {directory} (data.paths); '
                    'make it with python -m experiments.prepare_data --out=DIR')
  index = shards.read_index(directory)
  if index is None:
    raise DataError(f'data.source=tokens: {directory} has no {shards.INDEX}; make it with '
                    'python -m experiments.prepare_data --out=DIR')
  if not index.get('complete'):
    raise DataError(f'data.source=tokens: {directory} is only partly prepared '
                    f'({len(index["splits"]["train"]["shards"])} train shards); finish it '
                    'by rerunning the same prepare_data command')
  return index


def load_tokenizer(directory, index: dict, vocab_size: int) -> tokenizer_lib.HFTokenizer:
  """The directory's tokenizer.json, checked against the index fingerprint and the model."""
  path = pathlib.Path(directory) / index['tokenizer']['file']
  if not path.is_file():
    raise DataError(f'data.source=tokens: {path} is missing; prepare the directory again')
  tok = tokenizer_lib.get(str(path), [], vocab_size)
  if tokenizer_lib.tokenizer_info(tok)['fingerprint'] != index['tokenizer']['fingerprint']:
    raise DataError(f'data.source=tokens: {path} is not the tokenizer the shards were '
                    'written with (fingerprint differs); prepare the directory again')
  return tok


def windows(cfg, vocab_size: int, workdir, seq_len: int):
  """(origin, tokenizer, train windows, val windows, stats) of data.paths=DIR.

  The tokenizer is copied to workdir/tokenizer.json (for the evaluation tools).
  """
  directory = pathlib.Path(cfg.paths.strip()) if cfg.paths.strip() else None
  if directory is None:
    raise DataError('data.source=tokens needs --config.data.paths=DIR (made by '
                    'python -m experiments.prepare_data --out=DIR)')
  index = open_index(directory)
  tok = load_tokenizer(directory, index, vocab_size)
  tok.origin = f'{index["tokenizer"]["origin"]} (from {directory})'
  wins = {s: ShardWindows(directory, index['splits'][s]['shards'], index['dtype'], seq_len)
          for s in shards.SPLITS}
  for s, w in wins.items():
    if not len(w):
      raise DataError(f'data.source=tokens: the {s} split of {directory} has {w.num_tokens} '
                      f'tokens, fewer than one sequence (seq_len+1={seq_len + 1}); use a '
                      'shorter train.seq_len or prepare more data')
  if workdir is not None:
    saved = pathlib.Path(workdir) / tokenizer_lib.TOKENIZER_FILE
    if not saved.is_file():  # atomic: several processes may share the workdir
      saved.parent.mkdir(parents=True, exist_ok=True)
      tmp = saved.with_name(f'.{saved.name}.{os.getpid()}.tmp')
      shutil.copyfile(directory / index['tokenizer']['file'], tmp)
      os.replace(tmp, saved)
  cap = index['source'].get('max_docs', 0)
  stats = {'train_docs': index['splits']['train']['docs'],
           'val_docs': index['splits']['val']['docs'],
           'cap': f'at most {cap} documents per part (prepare_data data.max_docs)' if cap
                  else ''}
  return f'tokens:{directory} ({index["origin"]})', tok, wins['train'], wins['val'], stats
