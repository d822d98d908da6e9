"""Runs one experiments main on many argument lists in one process, each as `python -m` would.

`python tests/main_cases.py MODULE CASES.json RESULTS.json` (the `main_cases` fixture in
conftest.py calls it): the bad-flag tests start one process per main instead of one per
case, which saves the interpreter and jax start-up (~2-5 s a case on the CI's 2 cores).
Each case runs the main's real `__main__` block (runpy, as `python -m`), with fresh
`experiments` modules and flags (absl's and third-party flags stay), its own stdout and
stderr file descriptors, and its own empty folder put in place of '{tmp}' in its
arguments. RESULTS.json gets, per case, {rc, stdout, stderr, files}: the exit code, the
captured output, and what the case left in its folder (folders end in '/').
"""

import importlib
import json
import os
import runpy
import sys
import tempfile
import traceback

from absl import app, flags


def _ours(module: str) -> bool:
  return module in ('__main__', 'experiments') or module.startswith('experiments.')


def _forget_our_modules_and_flags(keep: frozenset = frozenset()) -> None:
  """Drops experiments.* from sys.modules, every flag they (or __main__) defined, and every
  flag not in keep (ml_collections defines a flag per --config.x override it parses)."""
  for name in [m for m in sys.modules if _ours(m)]:
    del sys.modules[name]
  ours = {f.name for mod, fs in flags.FLAGS.flags_by_module_dict().items() if _ours(mod)
          for f in fs}
  for name in ours | ({n for n in flags.FLAGS if n not in keep} if keep else set()):
    if name in flags.FLAGS:
      delattr(flags.FLAGS, name)
  flags.FLAGS.unparse_flags()


def _others_flags(module: str) -> frozenset:
  """The flags of everything but our modules (absl's, third parties' the main imports)."""
  importlib.import_module(module)
  importlib.import_module('experiments.common')
  app.define_help_flags()
  _forget_our_modules_and_flags()
  return frozenset(flags.FLAGS)


def _exit_code(e: SystemExit) -> int:
  """The process exit code sys.exit(e.code) gives (a message is printed, code 1)."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code
  print(e.code, file=sys.stderr)
  return 1


def run_case(module: str, args: list[str], folder: str, keep: frozenset) -> dict:
  """One `python -m module args` with '{tmp}' -> folder; its output captured by fd."""
  _forget_our_modules_and_flags(keep)
  sys.argv = [module] + [a.replace('{tmp}', folder) for a in args]
  with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    try:
      runpy.run_module(module, run_name='__main__', alter_sys=True)
      rc = 0
    except SystemExit as e:
      rc = _exit_code(e)
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()  # as the interpreter would, exit code 1
      rc = 1
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      os.close(saved[0])
      os.close(saved[1])
    out.seek(0)
    err.seek(0)
    files = sorted(os.path.relpath(os.path.join(r, n), folder) + end
                   for r, ds, fs in os.walk(folder) for names, end in ((fs, ''), (ds, '/'))
                   for n in names)
    return dict(rc=rc, stdout=out.read(), stderr=err.read(), files=files)


def main() -> None:
  module, cases_path, results_path = sys.argv[1:4]
  with open(cases_path, encoding='utf-8') as f:
    cases = json.load(f)
  root = os.path.dirname(results_path)
  keep = _others_flags(module)
  results = []
  for i, args in enumerate(cases):
    folder = os.path.join(root, f'case{i}')
    os.makedirs(folder)
    results.append(run_case(module, args, folder, keep))
  with open(results_path, 'w', encoding='utf-8') as f:
    json.dump(results, f)


if __name__ == '__main__':
  main()
