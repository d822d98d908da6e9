"""Data for elastic-depth: sources, tokenizers, packing and the grain pipeline."""

from elastic_depth.data.errors import DataError
from elastic_depth.data.pipeline import Data, Windows, build, fixed_batches, pack
from elastic_depth.data.sources import Corpus, Source, load
from elastic_depth.data.synthetic import SyntheticVocab
from elastic_depth.data.tokenizer import (
    TOKEN_CLASS_NAMES, HFTokenizer, TokenClass, class_table, token_classes)

__all__ = [
    'DataError', 'Data', 'Windows', 'build', 'fixed_batches', 'pack', 'Corpus', 'Source',
    'load', 'SyntheticVocab', 'TOKEN_CLASS_NAMES', 'HFTokenizer', 'TokenClass', 'class_table',
    'token_classes',
]
