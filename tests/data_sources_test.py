"""Tests of the document sources (text files, hf, tfds) and their errors."""

import json
import pathlib
import sys
import time
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_depth.config import DataConfig
from elastic_depth.data import sources
from elastic_depth.data.errors import DataError

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / 'shared' / 'data'
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f'{SHARED} absent')


def text_cfg(paths, **kw):
  return DataConfig(source='text', paths=str(paths), **kw)


@needs_shared
def test_tinystories_txt():
  corpus = sources.load(text_cfg(SHARED / 'tinystories' / 'TinyStories-valid.first1000.txt',
                                 max_docs=200, val_fraction=0.1))
  assert len(corpus.train) == 180 and len(corpus.val) == 20
  assert corpus.train[0].startswith('Spot. Spot saw the shiny car')
  assert all('<|endoftext|>' not in d and d == d.strip() and d for d in corpus.train)


@needs_shared
def test_fineweb_jsonl_glob():
  files = sorted((SHARED / 'fineweb_edu').glob('*.jsonl'))
  first = json.loads(files[0].read_text(encoding='utf-8').splitlines()[0])['text'].strip()
  corpus = sources.load(text_cfg(SHARED / 'fineweb_edu' / '*.part0.jsonl', max_docs=40))
  assert len(corpus.train) + len(corpus.val) == 40
  assert first in corpus.train + corpus.val


def test_txt_jsonl_parquet_list_and_split(tmp_path):
  (tmp_path / 'a.txt').write_text('one\n<|endoftext|>\n  \n<|endoftext|>two  ', encoding='utf-8')
  (tmp_path / 'b.jsonl').write_text(
      '{"text": "three"}\n\n{"text": "four", "x": 1}\n', encoding='utf-8')
  pq.write_table(pa.table({'body': ['five', None, 'six'], 'n': [1, 2, 3]}),
                 tmp_path / 'c.parquet')
  pq.write_table(pa.table({'text': ['five', 'six']}), tmp_path / 'd.parquet')
  cfg = text_cfg(f'{tmp_path}/a.txt, {tmp_path}/b.jsonl,{tmp_path}/d.parquet',
                 val_fraction=0.34, seed=5)
  corpus = sources.load(cfg)
  assert sorted(corpus.train + corpus.val) == sorted(['one', 'two', 'three', 'four', 'five',
                                                       'six'])
  assert len(corpus.val) == 2 and not set(corpus.train) & set(corpus.val)
  assert sources.load(cfg) == corpus
  assert sources.read_documents(str(tmp_path / 'c.parquet'),
                                DataConfig(text_field='body')) == ['five', 'six']


@pytest.mark.parametrize('chunk', [1, 3, 7, 1 << 22])
def test_txt_streamed_in_chunks_equals_split(tmp_path, monkeypatch, chunk):
  text = ('héllo wörld<|endoftext|>\n  <|endoftext|>ünïcode 🙂 doc<|endoftext|>'
          '<|endoftext|>last')
  (tmp_path / 'a.txt').write_text(text, encoding='utf-8')
  monkeypatch.setattr(sources, 'CHUNK_BYTES', chunk)
  want = [d.strip() for d in text.split('<|endoftext|>') if d.strip()]
  assert sources.read_documents(str(tmp_path / 'a.txt'), DataConfig()) == want
  bad = text.encode('utf-8') + b'<|endoftext|>ok \xfe'
  (tmp_path / 'b.txt').write_bytes(bad)
  with pytest.raises(DataError, match=f'at byte offset {len(bad) - 1} \\(byte 0xfe\\)'):
    sources.read_documents(str(tmp_path / 'b.txt'), DataConfig())


def test_val_paths_and_directory(tmp_path):
  (tmp_path / 'train').mkdir()
  (tmp_path / 'train' / 'x.txt').write_text('a<|endoftext|>b<|endoftext|>c', encoding='utf-8')
  (tmp_path / 'v.txt').write_text('z', encoding='utf-8')
  corpus = sources.load(text_cfg(tmp_path / 'train', val_paths=str(tmp_path / 'v.txt')))
  assert corpus.train == ['a', 'b', 'c'] and corpus.val == ['z']


