"""Smoke tests of the benchmarks (`nano` shape) and of the reference figures they quote.

Runs the modules as subprocesses (their absl flags stay out of the test process) and
checks the JSON reports; no timing assertions.
"""

import gzip
import json
import os
import platform
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import py_json
from elastic_depth import books, config as config_lib, model as model_lib, timing
from experiments import bench_util
from experiments import host_setup

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_train_writes_positive_numbers(tmp_path):
  out = tmp_path / 'bench_train.json'
  cmd = [sys.executable, '-m', 'experiments.bench_train', '--shapes=nano', '--steps=1',
         '--warmup=1', '--peak_n=256', '--remat=nothing,off', '--loss_chunk=0,5',
         '--rounds=3', '--round_warmup=2', f'--out={out}']
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out, encoding='utf-8') as f:
    doc = json.load(f)
  for key in ('date', 'command', 'jax_version', 'load_avg_start', 'load_avg_end',
              'other_processes_start'):
    assert key in doc
  assert doc['matmul_peak_flops'] > 0
  # `python -m experiments.<main>` re-executed itself with huge pages where they apply
  applies = host_setup.hugepage_env(dict(os.environ), platform.system(), platform.libc_ver(),
                                    host_setup.thp_mode()) is not None
  assert ('glibc.malloc.hugetlb=1' in doc['glibc_tunables']) == (
      applies or 'glibc.malloc.hugetlb=1' in os.environ.get('GLIBC_TUNABLES', ''))
  assert len(doc['load_avg_start']) == 3
  res, fused, off, _ = doc['results']
  assert [(r['remat'], r['loss_chunk']) for r in doc['results']] == [
      ('nothing', 0), ('nothing', 5), ('off', 0), ('off', 5)]
  assert fused['config']['train']['loss_chunk'] == 5
  # the fused head + cross-entropy gives the plain loss (same init and batch)
  assert fused['first_loss'] == pytest.approx(res['first_loss'], rel=1e-5)
  assert off['temp_bytes'] > res['temp_bytes'] > 0  # remat trades recompute for memory
  # without remat only the chunked attention's flash-style backward recomputes: the QK^T
  # product of every attention block (causal half: H K L FLOPs a token)
  m = off['config']['model']
  assert off['attention_impl_run'] == 'chunked' and m['attention'] == 'all'
  assert off['flops_per_token_hw'] - off['flops_per_token'] == pytest.approx(
      m['num_heads'] * m['head_dim'] * off['seq_len']
      * (off['depth'] * m['n_core'] + m['n_prelude'] + m['n_coda']))
  assert res['shape'] == 'nano' and 'reference' not in res  # no --reference_dir
  assert res['depths_run'] == [res['depth']]  # the depth really was fixed
  assert res['all_finite']
  assert len(res['step_times_s']) == 3  # a timed step per round
  # --warmup, then --round_warmup before rounds 2 and 3 (three rounds: swapped, 2 + 1 + 1)
  assert res['untimed_steps'] == 1 + 2 + 2
  assert res['step_minor_faults_median'] >= 0  # getrusage's count (0 off POSIX)
  for key in ('tokens_per_step', 'step_s_median', 'tokens_per_s', 'flops_per_token',
              'flops_per_token_forward', 'flops_per_token_hw', 'model_flops_per_s',
              'hw_flops_per_s', 'fraction_of_peak', 'hw_fraction_of_peak', 'params',
              'compile_s'):
    assert res[key] > 0, key
  assert res['flops_per_token'] == 3 * res['flops_per_token_forward']
  # the peak is the median of its samples (two: their mean), the rates per median step
  assert doc['matmul_peak_flops'] == pytest.approx(np.median(doc['matmul_peak_samples']))
  tokens, med = res['tokens_per_step'], np.median(res['step_times_s'])
  assert res['tokens_per_s_best'] == pytest.approx(tokens / min(res['step_times_s']))
  assert res['model_flops_per_s'] == pytest.approx(res['flops_per_token'] * tokens / med)
  assert res['hw_flops_per_s'] == pytest.approx(res['flops_per_token_hw'] * tokens / med)
  assert res['fraction_of_peak'] == pytest.approx(res['model_flops_per_s']
                                                  / doc['matmul_peak_flops'])
  assert res['flops_per_token_hw'] >= res['flops_per_token']
  assert 'nano' in proc.stdout


def _case(main_cases, cases, i, *extra):
  """Case i of cases ((main, *args) tuples), run with every case of its main in one process."""
  main = cases[i][0]
  same = [c for c in cases if c[0] == main]
  return main_cases(f'experiments.{main}', [[*c[1:], *extra] for c in same])[same.index(cases[i])]


