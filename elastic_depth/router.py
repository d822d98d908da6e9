"""A2: a linear router trained on the frozen model's own oracle labels.

Label for token t at loop i: 1 if its argmax prediction changes at some later loop
j in (i, r_max], else 0 (the token has settled). Features: the recurrent state
s_i (standardised). The probe is logistic regression trained with optax, with the
positive class re-weighted to balance the classes. As an exit policy a token
stops at the first loop where P(change) < threshold (`policies.Router`).
"""

import json
import os
from typing import Iterable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from elastic_depth import analysis, losses, model as model_lib
from elastic_depth.policies import Router, router_logit


class Harvest(NamedTuple):
  """Oracle-labelled (token, loop) pairs."""
  states_NxD: np.ndarray
  labels_N: np.ndarray  # 1: the argmax still changes later
  loops_N: np.ndarray   # the loop i each pair comes from (1-based)


def _recorded_loop(r_max: int) -> model_lib.LoopFn:
  """Loop policy: r_max loops, recording each loop's state (fp32) and argmax prediction."""
  def loop(mdl, s0, inj, pos):
    step = mdl.step_fn(inj, pos)  # RoPE tables once, outside the scan

    def body(s, _):
      s = step(s)
      am = losses.argmax_rows(mdl.logits(mdl.decode_state(s, pos)[0]))
      return s, (s.astype(jnp.float32), am)
    return jax.lax.scan(body, s0, None, length=r_max)
  return loop


def harvest(mdl, batches: Iterable[dict], r_max: int, rng: jax.Array,
            max_pairs: int = 200_000, seed: int = 0, progress: bool = False) -> Harvest:
  """Runs every batch at uniform depth r_max, recording states and argmax at each loop.

  Args:
    mdl: the frozen LM.
    batches: dicts of 'inputs' (int [B, L]) and 'mask' ([B, L]: tokens > 0 give pairs).
    r_max: the depth R of the runs.
    rng: key of the initial recurrent states.
    max_pairs: at most this many pairs, drawn without replacement when there are more.
    seed: seed of that draw.
    progress: a bar over the batches.
  Returns:
    Harvest of N pairs (every masked token at every loop 1..R, or max_pairs of them):
    states_NxD float32 [N, D] s_i, labels_N float32 [N] (1: the argmax changes at some
    loop j in (i, R]; 0 at loop R) and loops_N int [N] the loop i (1-based).
  """
  @jax.jit
  def run(inputs_BxL):
    return mdl.forward(inputs_BxL, rng, _recorded_loop(r_max)).aux  # [R, B, L, D], [R, B, L]

  feats, labels, loops = [], [], []
  for b in analysis.bar(list(batches), 'harvest (router)', progress):
    states, am = jax.device_get(run(b['inputs']))
    # changes_later[i] = any_{j > i} am[j] != am[i]
    change = np.zeros(am.shape, bool)
    for i in range(r_max - 1):
      change[i] = np.any(am[i + 1:] != am[i][None], axis=0)
    keep = np.asarray(b['mask']) > 0
    for i in range(r_max):
      feats.append(states[i][keep])
      labels.append(change[i][keep])
      loops.append(np.full(int(keep.sum()), i + 1))
  x, y, l = np.concatenate(feats), np.concatenate(labels), np.concatenate(loops)
  if len(y) > max_pairs:
    idx = np.random.default_rng(seed).choice(len(y), max_pairs, replace=False)
    x, y, l = x[idx], y[idx], l[idx]
  return Harvest(x, y.astype(np.float32), l)