def test_split_deterministic_and_seeded():
  docs = [f'doc {i}' for i in range(100)]
  a = sources.holdout_split(docs, DataConfig(seed=0), 'x')
  b = sources.holdout_split(docs, DataConfig(seed=0), 'x')
  c = sources.holdout_split(docs, DataConfig(seed=1), 'x')
  assert a == b and a.val != c.val and len(a.val) == 5
  assert sorted(a.train + a.val) == sorted(docs)


@pytest.mark.parametrize('name,content,match', [
    ('empty.txt', b' \n<|endoftext|>\n ', 'empty corpus'),
    ('bad.txt', b'hello \xff world', r'bad\.txt: not valid UTF-8 at byte offset 6'),
    ('bad.jsonl', b'{"text": "a"}\n{"body": "b"}\n', r'bad\.jsonl:2: no string field'),
    ('bad2.jsonl', b'{"text": ', r'bad2\.jsonl:1: invalid JSON'),
    ('x.csv', b'a,b', 'unsupported file type'),
    ('one.txt', b'only one document', 'at least 2'),
])
def test_file_errors(tmp_path, name, content, match):
  (tmp_path / name).write_bytes(content)
  with pytest.raises(DataError, match=match):
    sources.load(text_cfg(tmp_path / name))


def test_parquet_errors(tmp_path):
  pq.write_table(pa.table({'body': ['a']}), tmp_path / 'p.parquet')
  with pytest.raises(DataError, match=r"no column 'text'.*\['body'\]"):
    sources.load(text_cfg(tmp_path / 'p.parquet'))
  (tmp_path / 'q.parquet').write_bytes(b'not parquet')
  with pytest.raises(DataError, match='not a readable parquet'):
    sources.load(text_cfg(tmp_path / 'q.parquet'))


def test_missing_paths(tmp_path):
  with pytest.raises(DataError, match='no such file'):
    sources.load(text_cfg(tmp_path / 'nope.txt'))
  with pytest.raises(DataError, match='matches no file'):
    sources.load(text_cfg(tmp_path / '*.jsonl'))
  with pytest.raises(DataError, match='needs --config.data.paths'):
    sources.load(DataConfig(source='text'))
  with pytest.raises(DataError, match="data.source='csv' not in"):
    sources.load(DataConfig(source='csv'))


def test_hf_without_datasets_package(monkeypatch):
  monkeypatch.setitem(sys.modules, 'datasets', None)
  with pytest.raises(DataError, match='pip install datasets'):
    sources.load(DataConfig(source='hf', hf_name='HuggingFaceFW/fineweb-edu'))


def fake_datasets(rows=None, error=None):
  def load_dataset(name, config, split, streaming):
    assert split == 'train' and streaming
    if error:
      raise error
    return iter(rows)
  return types.SimpleNamespace(load_dataset=load_dataset)


def test_hf_offline(monkeypatch):
  monkeypatch.setitem(sys.modules, 'datasets', fake_datasets([]))
  monkeypatch.setattr(sources, 'hub_reachable', lambda: False)
  with pytest.raises(DataError, match='unreachable.*--config.data.source=text'):
    sources.load(DataConfig(source='hf', hf_name='a/b'))
  monkeypatch.setattr(sources, 'hub_reachable', lambda: True)
  monkeypatch.setitem(sys.modules, 'datasets', fake_datasets(error=ConnectionError('dns')))
  with pytest.raises(DataError, match='ConnectionError: dns.*unreachable'):
    sources.load(DataConfig(source='hf', hf_name='a/b'))


def test_hub_probe_fails_fast_offline(monkeypatch):
  monkeypatch.setenv('HF_ENDPOINT', 'http://127.0.0.1:9')
  start = time.time()
  assert not sources.hub_reachable()
  assert time.time() - start < 5


