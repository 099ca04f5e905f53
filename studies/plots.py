"""The figure both accuracy studies draw: one panel per codec, error on a log axis."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np


@contextmanager
def panels_per_codec(path: str, codecs, title: str, xlabel: str, legend_size: int = 8):
    """Yield ``[(axis, codec), ...]`` to draw on; label, title and save the PNG on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(codecs), figsize=(4.2 * len(codecs), 3.6), sharey=True)
    axes = np.atleast_1d(axes)
    yield list(zip(axes, codecs))
    for ax, g in zip(axes, codecs):
        ax.set_title(f"codec {g}")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("relative error of residual stream")
    axes[0].legend(fontsize=legend_size)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
