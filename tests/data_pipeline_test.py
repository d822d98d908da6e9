"""Tests of packing, the grain training iterator, validation batches and build()."""

import json
import pathlib

import numpy as np
import pytest

from elastic_depth.config import DataConfig
from elastic_depth.data import pipeline
from elastic_depth.data.errors import DataError

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / 'shared' / 'data'
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f'{SHARED} absent')
TINY = SHARED / 'tinystories' / 'TinyStories-valid.first1000.txt'
SYNTH = DataConfig(synth_examples=400, synth_task="binding")


def synth_data(**kw):
  kw = {'seq_len': 32, 'batch_size': 4, 'vocab_size': 512, **kw}
  return pipeline.build(kw.pop('cfg', SYNTH), **kw)


def test_pack_against_brute_force():
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 50, size=n).astype(np.int32) for n in (5, 1, 9, 3)]
  diffs = [np.arange(len(d), dtype=np.int32) + 1 for d in docs]
  tokens_N, diff_N = pipeline.pack(docs, 0, diffs)
  ref_t, ref_d = [], []
  for d, f in zip(docs, diffs):
    ref_t += list(d) + [0]
    ref_d += list(f) + [0]
  assert tokens_N.tolist() == ref_t and diff_N.tolist() == ref_d
  assert tokens_N.dtype == diff_N.dtype == np.int32
  assert (pipeline.pack(docs, 0)[1] == -1).all()
  windows = pipeline.Windows(tokens_N, diff_N, seq_len=4)
  assert len(windows) == (len(ref_t) - 1) // 4
  rows = [windows[i] for i in range(len(windows))]
  for i, r in enumerate(rows):
    assert r['inputs'].tolist() == ref_t[4 * i:4 * i + 4]
    assert r['targets'].tolist() == ref_t[4 * i + 1:4 * i + 5]
    assert r['difficulty'].tolist() == ref_d[4 * i + 1:4 * i + 5]
  n = 4 * len(windows)
  assert np.concatenate([r['inputs'] for r in rows]).tolist() == ref_t[:n]
  assert np.concatenate([r['targets'] for r in rows]).tolist() == ref_t[1:n + 1]
  with pytest.raises(IndexError):
    windows[len(windows)]


def test_synthetic_batches_shapes_and_difficulty():
  data = synth_data()
  batch = next(data.train_iter)
  assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
      'inputs': ((4, 32), 'int32'), 'targets': ((4, 32), 'int32'),
      'mask': ((4, 32), 'float32'), 'difficulty': ((4, 32), 'int32')}
  np.testing.assert_array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])
  assert batch['mask'].all() and batch['inputs'].max() < data.vocab_size == 31
  tok = data.tokenizer
  for row_t, row_d in zip(batch['targets'], batch['difficulty']):
    for i, (t, d) in enumerate(zip(row_t, row_d)):
      if d > 0 and i >= 2:  # answer digit: preceded by '? var'
        assert tok.id_to_token(t).isdigit() and tok.id_to_token(row_t[i - 2]) == '?'
      if tok.id_to_token(t) in ('=', ';', '.', '<|endoftext|>'):
        assert d == 0
  assert 'synthetic' in data.describe() and '400 docs' in data.describe()


