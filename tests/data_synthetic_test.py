"""Tests of the synthetic k-hop variable-binding corpus."""

import numpy as np
import pytest

from elastic_depth.config import DataConfig
from elastic_depth.data import sources, synthetic
from elastic_depth.data.errors import DataError


def resolve(tokens):
  """Brute force: [(position of the answer, answer, hops)] for every query in the program."""
  query = tokens.index('?')
  lines = ' '.join(tokens[:query]).split(';')
  bindings = {}
  for line in lines:
    if line.strip():
      lhs, rhs = line.split()
      assert lhs not in bindings
      bindings[lhs] = rhs
  out = []
  for q in range(query, len(tokens), 4):
    assert tokens[q] == '?' and tokens[q + 3] == '.'
    name, hops = tokens[q + 1], 0
    while not name.isdigit():
      name, hops = bindings[name], hops + 1
    out.append((q + 2, name, hops))
  assert sorted(tokens[q + 1] for q in range(query, len(tokens), 4)) == sorted(bindings)
  return out


def test_difficulty_matches_brute_force_hops():
  train, _, vocab = synthetic.load(300, 6, 16, seed=3, val_fraction=0.1)
  first_hops = set()
  for ids, diff in zip(train.ids, train.difficulty):
    tokens = vocab.decode(ids).split()
    assert len(tokens) == len(diff)
    answers = resolve(tokens)
    first_hops.add(answers[0][2])
    positions = set()
    for p, answer, hops in answers:
      assert tokens[p] == answer and diff[p] == hops
      positions.add(p)
    for p, (t, d) in enumerate(zip(tokens, diff)):
      if p not in positions:
        assert d == (synthetic.FORMAT if t in synthetic.FORMAT_TOKENS else synthetic.RANDOM), t
  assert first_hops == set(range(1, 7))


def test_vocab_small_and_round_trip():
  _, val, vocab = synthetic.load(50, 6, 16, seed=0, val_fraction=0.2)
  assert vocab.vocab_size == 5 + 10 + 16 < 64
  assert vocab.id_to_token(vocab.eos_id) == synthetic.EOS
  docs = val.docs(vocab)
  for ids, back in zip(val.ids, vocab.encode_batch(docs)):
    np.testing.assert_array_equal(ids, back)


def test_deterministic_and_seed_dependent():
  a, _, _ = synthetic.load(100, 4, 8, seed=1, val_fraction=0.1)
  b, _, _ = synthetic.load(100, 4, 8, seed=1, val_fraction=0.1)
  c, _, _ = synthetic.load(100, 4, 8, seed=2, val_fraction=0.1)
  assert all(np.array_equal(x, y) for x, y in zip(a.ids, b.ids))
  assert not all(np.array_equal(x, y) for x, y in zip(a.ids, c.ids))


def test_val_disjoint_from_train():
  train, val, vocab = synthetic.load(2000, 2, 3, seed=0, val_fraction=0.1)
  seen = set(train.docs(vocab))
  assert len(val.ids) == 200
  assert not seen & set(val.docs(vocab))


@pytest.mark.parametrize('hops,num_vars,n', [(0, 8, 10), (6, 5, 10), (2, 60, 10), (2, 4, 0)])
def test_bad_settings(hops, num_vars, n):
  with pytest.raises(DataError, match='synth_'):
    synthetic.load(n, hops, num_vars, seed=0, val_fraction=0.1)


def test_too_few_distinct_programs():
  with pytest.raises(DataError, match='distinct programs'):
    synthetic.load(500, 1, 1, seed=0, val_fraction=0.1)


def test_synthetic_source_has_no_text_loader():
  with pytest.raises(DataError, match="data.source='synthetic' has no text documents"):
    sources.load(DataConfig(synth_examples=100, val_fraction=0.1))


def test_compose_answers_and_difficulty_by_brute_force():
  train, val, vocab = synthetic.load(500, 6, 16, seed=4, val_fraction=0.2, task='compose')
  tables = synthetic.op_tables(4)
  for t in tables.values():  # every op is a permutation of the ten digits
    assert sorted(t.tolist()) == list(range(10))
  ks = set()
  for ids, diff in zip(train.ids + val.ids, train.difficulty + val.difficulty):
    toks = vocab.decode(ids).split()
    assert toks[0] == '?' and toks[-1] == '.' and toks[-3] == '='
    ops = toks[2:-3]
    x = int(toks[1])
    for o in ops:  # brute force: apply the permutations one by one
      x = [int(tables[o][d]) for d in range(10)][x]
    assert toks[-2] == str(x)
    k = len(ops)
    ks.add(k)
    assert list(diff) == [0, -1] + [-1] * k + [-1, k, 0]
  assert ks == set(range(1, 7))


