"""Elasticity: validation loss at every uniform depth 1..R from one traced run.

  python -m experiments.eval_depth --workdir=runs/tiny
  python -m experiments.eval_depth --workdir=runs/ts --max_depth=32 --batches=16
  python -m experiments.eval_depth --workdir=runs/ts --data_source=text \
      --data_paths=other.txt --data_val_paths=other.txt --tag=other  # another corpus

Writes <workdir>/reports/eval_depth[_TAG].{json,png,md}.
"""

import jax
from absl import app, flags

from elastic_depth import analysis, reports
from experiments import common, flags_util


def run(opts: common.Options) -> dict:
  """Loads the workdir, traces the validation batches and writes the report."""
  ld = common.load(opts)
  trace = analysis.trace_batches(ld.model, ld.batches, ld.r_max, jax.random.key(opts.seed),
                                 opts.progress)
  res = analysis.elasticity(trace)
  res.update(tokens=int((trace.mask > 0).sum()), train_mean=ld.cfg.depth.mean,
             train_r_max=ld.cfg.depth.r_max, ref_depth=int(round(common.train_mean(ld.cfg))))
  info = ld.checkpoint_info()
  paths = reports.write(opts.workdir, common.report_name('eval_depth', opts), res,
                        flags=common.flag_record(opts, ld), checkpoint=info,
                        markdown=reports.elasticity_markdown(res, info),
                        plot=reports.elasticity_plot(res))
  best = min(range(len(res['loss'])), key=lambda i: res['loss'][i])
  print("loss by depth: " + ', '.join(f'{d}: {l:.4f}' for d, l in
                                        zip(res['depths'], res['loss'])))
  print(f"best depth {res['depths'][best]} ({res['loss'][best]:.4f}); report {paths['md']}")
  return {'results': res, 'paths': paths}


flags.adopt_module_key_flags(common)  # the shared flags show in --helpshort

if __name__ == '__main__':
  app.run(common.main(run), flags_parser=flags_util.parse_or_fail)
