"""moeplug: Mixture-of-Experts training as plugins over a C++ runtime core."""

__version__ = "0.1.0"

# Plugins import moeplug through moeplug.api (`from moeplug.api import hookimpl`, docs/plugins.md);
# `from moeplug import hookimpl` keeps working for plugins written before it. hookspecs imports
# only pluggy.
from moeplug.hookspecs import hookimpl  # noqa: E402

__all__ = ["hookimpl"]
