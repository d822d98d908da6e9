"""Tests of prepare_data (shards.py): streaming shards, the index, resume and errors."""

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from elastic_depth.data.tokenizer import tokenizer_info
from elastic_depth.config import DataConfig
from elastic_depth.data import shards, sources, tokenizer as tokenizer_lib
from elastic_depth.data.errors import DataError

REPO = pathlib.Path(__file__).resolve().parents[1]
WORDS = ('the cat sat on a mat while seven dogs ran far away from home and '
         'every bird sang loud songs in green trees').split()


def write_corpus(path: pathlib.Path, n_docs: int, seed: int = 0) -> pathlib.Path:
  """A jsonl file of n_docs documents of 1..80 random words."""
  rng = np.random.default_rng(seed)
  with open(path, 'w', encoding='utf-8') as f:
    for _ in range(n_docs):
      words = rng.choice(WORDS, size=rng.integers(1, 80))
      f.write(json.dumps({'text': ' '.join(words)}) + '\n')
  return path


def text_cfg(paths, **kw) -> DataConfig:
  return DataConfig(**{'source': 'text', 'paths': str(paths), 'tokenizer': 'train',
                       'val_fraction': 0.1, **kw})


def prepare(cfg, out, **kw):
  kw = {'vocab_size': 300, 'shard_tokens': 2000, 'batch_docs': 64, 'quiet': True, **kw}
  return shards.prepare(cfg, out, **kw)


def shard_bytes(out: pathlib.Path) -> dict:
  return {p.name: p.read_bytes() for p in sorted(out.glob('*.bin'))}


def test_shards_hold_every_document_then_eos_in_order(tmp_path):
  corpus = write_corpus(tmp_path / 'c.jsonl', 300)
  index = prepare(text_cfg(corpus), tmp_path / 'out')
  tok = tokenizer_lib.get(str(tmp_path / 'out' / 'tokenizer.json'), [], 300)
  docs = list(sources.iter_files(str(corpus), DataConfig()))
  held = shards.is_val(0, np.arange(len(docs)), 0.1)
  assert 10 < held.sum() < 60  # about val_fraction of the documents
  for split, want_val in (('train', False), ('val', True)):
    ref = [t for d, v in zip(docs, held) if v == want_val
           for t in tok.encode_batch([d])[0].tolist() + [tok.eos_id]]
    entry = index['splits'][split]
    got = np.concatenate([np.fromfile(tmp_path / 'out' / s['file'], '<u2')
                          for s in entry['shards']])
    assert got.tolist() == ref
    assert entry['docs'] == sum(s['docs'] for s in entry['shards']) == (held == want_val).sum()
    sizes = [s['tokens'] for s in entry['shards']]
    assert set(sizes[:-1]) == {index['shard_tokens'][split]} and 0 < sizes[-1]
    # docs per shard = documents whose EOS lies in that shard
    ends = np.cumsum([s['tokens'] for s in entry['shards']])
    eos_at = np.flatnonzero(got == tok.eos_id)
    assert [s['docs'] for s in entry['shards']] == np.diff(
        np.searchsorted(eos_at, ends), prepend=0).tolist()
  assert index['complete'] and index['dtype'] == 'uint16'
  assert index['tokenizer']['fingerprint'] == tokenizer_info(tok)['fingerprint']


def test_a_special_token_string_in_a_document_is_text_in_the_shards(tmp_path):
  """Documents holding '<|endoftext|>' as text: each split's shards hold one EOS per
  document, and cut at the EOS ids they decode to that split's documents in order."""
  rows = [f'doc {i} holds <|endoftext|> inside' if i % 2 else f'doc {i} is plain'
          for i in range(120)]
  corpus = tmp_path / 'c.jsonl'
  corpus.write_text(''.join(json.dumps({'text': d}) + '\n' for d in rows), encoding='utf-8')
  index = prepare(text_cfg(corpus), tmp_path / 'out')
  tok = tokenizer_lib.get(str(tmp_path / 'out' / 'tokenizer.json'), [], 300)
  held = shards.is_val(0, np.arange(len(rows)), 0.1)
  for split, want_val in (('train', False), ('val', True)):
    want = [d for d, v in zip(rows, held) if v == want_val]
    got = np.concatenate([np.fromfile(tmp_path / 'out' / s['file'], '<u2')
                          for s in index['splits'][split]['shards']])
    ends = np.flatnonzero(got == tok.eos_id)
    assert index['splits'][split]['docs'] == len(ends) == len(want) > 0
    assert [tok.decode(p[:-1]) for p in np.split(got, ends[:-1] + 1)] == want


