"""Decode depths set per token by rules, oracles included, against uniform depth.

  python -m experiments.depth_oracle --workdir=runs/digit_last
  python -m experiments.depth_oracle --workdir=runs/digit_last \
      --schedule=uniform:2 --schedule=uniform:3 --schedule=split:3,2 \
      --schedule=lookahead:0.01 --schedule=state_delta:0.5

Forced decoding of the validation windows in cached semantics (prompt prefilled at a
uniform depth, then the next tokens decoded one at a time; see elastic_depth/oracle.py):
for each schedule the answer loss and the mean decode loops, and its gap to uniform depth
at equal mean loops. The oracles see labels or the future that an exit policy cannot, a
reference for what per-token depth can gain on this model (not a bound: an exit policy
can beat them). Writes
<workdir>/reports/depth_oracle[_TAG].{json,md,png}.
"""

import dataclasses

import jax
import numpy as np
from absl import app, flags

from elastic_depth import metrics, oracle, reports
from elastic_depth.data.pipeline import NO_DIFFICULTY
from experiments import common, flags_util

_DEFAULT = ('uniform:1', 'uniform:2', 'uniform:3', 'uniform:4', 'uniform:8', 'split:3,1',
            'split:3,2', 'split:4,2', 'difficulty:1,2', 'lookahead:0.01', 'lookahead:0.001',
            'kl:0.01', 'state_delta:0.5')


@dataclasses.dataclass
class OracleOptions:
  """This experiment's own settings."""
  schedules: tuple = _DEFAULT
  prompt_len: int = 16
  new_tokens: int = 64
  prefill_depth: int = 0  # 0: the training mean depth, rounded


SCHEDULES = flags.DEFINE_multi_string('schedule', list(_DEFAULT), 'A depth rule RULE:ARGS, '
                                      'repeatable (elastic_depth/oracle.py: uniform:D, '
                                      'split:A,B, difficulty:C,B, lookahead:EPS, kl:EPS, '
                                      'state_delta:EPS).')
PROMPT_LEN = flags.DEFINE_integer('prompt_len', 16, 'Prompt tokens (prefilled).')
NEW_TOKENS = flags.DEFINE_integer('new_tokens', 64, 'Tokens decoded after each prompt.')
PREFILL_DEPTH = flags.DEFINE_integer('prefill_depth', 0, 'Uniform depth of the prompt '
                                     '(0: the training mean, rounded).')


def pool_of(batches: list, p: int, n: int) -> dict:
  """Prompts, the forced text after them, its loss weights and (if any) difficulty."""
  width = np.asarray(batches[0]['inputs']).shape[1]
  if p < 1 or n < 2 or p + n > width:
    raise common.SetupError(f'--prompt_len ({p}) + --new_tokens ({n}) must fit the '
                            f'validation windows ({width} tokens), with p >= 1 and n >= 2')
  cat = lambda key, lo: np.concatenate([np.asarray(b[key])[:, lo:lo + n] for b in batches])
  pool = dict(prompt=np.concatenate([np.asarray(b['inputs'])[:, :p] for b in batches]),
              forced=cat('inputs', p), weight=cat('mask', p - 1).astype(np.float64))
  if all('difficulty' in b for b in batches):
    k = cat('difficulty', p - 1)
    if np.any(k[pool['weight'] > 0] != NO_DIFFICULTY):  # text windows carry -1 only
      pool['k'] = k
  if pool['weight'][:, 1:].sum() == 0:
    raise common.SetupError('the decoded text holds no scored token (mask all zero)')
  return pool


def markdown(res: dict) -> str:
  """The schedules' table, cheapest first."""
  rows = [[p['schedule'], p['loss'], p['mean_loops'], p['loops_answer'], p['loops_other'],
           p['uniform_loss'], p['gap']] for p in sorted(res['points'],
                                                        key=lambda p: p['mean_loops'])]
  return (f"# Decode depths by rule: {res['workdir']} step {res['step']}\n\n"
          f"Forced decoding of {res['windows']} validation windows (prompt {res['prompt_len']} "
          f"at depth {res['prefill_depth']}, {res['new_tokens']} tokens decoded; loss on "
          f"answers, {100 * res['answer_share']:.1f}% of the decoded tokens predict one).\n\n"
          + reports.table(['schedule', 'answer loss', 'mean loops', 'loops (answers)',
                           'loops (others)', 'uniform at equal loops', 'gap'], rows) + '\n'
          + ('' if sum(p['rule'] == 'uniform' for p in res['points']) >= 2 else
             'The gaps need at least two uniform schedules (uniform:N) to interpolate '
             'between.\n'))