def test_deterministic_and_seeded():
  take = lambda d: [next(d.train_iter)['inputs'] for _ in range(5)]
  a, b = take(synth_data()), take(synth_data())
  c = take(synth_data(cfg=DataConfig(synth_examples=400, seed=1)))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iterator_state_round_trip():
  data = synth_data(batch_size=8)
  n_windows = data.stats['train_windows']
  for _ in range(n_windows // 8 - 2):  # resume just before the epoch boundary
    next(data.train_iter)
  state = json.loads(json.dumps(data.train_iter.get_state()))
  expected = [next(data.train_iter) for _ in range(6)]
  fresh = synth_data(batch_size=8)
  fresh.train_iter.set_state(state)  # what the trainer does on --resume
  for want, got in zip(expected, [next(fresh.train_iter) for _ in range(6)]):
    for k in want:
      np.testing.assert_array_equal(want[k], got[k])


def test_epochs_cover_all_windows_and_reshuffle():
  data = synth_data(batch_size=1)
  n = data.stats['train_windows']
  first = [next(data.train_iter)['inputs'][0].tobytes() for _ in range(n)]
  second = [next(data.train_iter)['inputs'][0].tobytes() for _ in range(n)]
  assert len(set(first)) == n and set(first) == set(second) and first != second


def test_val_batches_fixed_padded_and_disjoint():
  data = synth_data(batch_size=16)
  everything = data.val_batches()
  assert len(everything) == -(-len(data.val_windows) // 16)
  assert all(np.array_equal(x['inputs'], y['inputs'])
             for x, y in zip(everything[:2], data.val_batches(2)))
  last = everything[-1]
  n_real = len(data.val_windows) - 16 * (len(everything) - 1)
  assert last['mask'][:n_real].all() and not last['mask'][n_real:].any()
  assert len(data.val_batches(10_000)) == len(everything)


def test_val_batches_of_hosts_make_up_one_hosts_set():
  """Hosts' rows of the global validation batches are the one-host batches, in order."""
  one = synth_data(batch_size=8).val_batches(3)
  hosts = [synth_data(batch_size=2, shard_index=i, shard_count=4).val_batches(3)
           for i in range(4)]
  assert len(one) == 3 and all(len(h) == 3 for h in hosts)
  for k in ('inputs', 'targets', 'mask', 'difficulty'):
    for b in range(3):
      whole = np.concatenate([h[b][k] for h in hosts])
      assert np.array_equal(whole, one[b][k]), (k, b)


@needs_shared
def test_tinystories_end_to_end_val_disjoint(tmp_path):
  cfg = DataConfig(source='text', paths=str(TINY), max_docs=300, val_fraction=0.1)
  data = pipeline.build(cfg, seq_len=64, batch_size=8, vocab_size=1024, workdir=tmp_path)
  assert (tmp_path / 'tokenizer.json').is_file() and data.vocab_size <= 1024
  batch = next(data.train_iter)
  assert (batch['difficulty'] == -1).all() and batch['mask'].all()
  docs = lambda w: data.tokenizer.decode(w.tokens_N).split('<|endoftext|>')[:-1]
  train, val = docs(data.train_windows), docs(data.val_windows)
  assert len(train) == 270 and len(val) == 30 == data.stats['val_docs']
  assert not set(train) & set(val)
  text = TINY.read_text('utf-8')
  originals = [s.strip() for s in text.split('<|endoftext|>') if s.strip()][:300]
  assert sorted(train + val) == sorted(originals)
  assert 'tokenizer trained byte-level BPE' in data.describe()


def test_too_short_errors(tmp_path):
  (tmp_path / 'a.txt').write_text('tiny text<|endoftext|>x' * 2, encoding='utf-8')
  cfg = DataConfig(source='text', paths=str(tmp_path / 'a.txt'))
  with pytest.raises(DataError, match=r'train split has \d+ tokens.*seq_len\+1=513'):
    pipeline.build(cfg, seq_len=512, batch_size=2, vocab_size=512, workdir=tmp_path)
  (tmp_path / 'b.txt').write_text('long enough text ' * 200, encoding='utf-8')
  (tmp_path / 'v.txt').write_text('x', encoding='utf-8')
  cfg = DataConfig(source='text', paths=str(tmp_path / 'b.txt'), val_paths=str(tmp_path / 'v.txt'))
  with pytest.raises(DataError, match='validation split has 2 tokens'):
    pipeline.build(cfg, seq_len=64, batch_size=2, vocab_size=512)


def test_bad_arguments_and_vocab():
  with pytest.raises(DataError, match=r'\(31 tokens.*model.vocab_size=16'):
    synth_data(vocab_size=16)
  with pytest.raises(DataError, match='seq_len=0'):
    synth_data(seq_len=0)
  with pytest.raises(DataError, match='shard_index=2'):
    synth_data(shard_index=2, shard_count=2)


def test_shards_disjoint():
  a = synth_data(batch_size=1, shard_index=0, shard_count=2)
  b = synth_data(batch_size=1, shard_index=1, shard_count=2)
  n = a.stats['train_windows'] // 2
  rows = lambda d: {next(d.train_iter)['inputs'].tobytes() for _ in range(n)}
  assert not rows(a) & rows(b)


def test_answers_only_mask_selects_exactly_the_answer_targets():
  cfg = DataConfig(synth_examples=400, loss_on='answers')
  data = synth_data(cfg=cfg)
  for batch in [next(data.train_iter)] + data.val_batches(2):
    np.testing.assert_array_equal(batch['mask'] > 0, batch['difficulty'] > 0)
    assert batch['mask'].sum() > 0
  full = synth_data()  # the default keeps every target
  assert next(full.train_iter)['mask'].all()


def test_curriculum_raises_k_stage_by_stage_and_resumes():
  cfg = DataConfig(synth_task='compose', synth_examples=300, synth_max_hops=4,
                   loss_on='answers', synth_curriculum=6)
  ds = pipeline.build(cfg, seq_len=32, batch_size=2, vocab_size=64)
  ks = []
  for _ in range(12):  # 2 windows per batch: stages k<=2, k<=3 (3 batches each), then all
    b = next(ds.train_iter)
    ks.append(set(np.unique(b['difficulty'][b['mask'] > 0]).tolist()))
  assert set().union(*ks[:3]) <= {1, 2} and set().union(*ks[3:6]) <= {1, 2, 3}
  assert 3 in set().union(*ks[3:6]) and 4 in set().union(*ks[6:])
  state = ds.train_iter.get_state()
  want = next(ds.train_iter)
  again = pipeline.build(cfg, seq_len=32, batch_size=2, vocab_size=64)
  again.train_iter.set_state(state)
  got = next(again.train_iter)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key])


