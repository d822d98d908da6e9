"""experiments.host_setup: when `python -m experiments.<main>` re-executes with huge pages."""

import os
import platform
import subprocess
import sys

import pytest

from experiments import host_setup

GLIBC = ('glibc', '2.36')
HUGE = 'glibc.malloc.hugetlb=1'


def test_env_gains_the_tunable_and_keeps_the_rest():
  env = host_setup.hugepage_env({'PATH': '/bin'}, 'Linux', GLIBC, 'madvise')
  assert env == {'PATH': '/bin', 'GLIBC_TUNABLES': HUGE}
  env = host_setup.hugepage_env({'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}, 'Linux',
                                ('glibc', '2.35'), 'always')
  assert env['GLIBC_TUNABLES'] == f'glibc.malloc.arena_max=2:{HUGE}'


@pytest.mark.parametrize('environ,system,libc,thp', [
    ({host_setup.OPT_OUT: '0'}, 'Linux', GLIBC, 'madvise'),  # opted out
    ({host_setup.OPT_OUT: 'off'}, 'Linux', GLIBC, 'madvise'),
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
  assert host_setup.started_as_module_main(['-m'], [py, '-m', 'experiments.pretrain', '--x'])
  assert not host_setup.started_as_module_main(['-m'], [py, '-m', 'pytest', '-q'])
  assert not host_setup.started_as_module_main(['/x/pytest'], [py, '/x/pytest', '-q'])
  # after the module was found argv[0] is its path: an import then changes nothing
  assert not host_setup.started_as_module_main(['/r/experiments/pretrain.py'],
                                               [py, '-m', 'experiments.pretrain'])
  assert not host_setup.started_as_module_main([], [])


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
  env = {k: v for k, v in os.environ.items()
         if k not in ('GLIBC_TUNABLES', host_setup.OPT_OUT)}
  out = subprocess.run([sys.executable, '-m', 'experiments.show', '--a=1', 'b c'],
                       cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
  applies = host_setup.hugepage_env(env, platform.system(), platform.libc_ver(),
                                    host_setup.thp_mode()) is not None
  assert out.stdout.strip() == f"{HUGE if applies else ''} ['--a=1', 'b c']"
  out = subprocess.run([sys.executable, '-m', 'experiments.show'], cwd=tmp_path,
                       env=dict(env, **{host_setup.OPT_OUT: '0'}), capture_output=True,
                       text=True, check=True)
  assert out.stdout.strip() == '[]'
