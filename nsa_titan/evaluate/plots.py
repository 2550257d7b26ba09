"""The eval pictures: loss by context position, passkey accuracy by length and depth."""

from __future__ import annotations

import numpy as np

from nsa_titan.observe.plots import pyplot, whole_number_ticks


def position_loss_figure(positions: dict, title: str):
    """Mean loss per context position, with a running mean over 2% of the positions."""
    plt = pyplot()
    x, y = np.array(positions["positions"]), np.array(positions["mean_loss"])
    fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
    ax.plot(x, y, lw=0.6, alpha=0.5, label="per position")
    window = max(len(y) // 50, 1)
    if len(y) >= window > 1:
        smooth = np.convolve(y, np.ones(window) / window, mode="valid")
        ax.plot(x[window - 1:], smooth, lw=1.6, label=f"running mean of {window}")
    ax.set_xlabel("context (tokens of its own document the prediction sees)")
    whole_number_ticks(ax.xaxis)
    ax.set_ylabel("held-out loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def passkey_figure(passkey: dict, title: str):
    """Accuracy heatmap: prompt length (rows) by needle depth (columns)."""
    plt = pyplot()
    accuracy = np.array(passkey["accuracy"])
    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * accuracy.shape[1], 1.2 + 0.5 * accuracy.shape[0]),
                           layout="constrained")
    image = ax.imshow(accuracy, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(passkey["depths"])), [f"{d:g}" for d in passkey["depths"]])
    ax.set_yticks(range(len(passkey["lengths"])), [str(n) for n in passkey["lengths"]])
    ax.set_xlabel("needle depth (0 = start)")
    ax.set_ylabel("prompt tokens")
    for (i, j), value in np.ndenumerate(accuracy):
        ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
    ax.set_title(f"passkey accuracy, {passkey['trials']} keys per cell\n{title}", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05)
    return fig
