"""Tests of tokenizer training/loading and token classes."""

import json
import pathlib

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from elastic_depth.data import synthetic
from elastic_depth.data import tokenizer as tokenizer_lib
from elastic_depth.data.errors import DataError

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / 'shared' / 'data'
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f'{SHARED} absent')
GPT2 = SHARED / 'tokenizers' / 'gpt2'
DOCS = [f'The {w} cat number {i} sat on the mat, said "hello" {i * 7}.'
        for i in range(200) for w in ('big', 'small', 'red')]


def stories(n):
  text = (SHARED / 'tinystories' / 'TinyStories-valid.first1000.txt').read_text('utf-8')
  return [s.strip() for s in text.split('<|endoftext|>') if s.strip()][:n]


def test_train_saves_reuses_and_is_deterministic(tmp_path):
  tok = tokenizer_lib.get('train', DOCS, 400, tmp_path)
  assert tok.vocab_size <= 400 and tok.id_to_token(tok.eos_id) == '<|endoftext|>'
  assert (tmp_path / 'tokenizer.json').is_file()
  again = tokenizer_lib.get('train', ['other text entirely'], 400, tmp_path)
  assert again.tok.get_vocab() == tok.tok.get_vocab()
  fresh = tokenizer_lib.get('train', DOCS, 400, None)
  assert fresh.tok.get_vocab() == tok.tok.get_vocab()
  ids = tok.encode_batch(DOCS[:3])
  assert all(x.dtype == np.int32 and x.max() < tok.vocab_size for x in ids)
  assert [tok.decode(x) for x in ids] == DOCS[:3]
  literal = tok.encode_batch(['a<|endoftext|>b'])[0]  # text, not EOS (see below)
  assert tok.eos_id not in literal and tok.decode(literal) == 'a<|endoftext|>b'


@needs_shared
def test_train_on_tinystories(tmp_path):
  docs = stories(300)
  tok = tokenizer_lib.get('train', docs, 1024, tmp_path)
  assert tok.vocab_size == 1024
  ids = tok.encode_batch(docs[:20])
  assert [tok.decode(x) for x in ids] == docs[:20]
  assert sum(map(len, ids)) < 0.5 * sum(map(len, docs[:20]))
  loaded = tokenizer_lib.get(str(tmp_path / 'tokenizer.json'), [], 1024)
  assert loaded.encode_batch(docs[:1])[0].tolist() == ids[0].tolist()


@needs_shared
def test_gpt2_files():
  tok = tokenizer_lib.get(str(GPT2), [], 50304)
  assert tok.vocab_size == 50257 and tok.eos_id == 50256
  line = (SHARED / 'fineweb_edu' / 'fineweb-edu.sample-350BT.part0.jsonl').open().readline()
  doc = json.loads(line)['text'][:2000]
  ids = tok.encode_batch([doc, 'Hello world'])
  assert tok.decode(ids[0]) == doc
  assert ids[1].tolist() == [15496, 995]  # GPT-2 ids of 'Hello', ' world'
  # the literal is text: GPT-2's byte-level pieces of it, read from vocab.json
  vocab = json.loads((GPT2 / 'vocab.json').read_text('utf-8'))
  assert tok.encode_batch(['x<|endoftext|>'])[0].tolist() == [
      vocab[p] for p in ('x', '<', '|', 'end', 'of', 'text', '|', '>')]


@needs_shared
def test_vocab_larger_than_model():
  with pytest.raises(DataError, match=r'\(50257 tokens.*model.vocab_size=512'):
    tokenizer_lib.get(str(GPT2), [], 512)


def test_bpe_needs_byte_alphabet():
  with pytest.raises(DataError, match='at least 257 tokens but model.vocab_size=100'):
    tokenizer_lib.get('train', DOCS, 100)


