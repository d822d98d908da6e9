"""Embedded synthetic corpus: variable-binding programs whose answers need k hops.

No download and no BPE: programs are written directly in a tiny vocabulary
(4 format tokens in use, 10 digits, `num_vars` variable names; under 64 ids by default).
One example (k = 3, shown with 5 binding lines instead of the usual 12):

  d 4 ; c b ; a 7 ; e c ; b a ; ? c 7 . ? e 7 . ? d 4 . ...

Generator, deterministic from the seed (numpy PCG64 seeded with (seed, split)):
  * draw the hop count k uniformly from 1..max_hops and
    n_lines = min(num_vars, 2 * max_hops) distinct variables;
  * the first k variables form the query chain x1 = v ; x2 = x1 ; ... ; xk = x(k-1),
    with v a random digit;
  * every other variable is a distractor bound either to a random digit or to a
    random variable bound before it in generation order (so distractors form their
    own chains and branch off the query chain, and var-to-var lines are no hint);
  * the binding lines `var rhs ;` are shuffled, then the query `? xk v .` follows,
    then one query per remaining variable in random order (about one token in
    seven is an answer, with depths spread over 1..max_hops). Without an `=`, a
    one-hop answer is exactly an induction-head copy (the token that followed the
    earlier occurrence of the query name); each further hop repeats that lookup.
Since every variable is bound exactly once, resolving a variable whose chain has
d links takes exactly d lookups; d is that answer token's difficulty.

Each token carries a difficulty as a prediction target (given everything before it):
   0  format tokens determined by the prefix: `=`, `;`, `?` (fixed line count), `.`, EOS;
  -1  random draws that no model can predict: bound names, right-hand sides, query names;
   k  the answer digit, which needs k hops through the bindings.
Validation programs come from a separate random stream and exclude any program
that also occurs in the training set.
"""

import dataclasses
import functools
import string

import numpy as np

from elastic_depth.data.errors import DataError

EOS = '<|endoftext|>'
FORMAT_TOKENS = (EOS, '=', ';', '?', '.')
DIGITS = tuple(str(d) for d in range(10))
VAR_NAMES = tuple(string.ascii_lowercase + string.ascii_uppercase)
RANDOM = -1  # difficulty of unpredictable tokens
FORMAT = 0   # difficulty of predictable format tokens
TRAIN_STREAM, VAL_STREAM = 0, 1


class SyntheticVocab:
  """Whitespace tokenizer over the synthetic vocabulary (same interface as HFTokenizer)."""

  def __init__(self, num_vars: int):
    self.tokens = FORMAT_TOKENS + DIGITS + VAR_NAMES[:num_vars]
    self._ids = {t: i for i, t in enumerate(self.tokens)}
    self.eos_id = self._ids[EOS]
    self.special_ids = frozenset({self.eos_id})

  @property
  def vocab_size(self) -> int:
    return len(self.tokens)

  def token_to_id(self, token: str) -> int:
    """Id of one token; DataError if it is not in the vocabulary."""
    if token not in self._ids:
      raise DataError(f'token {token!r} is not in the synthetic vocabulary')
    return self._ids[token]

  def encode_batch(self, docs: list[str]) -> list[np.ndarray]:
    """Splits each document on whitespace and maps tokens to int32 ids."""
    return [np.array([self.token_to_id(t) for t in d.split()], np.int32) for d in docs]

  def decode(self, ids) -> str:
    """Space-separated tokens."""
    return ' '.join(self.tokens[int(i)] for i in ids)

  def id_to_token(self, i: int) -> str:
    """Token string of one id."""
    return self.tokens[int(i)]


@dataclasses.dataclass
class Split:
  """Token ids and per-token difficulty of one split, one array per program."""
  ids: list[np.ndarray]
  difficulty: list[np.ndarray]

  def docs(self, vocab: SyntheticVocab) -> list[str]:
    """Programs as space-separated strings."""
    return [vocab.decode(x) for x in self.ids]


def check_config(max_hops: int, num_vars: int, num_examples: int) -> None:
  """Raises DataError for generator settings that cannot produce programs."""
  if max_hops < 1:
    raise DataError(f'data.synth_max_hops={max_hops} must be >= 1')
  if not max_hops <= num_vars <= len(VAR_NAMES):
    raise DataError(f'data.synth_num_vars={num_vars} must be in [synth_max_hops={max_hops}, '
                    f'{len(VAR_NAMES)}]')
  if num_examples < 1:
    raise DataError(f'data.synth_examples={num_examples} must be >= 1')


