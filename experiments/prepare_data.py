"""Tokenize a corpus once, streaming, into token shards for data.source=tokens.

  python -m experiments.prepare_data --out=data/fineweb_sample \
      --config.data.source=text --config.data.paths='../shared/data/fineweb_edu/*.jsonl' \
      --config.data.tokenizer=../shared/data/tokenizers/gpt2 --config.model.vocab_size=50257
  python -m experiments.prepare_data --flagfile=launch/135m.flags --config.data.source=hf \
      --out=data/fineweb-edu-10BT         # the document source of a launch file
  python -m experiments.pretrain --flagfile=launch/135m.flags   # trains on data.paths=DIR

Reads data.source (text | hf | tfds | synthetic) with the same --config.data.* flags as
pretrain; the tokenizer is data.tokenizer (a path, a hub name, or `train`: a byte-level BPE
of model.vocab_size learned from the first --tokenizer_docs documents) and is written to
OUT/tokenizer.json. Rerunning the command (or --resume) continues after the last complete
shard; a directory started with another source or tokenizer is refused.
Exit codes: 0 done; 2 a one-line `error: ...` on stderr; 130 interrupted (rerun to continue).
"""

from absl import app, flags

from elastic_depth import config as config_lib
from elastic_depth.data import DataError, shards
from experiments import flags_util


_fail = flags_util.fail


_CONFIG = flags_util.define_config(config_lib.Config(),
                                   'Data settings (config.data.*, model.vocab_size).')
_OUT = flags.DEFINE_string('out', None, 'Output directory of the shards and index.json.')
_SHARD_TOKENS = flags.DEFINE_integer('shard_tokens', 2**27, 'Tokens per train shard '
                                     '(validation shards: 2 * val_fraction of that).')
_BATCH_DOCS = flags.DEFINE_integer('batch_docs', 512, 'Documents per tokenizer call.')
_TOKENIZER_DOCS = flags.DEFINE_integer('tokenizer_docs', 20_000, 'Documents a `train` '
                                       'tokenizer learns from.')
_RESUME = flags.DEFINE_bool('resume', False, 'Require a partial --out to continue (a rerun '
                            'into the same --out continues anyway).')
_QUIET = flags.DEFINE_bool('quiet', False, 'No progress bar.')


def summary(index: dict) -> str:
  """One line: documents, tokens and shards per split."""
  parts = [f'{s} {x["docs"]} docs {x["tokens"]} tokens {len(x["shards"])} shards'
           for s, x in index['splits'].items()]
  return (f'prepared {index["origin"]} with {index["tokenizer"]["origin"]} '
          f'({index["dtype"]}): ' + '; '.join(parts))


def main(argv):
  flags_util.no_arguments(argv)
  if not _OUT.value:
    _fail('--out=DIR is required')
  cfg = _CONFIG.value
  if _BATCH_DOCS.value < 1 or _TOKENIZER_DOCS.value < 1:
    _fail('--batch_docs and --tokenizer_docs must be >= 1')
  if cfg.data.max_docs:
    print(f'data.max_docs={cfg.data.max_docs}: at most that many documents per part',
          flush=True)
  try:
    index = shards.prepare(cfg.data, _OUT.value, vocab_size=cfg.model.vocab_size,
                           shard_tokens=_SHARD_TOKENS.value, batch_docs=_BATCH_DOCS.value,
                           tokenizer_docs=_TOKENIZER_DOCS.value, resume=_RESUME.value,
                           quiet=_QUIET.value)
  except DataError as e:
    _fail(str(e))
  except KeyboardInterrupt:
    _fail(f'interrupted; rerun the same command to continue {_OUT.value} after its last '
          'complete shard', 130)
  print(summary(index), flush=True)


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
