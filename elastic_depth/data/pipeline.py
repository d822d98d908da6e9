"""Packing documents into fixed windows, the grain training pipeline and validation batches."""

import dataclasses

import grain
import numpy as np

from elastic_depth.data import sources, synthetic
from elastic_depth.data import tokenizer as tokenizer_lib
from elastic_depth.data.errors import DataError

NO_DIFFICULTY = -1  # difficulty of text tokens and of padding
# grain prefetches 500 batches by default (~260 MB at 16x2048); 32 feed as fast here
READ_OPTIONS = grain.ReadOptions(num_threads=16, prefetch_buffer_size=32)


def pack(docs_ids: list[np.ndarray], eos_id: int,
         docs_difficulty: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Concatenates documents, each followed by EOS, into flat streams.

  Args:
    docs_ids: one int array [T_i] of token ids per document (no EOS).
    eos_id: id appended after every document.
    docs_difficulty: optional int arrays [T_i]; EOS gets difficulty 0. None: all -1.

  Returns:
    (tokens_N, difficulty_N), both int32 with N = sum(T_i + 1).
  """
  eos = np.array([eos_id], np.int32)
  tokens_N = np.concatenate([np.concatenate([np.asarray(d, np.int32), eos]) for d in docs_ids])
  if docs_difficulty is None:
    return tokens_N, np.full_like(tokens_N, NO_DIFFICULTY)
  zero = np.zeros(1, np.int32)
  difficulty_N = np.concatenate([np.concatenate([np.asarray(d, np.int32), zero])
                                 for d in docs_difficulty])
  return tokens_N, difficulty_N


class Windows:
  """Random-access source of windows of seq_len + 1 tokens taken with stride seq_len.

  Window i covers stream[i*L : i*L + L + 1], so consecutive windows share one token
  and every next-token pair of the stream (up to the last full window) is a target once.
  """

  def __init__(self, tokens_N: np.ndarray, difficulty_N: np.ndarray, seq_len: int,
               answers_only: bool = False):
    self.tokens_N = tokens_N
    self.difficulty_N = difficulty_N
    self.seq_len = seq_len
    self.answers_only = answers_only  # mask = 1 only where the target's difficulty > 0

  @property
  def num_tokens(self) -> int:
    return len(self.tokens_N)

  def __len__(self) -> int:
    return max(0, (self.num_tokens - 1) // self.seq_len)

  def tokens(self, start: int, stop: int) -> np.ndarray:
    """int32 ids of stream[start:stop]."""
    return self.tokens_N[start:stop]

  def difficulty(self, start: int, stop: int) -> np.ndarray:
    """Difficulty labels of stream[start:stop]."""
    return self.difficulty_N[start:stop].copy()

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    if not 0 <= i < len(self):
      raise IndexError(f'window {i} out of range [0, {len(self)})')
    start = int(i) * self.seq_len
    window = self.tokens(start, start + self.seq_len + 1)
    difficulty = self.difficulty(start + 1, start + self.seq_len + 1)
    mask = (difficulty > 0) if self.answers_only else np.ones(self.seq_len, bool)
    return {
        'inputs': window[:-1].copy(),
        'targets': window[1:].copy(),
        'mask': mask.astype(np.float32),
        'difficulty': difficulty,
    }


def host_batches(stream: grain.MapDataset, batch_size: int, shard_index: int = 0,
                 shard_count: int = 1) -> grain.MapDataset:
  """This host's rows of the global batches of `stream`.

  The global stream (in batches of batch_size * shard_count) does not depend on the
  number of hosts: host i takes rows [i * batch_size, (i + 1) * batch_size) of every
  global batch, so hosts draw disjoint windows, and a run resumed on another host count
  continues the same stream.
  """
  if shard_count == 1:
    return stream.batch(batch_size, drop_remainder=True)
  lo = shard_index * batch_size
  rows = grain.MapDataset.range(0, len(stream)).map(
      lambda k: (k // batch_size) * batch_size * shard_count + lo + k % batch_size)
  return rows.map(lambda j: stream[j]).batch(batch_size, drop_remainder=True)


def train_dataset(windows: Windows, batch_size: int, seed: int, shard_index: int = 0,
                  shard_count: int = 1) -> grain.MapDataset:
  """Infinite grain dataset of this host's batches: all windows, reshuffled every epoch."""
  stream = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
  return host_batches(stream, batch_size, shard_index, shard_count)


def batch_iterator(ds: grain.MapDataset):
  """A checkpointable iterator over ds (get_state/set_state) with bounded prefetch."""
  return iter(ds.to_iter_dataset(READ_OPTIONS))


class Curriculum:
  """Training windows in a fixed order of stages of rising difficulty, then the full task.

  Window n of the stream comes from stage min(n // per_stage, last); stage j < last holds
  programs with k <= k_max[j], the last stage is the ordinary training split. Each stage
  is read in a shuffled order (reshuffled every pass, a pure function of (seed, stage,
  pass)), so the stream is deterministic and an index is all a resumed iterator needs.
  """

  def __init__(self, stages: list[Windows], per_stage: int, seed: int):
    self.stages, self.per_stage, self.seed = stages, per_stage, seed
    self._perm = {}

  def __len__(self) -> int:
    return 2 ** 40  # unbounded: the last stage repeats

  def _order(self, j: int, rnd: int) -> np.ndarray:
    """Permutation of stage j in pass rnd; one cache read and one write, so another
    grain thread clearing the cache in between cannot lose it."""
    perm = self._perm.get((j, rnd))
    if perm is None:
      perm = np.random.default_rng([self.seed, j, rnd]).permutation(len(self.stages[j]))
      if len(self._perm) > 64:
        self._perm.clear()
      self._perm[(j, rnd)] = perm
    return perm

  def __getitem__(self, n: int) -> dict[str, np.ndarray]:
    j = min(int(n) // self.per_stage, len(self.stages) - 1)
    m = int(n) - j * self.per_stage
    size = len(self.stages[j])
    return self.stages[j][int(self._order(j, m // size)[m % size])]


def curriculum_stages(cfg, tok, seq_len: int, answers_only: bool) -> list[Windows]:
  """Windows of the easier stages (k <= 2, 3, ..., max_hops - 1) of a compose or chain corpus."""
  out = []
  for j, k_max in enumerate(range(2, cfg.synth_max_hops)):
    split = synthetic.generate(cfg.synth_examples, k_max, cfg.synth_num_vars, cfg.seed,
                               synthetic.VAL_STREAM + 1 + j, task=cfg.synth_task,
                               num_ops=cfg.synth_num_ops)
    out.append(_windows(f'curriculum k<={k_max}', (split.ids, split.difficulty), tok,
                        seq_len, 'synthetic', answers_only))
  return out


def fixed_batches(windows: Windows, batch_size: int, n: int | None) -> list[dict]:
  """First n batches of windows in order; the last one padded with mask-0 rows."""
  n_all = -(-len(windows) // batch_size)
  out = []
  for b in range(n_all if n is None else min(n, n_all)):
    rows = [windows[i] for i in range(b * batch_size, min(len(windows), (b + 1) * batch_size))]
    while len(rows) < batch_size:
      rows.append({'inputs': np.zeros_like(rows[0]['inputs']),
                   'targets': np.zeros_like(rows[0]['targets']),
                   'mask': np.zeros_like(rows[0]['mask']),
                   'difficulty': np.full_like(rows[0]['difficulty'], NO_DIFFICULTY)})
    out.append({k: np.stack([r[k] for r in rows]) for k in rows[0]})
  return out


@dataclasses.dataclass
class Data:
  """Everything the trainer needs from the data package (see build)."""
  train_iter: object       # grain iterator of batches with get_state()/set_state()
  tokenizer: object        # HFTokenizer or synthetic.SyntheticVocab
  vocab_size: int
  eos_id: int
  seq_len: int
  batch_size: int
  train_ds: grain.MapDataset
  train_windows: Windows
  val_windows: Windows
  stats: dict
  shard_index: int = 0
  shard_count: int = 1

  def val_batches(self, n: int | None = None) -> list[dict[str, np.ndarray]]:
    """This host's rows of the first n global validation batches (all when None).

    A global batch holds batch_size * shard_count windows and host i its rows
    [i * batch_size, (i + 1) * batch_size), so the validation set is the same for any
    number of hosts; the same list on every call.
    """
    lo = self.shard_index * self.batch_size
    return [{k: v[lo:lo + self.batch_size] for k, v in b.items()} for b in
            fixed_batches(self.val_windows, self.batch_size * self.shard_count, n)]

  def describe(self) -> str:
    """One-line summary of sources, documents, tokens and windows."""
    s = self.stats
    return (f"data {s['origin']}: tokenizer {s['tokenizer']} (vocab {self.vocab_size}, "
            f"eos {self.eos_id}); train {s['train_docs']} docs {s['train_tokens']} tokens "
            f"{s['train_windows']} windows; val {s['val_docs']} docs {s['val_tokens']} tokens "
            f"{len(self.val_windows)} windows; seq_len {self.seq_len} batch {self.batch_size}"
            + (f"; {s['cap']}" if s.get('cap') else ''))


def _synthetic_streams(cfg, vocab_size, workdir):
  """Synthetic programs with difficulty labels in their own vocabulary."""
  del workdir
  train, val, vocab = synthetic.load(cfg.synth_examples, cfg.synth_max_hops,
                                     cfg.synth_num_vars, cfg.seed, cfg.val_fraction,
                                     getattr(cfg, 'synth_task', 'binding'),
                                     getattr(cfg, 'synth_num_ops', 4))
  tokenizer_lib.check_vocab(vocab, vocab_size)
  return 'synthetic', vocab, (train.ids, train.difficulty), (val.ids, val.difficulty)


def _text_streams(cfg, vocab_size, workdir):
  """Documents of a text-like source, tokenized; difficulty unknown (-1)."""
  corpus = sources.load(cfg)
  tok = tokenizer_lib.get(cfg.tokenizer, corpus.train, vocab_size, workdir)
  return (corpus.origin, tok, (tok.encode_batch(corpus.train), None),
          (tok.encode_batch(corpus.val), None))


STREAMS = {
    sources.Source.SYNTHETIC: _synthetic_streams,
    sources.Source.TEXT: _text_streams,
    sources.Source.HF: _text_streams,
    sources.Source.TFDS: _text_streams,
}


def _windows(split: str, docs, tok, seq_len: int, origin: str,
             answers_only: bool = False) -> Windows:
  """Packed windows of one split; DataError if shorter than one sequence."""
  ids, difficulty = docs
  empty = (np.zeros(0, np.int32), np.zeros(0, np.int32))
  tokens_N, difficulty_N = pack(ids, tok.eos_id, difficulty) if ids else empty
  if len(tokens_N) < seq_len + 1:
    raise DataError(f'{origin}: the {split} split has {len(tokens_N)} tokens, fewer than one '
                    f'sequence (seq_len+1={seq_len + 1}); use more data, a shorter '
                    'train.seq_len' + (' or a larger data.val_fraction / data.val_paths'
                                       if split == 'validation' else ''))
  return Windows(tokens_N, difficulty_N, seq_len, answers_only)


def _in_memory(cfg, vocab_size: int, workdir, seq_len: int):
  """Documents loaded, tokenized and packed in memory (every source but tokens)."""
  origin, tok, train_docs, val_docs = STREAMS[sources.source_of(cfg)](cfg, vocab_size, workdir)
  answers = (getattr(cfg, 'loss_on', 'all') == 'answers'
             and sources.source_of(cfg) == sources.Source.SYNTHETIC)
  train_w = _windows('train', train_docs, tok, seq_len, origin, answers)
  val_w = _windows('validation', val_docs, tok, seq_len, origin, answers)
  return origin, tok, train_w, val_w, {'train_docs': len(train_docs[0]),
                                       'val_docs': len(val_docs[0])}


def _prepared(cfg, vocab_size: int, workdir, seq_len: int):
  """Memory-mapped shards of experiments.prepare_data (see tokens.py)."""
  from elastic_depth.data import tokens  # pylint: disable=g-import-not-at-top (imports us)
  return tokens.windows(cfg, vocab_size, workdir, seq_len)


WINDOWS = {sources.Source.TOKENS: _prepared}  # other sources: _in_memory


def build(data_cfg, *, seq_len: int, batch_size: int, vocab_size: int, workdir=None,
          shard_index: int = 0, shard_count: int = 1) -> Data:
  """Loads, tokenizes and packs the configured corpus; every DataError is raised here.

  Args:
    data_cfg: a DataConfig.
    seq_len: L, tokens per sequence (windows hold L + 1 tokens).
    batch_size: B, sequences per batch (per host).
    vocab_size: the model's vocabulary size; the tokenizer may not exceed it.
    workdir: run directory; a trained tokenizer is saved/reused as workdir/tokenizer.json.
    shard_index: this host's index; hosts draw disjoint training windows.
    shard_count: number of hosts.

  Returns:
    Data whose batches are dicts: inputs int32[B,L], targets int32[B,L], mask float32[B,L],
    difficulty int32[B,L] (of the target token; -1 for text).
  """
  if seq_len < 1 or batch_size < 1:
    raise DataError(f'seq_len={seq_len} and batch_size={batch_size} must be >= 1')
  if not 0 <= shard_index < shard_count:
    raise DataError(f'shard_index={shard_index} not in [0, shard_count={shard_count})')
  source = sources.source_of(data_cfg)
  sources.check_loss_on(data_cfg)
  origin, tok, train_w, val_w, stats = WINDOWS.get(source, _in_memory)(
      data_cfg, vocab_size, workdir, seq_len)
  if len(train_w) < shard_count:
    raise DataError(f'{origin}: {len(train_w)} training windows for {shard_count} hosts')
  if getattr(data_cfg, 'synth_curriculum', 0) and origin == 'synthetic':
    answers = getattr(data_cfg, 'loss_on', 'all') == 'answers'
    stages = curriculum_stages(data_cfg, tok, seq_len, answers) + [train_w]
    train_ds = host_batches(grain.MapDataset.source(
        Curriculum(stages, data_cfg.synth_curriculum, data_cfg.seed)), batch_size,
        shard_index, shard_count)
  else:
    train_ds = train_dataset(train_w, batch_size, data_cfg.seed, shard_index, shard_count)
  stats = {'origin': origin, 'tokenizer': getattr(tok, 'origin', 'synthetic vocabulary'),
           'cap': f'at most {data_cfg.max_docs} documents per part (data.max_docs)'
                  if data_cfg.max_docs else '', **stats,
           'train_tokens': train_w.num_tokens, 'val_tokens': val_w.num_tokens,
           'train_windows': len(train_w)}
  return Data(batch_iterator(train_ds), tok, tok.vocab_size, tok.eos_id, seq_len, batch_size,
              train_ds, train_w, val_w, stats, shard_index, shard_count)
