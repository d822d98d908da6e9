"""Depth-wise batched generation against per-row decoding.generate and a brute-force schedule."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import exit_model_config, gumbel_pick_np

from elastic_depth import config, decoding, inference, model as model_lib, serving

R, N = 8, 5  # max loops, new tokens per row
PROMPTS = [[3, 17, 5, 9], [40, 2, 31, 0], [1, 2, 3, 4]]  # row 1 has 3 tokens + padding
PLEN = [4, 3, 4]


def _eps_between(kls):
  """Two thresholds from a uniform-depth trace (loops >= 2), far in log space from every KL."""
  v = np.sort(np.log(np.concatenate([k.ravel() for k in kls[1:]])))
  gaps = np.diff(v)
  lo, hi = len(v) // 5, 4 * len(v) // 5

  def pick(a, b):
    j = a + int(np.argmax(gaps[a:b]))
    return float(np.exp(0.5 * (v[j] + v[j + 1])))
  return pick(lo, len(v) // 2), pick(len(v) // 2, hi)


def _two_tiers(mdl, rng, policy: str, stat: str, patience: int = 1, growth: float = 1.0):
  """Depth-wise generation of PROMPTS with two eps tiers taken from the trace of `stat`."""
  prompts = jnp.asarray(PROMPTS, jnp.int32)
  tr = inference.score(mdl, prompts, config.ExitConfig(policy='uniform', depth=R), rng,
                       trace=True).traces
  eps_lo, eps_hi = _eps_between(list(np.asarray(tr[stat])))
  cfg = config.ExitConfig(policy=policy, eps=eps_hi, max_loops=R, min_loops=2,
                          patience=patience, eps_growth=growth)
  eps_B = jnp.asarray([eps_hi, eps_lo, eps_hi], jnp.float32)
  out = jax.jit(lambda p, e, n: serving.generate(mdl, p, N, cfg, rng, eps_B=e,
                                                  prompt_len_B=n))(
      prompts, eps_B, jnp.asarray(PLEN, jnp.int32))
  return cfg, eps_B, out


@pytest.fixture(scope='module')
def setup():
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(5))
  rng = jax.random.key(0)
  return (mdl, rng) + _two_tiers(mdl, rng, 'kl', 'kl')


def _alone(mdl, cfg, rng):
  """decoding.generate of one row (eps traced: one compilation per prompt length)."""
  return jax.jit(lambda p, eps: decoding.generate(
      mdl, p, N, dataclasses.replace(cfg, eps=eps), rng))


def _assert_rows_equal_alone(gen, eps_B, out):
  """Each row's tokens and depths equal its own lockstep generation with its eps."""
  depth = np.asarray(out.depth)
  for b, (p, n) in enumerate(zip(PROMPTS, PLEN)):
    toks, d = gen(jnp.asarray([p[:n]], jnp.int32), eps_B[b])
    np.testing.assert_array_equal(depth[b], np.asarray(d[0]))
    np.testing.assert_array_equal(np.asarray(out.tokens[b, :n + N]), np.asarray(toks[0]))


def test_rows_equal_their_own_generation_with_their_eps(setup):
  mdl, rng, cfg, eps_B, out = setup
  gen = _alone(mdl, cfg, rng)
  depth = np.asarray(out.depth)
  assert len(np.unique(depth)) > 2 and np.any(depth[0] != depth[2])  # ragged exits
  _assert_rows_equal_alone(gen, eps_B, out)
  # the two quality tiers differ: the lower eps runs deeper on the same prompt
  _, d_lo = gen(jnp.asarray([PROMPTS[0]], jnp.int32), eps_B[1])
  assert np.mean(np.asarray(d_lo)) > np.mean(depth[0])


def _schedule(depth_BxN):
  """Brute-force engine timeline: per step, the loop each row runs (0: idle)."""
  rows = [[i for d in ds for i in range(1, d + 1)] for ds in depth_BxN.tolist()]
  steps = max(len(r) for r in rows)
  loops = [[r[t] if t < len(r) else 0 for r in rows] for t in range(steps)]
  ends = [set(np.cumsum(ds)[:-1].tolist()) for ds in depth_BxN.tolist()]
  return steps, loops, ends


