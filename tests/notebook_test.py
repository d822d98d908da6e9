"""Executes the Colab reproduction notebook headlessly with a few training steps."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
  nb = nbformat.read(ROOT / 'notebooks' / 'reproduce.ipynb', as_version=4)
  workdir = tmp_path / 'nb'
  monkeypatch.setenv('ELASTIC_DEPTH_SKIP_INSTALL', '1')
  monkeypatch.setenv('ED_STEPS', '12')
  monkeypatch.setenv('ED_BATCHES', '2')
  monkeypatch.setenv('ED_WORKDIR', str(workdir))
  monkeypatch.setenv('ED_EXTRA', '--config.data.synth_examples=2000 --config.depth.r_max=4 '
                     '--config.depth.buckets=(1,2,3,4) --config.train.eval_depths=(1,4) '
                     '--config.model.d_model=32 --config.model.mlp_dim=64 '
                     '--config.train.batch_size=4 --config.train.seq_len=64')
  try:
    NotebookClient(nb, timeout=900, kernel_name='python3',
                   resources={'metadata': {'path': str(ROOT)}}).execute()
  except Exception as e:  # pragma: no cover - show the failing cell's output
    pytest.fail(f'notebook failed: {e}')
  for name in ('eval_depth', 'convergence', 'sweep_eps', 'router'):
    assert (workdir / 'reports' / f'{name}.json').exists(), name
  assert (workdir / 'reports' / 'sweep_eps.png').stat().st_size > 1000
  images = [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])
            if 'image/png' in o.get('data', {})]
  assert len(images) >= 3
