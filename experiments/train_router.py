"""Fit a state probe on a frozen checkpoint: the A2 router, or the KL probe.

  python -m experiments.train_router --workdir=runs/tiny
  python -m experiments.sweep_eps --workdir=runs/tiny --router   # adds the A2 curve
  python -m experiments.train_router --workdir=runs/tiny --probe=kl_probe
  python -m experiments.sweep_eps --workdir=runs/tiny --kl_probe  # adds the kl_probe curve

--probe=kl_probe fits `elastic_depth.kl_probe` instead (the model's own successive KL at
every loop 2..R, regressed on the state change and the state; --probe_rank sets its
rank, --probe_loops its parameter sets, by default one per loop), harvested in
--probe_semantics (parallel: one uniform-depth forward; cached: token by token through
decode_step), and writes <workdir>/kl_probe.json or
kl_probe_cached.json and reports/kl_probe[_cached].{json,md}: the held-out RMSE of log
KL and the rank correlation with the true KL, beside the state change's.

Labels come from the model itself: for token t at loop i, 1 if its argmax changes at a
later loop up to R. Training pairs come from validation batches --fit_from ..
--fit_from + --fit_batches - 1, after the ones sweep_eps scores by default (0..7), so the
A2 curve is held out; accuracy and calibration are reported on batches 0..--fit_from - 1.
router.json records which validation tokens the probe saw, and sweep_eps refuses to
score them. Writes <workdir>/router[_TAG].json and <workdir>/reports/router[_TAG].{json,md,png}
(a --tag names the probe as it names the report; sweep_eps --tag=TAG reads that probe).
"""

import dataclasses
import os

import jax
import numpy as np
from absl import app, flags

from elastic_depth import data as data_lib, kl_probe, reports, router
from experiments import common, flags_util


@dataclasses.dataclass
class RouterOptions:
  """This experiment's own settings."""
  steps: int = 500           # full-batch AdamW steps of the probe
  lr: float = 1e-2           # probe learning rate
  max_pairs: int = 200_000   # (token, loop) pairs used to train
  fit_from: int = 8          # first validation batch fitted on (earlier ones: held out)
  fit_batches: int = 4       # batches fitted on
  fit_split: str = 'val'     # 'val' (after the held-out ones) or 'train' (the first ones)
  probe: str = 'router'      # 'router' (A2) or 'kl_probe'
  rank: int = 32             # the KL probe's rank K
  hidden: int = 0            # the KL probe's hidden units H
  loops: int = 0             # the KL probe's parameter sets: loops 2, 3, ..., the last for the
                             # rest (0: one per loop 2..R)
  semantics: str = 'parallel'  # the KL probe's: harvested in parallel or cached semantics
  exit_eps: tuple[float, ...] = ()  # the KL probe's: also runs under the KL exit at these
  fit_seed: int = 0          # the KL probe's: pair subsample, initialisation and minibatches
  objective: str = 'squares'  # the KL probe's fit objective (kl_probe.Objective)


STEPS = flags.DEFINE_integer('router_steps', RouterOptions.steps, 'Full-batch AdamW steps of '
                             'the probe.')
LR = flags.DEFINE_float('router_lr', RouterOptions.lr, 'Probe learning rate.')
MAX_PAIRS = flags.DEFINE_integer('max_pairs', RouterOptions.max_pairs, '(token, loop) pairs '
                                 'used to train.')
FIT_FROM = flags.DEFINE_integer('fit_from', RouterOptions.fit_from, 'First validation batch '
                                'the probe fits on; batches before it are held out (sweep_eps '
                                'scores them).')
FIT_BATCHES = flags.DEFINE_integer('fit_batches', RouterOptions.fit_batches, 'Batches the '
                                   'probe fits on.')
FIT_SPLIT = flags.DEFINE_enum('fit_split', RouterOptions.fit_split, ['val', 'train'], 'Fit on '
                              'validation batches --fit_from.. (val) or on the first training '
                              'batches (train: the labels are the model\'s own, so any text '
                              'serves, and sweep_eps may then score every validation batch).')
PROBE = flags.DEFINE_enum('probe', RouterOptions.probe, ['router', 'kl_probe'], 'router: the '
                          'A2 router (router.json); kl_probe: the KL probe (kl_probe.json).')
RANK = flags.DEFINE_integer('probe_rank', RouterOptions.rank, 'Rank K of the KL probe.',
                            lower_bound=1)
HIDDEN = flags.DEFINE_integer('probe_hidden', RouterOptions.hidden, 'Hidden units H of the '
                              'KL probe (0: none).', lower_bound=0)
LOOPS = flags.DEFINE_integer('probe_loops', RouterOptions.loops, 'Parameter sets of the KL '
                             'probe, one per loop from loop 2 on, each fitted on its loop\'s '
                             'pairs; the last serves every later loop too (0: one per loop '
                             '2..R; 1: one set for all loops).', lower_bound=0)
