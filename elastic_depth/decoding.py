"""Autoregressive decoding of a frozen looped LM with a KV cache whose size does not
depend on the loops (cached semantics, documented in WORKSPACE.md).

One new token at a time (`decode_step`, `generate`, `score_cached`): in every core block
it attends to the keys/values that earlier tokens offered at their last executed loop
(one cache slot per token and block, overwritten each loop: Huginn-style KV sharing).
The prompt is prefilled in parallel semantics (`inference.score`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from elastic_depth import inference, losses, policies, recurrence
from elastic_depth.attention import grouped_attention
from elastic_depth.config import ExitConfig, ExitPolicy, check_exit
from elastic_depth.model import LoopedLM, check_tokens, keep_kv


class Cache(NamedTuple):
  """Per block (k, v) of shape [B, G, S, K] (kv-group-major) for prelude, core and coda blocks.

  The attention over the cache reads this layout directly (`attend`): no per-step
  transposed copy of the cache for the score and value matmuls.
  """
  prelude: list
  core: list
  coda: list


def init_cache(model: LoopedLM, batch: int, max_len: int) -> Cache:
  """An all-zero cache for max_len positions (size independent of the loop count)."""
  c = model.cfg
  z = lambda: (jnp.zeros((batch, c.num_kv_heads, max_len, c.head_dim), model.dtype),) * 2
  return Cache([z() for _ in range(c.n_prelude)], [z() for _ in range(c.n_core)],
               [z() for _ in range(c.n_coda)])


def group_major(x_BxLxGxK: jax.Array) -> jax.Array:
  """Token-major keys/values [B, L, G, K] in the cache's layout [B, G, L, K]."""
  return jnp.swapaxes(x_BxLxGxK, 1, 2)


def token_slots(c_BxGxSxK: jax.Array, start, n: int = 1) -> jax.Array:
  """Slots start..start+n of a cache array, token-major [B, n, G, K]."""
  return group_major(lax.dynamic_slice_in_dim(c_BxGxSxK, start, n, 2))


def attend(see_BxQxS: jax.Array):
  """Attention of a kv_fn's queries over a group-major cache: see [B or 1, Q, S] bool."""
  return lambda q, k, v: grouped_attention(q, k, v, 1, lambda i: k.shape[2],
                                           lambda i, end: see_BxQxS)


def fresh_kv(blocks, kvs, slot=None) -> list:
  """Each block's (k, v) at one slot (None: the last), token-major [B, 1, G, K].

  kvs are the blocks' outputs under cached kv_fns: caches for blocks with attention,
  token-major zeros for blocks without (model.attention=core).
  """
  at = lambda c: token_slots(c, c.shape[2] - 1 if slot is None else slot)
  return [(at(k), at(v)) if b.has_attn else (k[:, -1:], v[:, -1:])
          for b, (k, v) in zip(blocks, kvs)]


def _write(cache_kv, kv, start):
  """Token-major kv [B, n, G, K] into the cache at positions start..start+n."""
  return tuple(lax.dynamic_update_slice_in_dim(c, group_major(x).astype(c.dtype), start, 2)
               for c, x in zip(cache_kv, kv))


def _cached(cache_kv, pos, keep_B=None):
  """kv_fn writing the new token's (k, v) at pos and attending to positions <= pos."""
  def fn(k, v):
    if keep_B is not None:  # inactive rows keep the slot of their last executed loop
      m = keep_B[:, None, None, None]
      k = jnp.where(m, token_slots(cache_kv[0], pos), k)
      v = jnp.where(m, token_slots(cache_kv[1], pos), v)
    ks, vs = _write(cache_kv, (k, v), pos)
    return ks, vs, attend((jnp.arange(ks.shape[2]) <= pos)[None, None, :])
  return fn


