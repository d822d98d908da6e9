"""Import a Huginn-0125 checkpoint (safetensors) into a workdir the experiments load.

  python -m experiments.import_huginn --src=/data/huginn-0125 --workdir=runs/huginn
  python -m experiments.import_huginn --src=tomg-group-umd/huginn-0125 --workdir=runs/huginn

--src: a local HF snapshot folder (config.json, *.safetensors [+ index], tokenizer.json),
one .safetensors file beside its config.json, or a hub name (needs huggingface_hub and
the network, or the snapshot in the local hub cache). No torch needed. Then e.g.
  python -m experiments.eval_depth --workdir=runs/huginn --data_paths=docs.jsonl
See WORKSPACE.md, "Studying pretrained looped LMs".

  python -m experiments.import_huginn --src=FOLDER_WITH_CONFIG_JSON --dry_run

reads only config.json and prints the parameter count and the compiled memory analysis
(XLA, on this machine's backend) of the programs the experiments run at --batch_size x
--seq_len and depth --r_max: the traced uniform-depth pass and the per-token exit pass.
"""

import json
import os
import sys

from absl import app, flags, logging

from elastic_depth import checkpoint, huginn, snapshot
from elastic_depth.config import ConfigError
from experiments import flags_util

SRC = flags.DEFINE_string('src', None, 'Snapshot folder, .safetensors file or hub name.')
WORKDIR = flags.DEFINE_string('workdir', None, 'New folder for the imported run.')
R_MAX = flags.DEFINE_integer('r_max', 32, 'Default largest depth of the experiments.')
SEQ_LEN = flags.DEFINE_integer('seq_len', 0, 'Default evaluation sequence length (0: 1024, at '
                               'most the model\'s block_size).', lower_bound=0)
BATCH_SIZE = flags.DEFINE_integer('batch_size', 8, 'Default evaluation batch size.')
DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Only print the memory plan (needs config.json).')


def _dry_run() -> None:
  src = SRC.value if os.path.isdir(SRC.value) else os.path.dirname(os.path.abspath(SRC.value))
  if not os.path.isfile(os.path.join(src, snapshot.CONFIG_FILE)):
    raise snapshot.SourceError(f'--dry_run needs a local {snapshot.CONFIG_FILE}: none in {src}')
  cfg = huginn.full_config(snapshot.read_hf_config(src), R_MAX.value, SEQ_LEN.value,
                           BATCH_SIZE.value)
  print(json.dumps(huginn.memory_plan(cfg, BATCH_SIZE.value, cfg.train.seq_len), indent=1))


def main(argv):
  flags_util.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if not SRC.value or not (WORKDIR.value or DRY_RUN.value):
    print('error: --src and --workdir are required', file=sys.stderr)
    sys.exit(2)
  try:
    if DRY_RUN.value:
      _dry_run()
      return
    huginn.import_huginn(SRC.value, WORKDIR.value, r_max=R_MAX.value, seq_len=SEQ_LEN.value,
                         batch_size=BATCH_SIZE.value)
  except (snapshot.SourceError, ConfigError, checkpoint.CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
