"""The one exception the data package raises for unusable data or settings."""


class DataError(ValueError):
  """A corpus, tokenizer or data setting that cannot work, found before compiling."""


UNREACHABLE_HINT = ('the network or the hub is unreachable from this machine; train on local '
                    'files instead: --config.data.source=text --config.data.paths=...')
