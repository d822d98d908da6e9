"""Run-directory and process hygiene: the workdir probe, the preemption flag, metrics repair."""

import json
import os
import signal

import pytest

from elastic_depth import lifecycle
from elastic_depth.config import ConfigError


def test_check_workdir_creates_nested_dirs_and_leaves_no_probe(tmp_path):
  wd = tmp_path / 'a' / 'b'
  lifecycle.check_workdir(str(wd))
  assert wd.is_dir() and os.listdir(wd) == []


def test_check_workdir_names_an_unusable_dir(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('data')
  with pytest.raises(ConfigError, match='not writable') as e:
    lifecycle.check_workdir(str(blocker / 'run'))
  assert str(blocker / 'run') in str(e.value)
  assert blocker.read_text() == 'data'  # never touched


@pytest.mark.parametrize('text,want', [
    ('{"step": 1}\n{"step": 2', '{"step": 1}\n{"step": 2\n'),  # cut off by a kill
    ('{"step": 1}\n', '{"step": 1}\n'),
    ('', ''),
])
def test_end_jsonl_line_terminates_only_a_cut_line(tmp_path, text, want):
  p = tmp_path / 'metrics.jsonl'
  p.write_text(text)
  lifecycle.end_jsonl_line(str(p))
  assert p.read_text() == want
  with open(p, 'a') as f:  # an appended record stays on its own line
    f.write(json.dumps({'step': 3}) + '\n')
  assert p.read_text().splitlines()[-1] == '{"step": 3}'


def test_end_jsonl_line_ignores_a_missing_file(tmp_path):
  lifecycle.end_jsonl_line(str(tmp_path / 'none.jsonl'))
  assert not (tmp_path / 'none.jsonl').exists()


def test_preemption_flags_the_first_signal_and_stops_on_the_second():
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  with lifecycle.Preemption() as pre:
    assert pre.signum is None
    os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread before kill returns
    assert pre.signum == signal.SIGTERM  # the process lives on to save at a step boundary
    with pytest.raises(KeyboardInterrupt, match='second signal'):
      os.kill(os.getpid(), signal.SIGINT)
    # the second signal restored the previous handlers at once
    assert {s: signal.getsignal(s) for s in before} == before
  assert {s: signal.getsignal(s) for s in before} == before


def test_drop_jsonl_steps_after_keeps_the_checkpoint_step_and_drops_fragments(tmp_path):
  p = tmp_path / 'metrics.jsonl'
  lines = [json.dumps({'step': s, 'x': s}) for s in (1, 2, 3, 3, 4, 5)]
  p.write_text('\n'.join(lines) + '\n{"step": 6, "x')  # a line cut off by a kill
  assert lifecycle.drop_jsonl_steps_after(str(p), 3) == 3
  got = [json.loads(l) for l in p.read_text().splitlines()]
  assert [r['step'] for r in got] == [1, 2, 3, 3]  # brute force: steps <= 3, whole lines
  assert lifecycle.drop_jsonl_steps_after(str(p), 3) == 0  # nothing more to drop