def test_hf_streams_rows(monkeypatch):
  rows = [{'text': f' doc {i} '} for i in range(30)] + [{'text': 'never read'}]
  monkeypatch.setitem(sys.modules, 'datasets', fake_datasets(rows))
  monkeypatch.setattr(sources, 'hub_reachable', lambda: True)
  corpus = sources.load(DataConfig(source='hf', hf_name='a/b', max_docs=30, val_fraction=0.1))
  assert sorted(corpus.train + corpus.val) == sorted(f'doc {i}' for i in range(30))
  assert len(corpus.val) == 3
  monkeypatch.setitem(sys.modules, 'datasets', fake_datasets([{'body': 'x'}]))
  with pytest.raises(DataError, match="no field 'text'"):
    sources.load(DataConfig(source='hf', hf_name='a/b'))


def test_hf_max_docs_0_reads_every_document(monkeypatch):
  n = 50_001  # one more than the silent cap (STREAM_DEFAULT_DOCS) there used to be
  monkeypatch.setitem(sys.modules, 'datasets', fake_datasets([{'text': 'd'}] * n))
  monkeypatch.setattr(sources, 'hub_reachable', lambda: True)
  corpus = sources.load(DataConfig(source='hf', hf_name='a/b'))
  assert len(corpus.train) + len(corpus.val) == n
  corpus = sources.load(DataConfig(source='hf', hf_name='a/b', max_docs=7))
  assert len(corpus.train) + len(corpus.val) == 7


def test_tfds_not_prepared(tmp_path):
  cfg = DataConfig(source='tfds', tfds_name='tiny_shakespeare')
  cfg.tfds_data_dir = str(tmp_path)  # keyword default until DataConfig has the field
  start = time.time()
  with pytest.raises(DataError, match='not prepared.*never downloads.*unreachable'):
    sources.load(cfg)
  assert time.time() - start < 10
  with pytest.raises(DataError, match='needs --config.data.tfds_name'):
    sources.load(DataConfig(source='tfds'))


def test_tfds_local_array_record(tiny_tfds):
  cfg = DataConfig(source='tfds', tfds_name=tiny_tfds[0], tfds_data_dir=tiny_tfds[1])
  corpus = sources.load(cfg)
  assert sorted(corpus.train) == sorted(f't story {i}' for i in range(12))
  assert sorted(corpus.val) == sorted(f'v story {i}' for i in range(3))


def test_holdout_keeps_a_document_on_each_side_at_any_fraction():
  """round(n * val_fraction) documents are held out, clipped to [1, n - 1]: neither split
  is ever empty, and together they are the documents."""
  for n in (2, 3, 10, 41):
    docs = [f'doc {i}' for i in range(n)]
    for frac in (0.01, 0.2, 0.5, 0.9, 0.99):
      corpus = sources.holdout_split(docs, DataConfig(val_fraction=frac, seed=n), 'x')
      n_val = min(max(round(n * frac), 1), n - 1)
      assert (len(corpus.val), len(corpus.train)) == (n_val, n - n_val), (n, frac)
      assert sorted(corpus.train + corpus.val) == sorted(docs)


def test_a_glob_reads_the_files_it_matches_not_its_folders(tmp_path):
  (tmp_path / 'a.txt').write_text('one<|endoftext|>two', encoding='utf-8')
  (tmp_path / 'sub').mkdir()
  (tmp_path / 'sub' / 'b.txt').write_text('three', encoding='utf-8')
  assert sources.read_documents(f'{tmp_path}/*', DataConfig()) == ['one', 'two']


def test_a_shared_file_is_caught_under_another_name(tmp_path, monkeypatch):
  """check_disjoint compares files, not spellings: a training path given relative to the
  working directory, or a symlink to the validation file, is still the same file."""
  (tmp_path / 'd').mkdir()
  for name in ('a.txt', 'v.txt'):
    (tmp_path / 'd' / name).write_text(f'{name} text', encoding='utf-8')
  (tmp_path / 'link.txt').symlink_to(tmp_path / 'd' / 'v.txt')
  monkeypatch.chdir(tmp_path)
  for paths in ('d', 'd/*.txt', str(tmp_path / 'link.txt')):
    with pytest.raises(DataError, match='share 1 file'):
      sources.check_disjoint(paths, str(tmp_path / 'd' / 'v.txt'))
  sources.check_disjoint('d/a.txt', str(tmp_path / 'd' / 'v.txt'))  # disjoint: no error