def _bucket(n: int, b: int) -> int:
  """Rows a pass over n of b rows executes: 0, or the smallest power of two >= n, capped at b."""
  return 0 if n == 0 else min(b, 1 << (n - 1).bit_length())


def _replay(depth_BxN, cfg, *, paired: bool):
  """Per step, the rows needing a paired check, a final readout and an admission."""
  steps, loops, ends = _schedule(depth_BxN)
  first = max(cfg.min_loops, 2)
  is_check = lambda i: i >= first and (i - cfg.min_loops) % cfg.check_every == 0
  out = []
  for t, ls in enumerate(loops):
    nxt = loops[t + 1] if t + 1 < steps else [0] * len(ls)
    exits = [i > 0 and nxt[b] in (0, 1) for b, i in enumerate(ls)]
    pairs = [paired and i > 0 and is_check(i) for i in ls]  # kl: no gate
    finals = [x and not p for x, p in zip(exits, pairs)]
    admits = [t + 1 in e for e in ends]
    out.append((sum(pairs), sum(finals), sum(admits)))
  return steps, out


def _assert_counts_replayed(depth, cfg, counts, *, paired: bool, fused: bool = False):
  """Counts equal the replay, each pass counted at its bucket; returns the buckets used.

  fused: the readout and admission are one pass over every exit (checks that never read
  out), so the admissions run on the final readouts' buffer, last tokens included."""
  b = depth.shape[0]
  steps, per_step = _replay(depth, cfg, paired=paired)
  assert int(counts.steps) == steps
  assert int(counts.core_rows) == b * steps
  assert int(counts.active_rows) == depth.sum()
  assert int(counts.readout_rows) == sum(2 * _bucket(p, b) + _bucket(f, b)
                                         for p, f, _ in per_step)  # a pair reads 2 states
  assert int(counts.prelude_rows) == b + sum(_bucket(f if fused else a, b)
                                             for _, f, a in per_step)
  return {_bucket(n, b) for row in per_step for n in row} - {0}


def test_counts_equal_the_brute_force_schedule(setup):
  _, _, cfg, _, out = setup
  depth = np.asarray(out.depth)
  _assert_counts_replayed(depth, cfg, out.counts, paired=True)
  # the schedule alone: a final readout only where a token stops at R off a check loop
  finals = sum(f for _, f, _ in _replay(depth, cfg, paired=True)[1])
  assert finals == sum(d == R and not (R - cfg.min_loops) % cfg.check_every == 0
                       for d in depth.ravel())


@pytest.mark.parametrize('patience', [1, 2])
def test_state_change_rows_equal_their_own_generation(patience):
  """The check without a readout: each exit reads out once; rows equal their lockstep runs
  (with patience 2, a row's run of loops below its eps restarts with each token)."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(5))
  rng = jax.random.key(0)
  cfg, eps_B, out = _two_tiers(mdl, rng, 'state_delta', 'delta', patience)
  depth = np.asarray(out.depth)
  assert len(np.unique(depth)) > 2  # ragged exits
  _assert_rows_equal_alone(_alone(mdl, cfg, rng), eps_B, out)
  _assert_counts_replayed(depth, cfg, out.counts, paired=False, fused=True)  # exits read out
  # the same engine with the readout and the admission as two passes
  two = jax.jit(lambda p, e, n: serving.generate(mdl, p, N, cfg, rng, eps_B=e, prompt_len_B=n,
                                                  fuse=False))(
      jnp.asarray(PROMPTS, jnp.int32), eps_B, jnp.asarray(PLEN, jnp.int32))
  np.testing.assert_array_equal(np.asarray(two.tokens), np.asarray(out.tokens))
  np.testing.assert_array_equal(np.asarray(two.depth), depth)
  _assert_counts_replayed(depth, cfg, two.counts, paired=False)


@pytest.mark.parametrize('policy,stat', [('kl', 'kl'), ('state_delta', 'delta')])
def test_eps_growth_rows_equal_their_own_generation(policy, stat):
  """exit.eps_growth in the engine's checks (the paired KL and the state change, per row
  and loop) as in decoding's: rows equal their lockstep runs, and exit earlier."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(5))
  rng = jax.random.key(0)
  cfg, eps_B, out = _two_tiers(mdl, rng, policy, stat, growth=4.0)
  _assert_rows_equal_alone(_alone(mdl, cfg, rng), eps_B, out)
  flat = jax.jit(lambda p, e, n: serving.generate(
      mdl, p, N, dataclasses.replace(cfg, eps_growth=1.0), rng, eps_B=e, prompt_len_B=n))(
          jnp.asarray(PROMPTS, jnp.int32), eps_B, jnp.asarray(PLEN, jnp.int32))
  assert np.asarray(out.depth).mean() < np.asarray(flat.depth).mean()


