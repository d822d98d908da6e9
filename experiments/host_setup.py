"""Process set-up for `python -m experiments.X` on Linux: huge pages behind large host
buffers, kept by the process between calls on request or by default for some mains.

XLA:CPU allocates a step's temporaries afresh at every execution (hundreds of MB for a
training step), and glibc's malloc serves each with a new mmap, so every step faults the
whole buffer in again, 4 KiB at a time: ~180,000 minor page faults per step of shape S with
`remat=dots`, ~8% of its CPU time in the kernel. glibc >= 2.35 can back malloc's memory with
transparent huge pages (the tunable `glibc.malloc.hugetlb=1`), which cuts those faults
~200-fold.

The memory still goes back to the kernel after each step. On a VM that hands freed memory
back to its host, the first step after a pause of seconds (a sleep, an evaluation, another
computation) faults it in fresh and spends seconds in the kernel (shape S: a 2 s step took
4.5-5 s). `ED_KEEP_MEMORY=1` adds three tunables that keep freed memory in the process: one
arena (`arena_max=1`), no mmap'd chunks (`mmap_max=0`: every buffer from the heap) and no
heap trimming (`trim_threshold`). Steady steps then fault nothing and a pause costs
nothing, but the heap takes a few steps to reach its size (each slow) and the process keeps
its peak; so it is opt-in for training, and on by default for the mains in KEEP_BY_DEFAULT
(`ED_KEEP_MEMORY=0` turns it off there). Those time repeated inference forwards whose
buffers glibc otherwise hands back between calls: a forward of the 135M blocks on 4,096
tokens faulted 100,000-450,000 pages per call on the 2-core VM, 4-6.6 s of kernel time in a
10 s call, and ran ~25% faster with the memory kept (WORKSPACE.md, "Compacted scoring",
thirteenth session): XLA's worker threads there create and delete glibc thread-arena heaps
some 400 times per call, each faulted in afresh.

Tunables are read once, when the process starts, so `experiments/__init__.py` re-executes
the interpreter with them added, before anything heavy is imported, when (and only when)
the process was started as `python -m experiments.<main>`. Opt out with `ED_HUGEPAGES=0`;
a tunable already set is left alone.
"""

import os
import platform
import sys

TUNABLE = 'glibc.malloc.hugetlb'
OPT_OUT = 'ED_HUGEPAGES'
KEEP_OPT_IN = 'ED_KEEP_MEMORY'
KEEP_TUNABLES = (('glibc.malloc.arena_max', '1'), ('glibc.malloc.mmap_max', '0'),
                 ('glibc.malloc.trim_threshold', str(1 << 40)))
THP_MODE = '/sys/kernel/mm/transparent_hugepage/enabled'
# mains that keep freed memory unless ED_KEEP_MEMORY=0: repeated inference forwards, timed
KEEP_BY_DEFAULT = frozenset({'experiments.bench_exit'})


def _glibc_at_least(version: str, need: tuple[int, int] = (2, 35)) -> bool:
  try:
    major, minor = (int(p) for p in version.split('.')[:2])
  except ValueError:
    return False
  return (major, minor) >= need


def thp_mode(path: str = THP_MODE) -> str:
  """The kernel's transparent-huge-page mode ('always', 'madvise' or 'never'), or ''."""
  try:
    with open(path, encoding='ascii') as f:
      text = f.read()
  except OSError:
    return ''
  start, end = text.find('['), text.find(']')
  return text[start + 1:end] if 0 <= start < end else ''


def _flag(environ: dict, name: str, default: bool) -> bool:
  value = environ.get(name, '').strip().lower()
  return default if not value else value not in ('0', 'false', 'no', 'off')


def hugepage_env(environ: dict, system: str, libc: tuple[str, str],
                 thp_mode: str, main: str = '') -> dict | None:
  """The environment to re-execute with, or None when there is nothing to do.

  Args:
    environ: the current environment.
    system: platform.system().
    libc: platform.libc_ver(), e.g. ('glibc', '2.36').
    thp_mode: the kernel's transparent-huge-page mode (see thp_mode).
    main: the module being run (`experiments.<main>`); KEEP_BY_DEFAULT ones keep memory
      unless ED_KEEP_MEMORY says otherwise.
  Returns:
    a copy of environ with `glibc.malloc.hugetlb=1`, and with ED_KEEP_MEMORY=1 (or unset
    for a KEEP_BY_DEFAULT main) the KEEP_TUNABLES, appended to GLIBC_TUNABLES, each unless already named there; or None
    (not Linux with glibc >= 2.35, huge pages off in the kernel, opted out, or the huge
    page tunable already given).
  """
  if not _flag(environ, OPT_OUT, True):
    return None
  if system != 'Linux' or libc[0] != 'glibc' or not _glibc_at_least(libc[1]):
    return None
  if thp_mode not in ('always', 'madvise'):
    return None
  tunables = environ.get('GLIBC_TUNABLES', '')
  if TUNABLE in tunables:
    return None
  named = {t.split('=', 1)[0] for t in tunables.split(':') if t}
  add = [(TUNABLE, '1')] + ([kv for kv in KEEP_TUNABLES if kv[0] not in named]
                            if _flag(environ, KEEP_OPT_IN, main in KEEP_BY_DEFAULT) else [])
  env = dict(environ)
  env['GLIBC_TUNABLES'] = ':'.join([tunables] * bool(tunables) + [f'{k}={v}' for k, v in add])
  return env


def module_main(argv: list[str], orig_argv: list[str]) -> str:
  """'experiments.<main>' while `python -m experiments.<main>` is locating its module
  (argv[0] is '-m'), else ''."""
  if not argv or argv[0] != '-m' or '-m' not in orig_argv:
    return ''
  i = orig_argv.index('-m')
  name = orig_argv[i + 1] if i + 1 < len(orig_argv) else ''
  return name if name.startswith('experiments.') else ''



def maybe_reexec() -> None:
  """Re-executes this `python -m experiments.<main>` process with huge pages, if it applies."""
  orig = getattr(sys, 'orig_argv', [])
  main = module_main(sys.argv, orig)
  if not sys.executable or not main:
    return
  env = hugepage_env(dict(os.environ), platform.system(), platform.libc_ver(), thp_mode(),
                     main)
  if env is None:
    return
  try:
    os.execve(sys.executable, [sys.executable] + orig[1:], env)
  except OSError:  # cannot re-execute (odd interpreter path): run on without huge pages
    return

