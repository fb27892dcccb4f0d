"""matplotlib, the optional ``plot`` extra: imported at the point of use, with an error that
says what to install. Figures are plain ``matplotlib.figure.Figure`` objects (no pyplot), so
no global figure state and no GUI backend is involved."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from moeplug.config import ConfigError

INSTALL_PLOT = 'pip install "moeplug[plot]"'


def new_figure(width: float, height: float) -> Any:
    """An empty figure of ``width`` x ``height`` inches, laid out so labels never overlap."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ConfigError(f"plotting needs matplotlib, which is not installed ({e}). "
                          f"Fix: {INSTALL_PLOT}") from None
    return Figure(figsize=(width, height), layout="constrained")


def save(fig: Any, path: str) -> str:
    """Write ``fig`` to ``path`` (format from the extension, e.g. .png, .svg, .pdf)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def to_rgb(fig: Any) -> np.ndarray:
    """uint8 [H, W, 3]: ``fig`` rendered by Agg (for TensorBoard's add_image)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
