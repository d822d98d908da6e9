"""Tests of data.source=tokens (tokens.py): memory-mapped shards as training windows."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from conftest import nll_np
from elastic_depth import config as config_lib
from elastic_depth.config import DataConfig
from elastic_depth.data import pipeline, shards, tokens as tokens_lib, tokenizer as tokenizer_lib
from elastic_depth.data.errors import DataError

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / 'shared' / 'data'
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f'{SHARED} absent')
FINEWEB = sorted((SHARED / 'fineweb_edu').glob('*.jsonl'))


def rss_bytes() -> int:
  """Resident set size of this process (Linux)."""
  with open('/proc/self/statm', encoding='ascii') as f:
    return int(f.read().split()[1]) * 4096


def synth_prepared(out: pathlib.Path, **kw) -> DataConfig:
  """Synthetic programs prepared with a small trained BPE; returns the tokens DataConfig."""
  cfg = DataConfig(source='synthetic', synth_task='binding', synth_examples=300,
                   tokenizer='train', seed=0)
  shards.prepare(cfg, out, vocab_size=300, shard_tokens=kw.get('shard_tokens', 1500),
                 quiet=True)
  return DataConfig(source='tokens', paths=str(out), seed=kw.get('seed', 0))


@needs_shared
def test_same_windows_as_the_in_memory_text_source(tmp_path):
  text = DataConfig(source='text', paths=f'{FINEWEB[0]},{FINEWEB[1]}', val_paths=str(FINEWEB[2]),
                    tokenizer=str(SHARED / 'tokenizers' / 'gpt2'), max_docs=120)
  shards.prepare(text, tmp_path / 'fw', vocab_size=50257, shard_tokens=30_000, quiet=True)
  kw = dict(seq_len=64, batch_size=4, vocab_size=50257)
  ref = pipeline.build(text, **kw)
  got = pipeline.build(DataConfig(source='tokens', paths=str(tmp_path / 'fw')), **kw)
  assert len(got.train_windows.files) > 3  # windows cross shard boundaries
  for split in ('train_windows', 'val_windows'):
    a, b = getattr(ref, split), getattr(got, split)
    assert len(a) == len(b) > 100 and a.num_tokens == b.num_tokens
    for i in range(len(a)):
      for k, v in a[i].items():
        np.testing.assert_array_equal(b[i][k], v, err_msg=f'{split} {i} {k}')
  # max_docs caps each part: paths and val_paths
  assert (got.stats['train_docs'], got.stats['val_docs']) == (120, 120)
  for a, b in zip(ref.val_batches(3), got.val_batches(3)):
    assert all(np.array_equal(a[k], b[k]) for k in a)
  assert 'at most 120 documents per part' in got.describe()


def test_iterator_state_resumes_the_same_stream_and_hosts_are_disjoint(tmp_path):
  cfg = synth_prepared(tmp_path / 's')
  kw = dict(seq_len=16, batch_size=4, vocab_size=300)
  data = pipeline.build(cfg, workdir=tmp_path / 'wd', **kw)
  assert (tmp_path / 'wd' / 'tokenizer.json').read_bytes() == (
      tmp_path / 's' / 'tokenizer.json').read_bytes()
  n = len(data.train_windows)
  epoch = [next(data.train_iter) for _ in range(n // 4)]
  seen = np.concatenate([b['inputs'] for b in epoch])
  every = np.stack([data.train_windows[i]['inputs'] for i in range(n)])
  # one epoch draws every window once (up to the dropped remainder), in shuffled order
  assert len({r.tobytes() for r in seen}) == len(seen)
  assert {r.tobytes() for r in seen} <= {r.tobytes() for r in every}
  assert not np.array_equal(seen, every[:len(seen)])
  state = data.train_iter.get_state()
  after = [next(data.train_iter) for _ in range(5)]
  again = pipeline.batch_iterator(pipeline.build(cfg, **kw).train_ds)
  again.set_state(json.loads(json.dumps(state)))
  for a in after:
    b = next(again)
    assert all(np.array_equal(a[k], b[k]) for k in a)
  hosts = [pipeline.build(cfg, shard_index=i, shard_count=2, **kw) for i in range(2)]
  rows = [{r.tobytes() for _ in range(n // 8) for r in next(h.train_iter)['inputs']}
          for h in hosts]
  assert not rows[0] & rows[1] and len(rows[0] | rows[1]) == 2 * (n // 8) * 4


def test_two_billion_sparse_tokens_keep_rss_flat(tmp_path):
  out = tmp_path / 'big'
  out.mkdir()
  tok = tokenizer_lib.get('train', ['a b c d e f g'] * 20, 300)
  tok.save(out / 'tokenizer.json')
  sizes = {'train': [2**30, 2**30 + 12345], 'val': [1_000_000]}
  for split, ns in sizes.items():
    for k, n in enumerate(ns):
      with open(out / f'{split}-{k:05d}.bin', 'wb') as f:
        f.truncate(2 * n)  # sparse: no disk used; reads as token 0
  index = {'format': shards.FORMAT, 'complete': True, 'origin': 'sparse test',
           'source': {'max_docs': 0}, 'dtype': 'uint16',
           'tokenizer': {'file': 'tokenizer.json', **tokenizer_lib.tokenizer_info(tok)},
           'splits': {s: {'docs': 1, 'tokens': sum(ns), 'shards': [
               {'file': f'{s}-{k:05d}.bin', 'tokens': n, 'docs': 1} for k, n in enumerate(ns)]}
                      for s, ns in sizes.items()}}
  (out / 'index.json').write_text(json.dumps(index))
  before = rss_bytes()
  data = pipeline.build(DataConfig(source='tokens', paths=str(out)), seq_len=2048,
                        batch_size=16, vocab_size=300)
  assert data.train_windows.num_tokens > 2e9
  for _ in range(200):
    batch = next(data.train_iter)
  data.val_batches(2)
  assert batch['inputs'].shape == (16, 2048) and (batch['inputs'] == 0).all()
  grown = rss_bytes() - before
  assert grown < 200e6, f'RSS grew by {grown / 1e6:.0f} MB'
  for _ in range(800):  # flat: read pages are released (without it: +100 MB here)
    next(data.train_iter)
  more = rss_bytes() - before - grown
  assert more < 40e6, f'RSS grew by {more / 1e6:.0f} MB more over 800 batches'


def test_errors(tmp_path):
  kw = dict(seq_len=16, batch_size=4, vocab_size=300)
  with pytest.raises(DataError, match='needs --config.data.paths=DIR'):
    pipeline.build(DataConfig(source='tokens'), **kw)
  with pytest.raises(DataError, match='no such directory'):
    pipeline.build(DataConfig(source='tokens', paths=str(tmp_path / 'none')), **kw)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(DataError, match='has no index.json'):
    pipeline.build(DataConfig(source='tokens', paths=str(tmp_path / 'empty')), **kw)
  cfg = synth_prepared(tmp_path / 's')
  with pytest.raises(DataError, match=r'val split .* fewer than one sequence'):
    pipeline.build(cfg, **{**kw, 'seq_len': 2000})
  with pytest.raises(DataError, match='larger than model.vocab_size=200'):
    pipeline.build(cfg, **{**kw, 'vocab_size': 200})
  index_path = tmp_path / 's' / 'index.json'
  index = json.loads(index_path.read_text())
  index_path.write_text(json.dumps({**index, 'complete': False}))
  with pytest.raises(DataError, match='only partly prepared.*rerunning'):
    pipeline.build(cfg, **kw)
  index_path.write_text(json.dumps(index))
  with open(tmp_path / 's' / 'train-00000.bin', 'r+b') as f:
    f.truncate(10)
  with pytest.raises(DataError, match=r'train-00000.bin: 10 bytes, expected 1500 uint16'):
    pipeline.build(cfg, **kw)
  other = tokenizer_lib.get('train', ['x y z'] * 10, 280)
  other.save(tmp_path / 's' / 'tokenizer.json')
  with pytest.raises(DataError, match='not the tokenizer the shards were written with'):
    pipeline.build(cfg, **kw)


def test_loss_on_answers_is_refused_before_the_directory_is_read(tmp_path):
  """Prepared shards carry no difficulty labels: loss_on=answers (which would silently
  train on every token) is refused, naming both settings, before the shards are opened."""
  kw = dict(seq_len=16, batch_size=4, vocab_size=300)
  for paths in (str(tmp_path / 'none'), str(synth_prepared(tmp_path / 's').paths)):
    cfg = DataConfig(source='tokens', paths=paths, loss_on='answers')
    with pytest.raises(DataError, match='data.loss_on=answers with data.source=tokens.*'
                                        'prepared shards hold token ids only.*loss_on=all'):
      pipeline.build(cfg, **kw)
  assert pipeline.build(DataConfig(source='tokens', paths=paths), **kw).train_windows


def test_pretrain_trains_on_prepared_shards(tmp_path, make_config):
  from elastic_depth import train, train_step  # pylint: disable=g-import-not-at-top
  data = synth_prepared(tmp_path / 's')
  cfg = make_config(model=dict(vocab_size=300), train=dict(
      steps=2, eval_every=2, ckpt_every=2, log_every=1, eval_batches=1, seq_len=16,
      eval_depths=(1,)), depth=dict(buckets=(1,), r_max=1, mean=1.0, sigma=0.0))
  cfg = dataclasses.replace(cfg, data=data)
  config_lib.validate(cfg)
  summary = train.run(cfg, str(tmp_path / 'wd'), quiet=True)
  assert np.isfinite(list(summary['val_loss'].values())).all()
  saved = json.loads((tmp_path / 'wd' / 'config.json').read_text())
  assert saved['data']['source'] == 'tokens'
  assert (tmp_path / 'wd' / 'tokenizer.json').is_file()
  # the first step trained on the shards' first batch: its logged loss is an independent
  # forward of that batch (from the pipeline over the shards) with the initial weights
  import jax  # pylint: disable=g-import-not-at-top
  from elastic_depth import model as model_lib  # pylint: disable=g-import-not-at-top
  host = next(pipeline.build(data, seq_len=16, batch_size=cfg.train.batch_size,
                             vocab_size=300).train_iter)
  assert host['inputs'].max() >= 31  # BPE ids beyond the synthetic task's own 31
  graphdef, state = train_step.init_state(cfg, cfg.train.seed)
  mdl = model_lib.bind(graphdef, state.params)
  tokens = jax.numpy.asarray(host['inputs'])
  pos = model_lib.positions(tokens)
  e, _ = mdl.encode(tokens, pos)
  key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
      jax.random.key(cfg.train.seed), 0x1a17), 0), 0)  # step 0, micro-batch 0 (train_step_test)
  s, _ = mdl.core_step(mdl.initial_state(e, key, pos), mdl.inject(e), pos)
  nll = nll_np(mdl.logits(mdl.decode_state(s, pos)[0]), host['targets'])
  want = float((nll * host['mask']).sum() / host['mask'].sum())
  with open(tmp_path / 'wd' / 'metrics.jsonl', encoding='utf-8') as f:
    first = next(r for r in map(json.loads, f) if r.get('step') == 1 and 'train/loss' in r)
  assert first['train/loss'] == pytest.approx(want, rel=1e-5)


def test_shard_reads_equal_slices_of_the_concatenated_stream(tmp_path):
  """tokens(a, b) and difficulty(a, b) of ShardWindows are stream[a:b] (numpy slicing, stop
  clipped to the end) of the shards concatenated, for every a <= b, boundaries included."""
  rs = np.random.default_rng(0)
  parts = [rs.integers(0, 60000, n).astype('<u2') for n in (5, 1, 7, 3)]
  for k, p in enumerate(parts):
    p.tofile(tmp_path / f'train-{k:05d}.bin')
  w = tokens_lib.ShardWindows(tmp_path, [{'file': f'train-{k:05d}.bin', 'tokens': len(p)}
                                         for k, p in enumerate(parts)], 'uint16', 4)
  stream = np.concatenate(parts).astype(np.int32)
  assert w.num_tokens == len(stream) == 16 and len(w) == (16 - 1) // 4
  for a in range(len(stream) + 1):
    for b in range(a, len(stream) + 4):
      got = w.tokens(a, b)
      assert got.dtype == np.int32
      np.testing.assert_array_equal(got, stream[a:b], err_msg=f'{a}:{b}')
      np.testing.assert_array_equal(w.difficulty(a, b),
                                    np.full(len(stream[a:b]), pipeline.NO_DIFFICULTY))
  for i in range(len(w)):  # windows of seq_len + 1 tokens with stride seq_len
    np.testing.assert_array_equal(w[i]['inputs'], stream[4 * i:4 * i + 4])
    np.testing.assert_array_equal(w[i]['targets'], stream[4 * i + 1:4 * i + 5])


@pytest.mark.parametrize('extra', [-1, 1])
def test_a_shard_of_the_wrong_size_is_refused(tmp_path, extra):
  """A shard file one token shorter or longer than its index entry is damaged."""
  np.arange(5 + extra, dtype='<u2').tofile(tmp_path / 'train-00000.bin')
  with pytest.raises(DataError, match=rf'{2 * (5 + extra)} bytes, expected 5 uint16 tokens'):
    tokens_lib.ShardWindows(tmp_path, [{'file': 'train-00000.bin', 'tokens': 5}], 'uint16', 2)
  np.arange(5, dtype='<u2').tofile(tmp_path / 'train-00000.bin')
  assert tokens_lib.ShardWindows(tmp_path, [{'file': 'train-00000.bin', 'tokens': 5}], 'uint16',
                                 2).num_tokens == 5


def test_an_index_that_does_not_say_complete_is_refused(tmp_path):
  """Only an index with complete: true is read; one without the flag is not trusted."""
  index = {'format': shards.FORMAT, 'splits': {'train': {'shards': [{'file': 'x.bin'}]}}}
  for complete in ({}, {'complete': False}, {'complete': None}):
    (tmp_path / shards.INDEX).write_text(json.dumps({**index, **complete}))
    with pytest.raises(DataError, match=r'only partly prepared \(1 train shards\)'):
      tokens_lib.open_index(tmp_path)
  (tmp_path / shards.INDEX).write_text(json.dumps({**index, 'complete': True}))
  assert tokens_lib.open_index(tmp_path)['complete'] is True
