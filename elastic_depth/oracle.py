"""Per-token decode depths set by rules that may read the task's labels or the future.

Forced decoding of validation text in cached semantics (the prompt prefilled in parallel
semantics, then one token at a time through `decoding.decode_step`), with each token's
depth chosen by a rule. Beside uniform depth and the model's own exit policies, two kinds
of oracle that see what an exit policy cannot (they are references, not bounds: on the
main job the state-change exit beats both, WORKSPACE.md, twenty-ninth session):
- label oracles: the tokens that predict an answer run one depth and the rest another
  (`split`), or the answer's difficulty k sets its depth (`difficulty`);
- the lookahead oracle: a token stops at the first loop i >= 1 where the next loop would
  change its prediction by less than eps, KL(p_(i+1) || p_i) < eps (it runs the loops
  past its stop to know, then keeps the state of loop i).

A token's depth also sets the keys and values that later tokens read, so a rule that
stops tokens early can cost the answers after them (see WORKSPACE.md, "Depth-wise batched
generation", twenty-eighth session).
"""

import enum
import math
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from elastic_depth import analysis, decoding, losses
from elastic_depth.config import ExitConfig, ExitPolicy


class Rule(str, enum.Enum):
  """How a schedule sets each decoded token's depth."""
  UNIFORM = 'uniform'         # uniform:D: every token at D loops
  SPLIT = 'split'             # split:A,B: tokens that predict an answer at A, the rest at B
  DIFFICULTY = 'difficulty'   # difficulty:C,B: answer-predicting tokens at k + C, rest at B
  LOOKAHEAD = 'lookahead'     # lookahead:EPS: stop at the first i >= 1 with KL(p_i+1||p_i) < EPS
  KL = 'kl'                   # kl:EPS: the model's A1 exit, KL(p_i || p_i-1) < EPS
  STATE_DELTA = 'state_delta'  # state_delta:EPS: the relative state change < EPS


_ARITY = {Rule.UNIFORM: 1, Rule.SPLIT: 2, Rule.DIFFICULTY: 2, Rule.LOOKAHEAD: 1, Rule.KL: 1,
          Rule.STATE_DELTA: 1}
_INTEGER = (Rule.UNIFORM, Rule.SPLIT, Rule.DIFFICULTY)
_POLICY = {Rule.KL: ExitPolicy.KL, Rule.STATE_DELTA: ExitPolicy.STATE_DELTA}


class Schedule(NamedTuple):
  rule: Rule
  args: tuple

  @property
  def name(self) -> str:
    return f"{self.rule.value}:{','.join(f'{a:g}' for a in self.args)}"


def parse(spec: str) -> Schedule:
  """'split:3,2' -> Schedule(SPLIT, (3, 2)); a clear ValueError on a bad spec."""
  head, _, tail = spec.partition(':')
  try:
    rule = Rule(head.strip())
  except ValueError:
    raise ValueError(f'error: unknown depth rule {head!r} in {spec!r} (one of '
                     f"{', '.join(r.value for r in Rule)})") from None
  try:
    args = tuple(float(a) for a in tail.split(',')) if tail.strip() else ()
  except ValueError:
    raise ValueError(f'error: the arguments of {spec!r} must be numbers') from None
  if len(args) != _ARITY[rule]:
    raise ValueError(f'error: {rule.value} takes {_ARITY[rule]} argument(s), got {spec!r}')
  if not all(math.isfinite(a) for a in args):
    raise ValueError(f'error: the arguments of {spec!r} must be finite numbers')
  if rule in _INTEGER:
    if any(a != int(a) for a in args):
      raise ValueError(f'error: the depths of {spec!r} must be integers')
    s = Schedule(rule, tuple(int(a) for a in args))
    if min(depth_args(s)) < 1:
      raise ValueError(f'error: the depths of {spec!r} must be at least 1')
    return s
  if args[0] <= 0:
    raise ValueError(f'error: the threshold of {spec!r} must be positive')
  return Schedule(rule, args)


