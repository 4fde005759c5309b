"""The histogram observers: Percentile, MSE (power-of-two MinMSE when the spec asks for power-of-two
scales) and Entropy, over a fixed-size signed histogram per group that widens by exact pairwise bin
merges, and the numerics each method runs on that histogram."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from finetune.formats import FloatSpec, IntSpec

from .observers import CalibrationSpec, Observer, qparams

ErrorIntegral = Callable[[np.ndarray, np.ndarray], np.ndarray]

DEFAULT_BINS = 4096  # signed bins per histogram, i.e. 2048 bins of |x| as in TensorRT's calibrator
MSE_CHUNK_ELEMENTS = 1 << 21  # candidates x groups x bins evaluated at once by the MSE search
EMPTY_LEVEL_COUNT = 1e-4  # Q's count in a bin whose level holds only clipped outliers (entropy)
MAX_SHIFT = 62  # merging 2^62 bins or more maps every bin to one of the two central ones


class HistogramObserver(Observer):
    """A signed histogram per group over [-R, R]. When a batch exceeds R, R doubles as often as
    needed and bins merge pairwise: exact, since 0 stays a bin edge, and memory stays fixed."""

    def __init__(self, spec: CalibrationSpec, axis: int | None = None, bins: int = DEFAULT_BINS) -> None:
        super().__init__(spec, axis)
        if bins < 2 or bins % 2:
            raise ValueError(f"bins must be an even number >= 2, got {bins}")
        self.bins = bins
        self._counts = np.zeros((0, bins), np.int64)
        self._radius = np.zeros(0)

    def _update_rows(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, finite: bool) -> None:
        if self._radius.size == 0:
            self._counts = np.zeros((rows.shape[0], self.bins), np.int64)
            self._radius = np.zeros(rows.shape[0])
        absmax = np.maximum(np.maximum(-lo, hi), 0.0).astype(np.float64)
        self._grow(absmax)
        self._counts += _histogram(rows, self._radius, self.bins, finite)

    def _grow(self, absmax: np.ndarray) -> None:
        """Widen each group's radius to lie strictly above absmax, so no value sits on the outer edge
        (clamped into the last bin, it would land in the wrong bin after a merge): a group that held
        only zeros starts at absmax plus one part in `bins` (its counts sit in the bin starting at
        0 at any radius); others double."""
        fresh = (self._radius == 0) & (absmax > 0)
        self._radius[fresh] = absmax[fresh] * (1 + 1 / self.bins)
        over = (absmax >= self._radius) & (self._radius > 0)
        if not over.any():
            return
        doublings = np.zeros(absmax.shape, np.int64)
        doublings[over] = np.ceil(np.log2(absmax[over] / self._radius[over]))
        doublings += self._radius * np.exp2(doublings) <= absmax
        self._counts = _coarsen(self._counts, doublings)
        self._radius = self._radius * np.exp2(doublings)

    def _bin_width(self) -> np.ndarray:
        return self._radius / (self.bins // 2)

    def _abs_counts(self) -> np.ndarray:
        """The histogram of |x|: bin k covers [k, k + 1) bin widths."""
        half = self.bins // 2
        return self._counts[:, half:] + self._counts[:, half - 1::-1]


class PercentileObserver(HistogramObserver):
    """Clip at a percentile: of |x| when symmetric (the top 100 - p percent clipped), otherwise of x
    at both ends (half of that clipped at each end), interpolated linearly inside a histogram bin."""

    def __init__(
        self,
        spec: CalibrationSpec,
        axis: int | None = None,
        percentile: float = 99.999,
        symmetric: bool | None = None,
        bins: int = DEFAULT_BINS,
    ) -> None:
        super().__init__(spec, axis, bins)
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile
        self.symmetric = _is_symmetric(spec) if symmetric is None else symmetric

    def _range(self) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._observed()
        q = self.percentile / 100
        if self.symmetric:
            t = np.minimum(_quantile(self._abs_counts(), 0.0, self._bin_width(), q), np.maximum(-lo, hi))
            return -t, t
        tail = (1 - q) / 2
        start = -self._radius
        lower = _quantile(self._counts, start, self._bin_width(), tail)
        upper = _quantile(self._counts, start, self._bin_width(), 1 - tail)
        return np.clip(lower, lo, 0.0), np.clip(upper, 0.0, hi)


class MSEObserver(HistogramObserver):
    """The clip range minimising the expected squared quantization error on the spec's own grid.

    Candidates shrink the observed range by 2^(-i / steps_per_octave) over `octaves` octaves, then
    a linear refinement between the best one's neighbours; each candidate's scale and zero point
    come from `qparams`, so a power-of-two spec searches the integer exponent k of 2^k (MinMSE).
    Each histogram bin's error is integrated exactly, assuming values spread evenly in the bin.
    Ties go to the widest range (for MinMSE: the largest k)."""

    def __init__(
        self,
        spec: CalibrationSpec,
        axis: int | None = None,
        bins: int = DEFAULT_BINS,
        octaves: int = 16,
        steps_per_octave: int = 8,
        refine_steps: int = 16,
    ) -> None:
        super().__init__(spec, axis, bins)
        if octaves < 1 or steps_per_octave < 1 or refine_steps < 0:
            raise ValueError("octaves and steps_per_octave must be >= 1 and refine_steps >= 0")
        self.octaves, self.steps_per_octave, self.refine_steps = octaves, steps_per_octave, refine_steps
        self._integral = _error_integral(spec)

    def _range(self) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._observed()
        groups = np.arange(lo.size)
        coarse = np.exp2(-np.arange(self.octaves * self.steps_per_octave + 1) / self.steps_per_octave)
        errors = self.expected_errors(np.repeat(coarse[:, None], lo.size, axis=1))
        best = errors.argmin(axis=0)
        alpha, error = coarse[best], errors[best, groups]
        wide, narrow = coarse[np.maximum(best - 1, 0)], coarse[np.minimum(best + 1, coarse.size - 1)]
        fine = narrow + (wide - narrow) * np.linspace(1, 0, self.refine_steps + 2)[:, None]
        fine_errors = self.expected_errors(fine)
        fine_best = fine_errors.argmin(axis=0)
        better = fine_errors[fine_best, groups] < error
        alpha = np.where(better, fine[fine_best, groups], alpha)
        return alpha * lo, alpha * hi

    def expected_errors(self, alphas: np.ndarray) -> np.ndarray:
        """Mean squared quantization error [candidates, groups] of the histogram's data for the
        observed range shrunk by each factor in `alphas` [candidates, groups]."""
        lo, hi = self._observed()
        scale, zero_point = qparams(alphas * lo, alphas * hi, self.spec)
        scale, zero_point = scale.astype(np.float64), zero_point.astype(np.float64)
        return _expected_errors(self._counts, self._radius, scale, zero_point, self._integral)


class EntropyObserver(HistogramObserver):
    """The |x| threshold minimising the KL divergence between the histogram clipped there (outliers
    folded into the last bin) and its requantization to the spec's levels (TensorRT's idea).
    Asymmetric specs clip [max(min, -t), min(max, t)]."""

    def __init__(
        self,
        spec: IntSpec,
        axis: int | None = None,
        bins: int = DEFAULT_BINS,
        quantized_bins: int | None = None,
        candidates: int = 512,
    ) -> None:
        if not isinstance(spec, IntSpec):
            raise ValueError(f"entropy calibration needs an integer spec, got {spec!r}")
        super().__init__(spec, axis, bins)
        self.quantized_bins = quantized_bins or int(spec.qmax - spec.qmin + 1) // 2
        if candidates < 1 or self.quantized_bins < 1:
            raise ValueError("candidates and quantized_bins must be >= 1")
        self.candidates = candidates

    def _range(self) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._observed()
        kept = np.array([_kl_best_bins(row, self.quantized_bins, self.candidates) for row in self._abs_counts()])
        t = kept * self._bin_width()
        return np.maximum(lo, -t), np.minimum(hi, t)


def _is_symmetric(spec: CalibrationSpec) -> bool:
    return spec.symmetric if isinstance(spec, IntSpec) else True


def _histogram(rows: np.ndarray, radius: np.ndarray, bins: int, finite: bool) -> np.ndarray:
    """Counts [groups, bins] of each row's finite values over [-radius, radius]."""
    groups, half = rows.shape[0], bins // 2
    valid = None if finite else np.isfinite(rows)
    if valid is not None:
        rows = np.where(valid, rows, 0.0)
    width = np.where(radius > 0, radius / half, 1.0)
    index = np.clip(np.floor(rows / width[:, None]), -half, half - 1).astype(np.int64)
    index += (half + np.arange(groups) * bins)[:, None]
    flat = index.ravel() if valid is None else index[valid]
    return np.bincount(flat, minlength=groups * bins).reshape(groups, bins)


