"""Thin absl mains; `python -m experiments.<main>` starts with huge pages (see host_setup)."""

from experiments import host_setup as _host_setup

_host_setup.maybe_reexec()
