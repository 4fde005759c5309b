"""Calibration: data in every form users have, streaming observers (MinMax, Percentile, MSE /
power-of-two MinMSE, Entropy) and the onnxruntime pass that feeds them."""

from .collect import collect_statistics
from .data import LABELS_FILE, CalibrationData, Feed, InputInfo, data_labels, model_inputs, random_data, sample_count
from .factory import METHODS, make_observer
from .histograms import EntropyObserver, HistogramObserver, MSEObserver, PercentileObserver
from .observers import MinMaxObserver, Observer, qparams

__all__ = [
    "LABELS_FILE", "METHODS", "CalibrationData", "EntropyObserver", "Feed", "HistogramObserver", "InputInfo", "MSEObserver",
    "MinMaxObserver", "Observer", "PercentileObserver", "collect_statistics", "data_labels", "make_observer", "model_inputs",
    "qparams", "random_data", "sample_count",
]