def _coarsen(counts: np.ndarray, doublings: np.ndarray) -> np.ndarray:
    """Merge each row's bins 2^d at a time around the centre (d per row), as if its radius had
    doubled d times: bin i moves to half + floor((i - half) / 2^d)."""
    groups, bins = counts.shape
    half = bins // 2
    merge = np.left_shift(1, np.minimum(doublings, MAX_SHIFT))[:, None]
    index = half + np.floor_divide(np.arange(bins) - half, merge) + (np.arange(groups) * bins)[:, None]
    merged = np.bincount(index.ravel(), weights=counts.ravel(), minlength=groups * bins)
    return merged.reshape(groups, bins).astype(np.int64)


def _quantile(counts: np.ndarray, start: np.ndarray | float, width: np.ndarray, q: float) -> np.ndarray:
    """The q-quantile of each row's histogram (bins of `width` from `start`), linear inside a bin."""
    cdf = np.cumsum(counts, axis=1)
    target = q * cdf[:, -1]
    index = np.minimum((cdf < target[:, None]).sum(axis=1), counts.shape[1] - 1)[:, None]
    inside = np.take_along_axis(counts, index, axis=1)[:, 0]
    before = np.take_along_axis(cdf, index, axis=1)[:, 0] - inside
    fraction = np.divide(target - before, inside, out=np.zeros_like(target), where=inside > 0)
    return start + (index[:, 0] + fraction) * width


