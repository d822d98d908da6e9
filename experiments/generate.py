"""Generates text from a trained workdir with per-token early exit, streaming tokens.

  python -m experiments.generate --workdir=runs/tiny --prompt="? 3 1 4 a b =" --show_depths
  python -m experiments.generate --workdir=DIR --prompt=A --prompt=B --eps=1e-3,1e-2
  python -m experiments.generate --workdir=DIR --prompt=A --prompt=B --exit_policy=state_delta \
      --eps=0.3 --wait_rows=2

Each --prompt is one row of a batch run by the depth-wise engine (elastic_depth.serving):
every row exits per token on its own, with its own eps (one value, or one per prompt).
Tokens are printed as they are produced (one prompt: the text; several: one line per
token, tagged with the row); --show_depths adds each token's loops as [d];
--prefill_engine=pooled prefills all prompts' tokens through one compacted buffer;
--exit_policy picks the check (KL by default; state_delta reads out only at the exit);
--wait_rows lets exited rows share one readout and admission pass; --temperature > 0
samples, prompt i with the sampling seed --seed + i (identical prompts sample apart; a
prompt's samples depend on its text, its index and --seed, not on the other prompts).
"""


from absl import app, flags, logging

from experiments import common, flags_util

_PROMPT = flags.DEFINE_multi_string('prompt', [], 'Prompt text (repeat for a batch).')
_EPS = flags.DEFINE_list('eps', [], 'Exit threshold (KL in nats, or the relative state '
                         'change): one, or one per prompt (default: the checkpoint config '
                         'exit.eps).')
_POLICY = flags.DEFINE_enum('exit_policy', 'kl', ['kl', 'state_delta'],
                            'Exit check (state_delta: no readout until the token exits).')
_WAIT = flags.DEFINE_integer('wait_rows', 1, 'Exited rows idle until this many wait, then '
                             'share one readout and admission pass (serving.run; 1: none '
                             'waits). Tokens and depths do not depend on it.')
_NEW = flags.DEFINE_integer('max_new_tokens', 32, 'Tokens generated per prompt.')
_MAX_LOOPS = flags.DEFINE_integer('max_loops', 0, 'Loop cap (0: the training r_max).')
_TEMP = flags.DEFINE_float('temperature', 0.0, 'Sampling temperature (0: greedy).')
_SHOW = flags.DEFINE_bool('show_depths', False, 'Print each token\'s loops as [d].')
_PREFILL = flags.DEFINE_enum('prefill_engine', None, ['masked', 'compacted', 'pooled'],
                             'exit.engine of the prompts\' prefill (default: the checkpoint '
                             'config\'s; pooled: one buffer for all prompts\' tokens).')


_fail = flags_util.fail


def _check_flags() -> list:
  """Validates the flags before anything is loaded; returns the eps list (maybe empty)."""
  if not flags.FLAGS.workdir:
    _fail('--workdir is required (a directory trained by experiments.pretrain)')
  if not _PROMPT.value or not all(p.strip() for p in _PROMPT.value):
    _fail('--prompt is required and may not be empty')
  if _NEW.value < 1:
    _fail(f'--max_new_tokens must be >= 1, got {_NEW.value}')
  if _MAX_LOOPS.value < 0 or not 0 <= _TEMP.value < float('inf'):
    _fail('--max_loops and --temperature must be >= 0 (the temperature finite)')
  if _WAIT.value < 1:
    _fail(f'--wait_rows must be >= 1, got {_WAIT.value}')
  try:
    eps = flags_util.floats(_EPS.value, 'eps', lower=0.0)
  except ValueError as e:
    _fail(f'{e} (exit thresholds)')
  if len(eps) not in (0, 1, len(_PROMPT.value)):
    _fail(f'--eps needs one value >= 0 or one per prompt ({len(_PROMPT.value)}), got {eps}')
  return eps


