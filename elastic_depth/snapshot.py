"""Local Hugging Face snapshots of safetensors checkpoints, read without torch.

A snapshot is a folder with config.json and *.safetensors shards (listed by
model.safetensors.index.json when present), or one .safetensors file beside its
config.json, or a hub name fetched with huggingface_hub.snapshot_download (the network,
or a copy in the local hub cache). `scan` reads only the shard headers.
"""

import json
import os
import re

CONFIG_FILE = 'config.json'
INDEX_FILE = 'model.safetensors.index.json'


class SourceError(ValueError):
  """A source that cannot be read or converted (names the file, key or setting)."""


def _hub_snapshot(name: str) -> str:
  """A local snapshot of a hub repository (safetensors + json files), or SourceError."""
  try:
    import huggingface_hub  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise SourceError(f'--src={name!r} is not a local path and huggingface_hub is not '
                      'installed; download the snapshot elsewhere and pass its folder') from None
  from elastic_depth.data import errors, sources  # pylint: disable=g-import-not-at-top
  offline = not sources.hub_reachable()
  try:
    return huggingface_hub.snapshot_download(
        name, allow_patterns=['*.json', '*.safetensors'], local_files_only=offline)
  except Exception as e:  # pylint: disable=broad-except
    why = (f'it is not in the local hub cache and {errors.UNREACHABLE_HINT}' if offline
           else f'the download failed ({type(e).__name__}: {e})')
    raise SourceError(f'--src={name!r} is not a local path, and {why}') from None


def resolve_source(src: str) -> tuple[str, list[str]]:
  """(snapshot folder holding config.json, safetensors shard paths) for --src.

  Args:
    src: a snapshot folder (shards listed by model.safetensors.index.json, or every
      *.safetensors in it), one .safetensors file beside its config.json, or a hub name.
  """
  if not os.path.exists(src):
    if not re.fullmatch(r'[\w.-]+/[\w.-]+', src):
      raise SourceError(f'--src={src!r}: no such file or folder (nor a hub name owner/name)')
    src = _hub_snapshot(src)
  snap = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
  if not os.path.isfile(os.path.join(snap, CONFIG_FILE)):
    raise SourceError(f'{snap} has no {CONFIG_FILE} (the model configuration)')
  if not os.path.isdir(src):
    if not src.endswith('.safetensors'):
      raise SourceError(f'--src={src!r} is not a .safetensors file (torch .bin files are not '
                        'read: convert them to safetensors)')
    return snap, [src]
  index = os.path.join(snap, INDEX_FILE)
  if os.path.isfile(index):
    with open(index, encoding='utf-8') as f:
      names = sorted(set(_load_json(f, index).get('weight_map', {}).values()))
    files = [os.path.join(snap, n) for n in names]
    missing = [n for n, p in zip(names, files) if not os.path.isfile(p)]
    if missing:
      raise SourceError(f'{INDEX_FILE} names shards missing from {snap}: {missing}')
  else:
    files = sorted(os.path.join(snap, n) for n in os.listdir(snap) if n.endswith('.safetensors'))
  if not files:
    raise SourceError(f'no *.safetensors shards in {snap} (torch .bin files are not read)')
  return snap, files


def _load_json(f, path: str) -> dict:
  try:
    out = json.load(f)
  except ValueError as e:
    raise SourceError(f'{path} is not valid JSON ({e})') from None
  if not isinstance(out, dict):
    raise SourceError(f'{path} does not hold a JSON object')
  return out


def read_hf_config(snap: str) -> dict:
  """The source's config.json as a dict."""
  path = os.path.join(snap, CONFIG_FILE)
  with open(path, encoding='utf-8') as f:
    return _load_json(f, path)


def scan(files: list[str]) -> dict[str, tuple[str, tuple[int, ...], str]]:
  """key -> (shard, shape, dtype) from the shard headers only (no tensor is read)."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  found = {}
  for path in files:
    try:
      with safe_open(path, framework='numpy') as h:
        for k in h.keys():
          if k in found:
            raise SourceError(f'key {k} is in two shards: {found[k][0]} and {path}')
          s = h.get_slice(k)
          found[k] = (path, tuple(s.get_shape()), s.get_dtype())
    except SourceError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise SourceError(f'{path} is not a readable safetensors file '
                        f'({type(e).__name__}: {e})') from None
  return found