def _error_integral(spec: CalibrationSpec) -> ErrorIntegral:
    """Phi(u, zero_point): the integral of (t - Q(t))^2 from the lowest grid point to u, in units of
    the scale, for the spec's grid (clamped at both ends); an antiderivative of the squared error."""
    if isinstance(spec, IntSpec):
        def integer(u: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
            low, high = spec.qmin - zero_point, spec.qmax - zero_point
            code = np.clip(np.rint(u), low, high)
            return (code - low) / 12 + (u - code) ** 3 / 3

        return integer
    grid = _float_grid(spec)
    midpoints = (grid[1:] + grid[:-1]) / 2
    cell_start = np.concatenate([[0.0], np.cumsum(np.diff(grid) ** 3 / 12)])

    def floating(u: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
        cell = np.searchsorted(midpoints, u)
        return cell_start[cell] + (u - grid[cell]) ** 3 / 3

    return floating


def _float_grid(spec: FloatSpec) -> np.ndarray:
    """Every finite value of an 8-bit float type, ascending, as float64."""
    values = torch.arange(256, dtype=torch.uint8).view(spec.torch_dtype).float().numpy().astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def _expected_errors(
    counts: np.ndarray, radius: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, integral: ErrorIntegral
) -> np.ndarray:
    """Mean squared error [candidates, groups] of data distributed as the histogram (evenly inside
    each bin) under each candidate scale/zero point [candidates, groups], in chunks of candidates."""
    groups, bins = counts.shape
    width = np.where(radius > 0, radius / (bins // 2), 1.0)[:, None]
    edges = (np.arange(bins + 1) - bins // 2) * width
    totals = np.maximum(counts.sum(axis=1), 1)
    step = max(1, MSE_CHUNK_ELEMENTS // (groups * (bins + 1)))
    errors = np.empty(scale.shape)
    for start in range(0, scale.shape[0], step):
        s = scale[start:start + step, :, None]
        phi = integral(edges / s, zero_point[start:start + step, :, None])
        per_bin = np.diff(phi, axis=-1) * s**3 / width
        errors[start:start + step] = (per_bin * counts).sum(axis=-1) / totals
    return errors


def _kl_best_bins(hist: np.ndarray, levels: int, candidates: int) -> int:
    """How many |x| bins to keep (the threshold in bins) for the least KL divergence; all of them
    when the histogram has no more bins than levels or is empty. Ties go to the fewest bins."""
    size = hist.size
    if levels >= size or hist.sum() == 0:
        return size
    kept = np.unique(np.linspace(levels, size, min(candidates, size - levels + 1)).round().astype(np.int64))
    return int(kept[np.argmin(_kl_divergences(hist, kept, levels))])


def _kl_divergences(hist: np.ndarray, kept: np.ndarray, levels: int) -> np.ndarray:
    """KL(P || Q) for each number of kept bins: P is the histogram cut there with the outliers added
    to the last kept bin; Q spreads the cut histogram's mass per level evenly over P's nonzero bins,
    and a level with no mass of its own (outliers only) gets EMPTY_LEVEL_COUNT per bin, as
    TensorRT's smoothing does: clipping into an empty gap is costly but not infinitely so."""
    total = hist.sum()
    cumulative = np.concatenate([[0], np.cumsum(hist)])
    rows, bins, keep = np.arange(kept.size), np.arange(hist.size)[None, :], kept[:, None]
    p = np.where(bins < keep, hist, 0).astype(np.float64)
    p[rows, kept - 1] += total - cumulative[kept]
    nonzero = p > 0
    bounds = np.arange(levels + 1)[None, :] * keep // levels
    level_mass = np.diff(cumulative[bounds], axis=1)
    nonzero_before = np.concatenate([np.zeros((kept.size, 1), np.int64), np.cumsum(nonzero, axis=1)], axis=1)
    level_nonzero = np.diff(np.take_along_axis(nonzero_before, bounds, axis=1), axis=1)
    empty = np.full(level_mass.shape, EMPTY_LEVEL_COUNT)
    spread = np.divide(level_mass, level_nonzero, out=empty, where=level_mass > 0)
    level = np.minimum(((bins + 1) * levels + keep - 1) // keep - 1, levels - 1)
    q = np.where(nonzero, np.take_along_axis(spread, level, axis=1), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_norm, q_norm = p / total, q / q.sum(axis=1, keepdims=True)
        terms = np.where(nonzero, p_norm * np.log(p_norm / q_norm), 0.0)
    return terms.sum(axis=1)
