"""Huginn import: the tiny fixture made by Huginn's own PyTorch code is reproduced exactly,
bad sources are clear errors, and the experiments run on the imported model."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from elastic_depth import checkpoint, decoding, huginn, snapshot
from elastic_depth import model as model_lib
from elastic_depth.config import ExitConfig
from experiments import calibrate_eps, common, convergence, eval_depth, sweep_eps, train_router

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / 'shared'
FIXTURE = SHARED / 'fixtures' / 'huginn_tiny'
FINEWEB = SHARED / 'data' / 'fineweb_edu' / 'fineweb-edu.sample-350BT.part0.jsonl'
pytestmark = pytest.mark.skipif(not FIXTURE.is_dir(), reason=f'{FIXTURE} absent')


def _weights() -> dict:
  return dict(np.load(FIXTURE / 'weights.npz'))


def _snapshot(path: pathlib.Path, weights: dict, shards: int = 1, cfg_edit=None) -> str:
  """Writes weights as an HF-style safetensors snapshot (with an index when sharded)."""
  path.mkdir(parents=True)
  names = sorted(weights)
  groups = [names[i::shards] for i in range(shards)]
  weight_map = {}
  for i, group in enumerate(groups):
    fname = f'model-{i + 1:05d}-of-{shards:05d}.safetensors' if shards > 1 else \
        'model.safetensors'
    stn.save_file({k: weights[k] for k in group}, str(path / fname))
    weight_map.update({k: fname for k in group})
  if shards > 1:
    (path / snapshot.INDEX_FILE).write_text(json.dumps({'weight_map': weight_map}))
  cfg = json.loads((FIXTURE / 'config.json').read_text())
  (path / 'config.json').write_text(json.dumps(cfg if cfg_edit is None else cfg_edit(cfg)))
  return str(path)


def _small_tokenizer(path: pathlib.Path) -> None:
  """A character BPE of 200 ids (fits the fixture's vocabulary of 256) with EOS."""
  docs = [json.loads(line)['text'] for line in FINEWEB.read_text().splitlines()[:40]]
  tok = tokenizers.Tokenizer(models.BPE(unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(docs, trainers.BpeTrainer(
      vocab_size=200, limit_alphabet=100, special_tokens=['[UNK]', '<|endoftext|>'],
      show_progress=False))
  tok.save(str(path / 'tokenizer.json'))


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  """The fixture as a 2-shard snapshot with a tokenizer, imported into a workdir."""
  root = tmp_path_factory.mktemp('huginn')
  src = _snapshot(root / 'src', _weights(), shards=2)
  _small_tokenizer(root / 'src')
  wd = str(root / 'wd')
  huginn.import_huginn(src, wd, r_max=8, seq_len=16, batch_size=2, log=lambda s: None)
  return wd


@pytest.fixture(scope='module')
def loaded(imported):
  """(cfg, model, step, meta) of the imported workdir, loaded as the experiments do."""
  return common.load_model(imported)


def _load(name):
  return np.load(FIXTURE / name)


def test_reproduces_huginn_logits_and_per_loop_states(loaded):
  cfg, mdl, _, meta = loaded
  assert meta[checkpoint.WEIGHTS_ONLY] and cfg.model.norm_before_coda

  @jax.jit
  def run(tokens, s):  # 8 loops from Huginn's initial state; logits after every loop
    pos = model_lib.positions(tokens)
    e, _ = mdl.encode(tokens, pos)
    states, logits = [], []
    for _ in range(8):
      s = mdl.core_step(s, mdl.inject(e), pos)[0]
      states.append(s)
      logits.append(mdl.logits(mdl.decode_state(s, pos)[0]))
    return e, jnp.stack(states), jnp.stack(logits)

  e, states, logits = run(jnp.asarray(_load('tokens.npy')), jnp.asarray(_load('init_state.npy')))
  np.testing.assert_allclose(e, _load('prelude_out.npy'), atol=1e-5, rtol=0)
  for r in (1, 2, 4, 8):
    err = np.abs(np.asarray(logits[r - 1]) - _load(f'logits_r{r}.npy')).max()
    assert err <= 1e-4, (r, err)
  err = np.abs(np.asarray(states) - _load('states_r8.npy')).max()
  assert err <= 1e-4, err


def test_initial_state_follows_huginn_distribution(loaded):
  cfg, mdl, _, _ = loaded
  sigma = np.sqrt(2 / (5 * 64)) * 8.0  # README: sqrt(2/(5 n_embd)) * emb_scale
  assert cfg.model.state_std == pytest.approx(sigma)
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 100, (4, 64)), jnp.int32)
  pos = model_lib.positions(toks)
  s0 = np.asarray(mdl.initial_state(jnp.zeros((4, 64, 64)), jax.random.key(0), pos))
  assert np.abs(s0).max() <= 3 * sigma + 1e-6 and np.abs(s0).max() > 2.5 * sigma
  # std of a normal truncated at +-3 sigma: sigma * sqrt(1 - 6 phi(3) / (2 Phi(3) - 1))
  phi3 = np.exp(-4.5) / np.sqrt(2 * np.pi)
  assert s0.std() == pytest.approx(sigma * np.sqrt(1 - 6 * phi3 / 0.9973002), rel=0.02)


def test_bfloat16_single_file_source_converts_exactly(tmp_path):
  w = {k: v.astype(ml_dtypes.bfloat16) for k, v in _weights().items()}
  src = _snapshot(tmp_path / 'bf16', w)
  snap, files = snapshot.resolve_source(os.path.join(src, 'model.safetensors'))
  m = huginn.model_config(snapshot.read_hf_config(snap))
  found = snapshot.scan(files)
  huginn.check_keys(found, m)
  params = huginn.convert(found, m)
  wqkv = w['transformer.core_block.1.attn.Wqkv.weight'].astype(np.float32)
  perm = huginn.rope_permutation(16)
  got = params['core'][1]['attn']
  assert got['wq_DxHxK'].dtype == np.float32
  np.testing.assert_array_equal(got['wq_DxHxK'][:, 2, :], wqkv[32:48][perm].T)
  np.testing.assert_array_equal(got['wv_DxGxK'][:, 3, :], wqkv[128 + 48:128 + 64].T)


@pytest.mark.parametrize('edit,message', [
    (lambda w: w.update(extra=np.zeros(3, np.float32)), '1 unknown key.*extra'),
    (lambda w: w.pop('transformer.coda.0.norm_3.weight'),
     '1 missing key.*transformer.coda.0.norm_3.weight'),
    (lambda w: w.update({'transformer.adapter.weight': np.zeros((128, 64), np.float32)}),
     r'1 mis-shaped key.*transformer.adapter.weight \[128, 64\] \(expected \[64, 128\]\)'),
])
def test_bad_keys_are_named(tmp_path, edit, message):
  w = _weights()
  edit(w)
  src = _snapshot(tmp_path / 'src', w)
  with pytest.raises(huginn.HuginnError, match=message):
    huginn.import_huginn(src, str(tmp_path / 'wd'), log=lambda s: None)
  assert not (tmp_path / 'wd').exists()  # checked before anything is written


def test_cli_errors_exit_2(tmp_path):
  src = _snapshot(tmp_path / 'src', _weights(),
                  cfg_edit=lambda c: dict(c, block_class_name='Other'))
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-m', 'experiments.import_huginn', f'--src={src}',
                        f'--workdir={tmp_path}/wd'], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120, check=False)
  assert out.returncode == 2 and out.stderr.startswith('error: unsupported Huginn settings '
                                                        "{'block_class_name': 'Other'}")
  assert not (tmp_path / 'wd').exists()
  with pytest.raises(snapshot.SourceError, match='no such file'):
    snapshot.resolve_source(str(tmp_path / 'nope'))
  with pytest.raises(snapshot.SourceError, match='not a local path'):  # no network here
    snapshot.resolve_source('no-such-owner-zz/no-such-model-zz')