def test_bad_paths(tmp_path):
  with pytest.raises(DataError, match='neither tokenizer.json'):
    tokenizer_lib.get(str(tmp_path), [], 512)
  (tmp_path / 'junk.json').write_text('{}')
  with pytest.raises(DataError, match='not a readable tokenizer.json'):
    tokenizer_lib.get(str(tmp_path / 'junk.json'), [], 512)


def test_hub_unreachable(monkeypatch, tmp_path):
  monkeypatch.setattr(tokenizer_lib.sources, 'hub_reachable', lambda: False)
  monkeypatch.setenv('HF_HUB_CACHE', str(tmp_path))
  with pytest.raises(DataError, match='unreachable.*--config.data.source=text'):
    tokenizer_lib.get('no-such-org/no-such-tokenizer', [], 512)


def test_classify():
  c = tokenizer_lib.classify
  assert c(' ') == c('\n\n') == tokenizer_lib.TokenClass.WHITESPACE
  assert c(',') == c(' "') == c('.') == tokenizer_lib.TokenClass.PUNCTUATION
  assert c(' 42') == c('7') == tokenizer_lib.TokenClass.NUMERAL
  assert c(' cat') == c("'s") == c('Lily') == tokenizer_lib.TokenClass.WORD
  assert c('\ufffd') == c('3rd') == c('') == tokenizer_lib.TokenClass.OTHER


def test_token_classes_cached_and_special():
  tok = tokenizer_lib.get('train', DOCS, 400)
  ids = tok.encode_batch(['The cat, 42 sat'])[0]
  classes = tokenizer_lib.token_classes(tok, ids[None])
  assert classes.shape == (1, len(ids)) and classes.dtype == np.int32
  names = [tokenizer_lib.TOKEN_CLASS_NAMES[k] for k in classes[0]]
  assert names[0] == 'word' and 'punctuation' in names and 'numeral' in names
  assert tokenizer_lib.class_table(tok) is tokenizer_lib.class_table(tok)
  assert tokenizer_lib.token_classes(tok, [tok.eos_id]) == [tokenizer_lib.TokenClass.OTHER]
  vocab = synthetic.SyntheticVocab(4)
  table = tokenizer_lib.class_table(vocab)
  assert [tokenizer_lib.TOKEN_CLASS_NAMES[k] for k in table[[0, 1, 5, 15]]] == [
      'other', 'punctuation', 'numeral', 'word']


def word_level(tmp_path, pre_tokenizer: str, vocab: dict) -> pathlib.Path:
  """tokenizer.json of a WordLevel model with '<|endoftext|>' as its special token 3."""
  path = tmp_path / 'tokenizer.json'
  path.write_text(json.dumps({
      'version': '1.0', 'truncation': None, 'padding': None, 'normalizer': None,
      'pre_tokenizer': {'type': pre_tokenizer}, 'post_processor': None, 'decoder': None,
      'added_tokens': [{'id': 3, 'content': '<|endoftext|>', 'single_word': False,
                        'lstrip': False, 'rstrip': False, 'normalized': False,
                        'special': True}],
      'model': {'type': 'WordLevel', 'vocab': vocab, 'unk_token': '[UNK]'}}))
  return path


def test_vocab_size_is_the_highest_id_plus_one(tmp_path):
  """A tokenizer.json whose ids leave gaps needs max id + 1 embedding rows, not its count of
  entries: ids 0, 2, 9 (and the added EOS) do not fit a model vocabulary of 8."""
  path = word_level(tmp_path, 'Whitespace', {'a': 0, 'b': 9, '[UNK]': 2})
  with pytest.raises(DataError, match=r'\(10 tokens.*model.vocab_size=8'):
    tokenizer_lib.get(str(path), [], 8)
  tok = tokenizer_lib.get(str(path), [], 10)
  assert tok.vocab_size == 10
  assert max(tok.encode_batch(['a b a'])[0]) == 9 < tok.vocab_size