def test_chain_answers_and_difficulty_by_brute_force():
  train, val, vocab = synthetic.load(300, 5, 16, seed=2, val_fraction=0.2, task='chain',
                                     num_ops=6)
  tables = synthetic.op_tables(6)
  ks = []
  for ids, diff in zip(train.ids + val.ids, train.difficulty + val.difficulty):
    toks, x, ops = vocab.decode(ids).split(), None, []
    for t, d in zip(toks, diff):
      if t in tables:  # an op: pending until the next digit
        ops.append(t)
        assert d == -1
      elif x is None:  # the start digit is a random draw
        x = int(t)
        assert d == -1
      else:  # an answer: the pending ops applied in order to the previous digit
        for o in ops:
          x = dict(enumerate(tables[o].tolist()))[x]
        assert t == str(x) and d == len(ops) >= 1
        ks.append(len(ops))
        ops = []
    assert not ops and len(ks) % synthetic.CHAIN_SEGMENTS == 0
  assert set(ks) == set(range(1, 6))


def test_digit_last_answers_and_difficulty_by_brute_force():
  """digit_last: each segment's ops come before the digit they apply to, and the answer is
  that digit under the ops in order (no op position can know a value)."""
  train, val, vocab = synthetic.load(300, 5, 16, seed=2, val_fraction=0.2, task='digit_last',
                                     num_ops=6)
  tables = synthetic.op_tables(6)
  ks = []
  for ids, diff in zip(train.ids + val.ids, train.difficulty + val.difficulty):
    toks, ops, start = vocab.decode(ids).split(), [], None
    for t, d in zip(toks, diff):
      if t in tables:  # an op: pending until the segment's digits
        assert start is None and d == -1
        ops.append(t)
      elif start is None:  # the start digit, a random draw, after its ops
        assert ops and d == -1
        start = int(t)
      else:  # the answer: the pending ops applied in order to the start digit
        x = start
        for o in ops:
          x = dict(enumerate(tables[o].tolist()))[x]
        assert t == str(x) and d == len(ops)
        ks.append(len(ops))
        ops, start = [], None
    assert not ops and start is None and len(ks) % synthetic.CHAIN_SEGMENTS == 0
  assert set(ks) == set(range(1, 6))


def test_unknown_task_is_a_clear_error():
  with pytest.raises(DataError, match='synth_task'):
    synthetic.load(10, 2, 4, seed=0, val_fraction=0.1, task='nope')


def test_val_size_rounds_and_is_at_least_one():
  """n_val = max(1, round(N * val_fraction)), rounded to the nearest (not truncated)."""
  for n, frac in ((10, 0.01), (100, 0.29), (10, 0.15), (7, 0.5)):
    _, val, _ = synthetic.load(n, 2, 8, seed=0, val_fraction=frac)
    want = max(1, int(np.floor(n * frac + 0.5)))  # no exact halves here: round = floor(+0.5)
    assert len(val.ids) == want, (n, frac)


def test_op_tasks_accept_as_many_ops_as_variables():
  """num_ops may equal num_vars (every variable name an op); one more is refused."""
  for task in ('compose', 'chain', 'digit_last'):
    train, _, vocab = synthetic.load(20, 2, 4, seed=0, val_fraction=0.1, task=task, num_ops=4)
    assert len(train.ids) == 20
    ops = {t for ids in train.ids for t in vocab.decode(ids).split() if t.isalpha()}
    assert ops <= set(synthetic.VAR_NAMES[:4])
    with pytest.raises(DataError, match='synth_num_ops=5'):
      synthetic.load(20, 2, 4, seed=0, val_fraction=0.1, task=task, num_ops=5)


@pytest.mark.parametrize('hops,num_vars', [(3, 16), (6, 8), (2, 3)])
def test_binding_lines_and_distractor_chains(hops, num_vars):
  """min(num_vars, 2 * max_hops) bindings per program, and distractors bind to any earlier
  variable: some bind to another distractor (their own chains), not only to the query chain."""
  train, _, vocab = synthetic.load(300, hops, num_vars, seed=5, val_fraction=0.1)
  own_chains = 0
  for ids in train.ids:
    toks = vocab.decode(ids).split()
    q = toks.index('?')
    bindings = dict(zip(toks[0:q:3], toks[1:q:3]))
    assert len(bindings) == q // 3 == min(num_vars, 2 * hops)
    chain, x = set(), toks[q + 1]  # the first query's chain
    while x not in synthetic.DIGITS:
      chain.add(x)
      x = bindings[x]
    own_chains += sum(v not in chain and r in bindings and r not in chain
                      for v, r in bindings.items())
  assert own_chains > 0