def test_imported_checkpoint_is_not_resumed_as_training(imported):
  mngr = checkpoint.existing_manager(imported)
  with pytest.raises(checkpoint.MismatchError, match='cannot be resumed|not resumed'):
    checkpoint.restore_latest(mngr, None)
  assert checkpoint.committed_steps(mngr) == [0]  # nothing moved aside
  with pytest.raises(huginn.HuginnError, match='already holds'):
    huginn.import_huginn(os.path.join(os.path.dirname(imported), 'src'), imported)


def test_every_experiment_runs_on_the_imported_model(imported):
  opts = common.Options(workdir=imported, batches=2, max_depth=4, progress=False,
                        data={'paths': str(FINEWEB), 'max_docs': '30'})
  el = eval_depth.run(opts)['results']
  assert el['depths'] == [1, 2, 3, 4] and all(np.isfinite(el['loss']))
  conv = convergence.run(opts, convergence.ConvergenceOptions(eps_conv=1e-3))['results']
  assert conv['tokens'] == 64 and 'word' in conv['by_class']  # text: token classes
  rt = train_router.run(opts, train_router.RouterOptions(steps=20, lr=1e-2, max_pairs=1000))
  assert os.path.isfile(rt['router']) and 0 <= rt['results']['heldout']['accuracy'] <= 1
  sw = sweep_eps.run(opts, sweep_eps.SweepOptions(eps_grid=[0.0, 1e9], router=True,
                                                  router_grid=[0.5]))['results']
  kl = sw['curves']['kl']
  assert kl['mean_loops'] == [4, 2] and kl['loss'][0] == pytest.approx(el['loss'][-1],
                                                                        rel=1e-5)
  assert 'router' in sw['curves']
  cal = calibrate_eps.run(opts, calibrate_eps.CalibrateOptions(
      delta=0.5, alpha=0.2, bound=4.0, cal_batches=1, eps_grid=[1e-6, 1e-3, 1e9]))['results']
  assert cal['cal_batches'] == [0] and cal['test_batches'] == [1]
  assert cal['eps'] in (None, 1e-6, 1e-3, 1e9)