def test_hf_stream_is_prepared_whole(tmp_path, monkeypatch):
  rows = [{'text': f' row {i} '} for i in range(300)] + [{'text': '  '}]
  monkeypatch.setitem(sys.modules, 'datasets', types.SimpleNamespace(
      load_dataset=lambda name, config, split, streaming: iter(rows)))
  monkeypatch.setattr(sources, 'hub_reachable', lambda: True)
  index = prepare(DataConfig(source='hf', hf_name='a/b', tokenizer='train'), tmp_path / 'hf')
  assert index['origin'] == 'hf:a/b'
  assert index['splits']['train']['docs'] + index['splits']['val']['docs'] == 300


def test_tfds_splits_are_kept(tmp_path, tiny_tfds):
  cfg = DataConfig(source='tfds', tfds_name=tiny_tfds[0], tfds_data_dir=tiny_tfds[1],
                   tokenizer='train')
  index = prepare(cfg, tmp_path / 'out', shard_tokens=50)
  tok = tokenizer_lib.get(str(tmp_path / 'out' / 'tokenizer.json'), [], 300)
  for split, prefix, n in (('train', 't', 12), ('val', 'v', 3)):
    ids = np.concatenate([np.fromfile(tmp_path / 'out' / s['file'], '<u2')
                          for s in index['splits'][split]['shards']])
    docs = [d for d in tok.decode(ids).split(tokenizer_lib.EOS) if d]
    assert sorted(docs) == sorted(f'{prefix} story {i}' for i in range(n))  # tfds order


def test_split_is_seeded_and_stable():
  idx = np.arange(100_000)
  a, b = shards.is_val(0, idx, 0.05), shards.is_val(1, idx, 0.05)
  assert abs(a.mean() - 0.05) < 0.005 and (a != b).any()
  assert (shards.is_val(0, idx[500:900], 0.05) == a[500:900]).all()  # batch-independent
  assert shards.dtype_for(65536) == 'uint16' and shards.dtype_for(65537) == 'uint32'


@pytest.mark.parametrize('crash_after', [1, 4, 9, -1, 0])
def test_crash_between_shard_and_index_then_rerun_is_byte_identical(tmp_path, monkeypatch,
                                                                     crash_after):
  corpus = write_corpus(tmp_path / 'c.jsonl', 400)
  ref = prepare(text_cfg(corpus), tmp_path / 'ref')
  n_shards = sum(len(ref['splits'][s]['shards']) for s in shards.SPLITS)
  if crash_after <= 0:  # -1: during the final flush (tails), 0: the last shard's commit
    crash_after += n_shards
  real, calls = shards.Writer.commit, []

  def crashing_commit(self, complete=False):
    calls.append(1)
    if len(calls) == crash_after:  # the shard is renamed, its index entry not yet written
      raise KeyboardInterrupt
    real(self, complete)

  monkeypatch.setattr(shards.Writer, 'commit', crashing_commit)
  with pytest.raises(KeyboardInterrupt):
    prepare(text_cfg(corpus), tmp_path / 'out')
  monkeypatch.setattr(shards.Writer, 'commit', real)
  partial = json.loads((tmp_path / 'out' / 'index.json').read_text())
  assert not partial['complete']
  other_tok = tmp_path / 'other.json'
  tokenizer_lib.get('train', ['zz yy xx ww'] * 10, 290).save(other_tok)
  with pytest.raises(DataError, match=r'other settings \(tokenizer.fingerprint'):
    prepare(text_cfg(corpus, tokenizer=str(other_tok)), tmp_path / 'out')
  prepare(text_cfg(corpus), tmp_path / 'out', resume=True)
  assert shard_bytes(tmp_path / 'out') == shard_bytes(tmp_path / 'ref')
  ref_index = json.loads((tmp_path / 'ref' / 'index.json').read_text())
  assert json.loads((tmp_path / 'out' / 'index.json').read_text()) == ref_index


