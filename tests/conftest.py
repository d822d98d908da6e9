"""Shared tiny configurations (model, recurrence, policy, train-step tests) and the
float64 / brute-force helpers of the early-exit tests.

Compilation dominates the runtime of these tests, so every shape here is as small
as still exercises the code paths (GQA with 2 query heads per kv head, a prelude,
a 2-block core and a coda).
"""

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap


def _share_compilations() -> str:
  """One JAX persistent compilation cache for the whole test run: both xdist workers (they
  inherit the controller's environment) and every subprocess they start (an experiment
  main) reuse each other's executables (speed only: a hit returns the executable the
  compiler would build). Set before jax is imported, so the in-process tests read it too;
  a cache the user configured is left alone. Returns the folder this process created
  ('' if none), which `pytest_sessionfinish` removes."""
  created = ''
  if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
    created = tempfile.mkdtemp(prefix='elastic_depth_test_jax_cache_')
    os.environ['JAX_COMPILATION_CACHE_DIR'] = created
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
  # the suite is compile-bound (tiny shapes): LLVM at -O0 compiles ~30% faster (XLA's HLO
  # passes still run; only the LLVM backend optimizes less), and XLA:CPU's older loop
  # emitters compile fusions faster than its MLIR fusion emitters (two compile-bound test
  # files: 69 s against 96 s, 2026-12-07). Every tolerance and equality in the suite holds
  # under both. No test judges a timing.
  for flag in ('--xla_backend_optimization_level=0', '--xla_cpu_use_fusion_emitters=false'):
    if flag not in os.environ.get('XLA_FLAGS', ''):  # xdist workers inherit the controller's
      os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + flag).strip()
  return created


_CREATED_CACHE = _share_compilations()

import filelock  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.extend  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from elastic_depth import analysis
from elastic_depth import config as config_lib
from elastic_depth import decoding
from elastic_depth import inference
from elastic_depth import model as model_lib


def tiny_model_config(**overrides) -> config_lib.ModelConfig:
  """A 32-wide looped LM: 4 query heads over 2 kv heads, 1/2/1 blocks, vocab 64."""
  base = config_lib.ModelConfig(
      vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
      n_prelude=1, n_core=2, n_coda=1, max_len=64)
  return dataclasses.replace(base, **overrides)


def exit_model_config() -> config_lib.ModelConfig:
  """tiny_model_config with vocab 48 and init_std 0.1 (the early-exit tests' model)."""
  return tiny_model_config(vocab_size=48, init_std=0.1)


def tiny_config(model=None, depth=None, train=None) -> config_lib.Config:
  """A full Config around tiny_model_config with small depth buckets.

  Args:
    model: overrides of tiny_model_config.
    depth: overrides of the DepthConfig (buckets 1..4, mean 2.5).
    train: overrides of the TrainConfig (batch 4, seq 8).
  Returns:
    A validated Config.
  """
  cfg = config_lib.Config(
      model=tiny_model_config(**(model or {})),
      depth=dataclasses.replace(
          config_lib.DepthConfig(mean=2.5, sigma=0.5, r_max=4, buckets=(1, 2, 3, 4)),
          **(depth or {})),
      train=dataclasses.replace(
          config_lib.TrainConfig(seed=0, steps=100, batch_size=4, seq_len=8, lr=1e-2,
                                 warmup_steps=5),
          **(train or {})))
  config_lib.validate(cfg)
  return cfg


def random_batch(cfg: config_lib.Config, seed: int, batch_size=None, mask_frac=0.0):
  """One host batch dict of int32 inputs/targets and float32 mask, shaped [B, L]."""
  rng = np.random.default_rng(seed)
  b = batch_size or cfg.train.batch_size
  shape = (b, cfg.train.seq_len)
  v = cfg.model.vocab_size
  mask = (rng.random(shape) >= mask_frac).astype(np.float32)
  mask[:, 0] = 1.0  # never an empty micro-batch
  return dict(inputs=rng.integers(0, v, shape).astype(np.int32),
              targets=rng.integers(0, v, shape).astype(np.int32), mask=mask)