def plot(res: dict):
  """Answer loss against mean loops: uniform depth as a line, the other rules as points."""
  def draw(fig):
    ax = fig.add_subplot(1, 1, 1)
    uni = sorted((p['mean_loops'], p['loss']) for p in res['points'] if p['rule'] == 'uniform')
    if uni:  # no empty legend entry without uniform schedules
      ax.plot(*zip(*uni), 'k-o', label='uniform depth')
    rules = sorted({p['rule'] for p in res['points']} - {'uniform'})
    for j, rule in enumerate(rules):  # one colour and marker per rule, each point its args
      pts = [p for p in res['points'] if p['rule'] == rule]
      ax.plot([p['mean_loops'] for p in pts], [p['loss'] for p in pts], 'os^vDP'[j % 6],
              color=f'C{j}', linestyle='none', label=rule)
      for p in pts:
        ax.annotate(p['schedule'].partition(':')[2], (p['mean_loops'], p['loss']),
                    fontsize=7, xytext=(3, 3), textcoords='offset points')
    ax.set_yscale('log')
    ax.set_xlabel('mean decode loops')
    ax.set_ylabel('answer loss (nats)')
    ax.legend(fontsize=7)
  return draw


def run(opts: common.Options, x: OracleOptions = OracleOptions()) -> dict:
  """Loads the workdir, decodes the pool under every schedule and writes the report."""
  if x.prefill_depth < 0:
    raise common.SetupError(f'--prefill_depth must be >= 0 (0: the training mean), got '
                            f'{x.prefill_depth}')
  try:
    schedules = [oracle.parse(s) for s in x.schedules]
  except ValueError as e:
    raise common.SetupError(str(e).removeprefix('error: ')) from None
  ld = common.load(opts)
  pool = pool_of(ld.batches, x.prompt_len, x.new_tokens)
  if 'k' not in pool and any(s.rule == oracle.Rule.DIFFICULTY for s in schedules):
    if tuple(x.schedules) != _DEFAULT:
      raise common.SetupError('the difficulty rule needs the synthetic corpus (its tokens '
                              'carry their difficulty k)')
    schedules = [s for s in schedules if s.rule != oracle.Rule.DIFFICULTY]
    print('difficulty:* skipped: this data has no difficulty labels', flush=True)
  prefill = x.prefill_depth or int(round(ld.cfg.depth.mean))
  deep = [s.name for s in schedules if max(oracle.depth_args(s), default=0) > ld.r_max]
  deep += [f'--prefill_depth={prefill}'] if prefill > ld.r_max else []
  if deep:
    raise common.SetupError(f'depths above the loop cap {ld.r_max} (--max_depth, default the '
                            f'training r_max): {", ".join(deep)}')
  rng = jax.random.key(opts.seed)
  points = []
  bar = metrics.progress(len(schedules), desc='schedules', unit='schedule',
                         disable=not opts.progress)
  for s in schedules:
    points.append(oracle.measure(ld.model, pool, s, ld.r_max, rng, prefill))
    print(f"{s.name}: answer loss {points[-1]['loss']:.4f} at "
          f"{points[-1]['mean_loops']:.2f} mean loops", flush=True)
    bar.update(1)
  bar.close()
  res = dict(workdir=opts.workdir, step=ld.step, windows=int(pool['prompt'].shape[0]),
             prompt_len=x.prompt_len, new_tokens=x.new_tokens, prefill_depth=prefill,
             answer_share=points[0]['answer_share'], points=oracle.frontier_gaps(points))
  paths = reports.write(opts.workdir, common.report_name('depth_oracle', opts), res,
                        flags=common.flag_record(opts, ld, x), checkpoint=ld.checkpoint_info(),
                        markdown=markdown(res), plot=plot(res))
  print(f"report {paths['md']}")
  return {'results': res, 'paths': paths}


flags.adopt_module_key_flags(common)  # the shared flags show in --helpshort

if __name__ == '__main__':
  app.run(common.main(run, lambda: OracleOptions(
      schedules=tuple(SCHEDULES.value), prompt_len=PROMPT_LEN.value,
      new_tokens=NEW_TOKENS.value, prefill_depth=PREFILL_DEPTH.value)),
          flags_parser=flags_util.parse_or_fail)