TRAIN_FLAGS = [
    ('--reference_dir=/nonexistent', 'holds no recpre/raven_modeling_minimal.py'),
    ('--remat=some', "--remat: unknown choices ['some']"),
    ('--loss_chunk=-1', '--loss_chunk'),
    ('--micro_batch=-2', '--micro_batch=-2 must be >= 0'),
    ('--unroll=0', "--unroll: ['0'] must be integers >= 1"),
    ('--round_warmup=-1', '--round_warmup=-1 must be >= 0')]


@pytest.mark.parametrize('i', range(len(TRAIN_FLAGS)), ids=[f for f, _ in TRAIN_FLAGS])
def test_bench_train_bad_flag_is_one_line_exit_2(main_cases, i):
  cases = [('bench_train', '--shapes=nano', f) for f, _ in TRAIN_FLAGS]
  res = _case(main_cases, cases, i)
  lines = res['stderr'].strip().splitlines()
  assert res['rc'] == 2, res['stderr'][-2000:]
  assert len(lines) == 1 and lines[0].startswith('error: ') and TRAIN_FLAGS[i][1] in lines[0], lines


BEFORE_WORK = [
    ('bench_exit', '--shapes=S,Q', "--shapes: unknown ['Q']", 2),
    ('bench_exit', '--fake_exit_fraction=1', '--fake_exit_fraction=1.0 must be in [0, 1)', 2),
    ('bench_kl', '--shapes=8x4x16,8x4', "--shapes: '8x4' is not NxDxV", 1),
    ('bench_kl', '--shapes=0x4x16', "--shapes: '0x4x16' is not NxDxV", 1),
    ('bench_kl', '--v_splits=0', '--v_splits', 1)]


@pytest.mark.parametrize('i', range(len(BEFORE_WORK)), ids=[c[1] for c in BEFORE_WORK])
def test_bench_bad_flag_is_one_line_before_any_work(main_cases, i):
  _, _, needle, rc = BEFORE_WORK[i]
  res = _case(main_cases, [c[:2] for c in BEFORE_WORK], i, '--out={tmp}/out.json')
  lines = res['stderr'].strip().splitlines()
  assert res['rc'] == rc, res['stderr'][-2000:]
  assert len(lines) == 1 and lines[0].startswith('error: ') and needle in lines[0], lines
  assert res['files'] == [] and res['stdout'] == ''  # nothing timed, nothing written


def profile_train_ops(path):
  from experiments import profile_train  # pylint: disable=g-import-not-at-top
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    return profile_train.hlo_ops(f.read())