def fit(h: Harvest, steps: int = 500, lr: float = 1e-2, weight_decay: float = 1e-4,
        seed: int = 0) -> Router:
  """Class-balanced logistic regression on standardised states (full-batch AdamW).

  Args:
    h: the labelled pairs (`harvest`).
    steps: full-batch AdamW steps.
    lr: learning rate.
    weight_decay: AdamW weight decay.
    seed: seed of the initial weights' key.
  Returns:
    Router: w_D float32 [D], b [], and the standardisation mu_D, sd_D [D] (h's state
    mean, and std + 1e-6); each class weighs half of the loss.
  """
  x = jnp.asarray(h.states_NxD)
  y = jnp.asarray(h.labels_N)
  mu, sd = x.mean(0), x.std(0) + 1e-6
  pos = jnp.clip(y.mean(), 1e-6, 1 - 1e-6)
  w_pos, w_neg = 0.5 / pos, 0.5 / (1 - pos)
  d = x.shape[1]
  params = {'w': 0.01 * jax.random.normal(jax.random.key(seed), (d,)), 'b': jnp.zeros(())}
  tx = optax.adamw(lr, weight_decay=weight_decay)
  opt = tx.init(params)

  def loss_fn(p):
    r = Router(p['w'], p['b'], mu, sd)
    z = router_logit(r, x[None])[0]
    ll = y * jax.nn.log_sigmoid(z) * w_pos + (1 - y) * jax.nn.log_sigmoid(-z) * w_neg
    return -jnp.mean(ll)

  @jax.jit
  def step(p, o):
    loss, g = jax.value_and_grad(loss_fn)(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  for _ in range(steps):
    params, opt, _ = step(params, opt)
  return Router(params['w'], params['b'], mu, sd)


def evaluate(router: Router, h: Harvest, bins: int = 10) -> dict:
  """Accuracy, balanced accuracy, base rate and expected calibration error on h.

  Args:
    router: the probe (`fit`, `load`).
    h: labelled pairs (`harvest`), N of them.
    bins: equal-width bins of P(change) over [0, 1] for the calibration error.
  Returns:
    JSON-friendly dict: 'n' (pairs), 'base_rate' (share of label 1), 'accuracy' and
    'balanced_accuracy' (mean of the two classes' recalls; NaN without one class) of
    P(change) > 0.5, 'ece' and 'reliability' (per non-empty bin: 'bin', 'n', 'mean_p',
    'frac_pos').
  """
  p = np.asarray(jax.nn.sigmoid(router_logit(router, jnp.asarray(h.states_NxD)[None])[0]))
  y = h.labels_N > 0.5
  pred = p > 0.5
  tpr = float(np.mean(pred[y])) if y.any() else float('nan')
  tnr = float(np.mean(~pred[~y])) if (~y).any() else float('nan')
  edges = np.linspace(0, 1, bins + 1)
  which = np.clip(np.digitize(p, edges) - 1, 0, bins - 1)
  ece, reliability = 0.0, []
  for k in range(bins):
    sel = which == k
    if sel.any():
      conf, freq = float(p[sel].mean()), float(y[sel].mean())
      ece += sel.mean() * abs(conf - freq)
      reliability.append({'bin': k, 'n': int(sel.sum()), 'mean_p': conf, 'frac_pos': freq})
  return {'n': int(len(y)), 'base_rate': float(y.mean()), 'accuracy': float(np.mean(pred == y)),
          'balanced_accuracy': 0.5 * (tpr + tnr), 'ece': float(ece),
          'reliability': reliability}


def save(router: Router, path: str, fit: Optional[dict] = None) -> None:
  """Writes the probe as JSON (small: D weights), with `fit`: what it was fitted on."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  doc = {k: np.asarray(v).tolist() for k, v in router._asdict().items()}
  with open(path, 'w', encoding='utf-8') as f:
    json.dump({**doc, 'fit': fit}, f)


def load_fit(path: str) -> Optional[dict]:
  """The record of the data a saved probe was fitted on (None for older files)."""
  with open(path, encoding='utf-8') as f:
    return json.load(f).get('fit')


def load(path: str) -> Router:
  """Reads a probe written by save()."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'no router at {path}: run python -m experiments.train_router '
                            '--workdir=... first')
  with open(path, encoding='utf-8') as f:
    d = json.load(f)
  return Router(**{k: jnp.asarray(d[k], jnp.float32) for k in Router._fields})


def batch_tokens(first: int, count: int, batch_size: int, seq_len: int) -> list[int]:
  """[start, end) in the validation token stream of the targets of validation batches
  first..first+count-1 (batch b holds windows b*B..(b+1)*B - 1; window i predicts tokens
  i*L + 1..i*L + L)."""
  return [first * batch_size * seq_len + 1, (first + count) * batch_size * seq_len + 1]


def overlap_error(fit: Optional[dict], data_config: dict, tokens: list[int],
                  what: str = 'router') -> Optional[str]:
  """Why a probe fitted as `fit` records may not be scored on `tokens` of that data, or None.

  Scoring is refused when the probe's record is missing or when its fitting tokens and
  `tokens` ([start, end) of the same validation stream) overlap.
  """
  if not fit:
    return (f'the {what} file has no record of the batches it was fitted on (an older '
            'train_router); retrain it')
  if fit.get('split') == 'train' or fit['data_config'] != data_config:
    return None  # fitted on training text, or another corpus: not this validation stream
  lo, hi = fit['tokens']
  if lo < tokens[1] and tokens[0] < hi:
    return (f"the {what} was fitted on the validation targets [{lo}, {hi}) (batches "
            f"{fit['batches'][0]}..{fit['batches'][-1]} of {fit['batch_size']} x "
            f"{fit['seq_len']}), which overlap the targets [{tokens[0]}, {tokens[1]}) scored "
            'here: its curve would be in-sample')
  return None