def prefill(model: LoopedLM, prompt_BxP, cfg: ExitConfig, rng, max_len: int,
            router=None):
  """Runs the prompt in parallel semantics and fills a cache of max_len positions.

  Args:
    model: the frozen LM.
    prompt_BxP: int32 [B, P] prompt ids.
    cfg: the prompt's exit config (scored by `inference.score`).
    rng: key of the initial recurrent states.
    max_len: positions of the cache (>= P); slots 0..P-1 get the prompt's keys/values.
    router: the state probe, as `decode_step`.
  Returns:
    (cache, logits_BxV, depth_BxP): the Cache, fp32 [B, V] logits of the prompt's last
    position (predicting token P) and int32 [B, P] loops per prompt token.
  Raises:
    ValueError if the prompt is longer than max_len.
  """
  if prompt_BxP.shape[-1] > max_len:
    raise ValueError(f'a cache of max_len={max_len} positions cannot hold the '
                     f'{prompt_BxP.shape[-1]}-token prompt')
  res = inference.score(model, prompt_BxP, cfg, rng, router=router)
  cache = init_cache(model, prompt_BxP.shape[0], max_len)
  cache = Cache([_write(c, kv, 0) for c, kv in zip(cache.prelude, res.prelude_kv)],
                [_write(c, kv, 0) for c, kv in zip(cache.core, res.kv)],
                [_write(c, kv, 0) for c, kv in zip(cache.coda, res.coda_kv)])
  return cache, res.logits[:, -1], res.depth


def _pair_cached(cache_kv, pos):
  """kv_fn for two queries at one position (states of loops i-1 and i) over the cache."""
  def fn(k, v):  # k, v: [B, 2, G, K]
    ks = jnp.concatenate([cache_kv[0], group_major(k).astype(cache_kv[0].dtype)], axis=2)
    vs = jnp.concatenate([cache_kv[1], group_major(v).astype(cache_kv[1].dtype)], axis=2)
    s = cache_kv[0].shape[2]
    old = jnp.broadcast_to(jnp.arange(s) < pos, (2, s))
    return ks, vs, attend(jnp.concatenate([old, jnp.eye(2, dtype=bool)], axis=1)[None])
  return fn


def initial_states(model: LoopedLM, rng, length: int) -> jax.Array:
  """[length, 1, D]: the initial recurrent state of a token at each position, drawn once.

  `LoopedLM.initial_state` is a pure function of (rng, position), so row t is what a
  token at position t starts from in any batch; the decode loops index this table
  instead of drawing per token (XLA:CPU runs the truncated-normal draw as a rolled loop).
  """
  d = model.cfg.d_model
  return model.initial_state(jnp.zeros((1, length, d), model.dtype), rng,
                             jnp.arange(length)[None])[0][:, None]