def test_profile_train_attributes_the_step_time(tmp_path):
  out = tmp_path / 'profile.json'
  proc = subprocess.run([sys.executable, '-m', 'experiments.profile_train', '--shapes=nano',
                         '--profile_steps=1', '--micro_batch=1', '--loss_chunk=5', '--unroll=2',
                         f'--out={out}', f'--hlo_dir={tmp_path / "hlo"}'], cwd=REPO,
                        capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  [res] = json.loads(out.read_text())['results']
  assert (res['batch_size'], res['loss_chunk']) == (1, 5)  # nano's rows are 2: overridden
  assert res['unroll'] == 2
  assert res['op_s'] > 0 and res['wall_s'] > 0
  for axis, parts in res['summary'].items():  # every axis partitions the same op time
    assert sum(parts.values()) == pytest.approx(res['op_s'], rel=1e-6), axis
  assert res['unmatched_s'] < 0.1 * res['op_s']  # nearly every op event found its HLO op
  assert {'core loops', 'outside loops', 'optimizer'} <= set(res['summary']['region'])
  assert {'forward', 'backward', 'remat recompute'} <= set(res['summary']['pass'])
  assert {'mlp', 'sdpa', 'norm'} <= set(res['summary']['part'])
  [hlo] = (tmp_path / 'hlo').iterdir()  # the step's compiled HLO, as the profile read it
  assert hlo.name == f'nano_{res["remat"]}_c5_u2.hlo.txt.gz'
  assert len(profile_train_ops(hlo)) > 100


def test_cpu_description_names_the_generation_and_vector_units():
  zen5 = ('processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n'
          'model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n')
  want = 'AMD EPYC (family 26 model 2; avx2, avx512f, avx512_bf16)'
  assert bench_util.cpu_description(zen5) == want
  assert bench_util.cpu_description('model name : X\nflags : sse2\n') == 'X (no AVX2)'
  assert bench_util.cpu_description().count('(') == 1  # this machine's, whatever it is


def test_reference_figures_say_where_they_come_from_and_match_our_shapes():
  with open(bench_util.REFERENCE_FILE, encoding='utf-8') as f:
    doc = json.load(f)
  for key in ('implementation', 'commit', 'torch_version', 'threads', 'machine', 'date'):
    assert key in doc, key
  assert 'not a side-by-side' in doc['about']
  assert doc['generate']['exit_criterion'].startswith('kl')
  for kind in ('train', 'generate'):
    for name, tok_s in doc[kind]['tokens_per_s'].items():
      assert doc[kind]['shapes'][name]['model'] == bench_util.MODEL_SHAPES[name]
      assert tok_s > 0
  s = doc['train']['shapes']['S']
  assert bench_util.reference_tok_s('train', 'S', seq_len=s['seq_len'],
                                    batch_size=s['batch_size'], depth=s['depth']) == doc['train']['tokens_per_s']['S']
  # other settings or shapes get no ratio
  assert bench_util.reference_tok_s('train', 'S', seq_len=128, batch_size=s['batch_size'],
                                    depth=s['depth']) is None
  assert bench_util.reference_tok_s('generate', 'nano', batch_size=1) is None
  assert bench_util.reference_tok_s('generate', 'P', batch_size=1) == doc['generate']['tokens_per_s']['P']


def test_bench_exit_books_come_from_the_engines_counts(tmp_path):
  out = tmp_path / 'exit.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.bench_exit', '--shapes=nano', '--batch=2',
       '--seq_len=16', '--depth=4', '--repeats=1', '--settle=1', '--warmup_rounds=0',
       f'--out={out}'],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())['runs']['nano']
  v = r['variants']
  # A0 at depth 4 runs every token 4 loops and one readout; the masked engine runs the
  # deepest token's loops for all; the compacted one at most that; the active tokens' own
  # loops are the mean exit depth
  assert v['a0']['passes'] == dict(core=4, coda=1, head=1)
  deepest = v['a1_masked']['passes']['core']
  assert deepest == int(deepest) and r['mean_loops'] <= deepest <= 4
  assert r['mean_loops'] < deepest  # ragged exits, so the engines' books differ
  assert v['a1_compact']['passes']['core'] <= deepest
  assert r['active_passes']['core'] == pytest.approx(r['mean_loops'])
  # every variant's GFLOP are its passes x the FLOPs of each part (books.executed_flops,
  # checked against XLA's compiled cost in books_test) x the tokens
  mcfg = config_lib.ModelConfig(**r['model'])
  gflop = lambda p, keys: r['tokens'] * float(books.executed_flops(
      mcfg, p['core'], p['coda'], p['head'], 16, keys, model_lib.causal_keys(16))) / 1e9
  for k, x in v.items():
    assert x['executed_gflop'] == pytest.approx(gflop(x['passes'], x['core_keys'])), k
  assert r['active_gflop'] == pytest.approx(gflop(r['active_passes'],
                                                  v['a1_compact']['core_keys']))
  assert r['active_gflop'] <= v['a1_compact']['executed_gflop'] + 1e-12
  # attention keys per core query as executed: A0's chunked causal attention, the masked
  # engine's full L, the compacted buffers' static ranges in between
  assert v['a0']['core_keys'] == model_lib.causal_keys(16)
  assert v['a1_masked']['core_keys'] == 16
  assert 16 / 2 < v['a1_compact']['core_keys'] <= 16
  assert v['a1_pooled']['core_keys'] >= 16  # all B x L queries of L keys, over fewer slots
  assert set(r['ratios']) == {
      'vs_a0', 'vs_a1_masked', 'pooled_vs_a0', 'pooled_vs_a1_masked'}
  assert (tmp_path / 'exit.md').read_text().count('| nano |') >= 5
  assert r['settle'] == 1  # recorded: each timed call right after an untimed one of its own
  assert r['warmup_rounds'] == 0
  for x in v.values():  # every timed call's CPU time and page faults, beside its wall time
    assert len(x['sys_s_per_call']) == len(x['minor_faults_per_call']) == len(x['times_s'])
    assert x['user_s_median'] + x['sys_s_median'] > 0 and x['minor_faults_median'] >= 0


@pytest.mark.parametrize('name,family', [  # kernel names from a 135M step's trace on an H200
    ('cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26', 'attention (cuDNN)'),
    ('void cudnn::fusion::fmha_reduce_head<true>(void const*)', 'attention (cuDNN)'),
    ('sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize256x128x32', 'matmul fp32 (TF32)'),
    ('nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT', 'matmul'), ('gemm_fusion_dot_94', 'matmul'),
    ('loop_multiply_fusion_34', 'XLA fusion'), ('input_concatenate_fusion_8', 'XLA fusion'),
    ('MemcpyD2H', 'copy'), ('some_custom_kernel', 'other')])
