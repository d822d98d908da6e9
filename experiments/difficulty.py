"""Depth against known difficulty on the synthetic corpus (the main job's closing report).

  python -m experiments.difficulty --workdir=runs/tiny

Loss by (difficulty k, uniform depth r), A1 exit depth and loss by k, Spearman(exit
depth, k) and A1's gain over uniform depth at equal mean loops, on the answer tokens of
the validation batches (see elastic_depth/difficulty.py). experiments.pretrain runs it
at the end of a synthetic run with data.loss_on=answers. Writes
<workdir>/reports/difficulty[_TAG].{json,png,md}.
"""

import jax
from absl import app, flags

from elastic_depth import difficulty, distributed, reports
from experiments import common, flags_util


def run(opts: common.Options) -> dict:
  """Loads the workdir, measures and writes the report; prints the short table."""
  ld = common.load(opts)
  common.check_reaches_mean(ld, "the report's 'loss @ training mean'")
  if not all('difficulty' in b for b in ld.batches) or ld.data_cfg.source != 'synthetic':
    raise common.SetupError(f'{opts.workdir}: difficulty needs the synthetic corpus '
                            '(its tokens carry their difficulty k)')
  res = difficulty.report(ld.model, ld.batches, jax.random.key(opts.seed), ld.r_max,
                          common.train_mean(ld.cfg), progress=opts.progress)
  if not distributed.is_lead():  # a multi-process job: process 0 writes and prints
    return {'results': res, 'paths': {}}
  info = ld.checkpoint_info()
  paths = reports.write(opts.workdir, common.report_name('difficulty', opts), res,
                        flags=common.flag_record(opts, ld), checkpoint=info,
                        markdown=difficulty.markdown(res), plot=difficulty.plot(res))
  print(difficulty.short_table(res))
  print(f"report {paths['md']}")
  return {'results': res, 'paths': paths}


flags.adopt_module_key_flags(common)  # the shared flags show in --helpshort

if __name__ == '__main__':
  app.run(common.main(run), flags_parser=flags_util.parse_or_fail)