def test_a_special_token_string_in_a_document_never_splits_it(tmp_path):
  """Documents holding '<|endoftext|>' as text: one EOS per document (the separator
  `pack` appends), and the stream cut at its EOS ids decodes to the documents in order."""
  rows = [f'story {i} says <|endoftext|> then {i * 7} more<|endoftext|>' if i % 3 == 0
          else f'story {i} is plain text' for i in range(60)]
  for name, docs in (('train', rows[:48]), ('val', rows[48:])):
    (tmp_path / f'{name}.jsonl').write_text(
        ''.join(json.dumps({'text': d}) + '\n' for d in docs), encoding='utf-8')
  cfg = DataConfig(source='text', paths=str(tmp_path / 'train.jsonl'),
                   val_paths=str(tmp_path / 'val.jsonl'))
  data = pipeline.build(cfg, seq_len=16, batch_size=2, vocab_size=300)
  assert (data.stats['train_docs'], data.stats['val_docs']) == (48, 12)
  for w, want in ((data.train_windows, rows[:48]), (data.val_windows, rows[48:])):
    ends = np.flatnonzero(w.tokens_N == data.eos_id)
    assert len(ends) == len(want) and ends[-1] == w.num_tokens - 1
    pieces = np.split(w.tokens_N, ends[:-1] + 1)
    assert [data.tokenizer.decode(p[:-1]) for p in pieces] == want
    assert len(w) == (w.num_tokens - 1) // 16


def test_loss_on_answers_needs_difficulty_labels(tmp_path):
  """loss_on=answers with a text source (no difficulty labels) is refused by name, before
  any document is read (the file does not exist)."""
  cfg = DataConfig(source='text', paths=str(tmp_path / 'none.txt'), loss_on='answers')
  with pytest.raises(DataError, match='data.loss_on=answers with data.source=text.*'
                                      'loss_on=all'):
    pipeline.build(cfg, seq_len=16, batch_size=2, vocab_size=300)


class _ClearedByAnotherThread(dict):
  """A cache that another thread empties right after each of this thread's operations."""

  def __contains__(self, key):
    found = super().__contains__(key)
    self.clear()
    return found

  def get(self, key, default=None):
    value = super().get(key, default)
    self.clear()
    return value

  def __setitem__(self, key, value):
    super().__setitem__(key, value)
    self.clear()


