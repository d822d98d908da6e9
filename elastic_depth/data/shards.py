"""Tokenize a corpus once, streaming, into fixed-size token shards on disk (prepare_data).

Layout of a prepared directory:
  index.json        source settings, tokenizer (spec, fingerprint), dtype, shard sizes,
                    per split the complete shards with their token and document counts,
                    a resume point, and `complete` once every document is written.
  tokenizer.json    the tokenizer the ids come from (training copies it into the workdir).
  train-00000.bin   raw little-endian ids (uint16 when the vocabulary fits, else uint32);
  val-00000.bin     every document followed by EOS; a document may cross a shard boundary.

Each document goes to `train` or `val` by a seeded hash of its position in the stream
(or by its origin: data.val_paths, a TFDS validation split, the synthetic split). A shard
is written to a temporary name and renamed when full; the index is then rewritten
(atomically) with a resume point, the first document not yet completely on disk and both
splits' token counts before it. A rerun regenerates from that document, drops the tokens
already on disk, and so writes byte-identical shards.
"""

import collections
import dataclasses
import itertools
import json
import os
import pathlib
import time
from typing import Iterator, Optional

import numpy as np

from elastic_depth.config import DataConfig
from elastic_depth.data import sources
from elastic_depth.data import tokenizer as tokenizer_lib
from elastic_depth.data.errors import DataError

INDEX = 'index.json'
FORMAT = 1
SPLITS = ('train', 'val')
# DataConfig fields that decide the token stream; a directory prepared with others is refused
SOURCE_FIELDS = ('source', 'paths', 'val_paths', 'text_field', 'separator', 'hf_name',
                 'hf_config', 'tfds_name', 'max_docs', 'seed', 'val_fraction', 'synth_task',
                 'synth_examples', 'synth_max_hops', 'synth_num_vars', 'synth_num_ops')


@dataclasses.dataclass
class Part:
  """A stream of documents; split None: held out by hash, else all go to that split."""
  split: Optional[str]
  docs: Iterator[str]
  total: Optional[int] = None  # documents, when known


def _text_parts(cfg) -> tuple[str, list[Part]]:
  if not cfg.paths:
    raise DataError('data.source=text needs --config.data.paths=FILE|GLOB|A,B,...')
  if cfg.val_paths:
    sources.check_disjoint(cfg.paths, cfg.val_paths)
    return cfg.paths, [Part('train', sources.iter_files(cfg.paths, cfg)),
                       Part('val', sources.iter_files(cfg.val_paths, cfg, 'data.val_paths'))]
  return cfg.paths, [Part(None, sources.iter_files(cfg.paths, cfg))]


def _hf_parts(cfg) -> tuple[str, list[Part]]:
  return sources.hf_origin(cfg), [Part(None, sources.iter_hf(cfg))]


def _tfds_parts(cfg) -> tuple[str, list[Part]]:
  origin, splits = sources.iter_tfds(cfg)
  if 'val' not in splits:
    return origin, [Part(None, splits['train'][1], splits['train'][0])]
  return origin, [Part(k, docs, n) for k, (n, docs) in splits.items()]


def _synthetic_parts(cfg) -> tuple[str, list[Part]]:
  corpus = sources.load_synthetic(cfg)
  return corpus.origin, [Part('train', iter(corpus.train), len(corpus.train)),
                         Part('val', iter(corpus.val), len(corpus.val))]


def _no_parts(cfg) -> tuple[str, list[Part]]:
  raise DataError(f'data.source=tokens: {cfg.paths or "a prepared directory"} is already '
                  'token ids; prepare from a document source: --config.data.source='
                  'text|hf|tfds|synthetic')


PARTS = {
    sources.Source.TEXT: _text_parts,
    sources.Source.HF: _hf_parts,
    sources.Source.TFDS: _tfds_parts,
    sources.Source.SYNTHETIC: _synthetic_parts,
    sources.Source.TOKENS: _no_parts,
}


def document_parts(cfg) -> tuple[str, list[Part]]:
  """(origin, parts) of the configured source, each part capped at data.max_docs."""
  origin, parts = PARTS[sources.source_of(cfg)](cfg)
  if cfg.max_docs:
    parts = [Part(p.split, itertools.islice(p.docs, cfg.max_docs),
                  min(p.total or cfg.max_docs, cfg.max_docs)) for p in parts]
  return origin, parts