def _encode(tok, prompts: list, max_len: int):
  """Right-padded int32 prompts and their lengths; errors name the bad prompt."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from elastic_depth import data as data_lib  # pylint: disable=g-import-not-at-top
  try:
    ids = tok.encode_batch(prompts)
  except data_lib.DataError as e:
    _fail(f'cannot tokenize the prompt: {e}')
  for p, x in zip(prompts, ids):
    if len(x) == 0:
      _fail(f'prompt {p!r} has no tokens')
    if len(x) + _NEW.value > max_len:
      _fail(f'prompt {p!r} ({len(x)} tokens) + --max_new_tokens={_NEW.value} exceeds the '
            f'model\'s max_len {max_len}')
  out = np.zeros((len(ids), max(len(x) for x in ids)), np.int32)
  for b, x in enumerate(ids):
    out[b, :len(x)] = x
  return out, np.asarray([len(x) for x in ids], np.int32)


def main(argv):
  flags_util.no_arguments(argv)
  eps = _check_flags()
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from elastic_depth import checkpoint, data as data_lib, serving  # pylint: disable=g-import-not-at-top
  try:
    cfg = common.load_config(flags.FLAGS.workdir)
    tok = _tokenizer(cfg)
    prompt_np, plen = _encode(tok, _PROMPT.value, cfg.model.max_len)
    cfg, mdl, _, _ = common.load_model(flags.FLAGS.workdir, flags.FLAGS.step)
  except (common.SetupError, checkpoint.CheckpointError, data_lib.DataError) as e:
    _fail(str(e))
  b, n = len(plen), _NEW.value
  ecfg = dataclasses.replace(cfg.exit, policy=_POLICY.value,
                             max_loops=_MAX_LOOPS.value or cfg.depth.r_max,
                             engine=_PREFILL.value or cfg.exit.engine)
  eps_B = np.asarray(eps * (b // len(eps)) if eps else [ecfg.eps] * b, np.float32)
  rng = jax.random.key(flags.FLAGS.seed)
  t = _TEMP.value
  seed_B = flags.FLAGS.seed + np.arange(b, dtype=np.int32)  # one sampling seed per prompt
  st, _, eps_B = jax.jit(lambda p, e, l, s: serving.start(
      mdl, p, n, ecfg, rng, eps_B=e, prompt_len_B=l, temperature=t, seed_B=s))(
          prompt_np, eps_B, plen, seed_B)
  step = jax.jit(lambda st, k: serving.run(mdl, st, ecfg, rng, eps_B, until=k, temperature=t,
                                           wait_rows=_WAIT.value))
  _stream(step, st, tok, plen, n)


def _tokenizer(cfg):
  """The model's tokenizer (synthetic vocabulary or the workdir's), without building data."""
  from elastic_depth import data as data_lib  # pylint: disable=g-import-not-at-top
  data_cfg, workdir = common.resolve_data(cfg, flags.FLAGS.workdir, {})
  ds = data_lib.build(data_cfg, seq_len=8, batch_size=1, vocab_size=cfg.model.vocab_size,
                      workdir=workdir)
  return ds.tokenizer


def _piece(tok, i: int) -> str:
  """Text of token i; `<id:i>` for an id the model has and the tokenizer lacks (sampled)."""
  return tok.decode([i]) if i < tok.vocab_size else f'<id:{i}>'


def _stream(step, st, tok, plen, n: int) -> None:
  """Runs the engine one token per row at a time and prints each token as it is known."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  b = len(plen)
  for k in range(1, n + 1):
    st = step(st, k)
    toks, depth = np.asarray(st.tokens), np.asarray(st.depth)
    for row in range(b):
      piece = _piece(tok, int(toks[row, plen[row] + k - 1]))
      d = f'[{depth[row, k - 1]}]' if _SHOW.value else ''
      if b == 1:
        print(piece + d, end=' ', flush=True)
      else:
        print(f'{row}: {piece}{d}', flush=True)
  depth = np.asarray(st.depth)
  print(f'\nmean loops {depth.mean():.2f} over {depth.size} tokens; engine steps '
        f'{int(st.counts.steps)}; rows {b}')


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
