"""Tokenizers through HF `tokenizers`: train a byte-level BPE, load files, or the hub."""

import enum
import hashlib
import json
import pathlib
import unicodedata
import weakref

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from elastic_depth.data import sources
from elastic_depth.data.errors import UNREACHABLE_HINT, DataError

EOS = '<|endoftext|>'
TRAIN = 'train'            # DataConfig.tokenizer value that trains a BPE on the corpus
TOKENIZER_FILE = 'tokenizer.json'
MIN_BPE_VOCAB = 256 + 1    # byte alphabet plus EOS


class HFTokenizer:
  """Thin wrapper over tokenizers.Tokenizer with the interface the pipeline uses."""

  def __init__(self, tok: tokenizers.Tokenizer, origin: str):
    if tok.token_to_id(EOS) is None or EOS not in _special_tokens(tok):
      tok.add_special_tokens([EOS])
    tok.encode_special_tokens = True  # '<|endoftext|>' in a document is text, not EOS
    self.tok = tok
    self.origin = origin
    self.eos_id = tok.token_to_id(EOS)
    self.special_ids = frozenset(tok.token_to_id(t) for t in _special_tokens(tok))

  @property
  def vocab_size(self) -> int:
    """The highest id + 1 (the embedding rows its ids need; a tokenizer.json may leave
    gaps in its ids, so the count of entries can be smaller)."""
    return max(self.tok.get_vocab(with_added_tokens=True).values()) + 1

  def encode_batch(self, docs: list[str]) -> list[np.ndarray]:
    """Token ids (int32) of each document; special-token strings in it are encoded as text.

    Only the separator the pipeline appends is EOS, so a document is never split; a
    tokenizer that can encode a document's text only as EOS raises DataError.
    """
    out = [np.asarray(e.ids, np.int32) for e in self.tok.encode_batch_fast(docs)]
    for doc, ids in zip(docs, out):
      if (ids == self.eos_id).any():
        raise self._split_error(doc)
    return out

  def _split_error(self, doc: str) -> DataError:
    """DataError for a document whose text encodes to the EOS id."""
    at = max(0, doc.find(EOS))
    return DataError(f'a document encodes to the EOS id {self.eos_id} under tokenizer '
                     f'{self.origin} (it has no plain-text encoding of {EOS!r}, or its '
                     f'unknown token is EOS), so the document would be split there; remove '
                     f'that text from the corpus or use a byte-level tokenizer (text: '
                     f'{doc[max(0, at - 40):at + len(EOS) + 40]!r})')

  def decode(self, ids) -> str:
    """Text of a sequence of ids (special tokens kept)."""
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def id_to_token(self, i: int) -> str:
    """Raw vocabulary entry of one id (byte-level symbols for BPE)."""
    return self.tok.id_to_token(int(i))

  def save(self, path: pathlib.Path) -> None:
    """Writes tokenizer.json."""
    self.tok.save(str(path))


def _special_tokens(tok: tokenizers.Tokenizer) -> list[str]:
  """Contents of the tokenizer's special added tokens."""
  return [t.content for t in tok.get_added_tokens_decoder().values() if t.special]


def _train_bpe(docs: list[str], vocab_size: int) -> tokenizers.Tokenizer:
  """Byte-level BPE with at most vocab_size entries (EOS included) trained on docs."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
  return tok


def _byte_level_bpe_files(vocab: pathlib.Path, merges: pathlib.Path) -> tokenizers.Tokenizer:
  """GPT-2 style tokenizer from vocab.json + merges.txt."""
  tok = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return tok


def _from_path(path: pathlib.Path) -> tokenizers.Tokenizer:
  """A tokenizer.json file, or a directory with tokenizer.json or vocab.json + merges.txt."""
  if path.is_dir():
    if (path / TOKENIZER_FILE).is_file():
      path = path / TOKENIZER_FILE
    elif (path / 'vocab.json').is_file() and (path / 'merges.txt').is_file():
      return _byte_level_bpe_files(path / 'vocab.json', path / 'merges.txt')
    else:
      raise DataError(f'data.tokenizer: directory {path} has neither {TOKENIZER_FILE} '
                      'nor vocab.json + merges.txt')
  try:
    return tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'data.tokenizer: {path} is not a readable tokenizer.json ({e})') from None


def _from_hub(name: str) -> tokenizers.Tokenizer:
  """Tokenizer.from_pretrained, or the local hub cache when the hub is unreachable."""
  if sources.hub_reachable():
    try:
      return tokenizers.Tokenizer.from_pretrained(name)
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f'data.tokenizer={name!r}: no local file or directory of that name and '
                      f'the hub has no such tokenizer ({type(e).__name__}: {e})') from None
  try:
    import huggingface_hub  # pylint: disable=g-import-not-at-top
    cached = huggingface_hub.hf_hub_download(name, TOKENIZER_FILE, local_files_only=True)
  except Exception:  # pylint: disable=broad-except
    raise DataError(f'data.tokenizer={name!r}: no local file or directory of that name, '
                    f'none in the hub cache, and {UNREACHABLE_HINT}; or give '
                    f'--config.data.tokenizer=train or a path to tokenizer.json') from None
  return tokenizers.Tokenizer.from_file(cached)


def tokenizer_info(tok) -> dict:
  """vocab_size, eos_id and a SHA-256 fingerprint of the token -> id table."""
  if hasattr(tok, 'tok'):  # HFTokenizer
    table = sorted(tok.tok.get_vocab(with_added_tokens=True).items())
  elif hasattr(tok, 'tokens'):  # SyntheticVocab
    table = list(enumerate(tok.tokens))
  else:
    table = [tok.vocab_size]
  digest = hashlib.sha256(json.dumps(table).encode('utf-8')).hexdigest()[:16]
  return {'vocab_size': int(tok.vocab_size), 'eos_id': int(tok.eos_id), 'fingerprint': digest,
          'origin': str(getattr(tok, 'origin', 'synthetic vocabulary'))}


def check_vocab(tokenizer, vocab_size: int) -> None:
  """DataError if the tokenizer has more ids than the model's embedding table."""
  if tokenizer.vocab_size > vocab_size:
    raise DataError(f'tokenizer vocabulary ({tokenizer.vocab_size} tokens, '
                    f'{getattr(tokenizer, "origin", "synthetic")}) is larger than '
                    f'model.vocab_size={vocab_size}; raise --config.model.vocab_size to at '
                    f'least {tokenizer.vocab_size}')


