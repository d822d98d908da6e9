"""Benchmark the data path: prepare_data tokens/s, and batches/s of data.source=tokens.

  python -m experiments.bench_data --flagfile=launch/135m.flags   # writes runs/bench_data.json

Prepare: the FineWeb-Edu sample tokenized with the GPT-2 tokenizer into shards (the whole
prepare_data path), and tokenization alone three ways: HF `tokenizers` batch encoding on one
thread, on its own thread pool (every core), and in --workers processes of one thread each.
Input: batches of the configured train.batch_size x train.seq_len drawn from (a) the
prepared sample and (b) a sparse 2B-token shard set (random access over a corpus far larger
than the page cache it touches). The tokens/s they supply is compared with what the
configured model's training step consumes at --mfu of --peak_tflops (H200 bf16 dense: 989).
"""

import json
import multiprocessing
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments import bench_util, flags_util
from elastic_depth import config as config_lib, train_step
from elastic_depth.config import DataConfig
from elastic_depth.data import DataError, pipeline, shards, sources, tokenizer as tokenizer_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / 'shared' / 'data'
_CONFIG = flags_util.define_config(config_lib.Config(), 'Model/train shape.')
_OUT = flags.DEFINE_string('out', 'runs/bench_data.json', 'Output JSON path.')
_CORPUS = flags.DEFINE_string('corpus', str(SHARED / 'fineweb_edu' / '*.jsonl'), 'Documents.')
_TOKENIZER = flags.DEFINE_string('tokenizer', str(SHARED / 'tokenizers' / 'gpt2'), 'Tokenizer.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed repetitions (median reported).',
                                lower_bound=1)
_WORKERS = flags.DEFINE_integer('workers', 2, 'Processes for the multi-process encoding.',
                                lower_bound=1)
_BATCHES = flags.DEFINE_integer('batches', 1000, 'Batches drawn per input measurement.',
                                lower_bound=1)
_PEAK = flags.DEFINE_float('peak_tflops', 989.0, 'Accelerator dense bf16 peak (H200: 989).')
_MFU = flags.DEFINE_float('mfu', 0.45, 'Model FLOP utilisation assumed for the step.')
_SPARSE_TOKENS = flags.DEFINE_integer('sparse_tokens', 2**31, 'Tokens of the sparse shard set '
                                      '(at least 2^21: two train shards beside 2^20 of val).',
                                      lower_bound=2**21)
flags_util.require('peak_tflops', lambda x: 0 < x < float('inf'), 'a positive finite number')
flags_util.require('mfu', lambda x: 0 < x <= 1, 'in (0, 1]')


def median_time(fn, repeats: int) -> float:
  """Median wall seconds of fn() over `repeats` calls."""
  return bench_util.time_fn(fn, (), repeats, warmup=0)['median_s']


def _encode_child(docs, tokenizer: str, threads: bool) -> float:
  """Seconds to encode docs in a fresh process (TOKENIZERS_PARALLELISM is read at start)."""
  code = ('import json,sys,time; from elastic_depth.data import tokenizer as t; '
          'docs=json.load(sys.stdin); tok=t.get(sys.argv[1],[],10**6); t0=time.perf_counter(); '
          'tok.encode_batch(docs); print(time.perf_counter()-t0)')
  env = {**os.environ, 'PYTHONPATH': str(REPO),
         'TOKENIZERS_PARALLELISM': 'true' if threads else 'false'}
  res = subprocess.run([sys.executable, '-c', code, tokenizer], input=json.dumps(docs),
                       capture_output=True, text=True, env=env, check=True)
  return float(res.stdout.strip().splitlines()[-1])


def _encode_count(args) -> int:
  tokenizer, docs = args
  tok = tokenizer_lib.get(tokenizer, [], 10**6)
  return sum(len(x) for x in tok.encode_batch(docs))


def encode_modes(docs, tokenizer: str, repeats: int, workers: int) -> dict:
  """Tokens/s of encoding docs: one thread, the tokenizers thread pool, worker processes."""
  n_tokens = sum(len(x) for x in tokenizer_lib.get(tokenizer, [], 10**6).encode_batch(docs))
  out = {'docs': len(docs), 'tokens': n_tokens}
  for name, threads in (('one_thread', False), ('thread_pool', True)):
    secs = statistics.median(_encode_child(docs, tokenizer, threads) for _ in range(repeats))
    out[f'{name}_tokens_per_s'] = n_tokens / secs
  chunks = [(tokenizer, docs[i::workers]) for i in range(workers)]
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'  # inherited by the spawned workers
  with multiprocessing.get_context('spawn').Pool(workers) as pool:
    pool.map(_encode_count, chunks)  # warm-up: start the workers and load the tokenizer
    secs = median_time(lambda: pool.map(_encode_count, chunks), repeats)
  del os.environ['TOKENIZERS_PARALLELISM']
  out[f'{workers}_processes_tokens_per_s'] = n_tokens / secs
  return out