EXIT_EPS = flags.DEFINE_list('probe_exit_eps', [], 'The KL probe: also fit on runs under '
                             'the exact KL exit at these eps, in --probe_semantics (the '
                             'states that runs with exits reach), beside the uniform run.')
FIT_SEED = flags.DEFINE_integer('fit_seed', RouterOptions.fit_seed, 'The KL probe: seed of its '
                                'pair subsample, initialisation and minibatch order (a refit '
                                'with another seed shows how much the fit alone moves a '
                                'result).', lower_bound=0)
OBJECTIVE = flags.DEFINE_enum('probe_objective', RouterOptions.objective,
                              [o.value for o in kl_probe.Objective], 'The KL probe\'s fit: '
                              'squares (squared error of log KL) or crossings (the absolute '
                              'error of log KL clipped to the thresholds in use: the exit '
                              'decisions it gets wrong over log-uniform thresholds).')
SEMANTICS = flags.DEFINE_enum('probe_semantics', RouterOptions.semantics, ['parallel', 'cached'],
                              'The semantics the KL probe is fitted (and used) in: '
                              'kl_probe.json or kl_probe_cached.json.')


def _reliability(fig, res) -> None:
  """Calibration plot: predicted P(change) against the observed frequency."""
  ax = fig.add_subplot(1, 1, 1)
  for split, style in (('train', 'o--'), ('heldout', 's-')):
    rel = res[split]['reliability']
    ax.plot([r['mean_p'] for r in rel], [r['frac_pos'] for r in rel], style, label=split)
  ax.plot([0, 1], [0, 1], 'k:', lw=1)
  ax.set(xlabel='predicted P(argmax changes later)', ylabel='observed frequency',
         title='A2 router calibration')
  ax.legend()


def run(opts: common.Options, x: RouterOptions = RouterOptions()) -> dict:
  """Harvests labels, fits the probe, evaluates it on held-out text and saves it."""
  first, n_fit = x.fit_from, x.fit_batches
  if x.steps < 1 or x.max_pairs < 1 or not 0 < x.lr < float('inf'):
    raise common.SetupError(f'--router_steps={x.steps} and --max_pairs={x.max_pairs} must be '
                            f'>= 1 and --router_lr={x.lr} a finite number > 0')
  if first < 1 or n_fit < 1:
    raise common.SetupError(f'--fit_from={first} and --fit_batches={n_fit} must be >= 1 '
                            '(batches before --fit_from are the held-out ones)')
  if ((x.exit_eps or x.semantics != 'parallel' or x.loops or x.objective != 'squares')
      and x.probe != 'kl_probe'):
    raise common.SetupError('--probe_exit_eps, --probe_semantics, --probe_loops and '
                            '--probe_objective are the KL probe\'s (--probe=kl_probe)')
  on_val = x.fit_split == 'val'
  ld = common.load(dataclasses.replace(opts, batches=first + n_fit * on_val))
  if len(ld.batches) < first + n_fit * on_val:
    raise common.SetupError(
        f'the validation set has {len(ld.batches)} batches, fewer than --fit_from={first} + '
        f'--fit_batches={n_fit}; lower them (sweep_eps --batches must stay <= --fit_from), '
        'fit on --fit_split=train or enlarge the validation split')
  rng = jax.random.key(opts.seed)
  b, l = ld.data.batch_size, ld.data.seq_len
  if on_val:
    fit = {'batches': list(range(first, first + n_fit)), 'batch_size': b, 'seq_len': l,
           'tokens': router.batch_tokens(first, n_fit, b, l),
           'data_config': dataclasses.asdict(ld.data_cfg), 'checkpoint_step': ld.step}
    fit_batches = ld.batches[first:]
  else:  # the labels are the model's own: training text serves, and no scored batch is seen
    fit = {'split': 'train', 'batches': list(range(n_fit)), 'batch_size': b, 'seq_len': l,
           'data_config': dataclasses.asdict(ld.data_cfg), 'checkpoint_step': ld.step}
    fit_batches = data_lib.fixed_batches(ld.data.train_windows, b, n_fit)
  if x.probe == 'kl_probe':
    return _run_kl_probe(opts, x, ld, rng, fit, fit_batches)
  fit_h = router.harvest(ld.model, fit_batches, ld.r_max, rng, x.max_pairs,
                         progress=opts.progress)
  test_h = router.harvest(ld.model, ld.batches[:first], ld.r_max, rng, x.max_pairs,
                          progress=opts.progress)
  probe = router.fit(fit_h, steps=x.steps, lr=x.lr)
  res = {'train': router.evaluate(probe, fit_h), 'heldout': router.evaluate(probe, test_h),
         'r_max': ld.r_max, 'pairs_train': int(len(fit_h.labels_N))}
  res['fit'] = fit
  path = os.path.join(opts.workdir, common.report_name('router', opts) + '.json')
  _refuse_non_finite(probe, path)
  router.save(probe, path, fit)
  h = res['heldout']
  md = ('| split | pairs | base rate (changes later) | accuracy | balanced acc. | ECE |\n'
        '| --- | ---: | ---: | ---: | ---: | ---: |\n' +
        ''.join(f"| {k} | {v['n']} | {v['base_rate']:.3f} | {v['accuracy']:.3f} | "
                f"{v['balanced_accuracy']:.3f} | {v['ece']:.3f} |\n"
                for k, v in (('train', res['train']), ('held-out', h))))
  paths = reports.write(opts.workdir, common.report_name('router', opts), res,
                        flags=common.flag_record(opts, ld, x), checkpoint=ld.checkpoint_info(),
                        markdown=md, plot=lambda fig: _reliability(fig, res))
  print(f"router: held-out accuracy {h['accuracy']:.3f} (balanced {h['balanced_accuracy']:.3f},"
        f" base rate {h['base_rate']:.3f}, ECE {h['ece']:.3f}); saved {path}; "
        f"report {paths['md']}")
  return {'results': res, 'paths': paths, 'router': path}