def test_profile_train_kernel_families(name, family):
  from experiments import profile_train  # pylint: disable=g-import-not-at-top
  assert profile_train.kernel_family(name) == family


def test_profile_train_reads_gpu_kernels_from_stream_lines(monkeypatch):
  """Device planes only; hlo_op stats where present, else the kernel's name; the 'XLA Ops'
  line where no kernel has the stat."""
  from experiments import profile_train  # pylint: disable=g-import-not-at-top
  ev = lambda name, ns, stats=(): types.SimpleNamespace(name=name, duration_ns=ns, stats=stats)
  line = lambda name, evs: types.SimpleNamespace(name=name, events=evs)
  plane = lambda name, lines: types.SimpleNamespace(name=name, lines=lines)
  host = plane('/host:CPU', [line('XLA Ops', [ev('fusion.9', 99)])])
  gpu = plane('/device:GPU:0', [
      line('Stream #14(Compute)', [ev('nvjet_a', 10, [('hlo_op', '%dot.1')]),
                                    ev('loop_add_fusion', 5), ev('nvjet_a', 7)]),
      line('XLA Ops', [ev('dot.1', 17), ev('loop_add_fusion', 5)])])
  monkeypatch.setattr(profile_train, '_planes', lambda d: [host, gpu])
  ops, kernels, lines = profile_train.device_op_times('unused')
  # per kernel: its hlo_op stat, else its own name (XLA names its kernels as their op)
  assert ops == {'dot.1': 10, 'loop_add_fusion': 5, 'nvjet_a': 7}
  assert kernels == {'nvjet_a': 17, 'loop_add_fusion': 5}
  assert [l['line'] for l in lines] == ['Stream #14(Compute)', 'XLA Ops']
  gpu.lines[0].events[0].stats = ()  # no hlo_op stats anywhere: the XLA Ops line
  ops, _, _ = profile_train.device_op_times('unused')
  assert ops == {'dot.1': 17, 'loop_add_fusion': 5}
  gpu.lines.pop()  # nor an XLA Ops line (the H200's CUDA-graph trace): the kernel names
  ops, kernels, _ = profile_train.device_op_times('unused')
  assert ops == kernels == {'nvjet_a': 17, 'loop_add_fusion': 5}


HLO_WITH_A_DOT_FUSION = """HloModule m

%fused_dot (p0: f32[2,2], p1: f32[2,2]) -> f32[2,2] {
  %p0 = f32[2,2]{1,0} parameter(0)
  %p1 = f32[2,2]{1,0} parameter(1)
  ROOT %dot.1 = f32[2,2]{1,0} dot(f32[2,2]{1,0} %p0, f32[2,2]{1,0} %p1), lhs_contracting_dims={1}
}

%f_add (q0: f32[2,2]) -> f32[2,2] {
  %q0 = f32[2,2]{1,0} parameter(0)
  ROOT %add.1 = f32[2,2]{1,0} add(f32[2,2]{1,0} %q0, f32[2,2]{1,0} %q0)
}

ENTRY %main (a: f32[2,2]) -> f32[2,2] {
  %a = f32[2,2]{1,0} parameter(0)
  %fusion = f32[2,2] fusion(%a, %a), kind=kOutput, calls=%fused_dot, metadata={op_name="f/mlp/dot"}
  ROOT %fusion.1 = f32[2,2] fusion(%fusion), kind=kLoop, calls=%f_add, metadata={op_name="f/add"}
}
"""


def test_profile_train_hlo_ops_call_a_fusion_around_a_dot_a_matmul():
  """A fusion whose called computation holds a dot is a matmul; one without is not."""
  from experiments import profile_train  # pylint: disable=g-import-not-at-top
  ops = profile_train.hlo_ops(HLO_WITH_A_DOT_FUSION)
  assert ops['fusion'] == ('f/mlp/dot', True)
  assert ops['fusion.1'] == ('f/add', False)
  assert ops['dot.1'] == ('', True) and ops['add.1'] == ('', False)


def test_profile_train_classifies_the_backward_by_its_transpose_scope():
  """The backward is a transpose(...) scope; a forward op named transpose stays forward."""
  from experiments import profile_train  # pylint: disable=g-import-not-at-top
  core = 'jit(step)/while/body/while/body'
  assert profile_train.classify(f'{core}/mlp/transpose', False) == (
      'core loops', 'forward', 'mlp', 'elementwise')
  assert profile_train.classify(f'jit(step)/transpose(jvp({core}/mlp/dot_general))', True) == (
      'core loops', 'backward', 'mlp', 'matmul')
  assert profile_train.classify(f'{core}/rematted_computation/attention/sdpa/exp', False)[1:3] == (
      'remat recompute', 'sdpa')