def bench_prepare(tmp: pathlib.Path, repeats: int) -> dict:
  """prepare_data end to end on the corpus (shards, index, split): tokens/s and docs/s."""
  cfg = DataConfig(source='text', paths=_CORPUS.value, tokenizer=_TOKENIZER.value)
  index, made = {}, []

  def run():
    made.append(tmp / f'prep{time.perf_counter_ns()}')
    index.update(shards.prepare(cfg, made[-1], vocab_size=10**6, shard_tokens=2**20,
                                quiet=True))
  secs = median_time(run, repeats)
  tokens = sum(index['splits'][s]['tokens'] for s in shards.SPLITS)
  docs = sum(index['splits'][s]['docs'] for s in shards.SPLITS)
  return {'seconds': secs, 'tokens': tokens, 'docs': docs, 'tokens_per_s': tokens / secs,
          'docs_per_s': docs / secs, 'dir': str(made[-1])}


def sparse_dir(out: pathlib.Path, n_tokens: int, tok) -> pathlib.Path:
  """A complete prepared directory of sparse (all-zero, no disk) uint16 shards."""
  out.mkdir()
  tok.save(out / tokenizer_lib.TOKENIZER_FILE)
  split_sizes = {'train': [n_tokens // 2, n_tokens - n_tokens // 2], 'val': [2**20]}
  for split, sizes in split_sizes.items():
    for k, n in enumerate(sizes):
      with open(out / f'{split}-{k:05d}.bin', 'wb') as f:
        f.truncate(2 * n)
  index = {'format': shards.FORMAT, 'complete': True, 'origin': 'sparse', 'dtype': 'uint16',
           'source': {'max_docs': 0},
           'tokenizer': {'file': tokenizer_lib.TOKENIZER_FILE, **tokenizer_lib.tokenizer_info(tok)},
           'splits': {s: {'docs': 0, 'tokens': sum(ns), 'shards': [
               {'file': f'{s}-{k:05d}.bin', 'tokens': n, 'docs': 0} for k, n in enumerate(ns)]}
                      for s, ns in split_sizes.items()}}
  shards.write_json_atomic(out / shards.INDEX, index)
  return out


def bench_input(directory: pathlib.Path, cfg, vocab_size: int) -> dict:
  """Batches/s and tokens/s of the tokens source (build excluded; first batch excluded)."""
  t = cfg.train
  t0 = time.perf_counter()
  data = pipeline.build(DataConfig(source='tokens', paths=str(directory)), seq_len=t.seq_len,
                        batch_size=t.batch_size, vocab_size=vocab_size)
  build_s = time.perf_counter() - t0
  next(data.train_iter)
  t0 = time.perf_counter()
  for _ in range(_BATCHES.value):
    next(data.train_iter)
  secs = time.perf_counter() - t0
  return {'build_s': build_s, 'batches': _BATCHES.value, 'batches_per_s': _BATCHES.value / secs,
          'tokens_per_s': _BATCHES.value * t.batch_size * t.seq_len / secs,
          'corpus_tokens': data.train_windows.num_tokens}


def step_demand(cfg) -> dict:
  """Tokens/s the training step consumes at --mfu of --peak_tflops, and the arithmetic."""
  train_flops = train_step.train_flops_per_token(cfg)
  tokens_per_s = _MFU.value * _PEAK.value * 1e12 / train_flops
  return {'train_flops_per_token': train_flops, 'mean_depth': cfg.depth.mean,
          'peak_tflops': _PEAK.value, 'mfu': _MFU.value, 'tokens_per_s': tokens_per_s,
          'formula': 'mfu * peak / train_step.train_flops_per_token(config) (the forward at the '
                     'expected drawn loops, the backward at the expected backprop loops)'}


def main(argv):
  flags_util.no_arguments(argv)
  cfg = _CONFIG.value
  try:
    docs = sources.capped(sources.iter_files(_CORPUS.value, DataConfig(), '--corpus'),
                          DataConfig())
    tok = tokenizer_lib.get(_TOKENIZER.value, [], 10**6)
  except DataError as e:
    flags_util.fail(re.sub(r'^data\.tokenizer', '--tokenizer', str(e)))
  result = {'date': time.strftime('%Y-%m-%d'), 'command': ' '.join(sys.argv),
            'machine': f'{platform.processor() or platform.machine()}, '
                       f'{os.cpu_count()} cores', 'corpus': _CORPUS.value,
            'tokenizer': _TOKENIZER.value, 'batch': [cfg.train.batch_size, cfg.train.seq_len]}
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    result['encode'] = encode_modes(docs, _TOKENIZER.value, _REPEATS.value, _WORKERS.value)
    result['prepare'] = bench_prepare(tmp, _REPEATS.value)
    prepared = pathlib.Path(result['prepare']['dir'])
    result['input_prepared_sample'] = bench_input(prepared, cfg, tok.vocab_size)
    big = sparse_dir(tmp / 'sparse', _SPARSE_TOKENS.value, tok)
    result['input_sparse_corpus'] = bench_input(big, cfg, tok.vocab_size)
  demand = step_demand(cfg)
  result['step_demand'] = demand
  supply = min(result['input_prepared_sample']['tokens_per_s'],
               result['input_sparse_corpus']['tokens_per_s'])
  result['input_over_demand'] = supply / demand['tokens_per_s']
  bench_util.write_json(_OUT.value, result, echo=True)


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
