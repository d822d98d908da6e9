"""experiments.host_setup: when `python -m experiments.<main>` re-executes with huge pages."""

import os
import platform
import subprocess
import sys

import pytest

from experiments import host_setup

GLIBC = ('glibc', '2.36')
HUGE = 'glibc.malloc.hugetlb=1'
KEEP = ('glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:'
        'glibc.malloc.trim_threshold=1099511627776')
ALL = f'{HUGE}:{KEEP}'


def test_env_gains_the_tunables_and_keeps_the_rest():
  env = host_setup.hugepage_env({'PATH': '/bin'}, 'Linux', GLIBC, 'madvise')
  assert env == {'PATH': '/bin', 'GLIBC_TUNABLES': HUGE}
  env = host_setup.hugepage_env({'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}, 'Linux',
                                ('glibc', '2.35'), 'always')
  assert env['GLIBC_TUNABLES'] == f'glibc.malloc.arena_max=2:{HUGE}'
  keep = {host_setup.KEEP_OPT_IN: '1'}
  env = host_setup.hugepage_env(keep, 'Linux', GLIBC, 'madvise')
  assert env['GLIBC_TUNABLES'] == ALL
  # the user's own arena_max stays, and is not named twice
  env = host_setup.hugepage_env(dict(keep, GLIBC_TUNABLES='glibc.malloc.arena_max=2'),
                                'Linux', GLIBC, 'madvise')
  assert env['GLIBC_TUNABLES'] == (f'glibc.malloc.arena_max=2:{HUGE}:glibc.malloc.mmap_max=0:'
                                   'glibc.malloc.trim_threshold=1099511627776')
  env = host_setup.hugepage_env({host_setup.KEEP_OPT_IN: '0'}, 'Linux', GLIBC, 'madvise')
  assert env['GLIBC_TUNABLES'] == HUGE
  # the timed-inference mains keep memory unless told not to; the others only on request
  for main in host_setup.KEEP_BY_DEFAULT:
    assert host_setup.hugepage_env({}, 'Linux', GLIBC, 'madvise', main)['GLIBC_TUNABLES'] == ALL
    env = host_setup.hugepage_env({host_setup.KEEP_OPT_IN: '0'}, 'Linux', GLIBC, 'madvise', main)
    assert env['GLIBC_TUNABLES'] == HUGE
  env = host_setup.hugepage_env({}, 'Linux', GLIBC, 'madvise', 'experiments.pretrain')
  assert env['GLIBC_TUNABLES'] == HUGE


RSS_AFTER_FREE = r"""
import ctypes, os
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
n = 256 << 20
p = libc.malloc(ctypes.c_size_t(n))
ctypes.memset(p, 1, n)
held = rss()
libc.free(ctypes.c_void_p(p))
print((held - rss()) / n)
"""


@pytest.mark.skipif(platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
                    reason='glibc tunables')
def test_kept_memory_stays_in_the_process_after_free():
  """With KEEP's tunables a freed 256 MB buffer stays resident (glibc accepted them: it
  ignores a tunable out of bounds, silently); without them it goes back to the kernel."""
  env = {k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}
  returned = lambda tunables: float(subprocess.run(
      [sys.executable, '-c', RSS_AFTER_FREE], env=dict(env, GLIBC_TUNABLES=tunables),
      capture_output=True, text=True, check=True).stdout)
  assert returned('') > 0.9  # glibc's default: a large chunk is mmap'd, then unmapped
  assert returned(KEEP) < 0.1


@pytest.mark.parametrize('environ,system,libc,thp', [
    ({host_setup.OPT_OUT: '0'}, 'Linux', GLIBC, 'madvise'),  # opted out
    ({host_setup.OPT_OUT: 'off'}, 'Linux', GLIBC, 'madvise'),
    ({host_setup.OPT_OUT: 'no'}, 'Linux', GLIBC, 'madvise'),
    ({host_setup.OPT_OUT: ' False '}, 'Linux', GLIBC, 'madvise'),
    ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=0'}, 'Linux', GLIBC, 'madvise'),  # user's own
    ({}, 'Darwin', ('', ''), 'madvise'),
    ({}, 'Linux', ('musl', '1.2'), 'madvise'),
    ({}, 'Linux', ('glibc', '2.34'), 'madvise'),  # the tunable came in 2.35
    ({}, 'Linux', ('glibc', 'x.y'), 'madvise'),
    ({}, 'Linux', GLIBC, 'never'),  # huge pages off in the kernel
    ({}, 'Linux', GLIBC, ''),
])
def test_nothing_to_do(environ, system, libc, thp):
  assert host_setup.hugepage_env(environ, system, libc, thp) is None


def test_only_a_module_main_of_this_package_reexecutes():
  py = '/usr/bin/python3'
  assert host_setup.module_main(['-m'], [py, '-m', 'experiments.pretrain', '--x']) == (
      'experiments.pretrain')
  assert not host_setup.module_main(['-m'], [py, '-m', 'pytest', '-q'])
  assert not host_setup.module_main(['/x/pytest'], [py, '/x/pytest', '-q'])
  # after the module was found argv[0] is its path: an import then changes nothing
  assert not host_setup.module_main(['/r/experiments/pretrain.py'],
                                               [py, '-m', 'experiments.pretrain'])
  assert not host_setup.module_main([], [])


def test_a_trailing_dash_m_names_no_main():
  """`python -m` with no module after it is no main (and no IndexError)."""
  assert host_setup.module_main(['-m'], ['/usr/bin/python3', '-m']) == ''


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
  f = tmp_path / 'enabled'
  f.write_text('always [madvise] never\n')
  assert host_setup.thp_mode(str(f)) == 'madvise'
  f.write_text('[never]\n')
  assert host_setup.thp_mode(str(f)) == 'never'
  assert host_setup.thp_mode(str(tmp_path / 'missing')) == ''


def test_module_main_runs_with_the_tunable_in_a_fresh_process(tmp_path):
  """End to end: the re-executed process sees the tunable (or, where it does not apply, the
  environment it was given), and its arguments arrive unchanged."""
  probe = tmp_path / 'experiments'
  probe.mkdir()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  (probe / '__init__.py').write_text(
      open(os.path.join(repo, 'experiments', '__init__.py'), encoding='utf-8').read())
  (probe / 'host_setup.py').write_text(
      open(host_setup.__file__, encoding='utf-8').read())
  (probe / 'show.py').write_text(
      'import os, sys\nprint(os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:])\n')
  (probe / 'bench_exit.py').write_text((probe / 'show.py').read_text())  # a KEEP_BY_DEFAULT main
  env = {k: v for k, v in os.environ.items()
         if k not in ('GLIBC_TUNABLES', host_setup.OPT_OUT, host_setup.KEEP_OPT_IN)}
  out = subprocess.run([sys.executable, '-m', 'experiments.show', '--a=1', 'b c'],
                       cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
  applies = host_setup.hugepage_env(env, platform.system(), platform.libc_ver(),
                                    host_setup.thp_mode()) is not None
  assert out.stdout.strip() == f"{HUGE if applies else ''} ['--a=1', 'b c']"
  out = subprocess.run([sys.executable, '-m', 'experiments.show'], cwd=tmp_path,
                       env=dict(env, **{host_setup.OPT_OUT: '0'}), capture_output=True,
                       text=True, check=True)
  assert out.stdout.strip() == '[]'
  out = subprocess.run([sys.executable, '-m', 'experiments.show'], cwd=tmp_path,
                       env=dict(env, **{host_setup.KEEP_OPT_IN: '1'}), capture_output=True,
                       text=True, check=True)
  assert out.stdout.strip() == f"{ALL if applies else ''} []"
  out = subprocess.run([sys.executable, '-m', 'experiments.bench_exit'], cwd=tmp_path, env=env,
                       capture_output=True, text=True, check=True)
  assert out.stdout.strip() == f"{ALL if applies else ''} []"
