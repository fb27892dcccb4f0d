"""moeplug: Mixture-of-Experts training as plugins over a C++ runtime core."""

__version__ = "0.1.0"

# Plugin authors write `from moeplug import hookimpl`; hookspecs imports only pluggy.
from moeplug.hookspecs import hookimpl  # noqa: E402