def test_generation_with_per_token_exit_runs_on_the_imported_model(loaded):
  _, mdl, _, _ = loaded
  prompt = jnp.asarray(_load('tokens.npy')[:, :6])
  always = ExitConfig(policy='kl', eps=1e9, min_loops=1, max_loops=4)  # exit at first check
  toks, depth = jax.jit(lambda p: decoding.generate(mdl, p, 3, always,
                                                    jax.random.key(0)))(prompt)
  assert toks.shape == (2, 9) and (np.asarray(toks[:, :6]) == np.asarray(prompt)).all()
  assert (np.asarray(depth) == 2).all()  # KL needs two loops; max_loops is 4
  assert ((0 <= np.asarray(toks)) & (np.asarray(toks) < 256)).all()


def test_huginn_0125_config_maps_to_a_model_with_exactly_its_state_dict():
  hf = dict(json.loads((FIXTURE / 'config.json').read_text()), n_embd=5280, n_heads=55,
            num_key_value_heads=55, head_dim=96, intermediate_size=17920, vocab_size=65536,
            padded_vocab_size=65536, block_size=4096, n_layers_in_prelude=2,
            n_layers_in_recurrent_block=4, n_layers_in_coda=2, mean_recurrence=32,
            init_values={})  # nebel-raven-3.5b in Huginn's model registry
  cfg = huginn.full_config(hf)
  m = cfg.model
  assert m.embed_scale == pytest.approx(np.sqrt(5280)) and m.rope_theta == 50000
  assert m.state_std == pytest.approx(np.sqrt(2 / (5 * 5280)) * np.sqrt(5280))
  n = sum(int(np.prod(s)) for s in huginn.expected_shapes(m).values())
  d, f, v = 5280, 17920, 65536  # by hand: 4 norms, Wqkv, proj, qk_bias, fc, mlp.proj
  block = 4 * d + 3 * d * d + d * d + 2 * 5280 + 2 * f * d + d * f
  assert model_lib.count_params(m) == n == v * d + 2 * d * d + d + 8 * block  # tied head
  assert cfg.depth.mean == 32 and cfg.depth.r_max == cfg.exit.max_loops == 32


def test_memory_plan_counts_the_parameters_as_arguments():
  cfg = huginn.full_config(json.loads((FIXTURE / 'config.json').read_text()), r_max=4,
                           seq_len=24, batch_size=2)
  plan = huginn.memory_plan(cfg, 2, 24)
  n = sum(v.size for k, v in _weights().items() if k not in ('freqs_cis', 'lm_head.weight'))
  assert plan['params'] == n
  for kind in ('trace', 'exit'):  # fp32 parameters + inputs and targets (+ key, eps)
    assert abs(plan[kind]['argument'] * 1e9 - (4 * n + 2 * 4 * 2 * 24)) <= 64
    assert plan[kind]['temp'] > 0