def _refuse_non_finite(probe, path: str) -> None:
  """SetupError, before `path` is written, when the fit diverged."""
  if not all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(probe)):
    raise common.SetupError(f'the fit diverged (non-finite parameters); {path} is left as it '
                            'was: lower --router_lr or raise --max_pairs')


def _run_kl_probe(opts: common.Options, x: RouterOptions, ld, rng, fit: dict,
                  fit_batches: list) -> dict:
  """train_router --probe=kl_probe: fits, evaluates on the held-out batches and saves."""
  first = x.fit_from
  sem = x.semantics
  fit_h = kl_probe.harvest(ld.model, fit_batches, ld.r_max, rng, x.max_pairs, seed=x.fit_seed,
                           semantics=sem, exit_eps=x.exit_eps, progress=opts.progress)
  test_h = kl_probe.harvest(ld.model, ld.batches[:first], ld.r_max, rng, x.max_pairs,
                            semantics=sem, progress=opts.progress)
  probe = kl_probe.fit(fit_h, rank=x.rank, hidden=x.hidden, steps=x.steps, lr=x.lr,
                       seed=x.fit_seed, loops=max(1, min(x.loops or ld.r_max, ld.r_max - 1)),
                       objective=x.objective)
  res = {'train': kl_probe.evaluate(probe, fit_h), 'heldout': kl_probe.evaluate(probe, test_h),
         'r_max': ld.r_max, 'pairs_train': int(len(fit_h.log_kl_N)), 'fit': fit,
         'semantics': sem}
  name = kl_probe.file_name(sem)
  path = os.path.join(opts.workdir, common.report_name(name, opts) + '.json')
  _refuse_non_finite(probe, path)
  kl_probe.save(probe, path, fit)
  md = ('| split | pairs | RMSE of log KL | Spearman(probe, KL) | Spearman(state change, KL) '
        '| censored MSE |\n| --- | ---: | ---: | ---: | ---: | ---: |\n' +
        ''.join(f"| {k} | {v['n']} | {v['rmse_log_kl']:.3f} | {v['spearman_probe']:.4f} | "
                f"{v['spearman_state_change']:.4f} | {v['mse_censored']:.3f} |\n"
                for k, v in (('train', res['train']), ('held-out', res['heldout']))))
  paths = reports.write(opts.workdir, common.report_name(name, opts), res,
                        flags=common.flag_record(opts, ld, x), checkpoint=ld.checkpoint_info(),
                        markdown=md)
  h = res['heldout']
  print(f"{name} (rank {x.rank}, {x.hidden} hidden, {h['loops']} loop sets, {sem} semantics): "
        f"held-out RMSE of log "
        f"KL {h['rmse_log_kl']:.3f}, Spearman with KL {h['spearman_probe']:.4f} (state change "
        f"{h['spearman_state_change']:.4f}), censored MSE {h['mse_censored']:.3f}; saved "
        f"{path}; report {paths['md']}")
  return {'results': res, 'paths': paths, 'router': path}


flags.adopt_module_key_flags(common)  # the shared flags show in --helpshort

if __name__ == '__main__':
  app.run(common.main(run, lambda: RouterOptions(
      steps=STEPS.value, lr=LR.value, max_pairs=MAX_PAIRS.value, fit_from=FIT_FROM.value,
      fit_batches=FIT_BATCHES.value, fit_split=FIT_SPLIT.value, probe=PROBE.value,
      rank=RANK.value, hidden=HIDDEN.value, loops=LOOPS.value, semantics=SEMANTICS.value,
      fit_seed=FIT_SEED.value, objective=OBJECTIVE.value,
      exit_eps=tuple(flags_util.floats(EXIT_EPS.value, 'probe_exit_eps', common.SetupError,
                                       lower=0.0) or ()))),
          flags_parser=flags_util.parse_or_fail)