def special_bpe(tmp_path) -> pathlib.Path:
  """tokenizer.json of a byte-level BPE (as tokenizer.py trains one) with two special tokens."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(DOCS, trainers.BpeTrainer(
      vocab_size=400, special_tokens=['<|endoftext|>', '<|im_start|>'], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp_path / 'tokenizer.json'))
  return tmp_path / 'tokenizer.json'


@pytest.mark.parametrize('which', ['gpt2', 'train', 'file'])
def test_special_token_strings_in_a_document_are_text(which, tmp_path):
  """A document holding a special token's text (EOS or another) encodes to no special id
  and decodes back to itself: only the separator the pipeline appends is EOS."""
  if which == 'gpt2' and not GPT2.is_dir():
    pytest.skip(f'{GPT2} absent')
  spec = {'gpt2': str(GPT2), 'train': 'train', 'file': str(special_bpe(tmp_path))}[which]
  tok = tokenizer_lib.get(spec, DOCS, 50304 if which == 'gpt2' else 400)
  specials = ['<|endoftext|>'] + (['<|im_start|>'] if which == 'file' else [])
  assert {tok.id_to_token(i) for i in tok.special_ids} == set(specials)
  docs = [f'He typed {s} and went on.' for s in specials] + [
      '<|endoftext|><|endoftext|>', 'x<|endoftext|', ' <|endoftext|>\n']
  for doc, ids in zip(docs, tok.encode_batch(docs)):
    assert not set(ids.tolist()) & tok.special_ids, (doc, ids)
    assert tok.decode(ids) == doc


def test_a_special_string_only_encodable_as_itself_is_refused(tmp_path):
  """A word-level vocabulary that holds '<|endoftext|>' as a word has no other encoding of
  it: the document is refused (naming the token and the text) rather than split."""
  vocab = {'a': 0, 'b': 1, '[UNK]': 2, '<|endoftext|>': 3}
  tok = tokenizer_lib.get(str(word_level(tmp_path, 'WhitespaceSplit', vocab)), [], 8)
  assert tok.encode_batch(['a b a'])[0].tolist() == [0, 1, 0]
  with pytest.raises(DataError, match=r"encodes to the EOS id 3 .*split.*"
                                      r"text: 'b a <\|endoftext\|> b'"):
    tok.encode_batch(['a b', 'b a <|endoftext|> b'])


def test_bpe_at_exactly_the_byte_alphabet_plus_eos():
  """vocab_size = 256 + 1 is enough for a byte-level BPE (the bound is inclusive)."""
  tok = tokenizer_lib.get('train', DOCS, tokenizer_lib.MIN_BPE_VOCAB)
  assert tok.vocab_size == 257
  assert [tok.decode(x) for x in tok.encode_batch(DOCS[:2])] == DOCS[:2]
  with pytest.raises(DataError, match='at least 257 tokens but model.vocab_size=256'):
    tokenizer_lib.get('train', DOCS, 256)


def test_every_special_token_is_class_other(tmp_path):
  """A special token other than EOS is OTHER even when its text reads as a word."""
  vocab = {'a': 0, 'b': 1, '[UNK]': 2, '<|endoftext|>': 3, 'SEP': 4, '7': 5}
  path = word_level(tmp_path, 'WhitespaceSplit', vocab)
  spec = json.loads(path.read_text('utf-8'))
  spec['added_tokens'].append(dict(spec['added_tokens'][0], id=4, content='SEP'))
  path.write_text(json.dumps(spec))
  tok = tokenizer_lib.get(str(path), [], 8)
  assert tok.special_ids == {3, 4} and tok.decode([4]) == 'SEP'
  assert tokenizer_lib.classify(tok.decode([4])) == tokenizer_lib.TokenClass.WORD
  got = tokenizer_lib.token_classes(tok, [0, 3, 4, 5]).tolist()
  c = tokenizer_lib.TokenClass
  assert got == [c.WORD, c.OTHER, c.OTHER, c.NUMERAL]
