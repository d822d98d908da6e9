"""Bad flags, configs, data and checkpoints stop `experiments.pretrain` before compiling.

Each case must exit with code 2 and one `error: ...` line naming the problem, with no
traceback, and leave checkpoints alone: no checkpoints folder for a fresh workdir, an
unchanged one for an existing workdir.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from elastic_depth import checkpoint, config as config_lib, data as data_lib, train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    '--quiet', '--config.model.vocab_size=31', '--config.model.d_model=32',
    '--config.model.num_heads=2', '--config.model.num_kv_heads=1',
    '--config.model.head_dim=16', '--config.model.mlp_dim=64', '--config.model.n_core=1',
    '--config.model.max_len=64', '--config.train.seq_len=32', '--config.train.batch_size=4',
    '--config.data.synth_examples=200', '--config.depth.mean=1.5', '--config.depth.r_max=2',
    '--config.depth.buckets=(1,2)', '--config.train.steps=4',
]


def tiny_config() -> config_lib.Config:
  """The TINY flags as a Config."""
  return config_lib.Config(
      model=config_lib.ModelConfig(vocab_size=31, d_model=32, num_heads=2, num_kv_heads=1,
                                   head_dim=16, mlp_dim=64, n_core=1, max_len=64),
      depth=config_lib.DepthConfig(mean=1.5, r_max=2, buckets=(1, 2)),
      data=config_lib.DataConfig(synth_examples=200),
      train=config_lib.TrainConfig(seq_len=32, batch_size=4, steps=4))


def snapshot(workdir):
  """{relative path: (size, mtime_ns)} of everything under <workdir>/checkpoints."""
  root = os.path.join(workdir, 'checkpoints')
  out = {}
  for r, _, fs in os.walk(root):
    for f in fs:
      st = os.stat(os.path.join(r, f))
      out[os.path.relpath(os.path.join(r, f), root)] = (st.st_size, st.st_mtime_ns)
  return out


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A workdir holding a step-2 checkpoint of the TINY config (saved in-process)."""
  wd = str(tmp_path_factory.mktemp('trained'))
  cfg = tiny_config()
  ds = data_lib.build(cfg.data, seq_len=32, batch_size=4, vocab_size=31, workdir=wd)
  next(ds.train_iter)
  _, state = train_step.init_state(cfg)
  mngr = checkpoint.manager(wd)
  checkpoint.save(mngr, 2, state, {'config': train_step.config_dict(cfg),
                                   'data_iter': ds.train_iter.get_state(),
                                   'tokenizer': checkpoint.tokenizer_info(ds.tokenizer)})
  mngr.wait_until_finished()
  mngr.close()
  return wd


def pretrain(workdir, *flags):
  return subprocess.run([sys.executable, '-m', 'experiments.pretrain', f'--workdir={workdir}',
                         *TINY, *flags], cwd=REPO, capture_output=True, text=True,
                        timeout=180, check=False)