def decode_step(model: LoopedLM, cache: Cache, token_B, pos, cfg: ExitConfig, rng,
                router=None, with_counts: bool = False, init_table=None,
                trace: bool = False, depth_B=None):
  """One new token at scalar position pos through the cache.

  For the KL policy the exit check reads the loop-(i-1) and loop-i states in one
  pass over the coda and head (one weight read for both), runs only when the
  relative state change is below cfg.gate (policy gated_kl), and the logits of a
  successful check are the token's output, so the final readout costs nothing extra.

  Args:
    model: the frozen LM.
    cache: the Cache of S positions, filled before pos (`prefill`, earlier steps).
    token_B: int32 [B] the new token of each row.
    pos: its position, a scalar int or int32 [] (0 <= pos < S).
    cfg: exit policy, eps, min/max loops, check_every, gate.
    rng: key of the token's initial recurrent state (read only without init_table).
    router: the state probe of policies router and kl_probe (`router.load`,
      `kl_probe.load`).
    with_counts: also return the step's executed `inference.Counts`.
    init_table: `initial_states(model, rng, S)` [S, 1, D], to read the token's initial
      state from (else drawn here).
    trace: also return the check's statistics at every loop, the states included
      (`policies.make_check_fn`'s trace: kl, delta, ..., state; [R, B, 1(, D)]).
    depth_B: int32 [B] given depths: a row also exits after depth_B loops (an oracle's or
      a request's depth; with policy uniform at a cap >= max(depth_B), exactly those loops).
  Returns:
    (logits_BxV, cache, depth_B[, Counts][, traces]): fp32 [B, V] logits of the new
    token's output (predicting position pos + 1), the Cache with its keys/values written
    at pos, int32 [B] loops it ran; with with_counts the `inference.Counts` (batch passes
    int32 [], per-token arrays int32 [B, 1]); with trace the dict of [R, B, 1(, D)] stats,
    R = `inference.loop_cap(cfg)`.
  Raises:
    ValueError for an int pos outside the cache, or an exit config it cannot honour.
  """
  check_exit(cfg)
  if isinstance(pos, int) and not 0 <= pos < cache.core[0][0].shape[2]:
    raise ValueError(f'pos={pos} lies outside the cache of {cache.core[0][0].shape[2]} '
                     'positions')
  tok = token_B[:, None]
  pos_Bx1 = jnp.full(tok.shape, pos, jnp.int32)
  e, pre_kv = model.encode(tok, pos_Bx1, [_cached(kv, pos) for kv in cache.prelude])
  if init_table is None:
    s0 = model.initial_state(e, rng, pos_Bx1)  # as in the parallel forward
  else:
    s0 = jnp.broadcast_to(lax.dynamic_index_in_dim(init_table, pos, 0, keepdims=False),
                          e.shape).astype(e.dtype)
  inj = model.inject(e)

  def masked_step(s, core_kv, active_Bx1):
    fns = [_cached(kv, pos, keep_B=~active_Bx1[:, 0]) for kv in core_kv]
    return model.core_step(s, inj, pos_Bx1, fns)

  def readout(s):
    return model.decode_state(s, pos_Bx1, [_cached(kv, pos) for kv in cache.coda])

  fast = (cfg.policy in (ExitPolicy.KL, ExitPolicy.GATED_KL) and router is None and not trace
          and depth_B is None)
  if fast:
    check_fn, carry = _gated_kl_check(model, cache, pos, cfg, token_B.shape[0])
  else:
    check_fn, carry0 = policies.make_check_fn(
        cfg.policy, eps=cfg.eps, readout=lambda s: readout(s)[0],
        w_VxD=model.head_matrix(), router=router, use_kernel=cfg.use_kernel,
        min_loops=cfg.min_loops, check_every=cfg.check_every, gate=cfg.gate,
        max_loops=inference.loop_cap(cfg), patience=cfg.patience, eps_growth=cfg.eps_growth,
        trace=trace, trace_states=trace)
    carry = carry0(s0)
    if depth_B is not None:
      check_fn = policies.scheduled(check_fn, lambda: jnp.asarray(depth_B)[:, None])
  res = recurrence.early_exit(
      masked_step, check_fn, s0, cache.core, carry, min_loops=cfg.min_loops,
      max_loops=inference.loop_cap(cfg), check_every=cfg.check_every, return_check=True,
      trace=trace)

  cache_len = cache.core[0][0].shape[2] if cache.core else 0  # `attend` reads every slot

  def final_readout(_):
    h, coda_kv = readout(res.state)
    return model.logits(h)[:, 0], fresh_kv(model.coda, coda_kv, pos)
  if fast:
    logits_c, kv_c, fresh, books = res.check
    final = jnp.logical_not(jnp.all(fresh))
    logits, new_kv = lax.cond(final, final_readout, lambda _: (logits_c, kv_c), None)
    counts = inference.exit_counts(res._replace(check=books), final.astype(jnp.int32),
                                   core_keys=cache_len)
  else:
    logits, new_kv = final_readout(None)
    counts = inference.exit_counts(res, core_keys=cache_len)
  coda = keep_kv(model.coda, [_write(c, kv, pos) for c, kv in zip(cache.coda, new_kv)],
                     cache.coda)
  pre_kv = keep_kv(model.prelude, pre_kv, cache.prelude)
  out = (logits, Cache(pre_kv, list(res.kv), coda), res.depth[:, 0])
  return out + (counts,) * with_counts + (res.traces,) * trace