def kl_logits_np(logits_new, logits_old):
  """KL(p_new || p_old) over the last axis of two logit arrays, in float64."""
  a, b = (np.asarray(x, np.float64) for x in (logits_new, logits_old))
  la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
  lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
  return np.sum(np.exp(la) * (la - lb), axis=-1)


def kl_np(h_new, h_old, w):
  """KL(p_new || p_old) per row in float64, from hidden states and the head w [V, D]."""
  w = np.asarray(w, np.float64)
  return kl_logits_np(np.asarray(h_new, np.float64) @ w.T, np.asarray(h_old, np.float64) @ w.T)


def jaxpr_dots(jaxpr):
  """Every dot_general equation of a jaxpr, its sub-jaxprs' (cond, while, scan, ...) too."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from jaxpr_dots(sub)


def nll_np(logits, targets):
  """-log softmax(logits)[target] in float64, over the last axis."""
  lg = np.asarray(logits, np.float64)
  lse = np.logaddexp.reduce(lg, axis=-1)
  return lse - np.take_along_axis(lg, np.asarray(targets)[..., None], -1)[..., 0]


def gumbel_pick_np(logits_BxV, pos_B, rng, temperature: float, seed_B) -> np.ndarray:
  """Reference sampled tokens, row by row: argmax(logits / T + g) in float64, g the Gumbel
  noise of the key rng -> decoding.SAMPLING_STREAM -> the row's seed -> its position."""
  out = []
  for lg, p, s in zip(np.asarray(logits_BxV, np.float64), np.asarray(pos_B), np.asarray(seed_B)):
    k = jax.random.fold_in(jax.random.fold_in(
        jax.random.fold_in(rng, decoding.SAMPLING_STREAM), int(s)), int(p))
    out.append(np.argmax(lg / temperature + np.asarray(jax.random.gumbel(k, lg.shape),
                                                        np.float64)))
  return np.asarray(out)


def attend_list(ks, vs):
  """kv_fn attending to an explicit list of earlier (k, v) plus the new one."""
  def fn(k, v):
    kk = jnp.concatenate(ks + [k], axis=1)
    vv = jnp.concatenate(vs + [v], axis=1)
    return kk, vv, jnp.ones((1, 1, 1, kk.shape[1]), bool)
  return fn


