"""Executes the Colab reproduction notebook headlessly: shortened in full, and its first
cells as shipped (the main job's command; the repository found, cloned or asked for)."""

import pathlib
import subprocess

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

pytestmark = pytest.mark.slow  # the quick loop skips it: pytest -m "not slow"

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUP, PARAMS = 1, 3  # indices of the repository cell and the parameters cell


def _notebook():
  return nbformat.read(ROOT / 'notebooks' / 'reproduce.ipynb', as_version=4)


def _run(nb, cwd, cells=None):
  if cells is not None:
    nb.cells = [nb.cells[i] for i in cells]
  NotebookClient(nb, timeout=900, kernel_name='python3',
                 resources={'metadata': {'path': str(cwd)}}).execute()
  return nb


def _text(cell) -> str:
  return ''.join(o.get('text', '') for o in cell.get('outputs', []))


def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
  workdir = tmp_path / 'nb'
  monkeypatch.setenv('ELASTIC_DEPTH_SKIP_INSTALL', '1')
  monkeypatch.setenv('ED_STEPS', '12')
  monkeypatch.setenv('ED_BATCHES', '2')
  monkeypatch.setenv('ED_WORKDIR', str(workdir))
  monkeypatch.setenv('ED_EXTRA', '--config.data.synth_examples=2000 --config.depth.r_max=4 '
                     '--config.depth.buckets=(1,2,3,4) --config.train.eval_depths=(1,4) '
                     '--config.model.d_model=32 --config.model.mlp_dim=64 '
                     '--config.train.batch_size=4 --config.train.seq_len=64 '
                     '--config.data.val_fraction=0.25')
  try:
    nb = _run(_notebook(), ROOT)
  except Exception as e:  # pragma: no cover - show the failing cell's output
    pytest.fail(f'notebook failed: {e}')
  for name in ('eval_depth', 'convergence', 'calibrate_eps', 'sweep_eps', 'router',
               'difficulty'):
    assert (workdir / 'reports' / f'{name}.json').exists(), name
  assert (workdir / 'reports' / 'sweep_eps.png').stat().st_size > 1000
  images = [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])
            if 'image/png' in o.get('data', {})]
  assert len(images) >= 3


def test_shipped_defaults_are_the_main_job_and_the_repo_is_found(tmp_path, monkeypatch):
  for var in ('ED_STEPS', 'ED_EXTRA', 'ED_WORKDIR', 'ELASTIC_DEPTH_REPO'):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv('ELASTIC_DEPTH_SKIP_INSTALL', '1')
  nb = _notebook()
  nb.cells.insert(PARAMS + 1, nbformat.v4.new_code_cell('print(PRETRAIN)'))
  out = _run(nb, ROOT, [SETUP, PARAMS, PARAMS + 1])
  assert _text(out.cells[-1]).strip() == str(
      ['experiments.pretrain', '--flagfile=launch/tiny.flags', '--workdir=runs/tiny',
       '--quiet'])
  # outside a checkout, without a URL: a clear message naming the form fields
  with pytest.raises(CellExecutionError, match='REPO_URL'):
    _run(_notebook(), tmp_path, [SETUP])
  # with a URL (here a local clone source): cloned next to the notebook and used
  src = tmp_path / 'src'
  subprocess.run(['git', 'clone', '-q', '--depth=1', f'file://{ROOT}', str(src)], check=True)
  monkeypatch.setenv('ELASTIC_DEPTH_REPO', f'file://{src}')
  work = tmp_path / 'colab'
  work.mkdir()
  out = _run(_notebook(), work, [SETUP])
  assert f"repository: {work / 'elastic-depth'}" in _text(out.cells[0])