def depth_args(s: Schedule) -> tuple:
  """The loop counts a label rule names (difficulty's first argument is an offset)."""
  if s.rule not in _INTEGER:
    return ()
  return s.args[-1:] if s.rule == Rule.DIFFICULTY else s.args


def given_depths(s: Schedule, answer_BxN: np.ndarray, k_BxN: Optional[np.ndarray],
                 r_max: int) -> np.ndarray:
  """int32 [B, N] depths of a label rule, clipped to [1, r_max].

  answer_BxN: whether each decoded token predicts an answer (its target's loss weight).
  k_BxN: the difficulty of each token's target (the `difficulty` rule only).
  """
  ans = np.asarray(answer_BxN) > 0
  if s.rule == Rule.UNIFORM:
    d = np.full(ans.shape, s.args[0])
  elif s.rule == Rule.SPLIT:
    d = np.where(ans, s.args[0], s.args[1])
  elif s.rule == Rule.DIFFICULTY:
    if k_BxN is None:
      raise ValueError('error: the difficulty rule needs data whose tokens carry a difficulty')
    d = np.where(ans, np.asarray(k_BxN) + s.args[0], s.args[1])
  else:
    raise ValueError(f'error: {s.name} does not give depths from labels')
  return np.clip(d, 1, r_max).astype(np.int32)


def lookahead_depth(kl_RxB: jax.Array, eps) -> jax.Array:
  """int32 [B]: the first loop i >= 1 with KL(p_(i+1) || p_i) < eps, else R.

  kl_RxB[j] is KL(p_(j+1) || p_j), the statistic a trace records at loop j + 1.
  """
  r = kl_RxB.shape[0]
  ok_B = kl_RxB[1:] < eps  # row j: stopping at loop j + 1 changes the next loop by < eps
  first = jnp.argmax(ok_B, axis=0) + 1
  return jnp.where(jnp.any(ok_B, axis=0), first, r).astype(jnp.int32)


def lookahead_decode(model, prompt_BxP, forced_BxN, eps, r_max: int, rng,
                     prefill_cfg: ExitConfig):
  """Forced decoding under the lookahead oracle: returns (nll_BxN, depth_BxN).

  Each token first runs all r_max loops on the cache so far to trace its successive KL,
  then runs again for the depth `lookahead_depth` picks, which is what it commits.
  """
  p = prompt_BxP.shape[1]
  total = p + forced_BxN.shape[1]
  cache, logits, _ = decoding.prefill(model, prompt_BxP, prefill_cfg, rng, total)
  init = decoding.initial_states(model, rng, total)
  trace_cfg = ExitConfig(policy=ExitPolicy.KL, eps=0.0, max_loops=r_max)
  run_cfg = ExitConfig(policy=ExitPolicy.UNIFORM, depth=r_max)

  def body(carry, t):
    cache, logits = carry
    tok = jnp.asarray(forced_BxN, jnp.int32)[:, t - p]
    nll = losses.nll(logits, tok)
    *_, tr = decoding.decode_step(model, cache, tok, t, trace_cfg, rng, init_table=init,
                                  trace=True)
    d = lookahead_depth(tr['kl'][:, :, 0], eps)
    logits, cache, depth = decoding.decode_step(model, cache, tok, t, run_cfg, rng,
                                                init_table=init, depth_B=d)
    return (cache, logits), (nll, depth)

  _, (nll, depth) = lax.scan(body, (cache, logits), jnp.arange(p, total))
  return nll.T, depth.T