def is_val(seed: int, doc_idx: np.ndarray, val_fraction: float) -> np.ndarray:
  """Whether each document position is held out: a splitmix64 hash of (seed, position)."""
  with np.errstate(over='ignore'):
    z = doc_idx.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + 1) % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  return (z >> np.uint64(11)).astype(np.float64) / 2.0**53 < val_fraction


def dtype_for(vocab_size: int) -> str:
  """Narrowest unsigned dtype holding ids in [0, vocab_size)."""
  return 'uint16' if vocab_size <= 2**16 else 'uint32'


def read_index(directory) -> Optional[dict]:
  """The index of a prepared directory, or None when it has none."""
  path = pathlib.Path(directory) / INDEX
  if not path.is_file():
    return None
  try:
    index = json.loads(path.read_text(encoding='utf-8'))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f'{path}: not a readable index ({e})') from None
  if not isinstance(index, dict) or index.get('format') != FORMAT:
    raise DataError(f'{path}: not a prepare_data index of format {FORMAT}')
  return index


def write_json_atomic(path: pathlib.Path, obj) -> None:
  """Writes JSON to a temporary name, then renames it over path."""
  tmp = path.with_name(f'.{path.name}.tmp')
  tmp.write_text(json.dumps(obj, indent=1), encoding='utf-8')
  os.replace(tmp, path)


@dataclasses.dataclass
class _Split:
  """Writer state of one split: complete shards, the unwritten tail and its documents."""
  name: str
  shard_tokens: int
  shards: list
  written: int                     # tokens in complete shards
  buf: list = dataclasses.field(default_factory=list)
  buffered: int = 0
  # documents not completely on disk: (position, tokens of both splits before it, end)
  pending: collections.deque = dataclasses.field(default_factory=collections.deque)


class Writer:
  """Appends tokenized documents to the shards of both splits and commits each shard."""

  def __init__(self, out: pathlib.Path, index: dict, eos_id: int):
    self.out, self.index, self.eos_id = out, index, eos_id
    self.dtype = np.dtype(index['dtype'])
    self.splits = {s: _Split(s, index['shard_tokens'][s], index['splits'][s]['shards'],
                             sum(x['tokens'] for x in index['splits'][s]['shards']))
                   for s in SPLITS}
    resume = index['resume']
    self.next_doc = resume['doc']
    self.counts = dict(resume['tokens'])  # tokens of each split before next_doc

  def add(self, split: str, ids) -> None:
    """Appends one document's ids (and its EOS) to its split; skips tokens already on disk."""
    sp = self.splits[split]
    arr = np.append(np.asarray(ids, self.dtype), np.asarray(self.eos_id, self.dtype))
    start = self.counts[split]
    end = start + len(arr)
    if end > sp.written:
      sp.pending.append((self.next_doc, dict(self.counts), end))
      arr = arr[max(0, sp.written - start):]
      sp.buf.append(arr)
      sp.buffered += len(arr)
    self.counts[split] = end
    self.next_doc += 1

  def flush(self, final: bool = False) -> int:
    """Writes every full shard (and on `final` the partial tails); returns shards written."""
    n = 0
    for sp in self.splits.values():
      while sp.buffered >= sp.shard_tokens or (final and sp.buffered):
        self._write_shard(sp, min(sp.buffered, sp.shard_tokens))
        n += 1
    return n

  def _write_shard(self, sp: _Split, size: int) -> None:
    flat = np.concatenate(sp.buf)
    name = f'{sp.name}-{len(sp.shards):05d}.bin'
    tmp = self.out / f'.{name}.tmp'
    with open(tmp, 'wb') as f:
      f.write(flat[:size].astype(self.dtype.newbyteorder('<'), copy=False).tobytes())
    os.replace(tmp, self.out / name)
    sp.buf, sp.buffered = [flat[size:]], len(flat) - size
    sp.written += size
    docs = 0
    while sp.pending and sp.pending[0][2] <= sp.written:
      sp.pending.popleft()
      docs += 1
    sp.shards.append({'file': name, 'tokens': size, 'docs': docs})
    self.commit()

  def commit(self, complete: bool = False) -> None:
    """Rewrites the index: shards so far and the first document not completely on disk."""
    heads = [sp.pending[0] for sp in self.splits.values() if sp.pending]
    doc, counts, _ = min(heads, key=lambda h: h[0]) if heads else (
        self.next_doc, self.counts, None)
    self.index['resume'] = {'doc': doc, 'tokens': dict(counts)}
    for s, sp in self.splits.items():
      self.index['splits'][s].update(
          shards=sp.shards, tokens=sp.written, docs=sum(x['docs'] for x in sp.shards))
    self.index['complete'] = complete
    write_json_atomic(self.out / INDEX, self.index)


