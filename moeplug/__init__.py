"""moeplug: Mixture-of-Experts training as plugins over a C++ runtime core."""

__version__ = "0.1.0"
