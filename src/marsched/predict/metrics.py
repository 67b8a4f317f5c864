"""How good a length predictor is: the MARS paper's bin accuracies, MAE and Kendall's tau.

- Acc-5: the predicted length falls in the true length's bin (bins of 10 tokens, 50 of
  them, the last open-ended; the paper's name counts the ±5 tokens around a bin's centre).
- Acc-15: within one bin of it.
- MAE: mean absolute error in tokens.
- Kendall's tau (tau-b, ties accounted for): how well the predictions rank the requests,
  which is what a scheduler that orders by predicted length uses.
"""

from __future__ import annotations

import numpy as np

from marsched.predict.head import length_bin


def bin_accuracy(predicted: np.ndarray, true: np.ndarray, within: int = 0) -> float:
    """Share of predictions whose bin is within `within` bins of the true one."""
    predicted, true = _pair(predicted, true)
    return float(np.mean(np.abs(length_bin(np.rint(predicted).astype(np.int64)) - length_bin(true)) <= within))


def mean_absolute_error(predicted: np.ndarray, true: np.ndarray) -> float:
    predicted, true = _pair(predicted, true)
    return float(np.mean(np.abs(predicted - true)))


def kendall_tau(predicted: np.ndarray, true: np.ndarray, chunk: int = 512) -> float:
    """Kendall's tau-b over all pairs (O(n²), in chunks of rows; n of a few thousand takes a second).

    0 when either side is constant (a constant predictor ranks nothing).
    """
    x, y = _pair(predicted, true)
    concordant = discordant = ties_x = ties_y = 0
    n = len(x)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        dx = np.sign(x[rows, None] - x[None, :])
        dy = np.sign(y[rows, None] - y[None, :])
        # only pairs (i, j) with j > i count, once each
        upper = np.arange(n)[None, :] > np.arange(rows.start, rows.stop)[:, None]
        product = (dx * dy)[upper]
        concordant += int(np.sum(product > 0))
        discordant += int(np.sum(product < 0))
        ties_x += int(np.sum((dx == 0) & (dy != 0) & upper))
        ties_y += int(np.sum((dy == 0) & (dx != 0) & upper))
    denominator = np.sqrt(float(concordant + discordant + ties_x) * float(concordant + discordant + ties_y))
    return float((concordant - discordant) / denominator) if denominator > 0 else 0.0


def report(predicted: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """All four metrics, the keys `predictor eval` prints."""
    return {
        "acc5": bin_accuracy(predicted, true, 0),
        "acc15": bin_accuracy(predicted, true, 1),
        "mae_tokens": mean_absolute_error(predicted, true),
        "kendall_tau": kendall_tau(predicted, true),
        "n": int(len(np.asarray(true))),
    }


def _pair(predicted: np.ndarray, true: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    predicted, true = np.asarray(predicted, dtype=np.float64), np.asarray(true, dtype=np.float64)
    if predicted.shape != true.shape or predicted.ndim != 1:
        raise ValueError(f"predictions {predicted.shape} and true lengths {true.shape} must be 1-d and the same length")
    if len(true) == 0:
        raise ValueError("no examples to evaluate")
    return predicted, true