def program(rng: np.random.Generator, max_hops: int, num_vars: int,
            num_ops: int = 4) -> tuple[list[str], list[int]]:
  """One program (tokens, difficulty per token): bindings, then a query for every variable.

  The chain of the first query variable needs k ~ U{1..max_hops} hops; the other
  variables' chains (distractors) have their own depths, which are their difficulty.
  (num_ops belongs to the compose task and is ignored.)
  """
  del num_ops
  hops = int(rng.integers(1, max_hops + 1))
  n_lines = min(num_vars, 2 * max_hops)
  names = [VAR_NAMES[i] for i in rng.permutation(num_vars)[:n_lines]]
  value = DIGITS[rng.integers(10)]
  rhs = {names[0]: value}
  for i in range(1, hops):
    rhs[names[i]] = names[i - 1]
  for i in range(hops, n_lines):
    if rng.random() < 0.5:
      rhs[names[i]] = DIGITS[rng.integers(10)]
    else:
      rhs[names[i]] = names[rng.integers(i)]
  tokens, difficulty = [], []
  for i in rng.permutation(n_lines):
    tokens += [names[i], rhs[names[i]], ';']
    difficulty += [RANDOM, RANDOM, FORMAT]
  order = [hops - 1] + [int(i) for i in rng.permutation(n_lines) if i != hops - 1]
  for i in order:
    depth, x = 1, rhs[names[i]]
    while x not in DIGITS:
      depth, x = depth + 1, rhs[x]
    tokens += ['?', names[i], x, '.']
    difficulty += [FORMAT, RANDOM, depth, FORMAT]
  return tokens, difficulty


WORLD_SEED = 20260717  # the op permutations are part of the task, not of the data seed


@functools.lru_cache(maxsize=None)
def op_tables(num_ops: int) -> dict[str, np.ndarray]:
  """The fixed permutation of the 10 digits that each op symbol applies (the first n
  tables do not depend on num_ops)."""
  rng = np.random.default_rng(WORLD_SEED)
  return {VAR_NAMES[j]: rng.permutation(10) for j in range(num_ops)}


def _apply_ops(tables: dict[str, np.ndarray], seq: list[str], x: int) -> int:
  """Digit x under the ops of seq, applied in order."""
  for o in seq:
    x = int(tables[o][x])
  return x


def compose_program(rng: np.random.Generator, max_hops: int, num_vars: int,
                    num_ops: int = 4) -> tuple[list[str], list[int]]:
  """`? d o1 o2 .. ok = v .`: v = ok(...o1(d)), k ~ U{1..max_hops} ops from num_ops
  permutations (at most num_vars).

  Each op is a fixed permutation of the digits (learned into the weights); the answer
  needs the k ops applied in order, so its difficulty is k.
  """
  tables = op_tables(min(num_ops, num_vars))
  ops = list(tables)
  k = int(rng.integers(1, max_hops + 1))
  start = int(rng.integers(10))
  seq = [ops[int(i)] for i in rng.integers(len(ops), size=k)]
  x = _apply_ops(tables, seq, start)
  tokens = ['?', DIGITS[start]] + seq + ['=', DIGITS[x], '.']
  difficulty = [FORMAT, RANDOM] + [RANDOM] * k + [RANDOM, k, FORMAT]
  return tokens, difficulty


CHAIN_SEGMENTS = 8  # answers per chain program


def chain_program(rng: np.random.Generator, max_hops: int, num_vars: int,
                  num_ops: int = 4) -> tuple[list[str], list[int]]:
  """`d o o v1 o v2 ...`: CHAIN_SEGMENTS segments of k ~ U{1..max_hops} ops, each followed
  by the value of its ops applied in order to the previous digit.

  There is no `=`: an op position cannot tell whether its segment ends there, so every op
  position has to hold the running value, and the answer after k ops needs the k
  permutations applied one after the other (difficulty k). Same op tables as compose.
  """
  tables = op_tables(min(num_ops, num_vars))
  ops = list(tables)
  x = int(rng.integers(10))
  tokens, difficulty = [DIGITS[x]], [RANDOM]
  for _ in range(CHAIN_SEGMENTS):
    k = int(rng.integers(1, max_hops + 1))
    for i in rng.integers(len(ops), size=k):
      x = int(tables[ops[int(i)]][x])
      tokens.append(ops[int(i)])
    tokens.append(DIGITS[x])
    difficulty += [RANDOM] * k + [k]
  return tokens, difficulty


