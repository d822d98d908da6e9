"""absl flag parsing where a repeated --config.X override replaces the earlier one.

ml_collections concatenates repeated tuple overrides (`--config.depth.buckets=(1,2)` in a
flagfile plus `--config.depth.buckets=(1,2,3)` on the command line gives (1,2,1,2,3)).
Expanding flagfiles first and keeping only the last value of each --config.* flag
restores the usual rule: the command line overrides the flagfile.
"""

import math
import re
import sys
from typing import Callable, Optional

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


def parse_config(argv: list[str], base=None):
  """A Config from `--flagfile=...` / `--config.X=V` arguments, parsed as pretrain parses them.

  Args:
    argv: program name first, then flags (flag files relative to the working directory).
    base: the Config the overrides apply to (default: Config()); it is not modified.
  Returns:
    The parsed Config (ml_collections' own typing of every field).
  """
  import copy  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from elastic_depth import config as config_lib  # pylint: disable=g-import-not-at-top
  argv = dedupe_config_overrides(argv)
  old, sys.argv = sys.argv, argv  # config_flags registers overrides found in sys.argv
  try:
    fv = flags.FlagValues()
    holder = config_flags.DEFINE_config_dataclass(
        'config', copy.deepcopy(base) if base is not None else config_lib.Config(), 'config',
        flag_values=fv)
    fv(argv)
  finally:
    sys.argv = old
  return holder.value


def fail(msg: str, code: int = 2):
  """Prints a one-line `error: ...` on stderr and exits with `code`."""
  print(f'error: {msg}', file=sys.stderr, flush=True)
  sys.exit(code)


def define_config(default, help_text: str):
  """DEFINE_config_dataclass('config', ...) at import time, a one-line error on bad input.

  ml_collections reads sys.argv (flag files included) right here, so an unreadable
  --flagfile or a bad --config override fails before any flag is parsed.
  """
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  try:
    return config_flags.DEFINE_config_dataclass('config', default, help_text)
  except flags.Error as e:
    fail(f'{str(e).removeprefix("ERROR:: ")} (a flag file path is read from the current directory, and the launch '
         'files name each other from the repository root)')
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    fail(f'bad --config flag: {str(e).strip(chr(34))}')


def no_arguments(argv: list[str]) -> None:
  """One line, exit 2, for positional arguments an absl main does not take."""
  if len(argv) > 1:
    fail(f'unexpected arguments {argv[1:]} (flags are --name=value)')


def tag_fits_file_name(tag: str) -> bool:
  """Whether a --tag (the end of report file names) holds only letters, digits, _ . -."""
  return re.fullmatch(r'[\w.-]*', tag) is not None


def require(name: str, ok, what: str) -> None:
  """Registers an absl validator: --name fails to parse (one line, exit 2) unless ok(value)."""
  def check(value):
    try:
      return value is None or bool(ok(value))
    except (TypeError, ValueError):
      return False
  flags.register_validator(name, check, message=f'--{name} must be {what}')


def one_of(choices) -> Callable:
  """ok(values) for require: every item of a list flag is one of choices."""
  return lambda values: all(v in choices for v in values)


def parse_or_fail(argv: list[str]) -> list[str]:
  """A flags_parser for absl.app.run: a one-line error (exit 2) instead of a usage dump."""
  try:
    return flags.FLAGS(dedupe_config_overrides(argv))
  except flags.Error as e:
    fail(f'{e} (see --helpshort)')
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    fail(f'bad flag: {e}')


def floats(xs, name: str, error=ValueError, lower: Optional[float] = None):
  """A list flag's values as finite floats >= lower (None stays None); `error` names the
  bad flag."""
  if xs is None:
    return None
  try:
    vals = [float(x) for x in xs]
  except ValueError as e:
    raise error(f'--{name}: {e}') from None
  if not all(math.isfinite(v) and (lower is None or v >= lower) for v in vals):
    raise error(f'--{name}: want finite numbers' + ('' if lower is None else f' >= {lower:g}')
                + f', got {",".join(xs)}')
  return vals