def test_uniform_equals_lockstep_generation():
  """A0; with attention in the core only (prelude and coda blocks keep no cache)."""
  mdl = model_lib.LoopedLM(dataclasses.replace(exit_model_config(), attention='core'), nnx.Rngs(2))
  rng = jax.random.key(1)
  cfg = config.ExitConfig(policy='uniform', depth=3)
  prompts = jnp.asarray(PROMPTS, jnp.int32)
  out = jax.jit(lambda p: serving.generate(mdl, p, N, cfg, rng))(prompts)
  toks, depth = jax.jit(lambda p: decoding.generate(mdl, p, N, cfg, rng))(prompts)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(toks))
  np.testing.assert_array_equal(np.asarray(out.depth), np.asarray(depth))
  assert int(out.counts.steps) == 3 * N
  assert int(out.counts.readout_rows) == N * len(PROMPTS)  # one readout per token


def test_prefill_cfg_equals_lockstep_with_the_same_prompt_depth():
  """A deep prompt and shallow tokens (uniform 2 after a prompt at 6, the frontier's
  baseline in bench_generate): depths and forced NLLs equal decoding.generate's with the
  same prefill_cfg, and the NLLs differ from a prompt prefilled at the tokens' own depth."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(2))
  rng = jax.random.key(1)
  cfg = config.ExitConfig(policy='uniform', depth=2)
  deep = config.ExitConfig(policy='uniform', depth=6)
  prompts = jnp.asarray(PROMPTS, jnp.int32)
  forced = jax.random.randint(jax.random.key(3), (len(PROMPTS), N), 0, mdl.cfg.vocab_size)
  served = lambda pre: jax.jit(lambda p, f: serving.generate(
      mdl, p, N, cfg, rng, forced_BxN=f, prefill_cfg=pre))(prompts, forced)
  out, shallow = served(deep), served(None)
  _, depth, nll = jax.jit(lambda p, f: decoding.generate(
      mdl, p, N, cfg, rng, forced_BxN=f, prefill_cfg=deep))(prompts, forced)
  np.testing.assert_array_equal(np.asarray(out.depth), np.asarray(depth))
  np.testing.assert_array_equal(np.asarray(out.prompt_depth), 6)
  np.testing.assert_array_equal(np.asarray(shallow.prompt_depth), 2)
  np.testing.assert_allclose(np.asarray(out.nll), np.asarray(nll), rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(np.asarray(out.nll) - np.asarray(shallow.nll))) > 1e-3
  with pytest.raises(ValueError, match='depth'):
    serving.generate(mdl, prompts, N, cfg, rng, prefill_cfg=config.ExitConfig(
        policy='uniform', depth=0))


def test_bad_input_is_one_error_line(setup):
  mdl, rng, _, _, _ = setup
  p = jnp.asarray(PROMPTS, jnp.int32)
  with pytest.raises(ValueError, match='error: serving supports'):
    serving.generate(mdl, p, N, config.ExitConfig(policy='router'), rng)
  with pytest.raises(ValueError, match='error: eps_B'):
    serving.generate(mdl, p, N, config.ExitConfig(), rng, eps_B=jnp.ones((2,)))


def test_compacted_passes_equal_all_rows_passes(setup):
  """B = 8 rows, two tiers, ragged prompts: compacted readouts/admissions change nothing."""
  mdl, rng, cfg, eps_B, _ = setup
  prompts = jnp.asarray(PROMPTS + [[9, 5, 17, 3], [0, 31, 2, 40], [4, 3, 2, 1], [7, 11, 0, 0],
                                   [22, 8, 30, 0]], jnp.int32)
  plen = jnp.asarray(PLEN + [4, 3, 4, 2, 3], jnp.int32)
  eps8 = jnp.tile(eps_B, 3)[:8][::-1]

  def engine(compact: bool):
    def fn(p, e, n):
      st, _, e = serving.start(mdl, p, N, cfg, rng, eps_B=e, prompt_len_B=n)
      return serving.run(mdl, st, cfg, rng, e, compact=compact)
    return jax.jit(fn)(prompts, eps8, plen)
  new, old = engine(True), engine(False)
  depth = np.asarray(new.depth)
  assert len(np.unique(depth)) > 2
  for name in ('tokens', 'depth', 'pos', 'loop', 'n'):
    np.testing.assert_array_equal(np.asarray(getattr(new, name)), np.asarray(getattr(old, name)))
  chex.assert_trees_all_close((new.logits, new.s, new.inj, new.cache),
                              (old.logits, old.s, old.inj, old.cache), rtol=1e-5, atol=1e-6)
  assert {1, 2, 4, 8} <= _assert_counts_replayed(depth, cfg, new.counts, paired=True)
  assert int(new.counts.readout_rows) < int(old.counts.readout_rows)
  assert int(new.counts.prelude_rows) < int(old.counts.prelude_rows)


def _steps_waiting(depth_BxN, wait_rows) -> tuple[int, int]:
  """Brute-force engine steps under serving's wait rule (a pass once wait_rows rows wait,
  or no row has a token in flight), and the core rows executed: each step's rows in
  flight, in their bucket (wait_rows > 1), or all B rows (wait_rows = 1)."""
  b, n = depth_BxN.shape
  left = [int(d) for d in depth_BxN[:, 0]]  # loops left of each row's token in flight
  wait, exited, steps, core = [False] * b, [0] * b, 0, 0
  while any(e < n for e in exited):
    running = [not w and e < n for w, e in zip(wait, exited)]
    if any(wait) and (sum(wait) >= wait_rows or not any(running)):
      for r in range(b):
        if wait[r] and exited[r] < n:
          left[r] = int(depth_BxN[r, exited[r]])
      wait = [False] * b
    flying = sum(not w and e < n for w, e in zip(wait, exited))
    core += _bucket(flying, b) if wait_rows > 1 else b
    for r in range(b):
      if not wait[r] and exited[r] < n:
        left[r] -= 1
        if left[r] == 0:
          wait[r], exited[r] = True, exited[r] + 1
    steps += 1
  return steps, core


def test_waiting_rows_change_the_schedule_not_the_tokens(setup):
  """wait_rows: exited rows idle until that many wait. Tokens, depths and caches equal the
  default engine's (wait_rows = 1: no row waits); the steps equal a brute-force replay of
  the rule, and so do the core rows (wait_rows > 1: the core loop compacted to the rows in
  flight); with wait_rows = B every token round lasts its deepest row's loops (lockstep's
  schedule) and every admission pass takes all B rows."""
  mdl, rng, cfg, eps_B, out = setup
  prompts, plen = jnp.asarray(PROMPTS, jnp.int32), jnp.asarray(PLEN, jnp.int32)
  b = len(PROMPTS)

  def engine(wait_rows):
    fn = lambda p, e, n: serving.generate(mdl, p, N, cfg, rng, eps_B=e, prompt_len_B=n,
                                          wait_rows=wait_rows)
    return jax.jit(fn)(prompts, eps_B, plen)
  depth = np.asarray(out.depth)
  assert int(out.counts.steps) == depth.sum(axis=1).max() == _steps_waiting(depth, 1)[0]
  steps = {}
  for wait_rows in (2, b):
    got = engine(wait_rows)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(out.tokens))
    np.testing.assert_array_equal(np.asarray(got.depth), depth)
    assert int(got.counts.active_rows) == depth.sum()
    steps[wait_rows] = int(got.counts.steps)
    assert (steps[wait_rows], int(got.counts.core_rows)) == _steps_waiting(depth, wait_rows)
    assert int(got.counts.core_rows) < b * steps[wait_rows]  # idle rows skipped
  assert steps[b] == depth.max(axis=0).sum()
  assert int(got.counts.prelude_rows) == b * N
  assert steps[2] > int(out.counts.steps)  # waiting delays the rows that wait


def test_sampled_rows_equal_their_own_generation(setup):
  """At temperature 1 a row's samples depend on (rng, its request's seed, position) only:
  the depth-wise engine's rows (one prompt twice, with two seeds), lockstep decoding's
  batched rows and each row generated alone with its seed agree; the prompt given twice
  samples apart; each first token is the Gumbel-max draw of its prefill logits (numpy)."""
  mdl, rng, cfg, _, _ = setup
  rows = PROMPTS + [PROMPTS[0]]
  prompts, plen = jnp.asarray(rows, jnp.int32), jnp.asarray(PLEN + [PLEN[0]], jnp.int32)
  seeds = jnp.asarray([11, 4, 7, 5], jnp.int32)
  gens = {t: jax.jit(lambda p, s, t=t: decoding.generate(mdl, p, N, cfg, rng, temperature=t,
                                                         seed_B=s))
          for t in (0.0, 1.0)}
  out = jax.jit(lambda p, n, s: serving.generate(mdl, p, N, cfg, rng, prompt_len_B=n,
                                                 temperature=1.0, seed_B=s))(prompts, plen, seeds)
  m = min(PLEN)
  batched, _ = gens[1.0](prompts[:, :m], seeds)
  sampled_differs = False
  for b, (p, n) in enumerate(zip(rows, np.asarray(plen))):
    alone, _ = gens[1.0](jnp.asarray([p[:n]], jnp.int32), seeds[b:b + 1])
    np.testing.assert_array_equal(np.asarray(out.tokens[b, :n + N]), np.asarray(alone[0]))
    short, _ = gens[1.0](jnp.asarray([p[:m]], jnp.int32), seeds[b:b + 1])
    np.testing.assert_array_equal(np.asarray(batched[b]), np.asarray(short[0]))
    greedy, _ = gens[0.0](jnp.asarray([p[:n]], jnp.int32), seeds[b:b + 1])
    sampled_differs |= bool(np.any(np.asarray(greedy[0]) != np.asarray(alone[0])))
  assert sampled_differs  # the test samples
  assert np.any(np.asarray(out.tokens[0, 4:]) != np.asarray(out.tokens[3, 4:]))
  logits = inference.score(mdl, prompts, cfg, rng).logits[jnp.arange(4), plen - 1]
  np.testing.assert_array_equal(np.asarray(out.tokens[jnp.arange(4), plen]),
                                gumbel_pick_np(logits, plen, rng, 1.0, seeds))


@pytest.mark.parametrize('policy', ['kl', 'state_delta'])
def test_forced_rows_equal_their_own_forced_decoding(setup, policy):
  """Forced decoding through the engine (right-padded prompts, two eps tiers, wait_rows 1
  and B; state_delta: the fused readout and admission): each row's tokens are the forced
  ones, and its depths and NLLs equal lockstep forced decoding of that row alone; a forced
  run leaves the executed schedule as replayed."""
  mdl, rng, cfg, eps_B, _ = setup
  if policy == 'state_delta':
    cfg, eps_B, _ = _two_tiers(mdl, rng, 'state_delta', 'delta')
  prompts, plen = jnp.asarray(PROMPTS, jnp.int32), jnp.asarray(PLEN, jnp.int32)
  forced = jax.random.randint(jax.random.key(7), (len(PROMPTS), N), 0, mdl.cfg.vocab_size)
  alone = jax.jit(lambda p, f, eps: decoding.generate(
      mdl, p, N, dataclasses.replace(cfg, eps=eps), rng, forced_BxN=f))
  for wait_rows in (1, len(PROMPTS)):
    out = jax.jit(lambda p, e, n, f: serving.generate(
        mdl, p, N, cfg, rng, eps_B=e, prompt_len_B=n, wait_rows=wait_rows, forced_BxN=f))(
            prompts, eps_B, plen, forced)
    depth = np.asarray(out.depth)
    assert len(np.unique(depth)) > 1
    if wait_rows == 1:
      _assert_counts_replayed(depth, cfg, out.counts, paired=policy == 'kl',
                              fused=policy == 'state_delta')
    for b, (p, n) in enumerate(zip(PROMPTS, PLEN)):
      _, d, nll = alone(jnp.asarray([p[:n]], jnp.int32), forced[b:b + 1], eps_B[b])
      np.testing.assert_array_equal(np.asarray(out.tokens[b, n:n + N]), np.asarray(forced[b]))
      np.testing.assert_array_equal(depth[b], np.asarray(d[0]))
      np.testing.assert_allclose(np.asarray(out.nll[b]), np.asarray(nll[0]), rtol=1e-5,
                                 atol=1e-5)


def test_start_names_bad_rows_before_any_work():
  """prompt_len_B outside [1, P] picked garbage tokens; a short forced_BxN emitted
  -2**31; a NaN eps never exited: each is refused before the prefill."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(0))
  rng, p = jax.random.key(0), jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]])
  cfg = config.ExitConfig(eps=1e-2, max_loops=3)
  for kw, words in [(dict(prompt_len_B=jnp.array([0, 4])), r'prompt_len_B must lie in \[1, 4\]'),
                    (dict(prompt_len_B=jnp.array([5, 4])), r'prompt_len_B must lie in'),
                    (dict(prompt_len_B=jnp.array([2.0, 4.0])), 'integer lengths'),
                    (dict(prompt_len_B=jnp.array([2, 4, 4])), r'prompt_len_B must have shape'),
                    (dict(forced_BxN=jnp.ones((2, 2), jnp.int32)), r'forced_BxN .*\(2, 3\)'),
                    (dict(eps_B=jnp.array([0.1, jnp.nan])), 'eps_B must be finite'),
                    (dict(seed_B=jnp.array([1, 2, 3])), r'seed_B must have shape \(2,\)'),
                    (dict(seed_B=jnp.array([1.0, 2.0])), 'seed_B must hold integer seeds')]:
    with pytest.raises(ValueError, match=words):
      serving.generate(mdl, p, 3, cfg, rng, **kw)
  with pytest.raises(ValueError, match='ids must lie in'):
    serving.generate(mdl, p.at[1, 0].set(-3), 3, cfg, rng)