def digit_last_program(rng: np.random.Generator, max_hops: int, num_vars: int,
                       num_ops: int = 4) -> tuple[list[str], list[int]]:
  """`o1 .. ok d v o1 .. d v ...`: CHAIN_SEGMENTS segments of k ~ U{1..max_hops} ops, then a
  random start digit d, then v = ok(...o1(d)).

  The ops come before the digit they apply to, so no op position can hold a value: the
  digit's own position has to apply the k ops (difficulty k) when decoding one token at
  a time as in parallel scoring, unlike chain, where every op position holds the running
  value and a decoded token needs one lookup on top of it. Same op tables as compose.
  """
  tables = op_tables(min(num_ops, num_vars))
  ops = list(tables)
  tokens, difficulty = [], []
  for _ in range(CHAIN_SEGMENTS):
    k = int(rng.integers(1, max_hops + 1))
    seq = [ops[int(i)] for i in rng.integers(len(ops), size=k)]
    start = int(rng.integers(10))
    tokens += seq + [DIGITS[start], DIGITS[_apply_ops(tables, seq, start)]]
    difficulty += [RANDOM] * (k + 1) + [k]
  return tokens, difficulty


TASKS = {'binding': program, 'compose': compose_program, 'chain': chain_program,
         'digit_last': digit_last_program}
_OP_TASKS = ('compose', 'chain', 'digit_last')  # tasks over the fixed op permutations


def generate(num_examples: int, max_hops: int, num_vars: int, seed: int,
             stream: int, exclude: frozenset = frozenset(), task: str = 'binding',
             num_ops: int = 4) -> Split:
  """`num_examples` programs from the random stream (seed, stream), skipping `exclude`."""
  check_config(max_hops, num_vars, num_examples)
  vocab = SyntheticVocab(num_vars)
  rng = np.random.default_rng([seed, stream])
  ids, difficulty = [], []
  for _ in range(100 * num_examples + 1000):
    if len(ids) == num_examples:
      break
    tokens, diff = TASKS[task](rng, max_hops, num_vars, num_ops)
    if tuple(tokens) in exclude:
      continue
    ids.append(np.array([vocab.token_to_id(t) for t in tokens], np.int32))
    difficulty.append(np.array(diff, np.int32))
  if len(ids) < num_examples:
    raise DataError(f'only {len(ids)} of {num_examples} synthetic programs are new: too few '
                    'distinct programs; raise data.synth_num_vars or data.synth_max_hops')
  return Split(ids, difficulty)


def load(num_examples: int, max_hops: int, num_vars: int, seed: int,
         val_fraction: float, task: str = 'binding',
         num_ops: int = 4) -> tuple[Split, Split, SyntheticVocab]:
  """Train and validation programs (disjoint) and the vocabulary.

  Args:
    num_examples: training programs.
    max_hops: largest hop count k.
    num_vars: variable names in the vocabulary (>= max_hops, <= 52).
    seed: random seed; the same seed gives the same programs.
    val_fraction: validation programs = max(1, round(num_examples * val_fraction)).
    task: 'binding' (k-hop variable lookup), 'compose' (k fixed permutations applied
      in order), 'chain' (segments of k permutations continuing from the previous
      answer) or 'digit_last' (segments of k permutations, then the digit they apply to);
      validation excludes training programs only for 'binding'.
    num_ops: the op tasks: how many fixed permutations (op symbols, at most num_vars).

  Returns:
    (train, val, vocab); each Split holds int32 ids [T_i] and difficulty [T_i] per program.
  """
  if task not in TASKS:
    raise DataError(f'data.synth_task={task!r} not in {sorted(TASKS)}')
  vocab = SyntheticVocab(num_vars)
  if task in _OP_TASKS and not 1 <= num_ops <= num_vars:
    raise DataError(f'data.synth_num_ops={num_ops} must be in [1, synth_num_vars={num_vars}]')
  train = generate(num_examples, max_hops, num_vars, seed, TRAIN_STREAM, task=task,
                   num_ops=num_ops)
  seen = frozenset(tuple(vocab.decode(x).split()) for x in train.ids)
  n_val = max(1, int(round(num_examples * val_fraction)))
  val = generate(n_val, max_hops, num_vars, seed, VAL_STREAM,
                 exclude=seen if task == 'binding' else frozenset(), task=task,
                 num_ops=num_ops)
  return train, val, vocab