def _gated_kl_check(model: LoopedLM, cache: Cache, pos, cfg: ExitConfig, batch: int):
  """The decode-time A1 check: carry = (logits_BxV, coda (k, v), fresh_B, CheckCarry counts).

  Each check reads two states (loops i-1 and i) in one coda + head pass: counted as two.
  """
  c = model.cfg
  pos_Bx2 = jnp.full((batch, 2), pos, jnp.int32)

  def pair(s_old, s_new):
    x = jnp.concatenate([s_old, s_new], axis=1)  # [B, 2, D]: loop i-1 and loop i
    h, kvs = model.decode_state(x, pos_Bx2, [_pair_cached(kv, pos) for kv in cache.coda])
    logits = model.logits(h)
    kv_new = fresh_kv(model.coda, kvs)  # the loop-i query's (last) slot
    return losses.kl_from_logits(logits[:, 1], logits[:, 0]), logits[:, 1], kv_new

  def check_fn(s_new, s_old, carry, i, active_Bx1):
    logits_c, kv_c, fresh, books = carry
    delta = policies.relative_change(s_new, s_old)[:, 0]
    may = (i >= max(cfg.min_loops, 2)) & ((i - cfg.min_loops) % cfg.check_every == 0)
    gated = cfg.policy == ExitPolicy.GATED_KL
    gate = delta < cfg.gate if gated else jnp.ones_like(delta, bool)
    run = jnp.any(active_Bx1[:, 0] & gate) & may

    def full(_):
      kl, logits, kv = pair(s_old, s_new)
      return kl, logits, kv, jnp.ones_like(fresh)

    def skip(_):
      return jnp.full_like(delta, jnp.inf), logits_c, kv_c, jnp.zeros_like(fresh)
    kl, logits, kv, ran = lax.cond(run, full, skip, None)
    act = active_Bx1[:, 0]
    upd = lambda new, old, m: jnp.where(m.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    logits_c = upd(logits, logits_c, act)
    kv_c = jax.tree.map(lambda n, o: upd(n, o, act), kv, kv_c)
    fresh = jnp.where(act, ran, fresh)
    n = 2 * run.astype(jnp.int32)
    books = policies.CheckCarry((), books.coda + n, books.head + n,
                                books.coda_BxL + n * active_Bx1, books.head_BxL + n * active_Bx1)
    eps = policies.threshold(cfg.eps, cfg.eps_growth, i)
    return ((kl < eps) & gate)[:, None], (logits_c, kv_c, fresh, books), {}

  z = jnp.zeros((batch, 1, c.num_kv_heads, c.head_dim), model.dtype)
  carry = (jnp.zeros((batch, c.vocab_size), jnp.float32), [(z, z) for _ in range(c.n_coda)],
           jnp.zeros((batch,), bool), policies.CheckCarry((), jnp.int32(0), jnp.int32(0),
                                                          *[jnp.zeros((batch, 1), jnp.int32)] * 2))
  return check_fn, carry


def score_cached(model: LoopedLM, tokens_BxL, prompt_len: int, cfg: ExitConfig, rng,
                 router=None, with_counts: bool = False):
  """Teacher-forced scoring in cached semantics: prefill the prompt, then one token at a time.

  Args:
    model: the frozen LM.
    tokens_BxL: int32 [B, L] the sequences; tokens 0..prompt_len-1 are prefilled.
    prompt_len: tokens prefilled in parallel semantics, 1 <= prompt_len < L.
    cfg: exit policy of the prompt and of every decode step.
    rng: key of the initial recurrent states.
    router: the state probe, as `decode_step`.
    with_counts: also return the decode steps' executed Counts.
  Returns:
    (logits, depth, prompt depth[, counts]): fp32 logits [B, L - prompt_len, V]
    predicting tokens prompt_len..L-1, the int32 depths [B, L - prompt_len] of tokens
    prompt_len..L-1, the prompt's int32 depths [B, prompt_len] and, with with_counts, the
    decode steps' `inference.Counts` stacked over tokens, T = L - prompt_len (batch passes
    and core_keys [T], per-token arrays [B, T]).
  Raises:
    ValueError if prompt_len is not in [1, L).
  """
  l = tokens_BxL.shape[1]
  if not 1 <= prompt_len < l:
    raise ValueError(f'prompt_len={prompt_len} must be in [1, {l}) (the sequence length)')
  cache, last, pdepth = prefill(model, tokens_BxL[:, :prompt_len], cfg, rng, l, router)
  init = initial_states(model, rng, l)

  def body(cache, t):
    tok = lax.dynamic_index_in_dim(tokens_BxL, t, 1, keepdims=False)
    logits, cache, d, n = decode_step(model, cache, tok, t, cfg, rng, router, with_counts=True,
                                      init_table=init)
    return cache, (logits, d, n)

  _, (logits, depth, n) = lax.scan(body, cache, jnp.arange(prompt_len, l))
  logits = jnp.concatenate([last[None], logits[:-1]], 0) if l > prompt_len else last[None]
  out = jnp.swapaxes(logits, 0, 1), jnp.swapaxes(depth, 0, 1), pdepth
  per_token = lambda x: jnp.swapaxes(x[..., 0], 0, 1)  # [T, B, 1] -> [B, T]
  n = n._replace(depth=per_token(n.depth), coda=per_token(n.coda), head=per_token(n.head))
  return out + (n,) if with_counts else out


SAMPLING_STREAM = 1_000_003  # fold_in(rng, pos) keys initial states; samples branch off here


def request_seeds(seed_B, batch: int) -> jax.Array:
  """int32 [B] sampling seeds: seed_B (ValueError unless one integer per row), default arange(B)."""
  if seed_B is None:
    return jnp.arange(batch, dtype=jnp.int32)
  if (tuple(jnp.shape(seed_B)) != (batch,)
      or not jnp.issubdtype(jnp.result_type(seed_B), jnp.integer)):
    raise ValueError(f'seed_B must hold one integer seed per row, shape ({batch},), got '
                     f'{jnp.result_type(seed_B)} {jnp.shape(seed_B)}')
  return jnp.asarray(seed_B, jnp.int32)


def pick(logits_BxV, pos_B, rng, temperature: float, seed_B=None) -> jax.Array:
  """Each row's next token: greedy, or sampled with a key of (rng, its seed, its position).

  Row b's Gumbel noise is drawn from fold_in(fold_in(fold_in(rng, SAMPLING_STREAM),
  seed_B[b]), pos_B[b]) alone, so its sample does not depend on its row or its batch,
  and rows with different seeds draw independent noise.

  Args:
    logits_BxV: fp32 logits of each row's last token.
    pos_B: int32 [B] position of each row's new token.
    rng: the generation key.
    temperature: 0 for greedy; else logits / temperature are sampled.
    seed_B: int [B] each row's sampling seed, its request's (default arange(B): the row
      index, so a row's samples then depend on its place in the batch).
  Returns:
    int32 [B] tokens.
  Raises:
    ValueError for a temperature that is not finite and >= 0, or seed_B not [B] integers.
  """
  if not 0 <= temperature < float('inf'):
    raise ValueError(f'temperature={temperature} must be a finite number >= 0 (0: greedy)')
  if temperature == 0:
    return losses.argmax_rows(logits_BxV)
  seed_B = request_seeds(seed_B, pos_B.shape[0])
  stream = jax.random.fold_in(rng, SAMPLING_STREAM)
  key = lambda s, t: jax.random.fold_in(jax.random.fold_in(stream, s), t)
  gumbel_BxV = jax.vmap(lambda s, t: jax.random.gumbel(key(s, t), logits_BxV.shape[1:]))(
      seed_B, pos_B)
  return losses.argmax_rows(logits_BxV / temperature + gumbel_BxV)  # the Gumbel-max draw


def generate(model: LoopedLM, prompt_BxP, n_new: int, cfg: ExitConfig, rng, *,
             temperature: float = 0.0, router=None, with_counts: bool = False,
             forced_BxN=None, prefill_cfg: ExitConfig | None = None, depth_BxN=None,
             seed_B=None):
  """Samples n_new tokens (`pick`) after the prompt, one `decode_step` each.

  Args:
    model: the frozen LM.
    prompt_BxP: int32 [B, P] prompt ids (prefilled in parallel semantics).
    n_new: tokens to generate per row, an int >= 0 (N = n_new).
    cfg: exit config of the decode steps.
    rng: key of the initial recurrent states and of sampling.
    temperature: 0 for greedy, else sampling as `pick` (keys by seed and position).
    router: the state probe, as `decode_step`.
    with_counts: also the decode steps' Counts stacked over steps (every row runs each
      step's deepest row's loops).
    forced_BxN: int [B, N] forced decoding: the n_new tokens are these, not picked, and
      their NLL is returned.
    prefill_cfg: the prompt's exit config (default cfg), e.g. a deep prompt and a shallow
      uniform decode.
    depth_BxN: int [B, N] given depths of the n_new decode steps (`decode_step`'s depth_B).
    seed_B: int [B] each row's (request's) sampling seed, as `pick` (default arange(B)).
  Returns:
    (tokens_BxL, depth_BxN[, nll_BxN][, counts]): int32 [B, P + n_new] the prompt then the
    new tokens, int32 [B, N] loops per new token; with forced_BxN fp32 [B, N] each forced
    token's NLL under the logits it follows; with with_counts the `inference.Counts`
    stacked over steps (batch passes and core_keys [N], per-token arrays [N, B, 1]).
  Raises:
    ValueError for a prompt or n_new the model cannot take, forced_BxN / depth_BxN
    not of shape [B, N], or seed_B not [B] integers.
  """
  check_tokens(model.cfg, prompt_BxP, 'prompt', extra=n_new)
  b, p = prompt_BxP.shape
  if not isinstance(n_new, int) or n_new < 0:
    raise ValueError(f'n_new={n_new!r} must be an integer >= 0')
  for name, x in (('forced_BxN', forced_BxN), ('depth_BxN', depth_BxN)):
    if x is not None and tuple(jnp.shape(x)) != (b, n_new):
      raise ValueError(f'{name} must have shape ({b}, {n_new}) (rows, n_new), got '
                       f'{jnp.shape(x)}')
  seed_B = request_seeds(seed_B, b)
  total = p + n_new
  cache, logits, _ = prefill(model, prompt_BxP, prefill_cfg or cfg, rng, total, router)
  init = initial_states(model, rng, total)
  forced = forced_BxN is not None

  def body(carry, t):
    cache, logits = carry
    if forced:
      tok = jnp.asarray(forced_BxN, jnp.int32)[:, t - p]
      nll = (losses.nll(logits, tok),)
    else:
      tok, nll = pick(logits, jnp.full((b,), t), rng, temperature, seed_B), ()
    given = None if depth_BxN is None else jnp.asarray(depth_BxN, jnp.int32)[:, t - p]
    logits, cache, d, *n = decode_step(model, cache, tok, t, cfg, rng, router,
                                       with_counts=with_counts, init_table=init,
                                       depth_B=given)
    return (cache, logits), (tok, d, *nll, *n)  # n: [Counts] only when asked for

  _, (toks, depth, *rest) = lax.scan(body, (cache, logits), jnp.arange(p, total))
  nll = (rest.pop(0).T,) if forced else ()
  return (jnp.concatenate([prompt_BxP, toks.T], axis=1), depth.T, *nll, *rest)