def test_bf16_rows_equal_their_own_generation():
  """In bf16 too: the serving engine's passes and decode_step attend alike (normalized
  after the value product, one rounding), so rows decode as they do alone."""
  mdl = model_lib.LoopedLM(dataclasses.replace(exit_model_config(), dtype='bfloat16'),
                           nnx.Rngs(5))
  rng = jax.random.key(0)
  cfg, eps_B, out = _two_tiers(mdl, rng, 'kl', 'kl')
  assert len(np.unique(np.asarray(out.depth))) > 2  # ragged exits
  _assert_rows_equal_alone(_alone(mdl, cfg, rng), eps_B, out)


def test_uncompacted_waiting_rows_equal_default_engine():
  """compact=False with wait_rows > 1 (the benchmark baseline) must give the default
  engine's tokens and depths: waiting rows must not rewrite their core cache slot."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(5))
  rng = jax.random.key(0)
  cfg, eps_B, out = _two_tiers(mdl, rng, 'kl', 'kl')
  prompts, plen = jnp.asarray(PROMPTS, jnp.int32), jnp.asarray(PLEN, jnp.int32)
  def fn(p, e, n):
    st, _, e = serving.start(mdl, p, N, cfg, rng, eps_B=e, prompt_len_B=n)
    return serving.run(mdl, st, cfg, rng, e, compact=False, wait_rows=len(PROMPTS))
  got = jax.jit(fn)(prompts, eps_B, plen)
  np.testing.assert_array_equal(np.asarray(got.depth), np.asarray(out.depth))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(out.tokens))


def test_serving_gated_kl_rows_equal_their_own_generation():
  """policy gated_kl in the serving engine (untested there): each row's tokens and
  depths equal decoding.generate of that row alone (whose gate decoding_test checks against
  the float64 brute force), at a gate that binds."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(5))
  rng = jax.random.key(0)
  prompts = jnp.asarray(PROMPTS, jnp.int32)
  tr = inference.score(mdl, prompts, config.ExitConfig(policy='uniform', depth=R), rng,
                       trace=True).traces
  eps_lo, eps_hi = _eps_between(list(np.asarray(tr['kl'])))
  gate = float(np.median(np.asarray(tr['delta'])[1:]))
  cfg = config.ExitConfig(policy='gated_kl', eps=eps_hi, max_loops=R, min_loops=2, gate=gate)
  eps_B = jnp.asarray([eps_hi, eps_lo, eps_hi], jnp.float32)
  out = jax.jit(lambda p, e, n: serving.generate(mdl, p, N, cfg, rng, eps_B=e,
                                                  prompt_len_B=n))(
      prompts, eps_B, jnp.asarray(PLEN, jnp.int32))
  assert len(np.unique(np.asarray(out.depth))) > 1
  _assert_rows_equal_alone(_alone(mdl, cfg, rng), eps_B, out)


