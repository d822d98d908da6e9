"""Times the reference implementation's own training step (Huginn, PyTorch) at our shapes.

Glue only: the model class, its config class and its forward are the reference's own
(`recpre/raven_modeling_minimal.py` of github.com/seal-rg/recurrent-pretraining, loaded
from a checkout given by path); nothing of it is copied here. torch is an optional
dependency (`pip install -e '.[reference]'`); `bench_train --reference_dir=DIR` runs
`ReferenceStep` after timing our own step, one after the other, never at once.

The step: `model(tokens, labels=targets, num_steps=(0, r))` (r core loops, all with
gradient; no activation checkpointing, the reference's default), `loss.backward()`,
global-norm clipping and `torch.optim.AdamW`, with `torch.set_num_threads(threads)`.
RavenConfig has no grouped-query attention (num_key_value_heads = n_heads), so at P
(9 query heads over 3 kv heads here) the reference runs 9 kv heads: its K/V projections
cost 2 x 2 x 576 x (576 - 192) more FLOPs per token and block than ours, 9% more FLOPs
per step at r=8 (bench_train's shape `Pmha` is our model with 9 kv heads, for parity).
"""

import importlib
import os
import sys
import types

from experiments import bench_util

_PKG = '_huginn_reference'


class ReferenceUnavailable(RuntimeError):
  """The reference checkout or torch cannot be used."""


def check_reference_dir(path: str) -> str:
  """The path of the reference's modeling file, or a ReferenceUnavailable naming the problem."""
  f = os.path.join(path, 'recpre', 'raven_modeling_minimal.py')
  if not os.path.isfile(f):
    raise ReferenceUnavailable(
        f'--reference_dir={path!r} holds no recpre/raven_modeling_minimal.py (a checkout of '
        'github.com/seal-rg/recurrent-pretraining)')
  try:
    import torch  # pylint: disable=g-import-not-at-top,unused-import
    import transformers  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise ReferenceUnavailable(f'the reference needs torch and transformers ({e}); '
                          "pip install -e '.[reference]'") from None
  return f


def load_reference(path: str):
  """The reference's modeling module, imported without its package __init__ (heavy deps)."""
  check_reference_dir(path)
  if _PKG not in sys.modules:
    pkg = types.ModuleType(_PKG)
    pkg.__path__ = [os.path.join(os.path.abspath(path), 'recpre')]
    sys.modules[_PKG] = pkg
  return importlib.import_module(f'{_PKG}.raven_modeling_minimal')


def reference_config(mod, model: dict, seq_len: int, r: int):
  """The reference's RavenConfig at one of our MODEL_SHAPES (see the notes on GQA)."""
  d, h = model['d_model'], model['num_heads']
  if d != h * model['head_dim']:
    raise ReferenceUnavailable(f'the reference needs d_model = num_heads * head_dim '
                          f'({d} != {h} * {model["head_dim"]})')
  n = model['n_prelude'] + model['n_core'] + model['n_coda']
  return mod.RavenConfig(
      n_embd=d, n_heads=h, n_layers=n, block_size=seq_len, vocab_size=model['vocab_size'],
      intermediate_size=model['mlp_dim'], n_layers_in_prelude=model['n_prelude'],
      n_layers_in_recurrent_block=model['n_core'], n_layers_in_coda=model['n_coda'],
      mean_recurrence=r, mean_backprop_depth=r, qk_bias=False, tie_embeddings=True,
      torch_dtype='float32')


class ReferenceStep(bench_util.StepTimer):
  """The reference's model and AdamW at one of our shapes; times its training step."""

  def __init__(self, path: str, model: dict, *, seq_len: int, batch_size: int, r: int,
               threads: int = 2, lr: float = 1e-3, seed: int = 0):
    import torch  # pylint: disable=g-import-not-at-top
    super().__init__()
    self.torch, mod = torch, load_reference(path)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    self.cfg = reference_config(mod, model, seq_len, r)
    self.net = mod.RavenForCausalLM(self.cfg).float().train()
    self.opt = torch.optim.AdamW(self.net.parameters(), lr=lr, betas=(0.9, 0.95),
                                 weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    shape = (batch_size, seq_len)
    self.inputs = torch.randint(0, model['vocab_size'], shape, generator=g)
    self.targets = torch.randint(0, model['vocab_size'], shape, generator=g)
    self.r, self.threads, self.tokens = r, threads, batch_size * seq_len

  def step(self) -> float:
    """One training step: forward through r loops with gradient, backward, clip, AdamW."""
    out = self.net(self.inputs, labels=self.targets, num_steps=(0, self.r))
    out.loss.backward()
    self.torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
    self.opt.step()
    self.opt.zero_grad(set_to_none=True)
    return float(out.loss.detach())

  def result(self) -> dict:
    """The JSON record: settings, step times and tokens/s (median)."""
    return dict(implementation='Huginn recpre/raven_modeling_minimal.RavenForCausalLM',
                torch_version=self.torch.__version__, threads=self.threads,
                params=sum(p.numel() for p in self.net.parameters()),
                num_kv_heads=self.cfg.num_key_value_heads, gradient_checkpointing=False,
                steps_with_grad=self.r, **self.timing(self.tokens))
