"""Orthogonal rotations for QuaRot-style rotation of a model's residual stream (finetune.onnx.rotate):
a randomised Hadamard matrix (diag(±1) H / sqrt(n), QuaRot's choice: it spreads an outlier channel
evenly over all channels) where a Hadamard matrix of the order is built here, or a random orthogonal
matrix (QR of a Gaussian one) of any order.

Hadamard matrices are built as Sylvester's doubling of Paley's constructions over a prime field:
order 2^k m with m = 1, 2, q + 1 (q prime, q = 3 mod 4: Paley I) or 2 (q + 1) (q prime,
q = 1 mod 4: Paley II). That covers every order up to 128 that is a multiple of 4 except 52, 92, 100
and 116, and the widths of the common decoders (576 = 8 x 72, 768 = 64 x 12, 2048, 3072 = 256 x 12, 4096, 5120 = 128 x 40)."""

from __future__ import annotations

import math

import numpy as np

KINDS = ("hadamard", "random")
_SIGN_FLIP = np.array([[1, 1], [1, -1]], np.int8)  # Sylvester's order-2 matrix


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """Q[i, j] = chi(j - i) over the field of q elements (q prime): chi(0) = 0, 1 for a nonzero
    square, -1 otherwise."""
    character = np.full(q, -1, np.int8)
    character[np.unique(np.arange(1, q) ** 2 % q)] = 1
    character[0] = 0
    index = np.arange(q)
    return character[(index[None, :] - index[:, None]) % q]


def _core(m: int) -> np.ndarray | None:
    """A Hadamard matrix of order m from Paley I or II (or m = 1, 2), or None."""
    if m in (1, 2):
        return np.ones((1, 1), np.int8) if m == 1 else _SIGN_FLIP.copy()
    if _is_prime(m - 1) and (m - 1) % 4 == 3:  # Paley I: I + [[0, 1], [-1, Q]], Q skew-symmetric
        skew = np.zeros((m, m), np.int8)
        skew[0, 1:], skew[1:, 0], skew[1:, 1:] = 1, -1, _jacobsthal(m - 1)
        return skew + np.eye(m, dtype=np.int8)
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: C = [[0, 1], [1, Q]] symmetric, zeros on its diagonal
        conference = np.zeros((q + 1, q + 1), np.int8)
        conference[0, 1:], conference[1:, 0], conference[1:, 1:] = 1, 1, _jacobsthal(q)
        zero_block = np.array([[1, -1], [-1, -1]], np.int8)
        return np.kron(conference, _SIGN_FLIP) + np.kron(np.eye(q + 1, dtype=np.int8), zero_block)
    return None


def hadamard_factors(n: int, smallest_core: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """Sylvester's matrix of order 2^k and a core of order n / 2^k (Paley I or II, or 1 or 2) whose
    Kronecker product is a Hadamard matrix of order n (int8), or None: the largest core (what
    hadamard_matrix builds), or with `smallest_core` the smallest, for a rotation online
    (finetune.onnx.rotate_online), which applies the two factors one after the other."""
    orders = [n >> k for k in range((n & -n).bit_length())]  # n / 2^k for every 2^k dividing n
    for order in sorted(orders, reverse=not smallest_core):
        core = _core(order)
        if core is not None:
            break
    else:
        return None
    return _sylvester(n // core.shape[0]), core


def online_factors(n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Hadamard matrices A (Sylvester's, of a power of two near sqrt(n)) and B with A x B (Kronecker)
    of order n, or None: a rotation online applies x (A x B) as A^T X B on x as a matrix X, about
    2 sqrt(n) products per element instead of n."""
    factors = hadamard_factors(n, smallest_core=True)
    if factors is None:
        return None
    sylvester, core = factors
    left = 1
    while 2 * left <= sylvester.shape[0] and (2 * left) ** 2 <= n:
        left *= 2
    return _sylvester(left), np.kron(_sylvester(sylvester.shape[0] // left), core)


def _sylvester(order: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of a power-of-two order (symmetric)."""
    matrix = np.ones((1, 1), np.int8)
    while matrix.shape[0] < order:
        matrix = np.kron(_SIGN_FLIP, matrix)
    return matrix


def hadamard_matrix(n: int) -> np.ndarray | None:
    """A Hadamard matrix of order n (entries ±1, H H^T = n I) as int8, or None where none is built here."""
    factors = hadamard_factors(n)
    return None if factors is None else np.kron(*factors)


def rotation_matrix(n: int, kind: str, seed: int) -> np.ndarray:
    """An n x n orthogonal matrix (float64): diag(s) H / sqrt(n) with seeded random signs s for
    `hadamard`, the Q of a seeded Gaussian matrix's QR (signs fixed by R's diagonal) for `random`.
    A ValueError says what to do where no Hadamard matrix of order n is built here."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        q, r = np.linalg.qr(rng.standard_normal((n, n)))
        return q * np.sign(np.diag(r))[None, :]
    if kind != "hadamard":
        raise ValueError(f"rotation kind must be one of {', '.join(KINDS)}; got {kind!r}")
    matrix = hadamard_matrix(n)
    if matrix is None:
        raise ValueError(f"no Hadamard matrix of order {n} is built here (orders 2^k m with m 1, 2, a prime + 1 or twice "
                         "a prime + 1): set rotation.kind to random")
    signs = rng.choice(np.array([-1.0, 1.0]), n)
    return signs[:, None] * matrix.astype(np.float64) / math.sqrt(n)