def assert_one_line_error(out, *needles):
  assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
  assert 'Traceback' not in out.stderr, out.stderr[-3000:]
  errors = [l for l in out.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == errors[0]
  for n in needles:
    assert n in errors[0], (n, errors[0])
  assert 'elastic-depth:' not in out.stdout  # stopped before the model was built


CORPORA = {'empty.txt': b'', 'latin1.txt': b'ok ok ok' + bytes([0xff, 0xfe]) + b' more',
           'short.txt': b'hello there<|endoftext|>general kenobi', 'a_file': b'x'}

CASES = {
    'unknown flag': (['--nope=1'], ["Unknown command line flag 'nope'"]),
    'unknown config field': (['--config.model.nope=3'], ['bad --config flag', 'nope']),
    'bad flag value': (['--config.train.steps=abc'], ['--config.train.steps=abc']),
    'mean depth < 1': (['--config.depth.mean=0.5'], ['depth.mean=0.5', '>= 1']),
    'buckets below r_max': (['--config.depth.r_max=4'],
                            ['depth.buckets=(1, 2) do not cover depth.r_max=4']),
    'eps < 0': (['--config.exit.eps=-0.1'], ['exit.eps=-0.1', '>= 0']),
    'missing flag file': (['--flagfile={tmp}/nope.flags'],
                          ['Unable to open flagfile', 'nope.flags', 'repository root']),
    'missing corpus': (['--config.data.source=text', '--config.data.paths={tmp}/nope.txt'],
                       ['no such file or directory', 'nope.txt']),
    'empty corpus': (['--config.data.source=text', '--config.data.paths={files}/empty.txt'],
                     ['empty corpus']),
    'non-UTF-8 corpus': (['--config.data.source=text',
                          '--config.data.paths={files}/latin1.txt'],
                         ['not valid UTF-8 at byte offset 8']),
    'corpus shorter than a sequence': (
        ['--config.data.source=text', '--config.model.vocab_size=300',
         '--config.data.paths={files}/short.txt'], ['fewer than one sequence', 'seq_len+1=33']),
}


def _fresh_workdir_case(main_cases, i):
  """Case i of CASES and an unwritable workdir, one process for all (`main_cases`)."""
  cases = [['--workdir={tmp}/run', *TINY, *CASES[k][0]] for k in sorted(CASES)]
  cases.append(['--workdir={files}/a_file/run', *TINY])
  res = main_cases('experiments.pretrain', cases, CORPORA)[i]
  return subprocess.CompletedProcess(cases[i], res['rc'], res['stdout'], res['stderr']), res


@pytest.mark.parametrize('i', range(len(CASES)), ids=sorted(CASES))
def test_bad_input_is_one_clear_line_before_anything_is_built(main_cases, i):
  out, res = _fresh_workdir_case(main_cases, i)
  assert_one_line_error(out, *CASES[sorted(CASES)[i]][1])
  assert 'run/checkpoints/' not in res['files']
  assert 'run/tokenizer.json' not in res['files']  # a tokenizer of failed data is not kept


def test_unwritable_workdir(main_cases):
  out, _ = _fresh_workdir_case(main_cases, len(CASES))
  assert_one_line_error(out, 'is not writable', 'a_file')


RESUME_CASES = {
    'existing checkpoints without --resume': ([], ['already holds checkpoints [2]',
                                                   '--resume', 'nothing deleted']),
    'another model config': (['--resume', '--config.model.d_model=64'],
                             ['different model config', 'd_model: checkpoint=32 vs config=64']),
    'another tokenizer': (['--resume', '--config.data.synth_num_vars=10'],
                          ['another tokenizer', 'vocab 31', 'vocab 25']),
}


@pytest.mark.parametrize('case', sorted(RESUME_CASES))
def test_checkpoint_mismatch_is_one_clear_line_and_changes_nothing(case, trained, tmp_path):
  wd = str(tmp_path / 'run')
  shutil.copytree(trained, wd)
  before = snapshot(wd)
  flags, needles = RESUME_CASES[case]
  out = pretrain(wd, *flags)
  assert_one_line_error(out, *needles)
  assert snapshot(wd) == before and before
  assert not os.path.exists(os.path.join(wd, 'metrics.jsonl'))


def test_eval_depths_beyond_r_max_are_named_and_the_mean_label_is_true(tmp_path):
  """eval_depths above depth.r_max: a note before training; validation scores up to r_max,
  and the closing line labels the depth nearest a non-integer mean as nearest, not equal."""
  wd = tmp_path / 'run'
  out = pretrain(str(wd), '--config.train.eval_depths=(1,2,4,8)', '--config.train.eval_every=4')
  assert out.returncode == 0, out.stderr[-3000:]
  assert ('note: train.eval_depths [4, 8] exceed depth.r_max=2; validation scores up to 2'
          in out.stdout), out.stdout
  assert f'eval_depth --workdir={wd} --max_depth=8' in out.stdout
  summary = json.loads((wd / 'summary.json').read_text())
  scored = sorted(int(d) for d in summary['val_loss'])
  assert scored == train_step.validation_depths(tiny_config()) == [1, 2]
  assert 'depth 1 (nearest the training mean 1.5) = ' in out.stdout, out.stdout
  assert '(training mean)' not in out.stdout