@pytest.mark.slow
def test_huginn_0125_sweep_script_runs_end_to_end_on_the_fixture(tmp_path):
  """launch/huginn_0125_sweep.sh, small settings: import, every step; the router is fitted on
  other text, so the sweep may score more batches than train_router's default --fit_from."""
  src = _snapshot(tmp_path / 'src', _weights())
  _small_tokenizer(tmp_path / 'src')
  wd, fw = tmp_path / 'wd', str(FINEWEB)
  env = dict(os.environ, SRC=src, WD=str(wd), FW=fw,
             FIT=fw.replace('part0', 'part1'), BATCHES='10', DEPTH='4', BATCH='2', SEQ='16')
  out = subprocess.run(['bash', str(ROOT / 'launch' / 'huginn_0125_sweep.sh')], env=env,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  rt = json.loads((wd / 'router.json').read_text())['fit']
  assert rt['split'] == 'train' and fw.replace('part0', 'part1') in rt['data_config']['paths']
  sw = json.loads((wd / 'reports' / 'sweep_eps.json').read_text())
  assert {'kl', 'router'} <= set(sw['results']['curves']) and sw['flags']['batches'] == 10
  assert (wd / 'reports' / 'eval_depth.json').is_file()
  assert (wd / 'reports' / 'convergence.json').is_file()


def test_config_fields_huginn_ignores_or_cannot_honour(tmp_path):
  """Huginn scales embeddings by sqrt(n_embd) whatever init_values.embed_scale says (we
  used the field); init_values that is no mapping, and a seq_len above block_size (it was
  clamped in silence), are refused by name; seq_len 0 is 1024 capped at block_size."""
  hf = json.loads((FIXTURE / 'config.json').read_text())
  d = int(hf['n_embd'])
  m = huginn.model_config(dict(hf, init_values=dict(hf.get('init_values') or {}, embed_scale=4.0)))
  assert m.embed_scale == pytest.approx(np.sqrt(d))
  with pytest.raises(huginn.HuginnError, match='init_values=.* is not a mapping'):
    huginn.model_config(dict(hf, init_values=[1, 2]))
  block = int(hf['block_size'])
  with pytest.raises(huginn.HuginnError, match=f"seq_len={block + 1} exceeds the model's "
                     f'block_size={block}'):
    huginn.full_config(hf, seq_len=block + 1)
  assert huginn.full_config(hf).train.seq_len == min(1024, block)
  with pytest.raises(huginn.HuginnError, match='r_max=0 must be >= 1'):
    huginn.full_config(hf, r_max=0)


def test_a_workdir_that_holds_anything_or_is_a_file_is_refused_before_converting(tmp_path):
  """Nothing in it is overwritten: a folder holding only a tokenizer.json had that file
  replaced; a workdir that is a file failed with a traceback after the conversion."""
  src = _snapshot(tmp_path / 'src', _weights())
  _small_tokenizer(tmp_path / 'src')
  (tmp_path / 'wd').mkdir()
  (tmp_path / 'wd' / 'tokenizer.json').write_text('mine')
  (tmp_path / 'file').write_text('mine too')
  logs = []
  for wd, words in ((tmp_path / 'wd', r"already holds \['tokenizer.json'\]"),
                    (tmp_path / 'file', 'is a file, not a folder')):
    with pytest.raises(huginn.HuginnError, match=words):
      huginn.import_huginn(src, str(wd), log=logs.append)
  assert not logs  # refused before a tensor was read
  assert (tmp_path / 'wd' / 'tokenizer.json').read_text() == 'mine'
  assert (tmp_path / 'file').read_text() == 'mine too'
  huginn.import_huginn(src, str(tmp_path / 'empty'), r_max=4, log=logs.append)  # new: fine


@pytest.mark.parametrize('r_max', [2, 4, 8])
def test_imported_exit_depth_is_the_training_mean_recurrence_capped_at_r_max(r_max):
  """The imported config's uniform exit depth is Huginn's mean_recurrence (4 in the
  fixture's config.json) capped at r_max, like depth.mean; max_loops is r_max."""
  hf = json.loads((FIXTURE / 'config.json').read_text())
  mean = int(hf['mean_recurrence'])
  assert mean == 4
  cfg = huginn.full_config(hf, r_max=r_max)
  assert cfg.exit.depth == min(mean, r_max)
  assert cfg.depth.mean == min(mean, r_max)
  assert cfg.exit.max_loops == cfg.depth.r_max == r_max


def test_a_key_in_two_shards_is_named(tmp_path):
  """Two shards that both hold a tensor: SourceError naming the key and both shards (the
  later one would silently replace the earlier one)."""
  a, b = str(tmp_path / 'a.safetensors'), str(tmp_path / 'b.safetensors')
  stn.save_file({'x': np.zeros((2, 3), np.float32), 'y': np.ones(4, np.float32)}, a)
  stn.save_file({'x': np.ones((5,), np.float32)}, b)
  found = snapshot.scan([a])  # one shard alone is fine
  assert found == {'x': (a, (2, 3), 'F32'), 'y': (a, (4,), 'F32')}
  with pytest.raises(snapshot.SourceError, match=r'key x is in two shards: .*a\.safetensors '
                     r'and .*b\.safetensors'):
    snapshot.scan([a, b])


def test_dry_run_plans_the_evaluation_shape_without_a_workdir(main_cases):
  """--dry_run needs only --src: the plan is at --batch_size x --seq_len and --r_max, the
  sequence length by default 1024 capped at the model's block_size."""
  block = json.loads((FIXTURE / 'config.json').read_text())['block_size']
  got = main_cases('experiments.import_huginn', [
      [f'--src={FIXTURE}', '--dry_run'],
      [f'--src={FIXTURE}', '--dry_run', '--seq_len=8', '--batch_size=3', '--r_max=4']])
  for res, want in zip(got, ((min(1024, block), 8, 32), (8, 3, 4))):
    assert res['rc'] == 0, res['stderr'][-3000:]
    plan = json.loads(res['stdout'])
    assert (plan['seq_len'], plan['batch_size'], plan['r_max']) == want
    assert plan['trace']['argument'] > 0 and res['files'] == []