def get(spec: str, docs: list[str], vocab_size: int, workdir=None) -> HFTokenizer:
  """The tokenizer named by DataConfig.tokenizer, checked against the model vocabulary.

  Args:
    spec: 'train', a path (tokenizer.json or a vocab.json+merges.txt folder) or a hub name.
    docs: training documents (used only when training).
    vocab_size: the model's vocabulary size; the tokenizer may not exceed it.
    workdir: where a trained tokenizer is saved as tokenizer.json and reused from (optional).

  Returns:
    HFTokenizer whose vocab_size <= vocab_size and whose eos_id is `<|endoftext|>`.
  """
  if spec == TRAIN:
    saved = pathlib.Path(workdir) / TOKENIZER_FILE if workdir else None
    if saved is not None and saved.is_file():
      tokenizer = HFTokenizer(_from_path(saved), f'reused {saved}')
    else:
      if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f'a byte-level BPE needs at least {MIN_BPE_VOCAB} tokens but '
                        f'model.vocab_size={vocab_size}')
      tokenizer = HFTokenizer(_train_bpe(docs, vocab_size), 'trained byte-level BPE')
      if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(saved)
  elif pathlib.Path(spec).expanduser().exists():
    path = pathlib.Path(spec).expanduser()
    tokenizer = HFTokenizer(_from_path(path), str(path))
  else:
    tokenizer = HFTokenizer(_from_hub(spec), f'hub:{spec}')
  check_vocab(tokenizer, vocab_size)
  return tokenizer


class TokenClass(enum.IntEnum):
  """Coarse class of a token's decoded text."""
  WHITESPACE = 0
  PUNCTUATION = 1
  NUMERAL = 2
  WORD = 3
  OTHER = 4  # special tokens, partial UTF-8 bytes, mixed strings


TOKEN_CLASS_NAMES = tuple(c.name.lower() for c in TokenClass)
_CLASS_TABLES = weakref.WeakKeyDictionary()


def classify(text: str) -> TokenClass:
  """Class of one decoded token string."""
  stripped = text.strip()
  if not text or '\ufffd' in text:
    return TokenClass.OTHER
  if not stripped:
    return TokenClass.WHITESPACE
  if all(unicodedata.category(c)[0] in 'PS' for c in stripped):
    return TokenClass.PUNCTUATION
  if stripped.isdecimal():
    return TokenClass.NUMERAL
  if stripped.replace("'", '').replace('\u2019', '').isalpha():
    return TokenClass.WORD
  return TokenClass.OTHER


def class_table(tokenizer) -> np.ndarray:
  """int32 [vocab_size] class of every id; each id decoded once, cached per tokenizer."""
  table = _CLASS_TABLES.get(tokenizer)
  if table is None:
    table = np.array([TokenClass.OTHER if i in tokenizer.special_ids
                      else classify(tokenizer.decode([i]))
                      for i in range(tokenizer.vocab_size)], np.int32)
    _CLASS_TABLES[tokenizer] = table
  return table


def token_classes(tokenizer, ids) -> np.ndarray:
  """TokenClass (int32, same shape as ids) of each token id; see TOKEN_CLASS_NAMES."""
  return class_table(tokenizer)[np.asarray(ids)]