def test_curriculum_order_survives_a_cache_cleared_between_its_steps():
  """Curriculum._order keeps the permutation it computed even when the shared cache is
  cleared between its check, its store and its return (grain reads on many threads)."""
  stage = pipeline.Windows(np.arange(41, dtype=np.int32), np.zeros(41, np.int32), 4)
  cur = pipeline.Curriculum([stage], per_stage=5, seed=3)
  want = [cur[n]['inputs'] for n in range(25)]  # 10 windows: 2 passes and a half
  cur._perm = _ClearedByAnotherThread()  # pylint: disable=protected-access
  for n in range(25):
    np.testing.assert_array_equal(cur[n]['inputs'], want[n])
  rng = np.random.default_rng([3, 0, 1])  # the second pass's order, as documented
  assert [int(cur[10 + m]['inputs'][0]) // 4 for m in range(10)] == rng.permutation(10).tolist()


def test_windows_are_exactly_the_full_windows_at_every_stream_length():
  """len(Windows) is the number of full L+1-token windows at stride L (brute force over
  every stream length, including N = k*L where the last stride has no next token), and
  every window it admits has L inputs and their L next tokens."""
  for seq_len in (1, 3, 4, 7):
    for n in range(0, 4 * seq_len + 3):
      stream = np.arange(100, 100 + n, dtype=np.int32)
      w = pipeline.Windows(stream, np.zeros(n, np.int32), seq_len)
      full = [i for i in range(n) if i * seq_len + seq_len + 1 <= n]  # brute force
      assert len(w) == len(full), (seq_len, n)
      for i in range(len(w)):
        row = w[i]
        assert row['inputs'].shape == row['targets'].shape == (seq_len,), (seq_len, n, i)
        np.testing.assert_array_equal(row['targets'], row['inputs'] + 1)
      with pytest.raises(IndexError):
        w[len(w)]


def _counting_windows(first: int, n: int, seq_len: int = 4) -> pipeline.Windows:
  """n windows over the stream first, first + 1, ...: window i's first input is first + i*L."""
  stream = np.arange(first, first + n * seq_len + 1, dtype=np.int32)
  return pipeline.Windows(stream, np.zeros_like(stream), seq_len)


def test_hosts_training_rows_make_up_the_one_host_batches():
  """Host i's rows of training batch k are rows [i*B, (i+1)*B) of batch k of the one-host
  stream in batches of B * hosts, across epochs: the stream does not depend on the hosts."""
  w = _counting_windows(0, 50)
  one = pipeline.train_dataset(w, 6, seed=3)
  hosts = [pipeline.train_dataset(w, 2, seed=3, shard_index=i, shard_count=3) for i in range(3)]
  for k in range(20):  # 120 windows: past the first two epochs of 50
    np.testing.assert_array_equal(np.concatenate([h[k]['inputs'] for h in hosts]),
                                  one[k]['inputs'])


def test_curriculum_reads_each_stage_in_whole_passes_from_its_first_window():
  """Window n comes from stage min(n // per_stage, last), and each stage's reads, from its
  own first, are whole shuffled passes: every `size` consecutive reads of a stage are a
  permutation of its windows (per_stage a multiple of no stage's size)."""
  sizes, per_stage, seed = (3, 5, 4), 7, 2
  stages = [_counting_windows(1000 * j, size) for j, size in enumerate(sizes)]
  cur = pipeline.Curriculum(stages, per_stage=per_stage, seed=seed)
  n_all = 2 * per_stage + 5 * sizes[-1]
  read = [divmod(int(cur[n]['inputs'][0]), 1000) for n in range(n_all)]  # (stage, 4 * window)
  assert [j for j, _ in read] == [min(n // per_stage, 2) for n in range(n_all)]
  for j, size in enumerate(sizes):
    windows = [x // 4 for s, x in read if s == j]
    passes = [sorted(windows[a:a + size]) for a in range(0, len(windows) - size + 1, size)]
    assert passes and all(p == list(range(size)) for p in passes), (j, windows)


def test_more_hosts_than_training_windows_are_refused():
  """Every host needs a training window: a shard count above the windows is refused."""
  n = synth_data().stats['train_windows']
  with pytest.raises(DataError, match=f'{n} training windows for {n + 1} hosts'):
    synth_data(shard_count=n + 1)
  assert synth_data(shard_count=n, shard_index=n - 1).stats['train_windows'] == n
