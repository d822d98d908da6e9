"""absl flag parsing where a repeated --config.X override replaces the earlier one.

ml_collections concatenates repeated tuple overrides (`--config.depth.buckets=(1,2)` in a
flagfile plus `--config.depth.buckets=(1,2,3)` on the command line gives (1,2,1,2,3)).
Expanding flagfiles first and keeping only the last value of each --config.* flag
restores the usual rule: the command line overrides the flagfile.
"""

from absl import flags


def dedupe_config_overrides(argv: list[str]) -> list[str]:
  """Expands --flagfile and keeps the last occurrence of each --config.* flag."""
  expanded = flags.FLAGS.read_flags_from_files(argv[1:], force_gnu=False)
  last = {}
  for i, arg in enumerate(expanded):
    if arg.startswith('--config.') and '=' in arg:
      last[arg.split('=', 1)[0]] = i
  keep = [a for i, a in enumerate(expanded)
          if not (a.startswith('--config.') and '=' in a) or last[a.split('=', 1)[0]] == i]
  return argv[:1] + keep


def parse(argv: list[str]) -> list[str]:
  """A flags_parser for absl.app.run."""
  return flags.FLAGS(dedupe_config_overrides(argv))


def floats(xs, name: str, error=ValueError):
  """A list flag's values as floats (None stays None); `error` names the bad flag."""
  if xs is None:
    return None
  try:
    return [float(x) for x in xs]
  except ValueError as e:
    raise error(f'--{name}: {e}') from None
