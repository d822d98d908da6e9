"""Data for elastic-depth: sources, tokenizers, packing and the grain pipeline.

The grain pipeline (Data, Windows, build, fixed_batches, pack) is imported on first use, so
that tools which only read or tokenize documents (prepare_data) start quickly.
"""

import importlib

from elastic_depth.data.errors import DataError
from elastic_depth.data.sources import Corpus, Source, load
from elastic_depth.data.synthetic import SyntheticVocab
from elastic_depth.data.tokenizer import (
    TOKEN_CLASS_NAMES, HFTokenizer, TokenClass, class_table, token_classes)

_PIPELINE = ('Data', 'Windows', 'build', 'fixed_batches', 'pack')

__all__ = [
    'DataError', 'Data', 'Windows', 'build', 'fixed_batches', 'pack', 'Corpus', 'Source',
    'load', 'SyntheticVocab', 'TOKEN_CLASS_NAMES', 'HFTokenizer', 'TokenClass', 'class_table',
    'token_classes',
]


def __getattr__(name):
  if name in _PIPELINE:
    return getattr(importlib.import_module('elastic_depth.data.pipeline'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