def safe_eps(kls):
  """A threshold far (in log space) from every observed KL, near their median."""
  v = np.sort(np.concatenate([k[np.isfinite(k)] for k in kls[1:]]))
  logs = np.log(v)
  mid = len(v) // 2
  window = range(max(mid - len(v) // 4, 0), min(mid + len(v) // 4, len(v) - 1))
  j = max(window, key=lambda i: logs[i + 1] - logs[i])
  return float(np.exp(0.5 * (logs[j] + logs[j + 1])))


def median_kl_cfg(mdl, toks, rng, max_loops: int) -> config_lib.ExitConfig:
  """A KL exit config whose eps is the median per-loop KL (loops >= 3) of a uniform run."""
  tr = inference.score(mdl, toks, config_lib.ExitConfig(policy='uniform', depth=max_loops),
                       rng, trace=True).traces
  return config_lib.ExitConfig(policy='kl', eps=float(np.median(np.asarray(tr['kl'][2:]))),
                               max_loops=max_loops)


def traced_setup(r_max: int, length: int, batch: int = 2):
  """A random exit model, two masked batches of random tokens, a key and their trace."""
  mdl = model_lib.LoopedLM(exit_model_config(), nnx.Rngs(3))
  rs = np.random.default_rng(0)
  batches = []
  for _ in range(2):
    mask = (rs.random((batch, length)) > 0.25).astype(np.float32)
    mask[:, 0] = 1
    batches.append(dict(inputs=rs.integers(0, 48, (batch, length)).astype(np.int32),
                        targets=rs.integers(0, 48, (batch, length)).astype(np.int32), mask=mask,
                        difficulty=rs.integers(-1, 4, (batch, length)).astype(np.int32)))
  rng = jax.random.key(5)
  return mdl, batches, rng, analysis.trace_batches(mdl, batches, r_max, rng)


def built_once(tmp_path_factory, worker_id: str, name: str, build,
               marker: str = 'summary.json') -> str:
  """A workdir built once per session and shared by the xdist workers (file lock).

  build(path) must end by writing path/marker (training writes summary.json): a
  directory without it is rebuilt.
  """
  root = tmp_path_factory.getbasetemp()
  if worker_id != 'master':
    root = root.parent
  wd = str(root / name)
  with filelock.FileLock(wd + '.lock'):
    if not os.path.exists(os.path.join(wd, marker)):
      shutil.rmtree(wd, ignore_errors=True)
      build(wd)
  return wd


@pytest.fixture(scope='module')
def workdir(tmp_path_factory, make_config, worker_id):
  """A trained tiny workdir for the mains' tests: trained once for both xdist workers,
  copied for each module (the tests write reports into it)."""
  cfg = make_config(train=dict(steps=20, eval_every=20, ckpt_every=20, log_every=10,
                               eval_batches=1, seq_len=16, eval_depths=(1, 4)),
                    depth=dict(buckets=(2, 4)))
  cfg = dataclasses.replace(cfg, data=config_lib.DataConfig(synth_examples=100,
                                                           val_fraction=0.5))
  from elastic_depth import train  # pylint: disable=import-outside-toplevel
  shared = built_once(tmp_path_factory, worker_id, 'experiments_tiny',
                      lambda wd: train.run(cfg, wd, quiet=True))
  wd = str(tmp_path_factory.mktemp('tiny'))
  shutil.copytree(shared, wd, dirs_exist_ok=True)  # the tests write reports into it
  return wd


def mains_opts(wd, **kw):
  """The measurement mains' options on wd: two batches, no progress bar."""
  from experiments import common  # pylint: disable=import-outside-toplevel
  return common.Options(workdir=wd, batches=2, progress=False, **kw)


def report_results(path):
  """A report's results, after checking that the record holds its provenance."""
  from elastic_depth import reports  # pylint: disable=import-outside-toplevel
  doc = reports.read_report(path)
  assert {'date', 'command', 'flags', 'checkpoint', 'results'} <= set(doc)
  return doc['results']


def with_mean(workdir, tmp_path, mean: float):
  """A copy of the workdir whose config.json says depth.mean = mean: (its path, that config)."""
  wd = str(tmp_path / f'mean{mean}')
  shutil.copytree(workdir, wd)
  path = os.path.join(wd, 'config.json')
  with open(path, encoding='utf-8') as f:
    cfg = json.load(f)
  cfg['depth']['mean'] = mean
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(cfg, f)
  return wd, cfg


def md_table(md: str, header_start: str) -> tuple[list[str], list[list[str]]]:
  """(header cells, each body row's cells) of the first markdown table whose header line
  starts with header_start."""
  lines = md.splitlines()
  i = next(k for k, l in enumerate(lines) if l.startswith(header_start))
  cells = lambda l: [c.strip() for c in l.strip().strip('|').split('|')]
  body = []
  for l in lines[i + 2:]:
    if not l.startswith('|'):
      break
    body.append(cells(l))
  return cells(lines[i]), body


def py_json(code: str):
  """Runs code in a fresh interpreter at the repository root; returns json of its last line
  (the benches' report math, away from the test process's absl flags)."""
  proc = subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope='session')
def main_cases(tmp_path_factory, worker_id):
  """run(module, cases, files) -> one {rc, stdout, stderr, files} per case (`main_cases.py`).

  The cases (argument lists; '{tmp}' is each case's own empty folder, '{files}' a folder
  holding `files`, {name: bytes}, written first) run in one process, once per session
  for both xdist workers (`built_once`), so a test of many bad flags starts one
  interpreter instead of one per flag.
  """
  def run(module: str, cases, files=None) -> list[dict]:
    files = files or {}
    key = hashlib.sha256(json.dumps([module, [list(c) for c in cases],
                                     {k: v.hex() for k, v in sorted(files.items())}])
                         .encode()).hexdigest()[:16]

    def build(path):
      folder = pathlib.Path(path)
      (folder / 'files').mkdir(parents=True)
      for name, data in files.items():
        (folder / 'files' / name).write_bytes(data)
      (folder / 'cases.json').write_text(json.dumps(
          [[a.replace('{files}', str(folder / 'files')) for a in c] for c in cases]))
      proc = subprocess.run(
          [sys.executable, os.path.join(os.path.dirname(__file__), 'main_cases.py'), module,
           str(folder / 'cases.json'), str(folder / 'results.json')],
          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
          capture_output=True, text=True, timeout=120 + 30 * len(cases), check=False)
      assert proc.returncode == 0 and (folder / 'results.json').exists(), proc.stderr[-3000:]

    folder = built_once(tmp_path_factory, worker_id, f'main_cases_{key}', build,
                        marker='results.json')
    return json.loads((pathlib.Path(folder) / 'results.json').read_text())

  return run


@functools.cache
def _tiny_tfds_builder():
  """A TFDS builder of 12 train ('t story i') and 3 validation ('v story i') texts."""
  tfds = pytest.importorskip('tensorflow_datasets')

  class ElasticDepthTinyText(tfds.core.GeneratorBasedBuilder):
    """Tiny local text dataset."""
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self, features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples('t', 12),
              'validation': self._generate_examples('v', 3)}

    def _generate_examples(self, prefix, n):
      for i in range(n):
        yield i, {'text': f'{prefix} story {i}'}

  return ElasticDepthTinyText