def test_the_first_check_is_at_loop_2_with_min_loops_1(setup):
  """min_loops=1: a check compares loop i with loop i - 1, so the first is at loop 2, as in
  decoding: at an eps above every KL each token exits there, and rows equal their own
  lockstep generation."""
  mdl, rng, _, _, _ = setup
  cfg = config.ExitConfig(policy='kl', eps=1e9, max_loops=R, min_loops=1)
  out = jax.jit(lambda p, n: serving.generate(mdl, p, N, cfg, rng, prompt_len_B=n))(
      jnp.asarray(PROMPTS, jnp.int32), jnp.asarray(PLEN, jnp.int32))
  np.testing.assert_array_equal(np.asarray(out.depth), np.full((len(PROMPTS), N), 2))
  _assert_rows_equal_alone(_alone(mdl, cfg, rng), jnp.full(len(PROMPTS), 1e9), out)


def test_run_until_stops_at_the_slowest_rows_count_and_resumes(setup):
  """run(until=2) stops once every row has 2 tokens (the slowest has exactly 2); each row's
  tokens and depths so far are the full run's, and running on from that State gives the
  full generation."""
  mdl, rng, cfg, eps_B, out = setup

  def fn(p, e, n):
    st, _, e = serving.start(mdl, p, N, cfg, rng, eps_B=e, prompt_len_B=n)
    part = serving.run(mdl, st, cfg, rng, e, until=2)
    return part, serving.run(mdl, part, cfg, rng, e)
  part, full = jax.jit(fn)(jnp.asarray(PROMPTS, jnp.int32), eps_B, jnp.asarray(PLEN, jnp.int32))
  n = np.asarray(part.n)
  assert n.min() == 2, n
  for b, p in enumerate(PLEN):
    np.testing.assert_array_equal(np.asarray(part.depth[b, :n[b]]), np.asarray(out.depth[b, :n[b]]))
    np.testing.assert_array_equal(np.asarray(part.tokens[b, :p + n[b]]),
                                  np.asarray(out.tokens[b, :p + n[b]]))
  np.testing.assert_array_equal(np.asarray(full.tokens), np.asarray(out.tokens))
  np.testing.assert_array_equal(np.asarray(full.depth), np.asarray(out.depth))
