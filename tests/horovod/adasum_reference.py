"""Adasum transcribed directly from the paper, in numpy float64 (the reference for tests).

Maleki et al. 2020, "Scaling Distributed Training with Adaptive Summation": two gradients
combine as (1 - g1.g2 / (2 |g1|^2)) g1 + (1 - g1.g2 / (2 |g2|^2)) g2, and n = 2^k gradients
as the combination of the Adasum of the first half with the Adasum of the second half. A
squared norm below 1e-8 gives the coefficient 1 (Horovod's guard for zero gradients).
"""

import numpy as np


def pair(g1, g2):
    g1, g2 = np.asarray(g1, np.float64), np.asarray(g2, np.float64)
    dot = float(np.sum(g1 * g2))
    n1, n2 = float(np.sum(g1 * g1)), float(np.sum(g2 * g2))
    c1 = 1.0 - dot / (2.0 * n1) if n1 >= 1e-8 else 1.0
    c2 = 1.0 - dot / (2.0 * n2) if n2 >= 1e-8 else 1.0
    return c1 * g1 + c2 * g2


def adasum(grads):
    grads = list(grads)
    if len(grads) == 1:
        return np.asarray(grads[0], np.float64)
    half = len(grads) // 2
    return pair(adasum(grads[:half]), adasum(grads[half:]))