@pytest.fixture
def tiny_tfds(tmp_path) -> tuple[str, str]:
  """(tfds_name, tfds_data_dir) of a locally prepared array_record text dataset."""
  _tiny_tfds_builder()(data_dir=str(tmp_path / 'tfds'),
                       file_format='array_record').download_and_prepare()
  return 'elastic_depth_tiny_text', str(tmp_path / 'tfds')


@pytest.fixture(scope='session')
def make_config():
  """The tiny_config factory (for tests that need their own overrides)."""
  return tiny_config


@pytest.fixture(scope='session')
def make_batch():
  """The random_batch factory."""
  return random_batch


@pytest.fixture(scope='session')
def model_cfg() -> config_lib.ModelConfig:
  return tiny_model_config()


@pytest.fixture(scope='session')
def cfg() -> config_lib.Config:
  return tiny_config()


@pytest.fixture(autouse=True, scope='session')
def _cpu_float32_matmuls():
  """Full-precision matmuls so that float32 tolerances are meaningful everywhere."""
  with jax.default_matmul_precision('highest'):
    yield


# The longest tests (an idle 2-core box, 2026-12-05) start first, so that neither xdist
# worker is left running one of them while the other idles at the end.
LONGEST_FIRST = (
    'test_bench_generate_forced_decoding_reports_the_timed_calls_loss',
    'test_exit_depth_rises_with_k_and_depth_is_used_by_the_hard_answers',
    'test_bench_generate_batch_sizes_write_json_and_markdown',
    'test_two_processes_fsdp_and_a_resume_equal_one_device',
    'test_notebook_runs_end_to_end',
    'test_bench_exit_books_come_from_the_engines_counts',
    'test_generate_cli_streams_the_tokens_and_depths_of_generate',
    'test_bench_exit_on_a_checkpoint_matches_quality_then_times',
)


def pytest_collection_modifyitems(items):
  """Moves the LONGEST_FIRST tests to the front (stable otherwise)."""
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda it: rank.get(it.originalname, len(rank)))


def pytest_sessionfinish():
  """The process that created the run's compilation cache (the xdist controller, or the
  only process) removes it."""
  if _CREATED_CACHE:
    shutil.rmtree(_CREATED_CACHE, ignore_errors=True)