def test_sigkill_subprocess_then_rerun_is_byte_identical(tmp_path):
  corpus = write_corpus(tmp_path / 'c.jsonl', 6000)
  args = ['--config.data.source=text', f'--config.data.paths={corpus}',
          '--config.data.val_fraction=0.1', '--config.model.vocab_size=300',
          '--shard_tokens=2000', '--batch_docs=16', '--quiet']
  out = tmp_path / 'out'
  env = {**os.environ, 'PYTHONPATH': str(REPO)}
  proc = subprocess.Popen([sys.executable, '-m', 'experiments.prepare_data', f'--out={out}',
                           *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
  deadline = time.time() + 120
  while time.time() < deadline and proc.poll() is None:
    index = shards.read_index(out) if (out / 'index.json').is_file() else None
    if index and len(index['splits']['train']['shards']) >= 3:
      break
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  partial = shards.read_index(out)
  assert proc.returncode == -signal.SIGKILL and not partial['complete'], 'killed too late'
  conflict = subprocess.run([sys.executable, '-m', 'experiments.prepare_data', f'--out={out}',
                             *args, '--config.data.seed=3'], cwd=REPO, env=env,
                            capture_output=True, text=True)
  assert conflict.returncode == 2
  assert conflict.stderr.strip().splitlines()[-1].startswith(
      f'error: {out} was prepared with other settings (source.seed')
  cfg = text_cfg(corpus)
  prepare(cfg, out, batch_docs=16)  # the rerun (in-process: it saves a process start)
  prepare(cfg, tmp_path / 'ref', batch_docs=16)
  assert shard_bytes(out) == shard_bytes(tmp_path / 'ref')
  assert not list(out.glob('.*.tmp'))


def test_rerun_of_complete_dir_does_nothing_and_other_settings_are_refused(tmp_path):
  corpus = write_corpus(tmp_path / 'c.jsonl', 100)
  out = tmp_path / 'out'
  prepare(text_cfg(corpus), out)
  before = shard_bytes(out)
  prepare(text_cfg(corpus), out)
  assert shard_bytes(out) == before
  other_tok = tmp_path / 'other.json'
  tokenizer_lib.get('train', ['zz yy xx ww'] * 10, 290).save(other_tok)
  with pytest.raises(DataError, match=r'other settings \(tokenizer.fingerprint.*never mixed'):
    prepare(text_cfg(corpus, tokenizer=str(other_tok)), out)
  with pytest.raises(DataError, match=r'source.seed.*never mixed'):
    prepare(text_cfg(corpus, seed=3), out)
  with pytest.raises(DataError, match='shard_tokens'):
    prepare(text_cfg(corpus), out, shard_tokens=999)
  assert shard_bytes(out) == before


def test_synthetic_ops_are_part_of_the_settings_and_older_indexes_read_the_default(tmp_path):
  """synth_num_ops changes every program: a directory prepared with 4 ops refuses 2; an
  index written before the field was recorded counts as the default (4 ops)."""
  syn = lambda **kw: DataConfig(source='synthetic', synth_task='chain', synth_examples=60,
                                val_fraction=0.1, **kw)
  out = tmp_path / 'syn'
  prepare(syn(), out)
  with pytest.raises(DataError, match=r'source.synth_num_ops.*never mixed'):
    prepare(syn(synth_num_ops=2), out)
  index = json.loads((out / shards.INDEX).read_text())
  del index['source']['synth_num_ops']  # as an older prepare_data wrote it
  (out / shards.INDEX).write_text(json.dumps(index))
  before = shard_bytes(out)
  prepare(syn(), out)  # complete, same settings: nothing to do
  assert shard_bytes(out) == before
  with pytest.raises(DataError, match=r'source.synth_num_ops'):
    prepare(syn(synth_num_ops=2), out)


def test_validation_files_are_never_training_files(tmp_path, make_config):
  """data.paths (a directory or glob) that also names a data.val_paths file is refused
  where a run trains (pretraining, prepare_data); scoring a frozen model may name one file
  twice (its data.paths are not trained on)."""
  from elastic_depth import train  # pylint: disable=g-import-not-at-top
  (tmp_path / 'd').mkdir()
  write_corpus(tmp_path / 'd' / 'train.jsonl', 30)
  val = write_corpus(tmp_path / 'd' / 'val.jsonl', 10, seed=1)
  for paths in (tmp_path / 'd', f'{tmp_path}/d/*.jsonl'):
    cfg = text_cfg(paths, val_paths=str(val))
    with pytest.raises(DataError, match=r'share 1 file\(s\) \(.*val.jsonl\).*trained on'):
      train._build_data_here(dataclasses.replace(make_config(), data=cfg), str(tmp_path / "wd"))
    with pytest.raises(DataError, match='share 1 file'):
      prepare(cfg, tmp_path / 'out')
  assert len(sources.load_text(text_cfg(val, val_paths=str(val))).val) == 10


def test_errors(tmp_path, monkeypatch):
  (tmp_path / 'empty.jsonl').write_text('\n', encoding='utf-8')
  (tmp_path / 'bad.txt').write_bytes(b'fine<|endoftext|>bad \xff byte')
  corpus = write_corpus(tmp_path / 'c.jsonl', 20)
  cases = [
      (text_cfg(tmp_path / 'empty.jsonl'), 'empty corpus'),
      (text_cfg(tmp_path / 'bad.txt', tokenizer=str(tmp_path / 'tok.json')),
       r'bad\.txt: not valid UTF-8 at byte offset 21'),
      (text_cfg(corpus, source='tokens'), 'already token ids'),
      (text_cfg(tmp_path / 'nope.jsonl'), 'no such file'),
      (DataConfig(source='hf', hf_name='a/b'), 'optional `datasets` package'),
      (text_cfg(corpus, loss_on='answers'), 'data.loss_on=answers: prepared shards hold '
                                            'token ids only.*data.source=tokens'),
  ]
  tokenizer_lib.get('train', ['fine bad byte'] * 10, 290).save(tmp_path / 'tok.json')
  monkeypatch.setitem(sys.modules, 'datasets', None)
  for i, (cfg, match) in enumerate(cases):
    with pytest.raises(DataError, match=match):
      prepare(cfg, tmp_path / f'out{i}')
  monkeypatch.setitem(sys.modules, 'datasets', object())
  monkeypatch.setattr(sources, 'hub_reachable', lambda: False)
  with pytest.raises(DataError, match='unreachable'):
    prepare(DataConfig(source='hf', hf_name='a/b'), tmp_path / 'hf')
  with pytest.raises(DataError, match=r'larger than model.vocab_size=100'):
    prepare(text_cfg(corpus, tokenizer=str(tmp_path / 'tok.json')), tmp_path / 'v',
            vocab_size=100)
  (tmp_path / 'busy').mkdir()
  (tmp_path / 'busy' / 'notes.txt').write_text('x')
  with pytest.raises(DataError, match='non-empty directory without index.json'):
    prepare(text_cfg(corpus), tmp_path / 'busy')
  with pytest.raises(DataError, match='--resume: .* holds no index.json'):
    prepare(text_cfg(corpus), tmp_path / 'fresh', resume=True)
  with pytest.raises(DataError, match='no val document among 3.*new --out'):
    prepare(text_cfg(corpus, max_docs=3), tmp_path / 'few')
  (tmp_path / 'a_file').write_text('keep me')
  with pytest.raises(DataError, match='is a file'):
    prepare(text_cfg(corpus), tmp_path / 'a_file')
  assert (tmp_path / 'a_file').read_text() == 'keep me'


def test_train_bpe_learns_from_training_documents_only(tmp_path, monkeypatch):
  """--tokenizer=train on a hash-split corpus: the BPE sample is the documents the split
  keeps for training, in order, none of the held-out (validation) ones."""
  corpus = write_corpus(tmp_path / 'c.jsonl', 120)
  docs = [json.loads(line)['text'] for line in open(corpus, encoding='utf-8')]
  seen, real = [], tokenizer_lib.get
  monkeypatch.setattr(tokenizer_lib, 'get', lambda spec, d, v, *a, **kw: (
      seen.append(list(d)), real(spec, d, v, *a, **kw))[1])
  cfg = text_cfg(corpus, val_fraction=0.2)
  prepare(cfg, tmp_path / 'out')
  held = shards.is_val(cfg.seed, np.arange(len(docs)), 0.2)
  assert 10 < held.sum() < 40
  assert seen[0] == [d for d, v in zip(docs, held) if not v]


def test_prepare_refuses_loss_on_answers_before_writing_anything(tmp_path):
  """Prepared shards hold token ids only: data.loss_on=answers has no labels to use there,
  even for the synthetic source that has them, so prepare refuses it up front."""
  corpus = write_corpus(tmp_path / 'c.jsonl', 20)
  for cfg in (text_cfg(corpus, loss_on='answers'), DataConfig(loss_on='answers')):
    with pytest.raises(DataError, match='data.loss_on=answers: prepared shards hold token ids'):
      prepare(cfg, tmp_path / 'out')
    assert not (tmp_path / 'out').exists()


def test_validation_shards_hold_twice_val_fraction_of_a_training_shard(tmp_path):
  """shard_tokens is a training shard; a validation shard holds 2 * val_fraction of it (at
  most as much): every validation shard but the last has that size."""
  corpus = write_corpus(tmp_path / 'c.jsonl', 300)
  for frac, val_shard in ((0.1, 400), (0.7, 2000)):  # 2 * 0.1 * 2000; min(1.4, 1) * 2000
    index = prepare(text_cfg(corpus, val_fraction=frac), tmp_path / f'out{frac}')
    assert index['shard_tokens'] == {'train': 2000, 'val': val_shard}
    sizes = [s['tokens'] for s in index['splits']['val']['shards']]
    assert len(sizes) > 1 and set(sizes[:-1]) == {val_shard}


def test_prepare_data_summary_counts_what_the_shards_hold(tmp_path, main_cases):
  """The main's last line gives, per split, the documents (EOS tokens), tokens (uint16 ids)
  and shard files written; --batch_docs=0 is one line, exit 2, before any work."""
  corpus = write_corpus(tmp_path / 'c.jsonl', 300)
  out = tmp_path / 'out'
  args = ['--config.data.source=text', f'--config.data.paths={corpus}',
          '--config.data.val_fraction=0.1', '--config.model.vocab_size=300',
          '--shard_tokens=2000', '--quiet']
  ok, bad = main_cases('experiments.prepare_data', [[f'--out={out}', *args],
                                                    ['--out={tmp}/x', *args, '--batch_docs=0']])
  assert ok['rc'] == 0, ok['stderr'][-3000:]
  eos = tokenizer_lib.get(str(out / 'tokenizer.json'), [], 300).eos_id
  got = {s: tuple(map(int, n)) for s, *n in
         re.findall(r'(\w+) (\d+) docs (\d+) tokens (\d+) shards', ok['stdout'])}
  for split in ('train', 'val'):
    files = sorted(out.glob(f'{split}-*.bin'))
    ids = np.concatenate([np.fromfile(f, '<u2') for f in files])
    assert got[split] == (int((ids == eos).sum()), ids.size, len(files)), split
  assert sum(d for d, _, _ in got.values()) == 300 and got['train'][2] > 1
  assert bad['rc'] == 2 and bad['stderr'].startswith('error: --batch_docs'), bad['stderr']
  assert bad['files'] == []