@pytest.mark.parametrize('module,extra', [('bench_generate', ['--batch_sizes=2']),
                                          ('bench_exit', [])])
def test_benchmarks_name_a_missing_workdir_in_one_line(tmp_path, module, extra):
  """A workdir that does not exist: 'error: ...' naming it and exit 2, no traceback, nothing
  written."""
  missing = tmp_path / 'nowhere'
  out = tmp_path / 'out.json'
  proc = subprocess.run([sys.executable, '-m', f'experiments.{module}', f'--workdir={missing}',
                         f'--out={out}', *extra], cwd=REPO, capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [f"error: workdir '{missing}' does not exist"]
  assert not out.exists() and not missing.exists()


def test_bench_import_works_in_its_own_scratch_folder_and_keeps_the_rest(tmp_path):
  """--tmp names where a scratch folder is made: a bad flag stops before anything is
  written, and a run removes only its own folder (it once emptied --tmp itself)."""
  keep = tmp_path / 'runs' / 'checkpoints' / 'keep.txt'
  keep.parent.mkdir(parents=True)
  keep.write_text('precious')
  run = lambda *a: subprocess.run(
      [sys.executable, '-m', 'experiments.bench_import', f'--tmp={tmp_path / "runs"}', *a],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  bad = run('--d_model=0', f'--out={tmp_path / "bad.json"}')
  assert bad.returncode == 2 and bad.stderr.strip().startswith('error: --d_model=0'), bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1
  out = tmp_path / 'import.json'
  ok = run('--d_model=128', '--mlp_dim=64', '--vocab=64', f'--out={out}')
  assert ok.returncode == 0, ok.stderr[-3000:]
  assert keep.read_text() == 'precious'
  assert sorted(p.name for p in (tmp_path / 'runs').iterdir()) == ['checkpoints']
  rec = json.loads(out.read_text())
  assert rec['params'] > 0 and rec['peak_bytes'] >= rec['base_bytes'] > 0
  # the ratio is over fp32 bytes (4 a parameter); the estimate adds the imports' base back
  ratio = (rec['peak_bytes'] - rec['base_bytes']) / (4 * rec['params'])
  assert rec['fp32_bytes'] == 4 * rec['params']
  assert rec['peak_over_fp32'] == pytest.approx(ratio)
  assert rec['huginn_0125_peak_gb_estimate'] == pytest.approx(
      (ratio * 3_564_976_800 * 4 + rec['base_bytes']) / 1e9)


BENCH_DATA_PARTS = """
import dataclasses, json, pathlib, shutil, tempfile
from absl import flags
from experiments import bench_data
from elastic_depth.data import tokenizer as tokenizer_lib
flags.FLAGS(['x', '--batches=3', '--mfu=0.25', '--peak_tflops=100'])
cfg = bench_data._CONFIG.value
cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=2, seq_len=16))
tok = tokenizer_lib.get(bench_data._TOKENIZER.value, [], 10**6)
d = bench_data.sparse_dir(pathlib.Path(tempfile.mkdtemp()) / 'sparse', 2**21 + 1, tok)
out = dict(index=json.loads((d / 'index.json').read_text()),
           sizes={p.name: p.stat().st_size for p in d.glob('*.bin')},
           input=bench_data.bench_input(d, cfg, tok.vocab_size),
           demand=bench_data.step_demand(cfg))
shutil.rmtree(d.parent)
print(json.dumps(out))
"""


def test_bench_data_sparse_shards_input_rate_and_step_demand():
  """An odd-sized sparse set keeps every token, uint16 bytes on disk; tokens/s is batches/s x
  batch x seq_len; the step demand x its FLOPs a token is mfu x peak."""
  r = py_json(BENCH_DATA_PARTS)
  splits = r['index']['splits']
  assert [s['tokens'] for s in splits['train']['shards']] == [2**20, 2**20 + 1]
  for split in splits.values():
    assert split['tokens'] == sum(s['tokens'] for s in split['shards'])
    for s in split['shards']:
      assert r['sizes'][s['file']] == 2 * s['tokens']  # two bytes a uint16 token
  assert splits['val']['tokens'] == 2**20
  inp = r['input']
  assert inp['corpus_tokens'] == 2**21 + 1 and inp['batches'] == 3
  assert inp['tokens_per_s'] == pytest.approx(inp['batches_per_s'] * 2 * 16)
  dem = r['demand']
  assert dem['tokens_per_s'] * dem['train_flops_per_token'] == pytest.approx(0.25 * 100e12)


BENCH_DATA_PREPARE = """
import json, pathlib, shutil, tempfile
from absl import flags
from experiments import bench_data
tmp = pathlib.Path(tempfile.mkdtemp())
corpus = tmp / 'docs.jsonl'
corpus.write_text(''.join(json.dumps({'text': f'document {i} says hello.'}) + '\\n'
                          for i in range(50)))
flags.FLAGS(['x', f'--corpus={corpus}'])
r = bench_data.bench_prepare(tmp, 1)
made = [str(p) for p in tmp.glob('prep*')]
shutil.rmtree(tmp)
print(json.dumps(dict(r, made=made)))
"""


def test_bench_data_prepare_reports_the_folder_it_prepared():
  """prepare.dir in the report is the folder prepare_data wrote."""
  r = py_json(BENCH_DATA_PREPARE)
  assert r['docs'] == 50 and r['dir'] in r['made']


OUT_OF_RANGE = [
    (('bench_generate', '--shapes=foo'), '--shapes must be shape names'),
    (('bench_generate', '--batch_sizes=1', '--serve_shape=foo'), '--serve_shape must be one of'),
    (('bench_generate', '--new_tokens=0'), '--new_tokens=0'),
    (('bench_generate', '--eps_grid=abc'), '--eps_grid must be numbers'),
    (('bench_generate', '--quality_tol=nan'), '--quality_tol must be a finite number'),
    (('bench_exit', '--batch=0'), '--batch=0'),
    (('bench_exit', '--shapes=nano', '--repeats=0'), '--repeats=0'),
    (('bench_exit', '--depth=0'), '--depth=0'),
    (('bench_kl', '--repeats=0'), '--repeats=0'),
    (('bench_kl', '--shapes=64x8x40', '--block_n=-1'), '--block_n=-1'),
    (('bench_kl', '--shapes=64x8x40', '--peak_tflops=0'), '--peak_tflops must be a positive'),
    (('bench_kl', '--shapes=64x8x40', '--cpu_max_gflop=-1'), '--cpu_max_gflop must be'),
    (('bench_exit', '--shapes=nano', '--eps=-1'), '--eps must be a finite number >= 0'),
    (('bench_exit', '--shapes=nano', '--eps=nan'), '--eps must be a finite number >= 0'),
    (('bench_exit', '--shapes=nano', '--min_tokens=0'), '--min_tokens=0'),
    (('bench_generate', '--shapes=nano', '--target_loops=0'), '--target_loops must be'),
    (('bench_generate', '--shapes=nano', '--target_loops=nan'), '--target_loops must be'),
    (('bench_data', '--repeats=0'), '--repeats=0'),
    (('bench_data', '--corpus=/no/such.jsonl'), '--corpus: no such file or directory'),
    (('bench_data', '--tokenizer=/no/such/tok'), "--tokenizer='/no/such/tok': no local file"),
    (('bench_data', '--mfu=2'), '--mfu must be in (0, 1]'),
    (('bench_import', '--tmp={tmp}', '--d_model=192'), '--d_model=192 must be a positive'),
    (('bench_import', '--tmp={tmp}', '--mlp_dim=0'), '--mlp_dim=0 must be >= 1'),
    (('bench_import', '--tmp={tmp}', '--vocab=0'), '--vocab=0 must be >= 1'),
    (('bench_train', '--depth=-1'), '--depth=-1'),
    (('bench_train', '--shapes=nano', '--warmup=-1'), '--warmup=-1 must be >= 0'),
    (('bench_train', '--shapes=nano', '--peak_n=0'), '--peak_n=0'),
    (('bench_train', '--shapes=nano', '--reference_threads=0'), '--reference_threads=0'),
    (('bench_train', '--shapes=tiny', '--tiny_flags=/no/such.flags'),
     "--tiny_flags='/no/such.flags' does not name a readable flag file"),
    *[((*args, 'stray'), "unexpected arguments ['stray']")
      for args in (('bench_generate', '--shapes=nano'), ('bench_exit', '--shapes=nano'),
                   ('bench_kl', '--shapes=64x8x40'), ('bench_train', '--shapes=nano'),
                   ('bench_import',))]]


@pytest.mark.parametrize('i', range(len(OUT_OF_RANGE)),
                         ids=[' '.join(a) for a, _ in OUT_OF_RANGE])
def test_bench_flags_out_of_range_are_one_line_before_any_work(main_cases, i):
  words = OUT_OF_RANGE[i][1]
  res = _case(main_cases, [a for a, _ in OUT_OF_RANGE], i, '--out={tmp}/b.json')
  assert res['rc'] == 2 and res['stderr'].startswith('error:'), res['stderr'][-3000:]
  assert words in res['stderr'] and len(res['stderr'].strip().splitlines()) == 1, res['stderr']
  assert res['files'] == []


def test_bench_exit_ratios_are_medians_and_wall_over_flop_savings():
  """bench_exit._ratio / paired_saving against a hand count (float64 numpy)."""
  got = py_json('''
    import json
    from experiments import bench_exit
    t = {'v': [1.0, 3.0, 2.0], 'b': [4.0, 4.0, 4.0]}
    f = {'v': 25.0, 'b': 100.0}
    r = bench_exit._ratio(t, f, 'v', 'b')
    none = bench_exit._ratio(t, {'v': 100.0, 'b': 100.0}, 'v', 'b')
    paired = bench_exit.paired_saving([1.0, 1.0, 1.0], [2.0, 2.0, 10.0])
    print(json.dumps(dict(r=r, none=none, paired=paired)))
  ''')
  v, b = np.array([1.0, 3.0, 2.0]), np.array([4.0, 4.0, 4.0])
  wall = 1 - np.median(v) / np.median(b)          # 0.5
  wall_min = 1 - v.min() / b.min()                # 0.75
  pair = np.median(1 - v / b)                     # median(0.75, 0.25, 0.5) = 0.5
  flop = 1 - 25.0 / 100.0                         # 0.75
  r = got['r']
  assert r['wall_saving'] == pytest.approx(wall)
  assert r['wall_saving_min'] == pytest.approx(wall_min)
  assert r['wall_saving_paired'] == pytest.approx(pair)
  assert r['flop_saving'] == pytest.approx(flop)
  assert r['realized_over_flop'] == pytest.approx(wall / flop)       # 2/3, not 3/2
  assert r['realized_over_flop_min'] == pytest.approx(wall_min / flop)
  assert r['realized_over_flop_paired'] == pytest.approx(pair / flop)
  # no FLOP saving: no ratio rather than a division by ~0
  assert got['none']['realized_over_flop'] is None
  # the paired saving is the median over rounds (0.5), not the mean (0.633)
  assert got['paired'] == pytest.approx(np.median(1 - np.array([1.0, 1, 1]) / [2.0, 2, 10]))


def test_bench_exit_matched_eps_is_the_fewest_loops_within_tol():
  """bench_exit.matched_eps on a fixed curve: brute force over the grid."""
  thr, loops = [1e-3, 1e-2, 1e-1, 3e-1], [4.0, 3.0, 3.0, 2.0]
  got = py_json(f'''
    import json
    from experiments import bench_exit
    def curve(mdl, batches, rng, c, depth):
      if c.policy == 'uniform':
        return {{'loss': [2.0]}}
      return {{'threshold': {thr}, 'loss': [2.0, 2.005, 2.004, 2.5], 'mean_loops': {loops}}}
    bench_exit.frontier.policy_curve = curve
    print(json.dumps(bench_exit.matched_eps(None, [], 4, 'kl', {thr}, tol=0.01)))
  ''')
  loss = [2.0, 2.005, 2.004, 2.5]
  ok = [i for i in range(len(thr)) if loss[i] <= 2.0 + 0.01]
  want = sorted(ok, key=lambda i: (loops[i], loss[i]))[0]  # fewest loops, then lower loss
  assert want == 2
  assert got['eps'] == thr[want] and got['mean_loops'] == loops[want]
  assert got['loss'] == loss[want] and got['a0_loss'] == 2.0


def test_paired_remainder_gives_no_figure_at_zero():
  """A median remainder of exactly 0 is noise, not a decode phase: None (rest > 0)."""
  assert bench_util.paired_remainder([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) is None
  assert bench_util.paired_remainder([1.0, 2.0, 3.0], [0.5, 2.0, 3.5]) is None  # median 0


def test_usage_fields_are_medians_of_the_calls():
  calls = [timing.Usage(1.0, 0.0, 10), timing.Usage(2.0, 0.5, 10), timing.Usage(9.0, 0.1, 1000)]
  out = bench_util.usage_fields(calls)
  assert out['user_s_median'] == np.median([1.0, 2.0, 9.0]) == 2.0
  assert out['sys_s_median'] == 0.1 and out['minor_faults_median'] == 10
  assert out['minor_faults_per_call'] == [10, 10, 1000]
  assert 'user_s_per_call' not in bench_util.usage_fields(calls, per_call=False)


def test_bench_train_scores_against_the_peaks_and_the_reference_target():
  """bench_train._score: fractions of the matmul peak from the model (and hardware) FLOP/s,
  MFU against the device peak, and the speed target at 1.2x the reference, by hand."""
  got = py_json('''
    import json
    from experiments import bench_train
    out = []
    for tok_s in (110.0, 120.0):  # 1.1x the reference: missed; 1.2x: met
      res = dict(timed=True, shape='S', seq_len=256, batch_size=8, depth=8, tokens_per_s=tok_s,
                 model_flops_per_s=2e9, hw_flops_per_s=3e9, reference_tokens_per_s=100.0)
      bench_train._score(res, 4e9, 8e9)
      out.append(res)
    print(json.dumps(out))
  ''')
  for res, tok_s, met in zip(got, (110.0, 120.0), (False, True)):
    assert res['fraction_of_peak'] == 2e9 / 4e9 and res['hw_fraction_of_peak'] == 3e9 / 4e9
    assert res['mfu'] == 2e9 / 8e9 and res['device_peak_flops'] == 8e9
    assert res['ratio_vs_reference'] == pytest.approx(tok_s / 100.0)
    assert res['target_tokens_per_s'] == pytest.approx(120.0)
    assert res['meets_speed_target'] is met
    assert res['meets_peak_target'] is True and res['target_fraction_of_peak'] == 0.40


@pytest.mark.parametrize('impl', ['xla', 'chunked'])
def test_train_step_flop_books_count_what_the_backward_recomputes(impl):
  """timed_step.flop_counts against model.flops_per_token's totals: remat 'nothing' redoes
  the r loops' forward (total(r) - total(0)), 'dots' their attention products (total at
  causal keys - total at none, in the core), all_dots or no remat nothing; a flash-style
  attention (chunked) also redoes QK^T, half the attention FLOPs of every block."""
  from experiments import timed_step  # pylint: disable=g-import-not-at-top
  r, seq = 3, 16
  m = config_lib.ModelConfig(**bench_util.MODEL_SHAPES['nano'], max_len=seq, attention_impl=impl)
  total = lambda r, **kw: float(model_lib.flops_per_token(m, r, seq, **kw)['total'])
  flash = (total(r) - total(r, core_keys=0, outer_keys=0)) / 2 if impl == 'chunked' else 0.0
  want = {'nothing': total(r) - total(0),
          'dots': 0.0 if impl == 'chunked' else total(r) - total(r, core_keys=0),
          'all_dots': 0.0, 'off': 0.0}
  for remat, extra in want.items():
    cfg = config_lib.Config(model=m, depth=config_lib.DepthConfig(
        mean=float(r), sigma=0.0, r_max=r, buckets=(r,), remat=remat != 'off',
        remat_policy='nothing' if remat == 'off' else remat),
                            train=config_lib.TrainConfig(seq_len=seq, batch_size=2))
    fl = timed_step.flop_counts(cfg, r)
    assert fl['model'] == pytest.approx(3 * total(r), rel=1e-12)
    assert fl['remat_recompute'] == pytest.approx(extra + flash, rel=1e-12), remat
    assert fl['hw'] == pytest.approx(3 * total(r) + extra + flash, rel=1e-12), remat
  assert want['nothing'] > 0 and (want['dots'] > 0) == (impl == 'xla')


def test_bench_kl_roofline_floors_by_hand():
  """bench_kl.roofline: two [N, D] x [D, V] products (4 N D V FLOPs), the least traffic
  h, hprev and W once plus three fp32 outputs per token, and the roofline the larger floor."""
  n, d, v, sec = 64, 8, 40, 1e-6
  got = py_json(f'''
    import json
    from absl import flags
    from experiments import bench_kl
    flags.FLAGS(['bench_kl', '--peak_tflops=100', '--peak_gbps=1000'])
    print(json.dumps(bench_kl.roofline({n}, {d}, {v}, 'bfloat16', {sec})))
  ''')
  flops, bytes_ = 2 * (2 * n * d * v), 2 * (n * d + n * d + v * d) + 4 * 3 * n
  flop_s, bw_s = flops / 100e12, bytes_ / 1000e9
  assert got['achieved_tflops'] == pytest.approx(flops / sec / 1e12)
  assert got['flop_floor_s'] == pytest.approx(flop_s)
  assert got['bandwidth_floor_s'] == pytest.approx(bw_s)
  assert got['frac_of_flop_floor'] == pytest.approx(flop_s / sec)
  assert got['frac_of_bandwidth_floor'] == pytest.approx(bw_s / sec)
  assert got['frac_of_roofline'] == pytest.approx(max(flop_s, bw_s) / sec)
  assert flop_s != bw_s