def schedule_fn(model, s: Schedule, r_max: int, rng, prefill_depth: int):
  """A jitted (prompt_BxP, forced_BxN, depth_BxN) -> (nll_BxN, depth_BxN) for schedule s."""
  pcfg = ExitConfig(policy=ExitPolicy.UNIFORM, depth=prefill_depth)
  if s.rule == Rule.LOOKAHEAD:
    return jax.jit(lambda x, f, _: lookahead_decode(model, x, f, s.args[0], r_max, rng, pcfg))
  given = s.rule in _INTEGER
  cfg = (ExitConfig(policy=ExitPolicy.UNIFORM, depth=r_max) if given else
         ExitConfig(policy=_POLICY[s.rule], eps=s.args[0], max_loops=r_max))

  def run(x, f, d):
    _, depth, nll = decoding.generate(model, x, f.shape[1], cfg, rng, forced_BxN=f,
                                      prefill_cfg=pcfg, depth_BxN=d if given else None)
    return nll, depth
  return jax.jit(run)


def measure(model, pool: Mapping[str, Any], s: Schedule, r_max: int, rng, prefill_depth: int,
            chunk: int = 64) -> dict:
  """Answer loss and mean decode loops of schedule s over a pool of validation windows.

  The depth of the token decoded at step j sets the prediction of forced token j + 1, so
  it predicts an answer where weight[:, j + 1] > 0.

  Args:
    model: the frozen LM.
    pool: 'prompt' [N, P], 'forced' [N, T] (the text decoded after each prompt), 'weight'
      [N, T] (each forced token's loss weight: 1 on answers), optionally 'k' [N, T] (the
      difficulty of each forced token).
    s: the depth rule and its arguments (`parse`).
    r_max: the loop cap (label rules' depths are clipped to [1, r_max]).
    rng: key of the initial recurrent states.
    prefill_depth: the uniform depth of the prompts' prefill.
    chunk: rows per call (`analysis.in_row_chunks`: one compilation).
  Returns:
    JSON-friendly dict: 'schedule' (s.name), 'rule', 'loss' (the weight-weighted mean NLL
    of the forced tokens), 'mean_loops' (over all N x T decoded tokens), 'loops_answer'
    and 'loops_other' (mean loops of the tokens that do and do not predict an answer;
    None where there are none), 'answer_share' and 'tokens' (N x T).
  Raises:
    ValueError for the difficulty rule on a pool without 'k'.
  """
  w = np.asarray(pool['weight'], np.float64)
  nxt = lambda a: np.concatenate([a[:, 1:], np.zeros_like(a[:, :1])], axis=1)
  answer = nxt(w) > 0
  k = nxt(np.asarray(pool['k'])) if 'k' in pool else None
  given = given_depths(s, answer, k, r_max) if s.rule in _INTEGER else np.zeros(w.shape,
                                                                               np.int32)
  fn = schedule_fn(model, s, r_max, rng, prefill_depth)
  nll, depth = analysis.in_row_chunks(lambda p, f, g: fn(p, f, g)[:2],
                                      [pool['prompt'], pool['forced'], given], chunk)
  return dict(schedule=s.name, rule=s.rule.value, loss=float((nll * w).sum() / max(w.sum(), 1)),
              mean_loops=float(depth.mean()),
              loops_answer=float(depth[answer].mean()) if answer.any() else None,
              loops_other=float(depth[~answer].mean()) if (~answer).any() else None,
              answer_share=float(answer.mean()), tokens=int(depth.size))


def frontier_gaps(points: list) -> list:
  """Each point's loss minus uniform depth's at equal mean loops (linear between depths).

  None outside the uniform points' range; negative: better than uniform depth.
  """
  uni = sorted((p['mean_loops'], p['loss']) for p in points if p['rule'] == Rule.UNIFORM.value)
  out = []
  for p in points:
    m = p['mean_loops']
    inside = len(uni) >= 2 and uni[0][0] <= m <= uni[-1][0]
    ref = float(np.interp(m, [u[0] for u in uni], [u[1] for u in uni])) if inside else None
    out.append(dict(p, uniform_loss=ref, gap=None if ref is None else p['loss'] - ref))
  return out