def _tokenizer(cfg, out: pathlib.Path, vocab_size: int, tokenizer_docs: int):
  """The tokenizer of out/ (on a rerun), else data.tokenizer; a 'train' BPE learns a sample."""
  saved = out / tokenizer_lib.TOKENIZER_FILE
  if saved.is_file() and cfg.tokenizer == tokenizer_lib.TRAIN:
    return tokenizer_lib.get(str(saved), [], vocab_size)
  docs = []
  if cfg.tokenizer == tokenizer_lib.TRAIN:
    # training documents only: a hash-split part's held-out documents are the validation
    # set (positions as `prepare` numbers the chained parts)
    _, parts = document_parts(cfg)
    hinted = enumerate((p.split, d) for p in parts for d in p.docs)
    docs = list(itertools.islice((d for i, (split, d) in hinted if split == 'train' or (
        split is None and not is_val(cfg.seed, np.asarray([i]), cfg.val_fraction)[0])),
                                 tokenizer_docs))
    print(f'training a byte-level BPE (vocab {vocab_size}) on the first {len(docs)} '
          f'documents (--tokenizer_docs={tokenizer_docs})', flush=True)
  return tokenizer_lib.get(cfg.tokenizer, docs, vocab_size)


def _new_index(cfg, origin: str, tok, vocab_size: int, shard_tokens: int) -> dict:
  """Index of an empty prepared directory."""
  val_shard = max(1, int(shard_tokens * min(1.0, 2 * cfg.val_fraction)))
  return {
      'format': FORMAT, 'complete': False, 'origin': origin,
      'source': {k: getattr(cfg, k) for k in SOURCE_FIELDS},
      'tokenizer': {'spec': cfg.tokenizer, 'file': tokenizer_lib.TOKENIZER_FILE,
                    **tokenizer_lib.tokenizer_info(tok)},
      'model_vocab_size': vocab_size, 'dtype': dtype_for(tok.vocab_size),
      'shard_tokens': {'train': shard_tokens, 'val': val_shard},
      'resume': {'doc': 0, 'tokens': {s: 0 for s in SPLITS}},
      'splits': {s: {'shards': [], 'tokens': 0, 'docs': 0} for s in SPLITS},
  }


def _check_same(old: dict, new: dict, out: pathlib.Path) -> None:
  """DataError if out/ was started with another source, tokenizer or shard size."""
  # a field an older index lacks had its default then (synth_num_ops: 4 ops)
  diff = [f'source.{k}' for k in SOURCE_FIELDS
          if old['source'].get(k, getattr(DataConfig(), k)) != new['source'][k]]
  diff += [k for k in ('dtype', 'shard_tokens') if old.get(k) != new[k]]
  diff += [f'tokenizer.{k}' for k in ('fingerprint', 'vocab_size', 'eos_id')
           if old['tokenizer'].get(k) != new['tokenizer'][k]]
  if diff:
    raise DataError(f'{out} was prepared with other settings ({", ".join(diff)}: e.g. '
                    f'tokenizer {old["tokenizer"].get("origin")}); it is never mixed: give '
                    'the same flags, or a new --out (nothing deleted)')


