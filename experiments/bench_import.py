"""Host memory and time of the Huginn import on a random bf16 source of a given shape.

  python -m experiments.bench_import                     # 138M parameters, ~1 min on CPU
  python -m experiments.bench_import --d_model=2048 --mlp_dim=5632

Writes a Huginn-style snapshot (3 bf16 safetensors shards + config.json) in a new
folder of its own under --tmp (removed at the end; nothing else there is touched),
then imports it in a fresh process that reports its peak resident memory above the
memory of its imports (jax, orbax, safetensors). The ratio peak / fp32 parameter bytes
scales the figure to Huginn-0125 (14.3 GB of fp32 parameters). JSON to --out.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
from absl import app, flags
from safetensors.numpy import save_file

from experiments import bench_util, flags_util
from elastic_depth import huginn

_D = flags.DEFINE_integer('d_model', 1024, 'n_embd of the random source.')
_F = flags.DEFINE_integer('mlp_dim', 2816, 'intermediate_size.')
_V = flags.DEFINE_integer('vocab', 32768, 'Vocabulary.')
_TMP = flags.DEFINE_string('tmp', '/tmp', 'Where the scratch folder is made (a new '
                           'bench_import-* folder inside it, removed at the end).')
_OUT = flags.DEFINE_string('out', 'runs/bench_import.json', 'JSON output.')
HUGINN_0125_FP32_BYTES = 3_564_976_800 * 4

_CHILD = """
import json, resource, sys, time
import jax, orbax.checkpoint, safetensors
from elastic_depth import huginn
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base, t = rss(), time.perf_counter()
huginn.import_huginn(sys.argv[1], sys.argv[2], log=lambda s: None)
print(json.dumps({'import_s': time.perf_counter() - t, 'base_bytes': base,
                  'peak_bytes': rss()}))
"""


def _source(path: str) -> int:
  """Writes the random bf16 snapshot; returns the parameter count."""
  hf = dict(n_embd=_D.value, n_heads=_D.value // 128, head_dim=128,
            intermediate_size=_F.value, vocab_size=_V.value, block_size=4096,
            n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
            rope_base=50000, norm_eps=1e-6, tie_embeddings=True, qk_bias=True,
            mean_recurrence=32)
  shapes = huginn.expected_shapes(huginn.model_config(hf))
  rng = np.random.default_rng(0)
  keys = sorted(shapes)
  os.makedirs(path)
  for i in range(3):
    part = {k: rng.standard_normal(shapes[k], np.float32).astype(ml_dtypes.bfloat16)
            for k in keys[i::3]}
    shard = os.path.join(path, f'model-{i + 1:05d}-of-00003.safetensors')
    save_file(part, shard)
  with open(os.path.join(path, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(hf, f)
  return sum(int(np.prod(s)) for s in shapes.values())


def _check_flags() -> None:
  """One-line errors for shapes the source cannot have, before anything is written."""
  if _D.value < 128 or _D.value % 128:
    flags_util.fail(f'--d_model={_D.value} must be a positive multiple of 128 (head_dim 128)')
  for name, v in (('mlp_dim', _F.value), ('vocab', _V.value)):
    if v < 1:
      flags_util.fail(f'--{name}={v} must be >= 1')
  if not os.path.isdir(_TMP.value):
    flags_util.fail(f'--tmp={_TMP.value!r} is not a directory')


def main(argv):
  flags_util.no_arguments(argv)
  _check_flags()
  scratch = tempfile.mkdtemp(prefix='bench_import-', dir=_TMP.value)  # ours alone
  try:
    n = _source(os.path.join(scratch, 'src'))
    out = subprocess.run([sys.executable, '-c', _CHILD, os.path.join(scratch, 'src'),
                          os.path.join(scratch, 'wd')], capture_output=True, text=True,
                         check=True, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  rec = json.loads(out.stdout.strip().splitlines()[-1])
  ratio = (rec['peak_bytes'] - rec['base_bytes']) / (4 * n)
  rec.update(params=n, fp32_bytes=4 * n, peak_over_fp32=ratio,
             huginn_0125_peak_gb_estimate=(ratio * HUGINN_0125_FP32_BYTES
                                           + rec['base_bytes']) / 1e9)
  bench_util.write_json(_OUT.value, rec, echo=True)


if __name__ == '__main__':
  app.run(main, flags_parser=flags_util.parse_or_fail)
