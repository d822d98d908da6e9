"""Convergence of the recurrence: successive KL / state change per loop, and the
per-token depth after which the prediction stops changing (overall, by token class,
and by the synthetic generator's hop count).

  python -m experiments.convergence --workdir=runs/tiny
  python -m experiments.convergence --workdir=runs/ts --max_depth=32 --eps_conv=1e-4

Writes <workdir>/reports/convergence[_TAG].{json,png,md}.
"""

import dataclasses

import jax
import numpy as np
from absl import app, flags

from elastic_depth import analysis, data as data_lib, reports
from experiments import common, flags_util



@dataclasses.dataclass
class ConvergenceOptions:
  """This experiment's own settings."""
  eps_conv: float = 1e-3  # KL threshold (nats) of the KL-based convergence depth


EPS_CONV = flags.DEFINE_float('eps_conv', ConvergenceOptions.eps_conv, 'KL threshold (nats) '
                              'of the KL-based convergence depth.')


def groups_for(ld: common.Loaded, trace: analysis.Trace) -> dict:
  """Token classes of the targets, and the synthetic difficulty when the data has one."""
  out = {'class': analysis.class_groups(
      data_lib.token_classes(ld.data.tokenizer, trace.targets), data_lib.TOKEN_CLASS_NAMES)}
  if trace.difficulty is not None and np.any(trace.difficulty[trace.mask > 0] != -1):
    out['difficulty'] = analysis.difficulty_groups(trace.difficulty)
  return out


def run(opts: common.Options, x: ConvergenceOptions = ConvergenceOptions()) -> dict:
  """Loads the workdir, traces the validation batches and writes the report."""
  if not x.eps_conv > 0 or x.eps_conv == float('inf'):
    raise common.SetupError(f'--eps_conv={x.eps_conv} must be a finite KL threshold > 0')
  ld = common.load(opts)
  common.check_reaches_mean(ld, 'the "loss @mean" column and the share still changing')
  trace = analysis.trace_batches(ld.model, ld.batches, ld.r_max, jax.random.key(opts.seed),
                                 opts.progress)
  res = analysis.convergence(trace, common.train_mean(ld.cfg), x.eps_conv,
                             groups_for(ld, trace))
  info = ld.checkpoint_info()
  paths = reports.write(opts.workdir, common.report_name('convergence', opts), res,
                        flags=common.flag_record(opts, ld, x), checkpoint=info,
                        markdown=reports.convergence_markdown(res, info),
                        plot=reports.convergence_plot(res))
  a = res['argmax_depth']
  print(f"argmax convergence depth: median {a['median']:.0f}, p90 {a['p90']:.1f}, "
        f"{100 * a['share_changing_after_ref']:.1f}% still changing after loop "
        f"{res['ref_depth']}; report {paths['md']}")
  return {'results': res, 'paths': paths}


flags.adopt_module_key_flags(common)  # the shared flags show in --helpshort

if __name__ == '__main__':
  app.run(common.main(run, lambda: ConvergenceOptions(eps_conv=EPS_CONV.value)),
          flags_parser=flags_util.parse_or_fail)