def open_output(cfg, out, vocab_size: int, shard_tokens: int, tokenizer_docs: int,
                resume: bool):
  """Checks out/ and the settings before any tokenizing; returns (index, tokenizer).

  A directory with an index continues (after the same checks) when the source, tokenizer
  and shard size match; `resume` requires such an index.
  """
  out = pathlib.Path(out)
  if out.exists() and not out.is_dir():
    raise DataError(f'--out={out} is a file; give a new or empty directory')
  if shard_tokens < 2:
    raise DataError(f'--shard_tokens={shard_tokens} must be >= 2')
  if not 0 < cfg.val_fraction < 1:
    raise DataError(f'data.val_fraction={cfg.val_fraction} must be in (0, 1)')
  if getattr(cfg, 'loss_on', 'all') == 'answers':
    raise DataError('data.loss_on=answers: prepared shards hold token ids only, no difficulty '
                    'labels, so a run on them (data.source=tokens) cannot put the loss on '
                    'answers only; give --config.data.loss_on=all')
  old = read_index(out)
  if old is None and out.is_dir() and any(
      p.name != tokenizer_lib.TOKENIZER_FILE and not p.name.startswith('.')
      for p in out.iterdir()):
    raise DataError(f'--out={out} is a non-empty directory without {INDEX}; choose an '
                    'empty or new directory')
  if old is None and resume:
    raise DataError(f'--resume: {out} holds no {INDEX} to continue')
  origin, _ = document_parts(cfg)  # fails early on a bad source (no document read yet)
  out.mkdir(parents=True, exist_ok=True)
  tok = _tokenizer(cfg, out, vocab_size, tokenizer_docs)
  index = _new_index(cfg, origin, tok, vocab_size, shard_tokens)
  if old is not None:
    _check_same(old, index, out)
    index = old
  else:
    tok.save(out / tokenizer_lib.TOKENIZER_FILE)
    write_json_atomic(out / INDEX, index)
  listed = {x['file'] for s in SPLITS for x in index['splits'][s]['shards']}
  for p in out.iterdir():  # a shard renamed just before a kill, before its index entry
    if p.suffix in ('.bin', '.tmp') and p.name not in listed:
      p.unlink()
  return index, tok


def _progress(total: Optional[int], quiet: bool):
  """Documents done, tokens/s and ETA (a bar on a terminal, lines in a log)."""
  from elastic_depth import metrics  # pylint: disable=g-import-not-at-top
  return metrics.progress(total, desc='prepare', unit='doc', disable=True if quiet else None)


def prepare(cfg, out, *, vocab_size: int, shard_tokens: int = 2**27, batch_docs: int = 512,
            tokenizer_docs: int = 20_000, resume: bool = False, quiet: bool = False) -> dict:
  """Tokenizes the configured source into shards under `out`; continues a partial run.

  Args:
    cfg: a DataConfig naming a document source (text, hf, tfds, synthetic) and tokenizer.
    out: output directory.
    vocab_size: the model's vocabulary size; the tokenizer may not exceed it.
    shard_tokens: tokens per train shard (validation shards: 2 * val_fraction of that).
    batch_docs: documents per tokenizer call.
    tokenizer_docs: documents a 'train' tokenizer learns from.
    resume: require a partial directory to continue.
    quiet: no progress bar.

  Returns:
    The final index (also out/index.json).
  """
  out = pathlib.Path(out)
  index, tok = open_output(cfg, out, vocab_size, shard_tokens, tokenizer_docs, resume)
  if index['complete']:
    print(f'{out}: already complete ({index["splits"]["train"]["tokens"]} train tokens)')
    return index
  writer = Writer(out, index, tok.eos_id)
  _, parts = document_parts(cfg)
  hinted = itertools.chain.from_iterable(
      ((p.split, d) for d in p.docs) for p in parts)
  stream = itertools.islice(hinted, writer.next_doc, None)
  total = sum(p.total for p in parts) if all(p.total for p in parts) else None
  start, tokens0 = time.time(), sum(writer.counts.values())
  if writer.next_doc:
    print(f'{out}: resuming at document {writer.next_doc} '
          f'({sum(len(index["splits"][s]["shards"]) for s in SPLITS)} complete shards)',
          flush=True)
  with _progress(total, quiet) as bar:
    bar.update(writer.next_doc)
    while batch := list(itertools.islice(stream, batch_docs)):
      pos = np.arange(writer.next_doc, writer.next_doc + len(batch))
      held = is_val(cfg.seed, pos, cfg.val_fraction)
      for (hint, _), ids, v in zip(batch, tok.encode_batch([d for _, d in batch]), held):
        writer.add(hint or ('val' if v else 'train'), ids)
      writer.flush()
      bar.update(len(batch))
      rate = (sum(writer.counts.values()) - tokens0) / max(time.time() - start, 1e-9)
      bar.set_postfix_str(f'{rate:,.0f} tokens/s', refresh=False)
  for s in SPLITS:
    if writer.counts[s] == 0:
      raise DataError(f'{index["origin"]}: no {s} document among {writer.next_doc}; '
                      + ('use more data' if s == 'train' else 'raise data.val_fraction')
                      + f', then prepare into a new --out ({out} records these settings)')
  writer.flush(final=True)
  writer.commit(complete=True)
  return index
