"""What the benchmarks share: timing, model shapes and the reference figures."""

import json
import os
import platform
import statistics
import subprocess
from typing import Optional

from elastic_depth import timing

from elastic_depth import config


def write_json(path: str, doc: dict, echo: bool = False) -> None:
  """Writes a benchmark's JSON (creating its folder); echo: also print it."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(doc, f, indent=1, default=str)
  if echo:
    print(json.dumps(doc, indent=1, default=str))


def time_fn(fn, args, repeats, warmup: int = 1):
  """Median / min wall seconds of fn(*args) after `warmup` untimed calls."""
  times = timing.interleaved({'fn': lambda: fn(*args)}, repeats, warmup).times['fn']
  return {'median_s': statistics.median(times), 'min_s': min(times),
          'repeats': repeats}


def cpu_description(info: Optional[str] = None) -> str:
  """The CPU's model name, family/model numbers and vector extensions (AVX2 / AVX-512), for
  the record (AMD's 'AMD EPYC' alone hides the generation: family 25 is Zen 3/4, 26 Zen 5).

  info: /proc/cpuinfo's text (read here when None).
  """
  if info is None:
    try:
      with open('/proc/cpuinfo', encoding='utf-8') as f:
        info = f.read()
    except OSError:
      return platform.processor() or 'unknown'
  field = lambda key: next((l.split(':', 1)[1].strip() for l in info.splitlines()
                            if l.split(':', 1)[0].strip() == key), None)
  flags_line = (field('flags') or '').split()
  isa = [x for x in ('avx2', 'avx512f', 'avx512_bf16', 'amx_tile') if x in flags_line]
  family = ('' if field('cpu family') is None
            else f'family {field("cpu family")} model {field("model")}; ')
  return f'{field("model name") or "unknown"} ({family}{", ".join(isa) or "no AVX2"})'


def machine_description() -> str:
  """The accelerator that ran the work (device kind), or the CPU's description."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() == 'cpu':
    return cpu_description()
  return f'{jax.devices()[0].device_kind} (host: {cpu_description()})'


def usage_fields(calls, per_call: bool = True) -> dict:
  """JSON fields of timed calls' timing.Usage: `<field>_median` (and `<field>_per_call`)."""
  out = {}
  for field in timing.Usage._fields:
    vals = [getattr(u, field) for u in calls]
    if per_call:
      out[f'{field}_per_call'] = vals
    out[f'{field}_median'] = statistics.median(vals)
  return out


def paired_remainder(total_s, part_s) -> Optional[float]:
  """Median over rounds of total - part (each pair timed in the same interleaved round), or
  None where the noise exceeds the remainder (median <= 0): no figure rather than a wrong one."""
  rest = statistics.median(t - p for t, p in zip(total_s, part_s, strict=True))
  return rest if rest > 0 else None


def glibc_tunables() -> str:
  """GLIBC_TUNABLES of this process (huge pages or not: experiments.host_setup), for the record."""
  return os.environ.get('GLIBC_TUNABLES', '')


# The model shapes the benchmarks share (the reference figures were measured at S and P).
MODEL_SHAPES = {
    'S': dict(vocab_size=4096, d_model=256, num_heads=4, num_kv_heads=4, head_dim=64,
              mlp_dim=1024, n_prelude=1, n_core=2, n_coda=1),
    'P': dict(config.BLOCKS_135M),  # the 135M blocks
    'nano': dict(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                 mlp_dim=64, n_prelude=1, n_core=1, n_coda=1),  # smoke tests only
}

REFERENCE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              'reference_figures.json')
REFERENCE_NOTE = ('reference measured elsewhere (another machine and run, see '
                  'experiments/reference_figures.json): a ratio, not a side-by-side measurement')


def random_model_len(prompt_len: int, new_tokens: int) -> int:
  """max_len of a benchmark's random-init model: the generation, and the eps calibration's
  prompt followed by the prompt reversed (bench_generate._calibrate), plus slack."""
  return max(prompt_len + new_tokens, 2 * prompt_len) + 8


def reference_tok_s(kind: str, shape: str, **settings) -> float | None:
  """The reference tokens/s for a benchmark kind and shape, if recorded at these settings.

  Args:
    kind: 'train' or 'generate' (a section of reference_figures.json).
    shape: a MODEL_SHAPES name.
    **settings: what our run uses (seq_len=..., batch_size=...); a figure recorded with
      other values, or another model shape, is not returned.
  Returns:
    tokens/s, or None when no comparable figure is recorded.
  """
  with open(REFERENCE_FILE, encoding='utf-8') as f:
    section = json.load(f)[kind]
  recorded = section['shapes'].get(shape)
  ours = dict(settings, model=MODEL_SHAPES.get(shape))
  if recorded is None or any(recorded.get(k) != v for k, v in ours.items()):
    return None
  return float(section['tokens_per_s'][shape])


def busy_processes(limit: int = 8) -> list[str]:
  """The busiest other processes (pid %cpu command), for the record."""
  try:
    out = subprocess.run(['ps', '-eo', 'pid,pcpu,args', '--sort=-pcpu'], capture_output=True,
                         text=True, timeout=5, check=False).stdout.splitlines()[1:]
  except (OSError, subprocess.SubprocessError):
    return []
  me = str(os.getpid())
  rows = [l.strip()[:160] for l in out if l.split(None, 1)[0] != me]
  return rows[:limit]


class StepTimer:
  """Times a training step: `step()` (returns the loss, blocking) in warm-up and timed calls."""

  def __init__(self):
    self.times, self.cpu_times, self.losses, self.faults, self.untimed = [], [], [], [], 0

  def step(self) -> float:
    raise NotImplementedError

  def run(self, steps: int, warmup: int = 0) -> None:
    """Runs warmup + steps steps; records the timed ones (wall and process CPU seconds)."""
    self.untimed += warmup
    for i in range(warmup + steps):
      loss, dt, use = timing.call_usage(self.step)
      self.losses.append(loss)
      if i >= warmup:
        self.times.append(dt)
        self.cpu_times.append(use.user_s + use.sys_s)
        self.faults.append(use.minor_faults)

  def timing(self, tokens: int) -> dict:
    """The timed steps' JSON fields (medians; tokens: per step)."""
    med = statistics.median(self.times)
    return dict(step_times_s=self.times, untimed_steps=self.untimed, step_cpu_s=self.cpu_times,
                step_s_median=med, step_s_min=min(self.times),
                step_cpu_s_median=statistics.median(self.cpu_times),
                step_minor_faults_median=statistics.median(self.faults),
                step_minor_faults=self.faults, tokens_per_s=tokens / med,
                first_loss=self.losses[0], last_loss=self.losses[-1])
