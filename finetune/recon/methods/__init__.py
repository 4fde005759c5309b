"""How a unit's tensors change: the run's algorithm (AdaRound, AdaQuant or GPTQ) and the methods that
join it (GPTQ's start, bias correction, learned scales, learned equalisation, QDrop inside blocks),
each a Method the tuner asks at every moment of a unit's tuning (see base). Adding a method is a
module here and a line in EXTENSIONS."""

from __future__ import annotations

from finetune.config import FastFinetune

from .adaquant import AdaQuant
from .adaround import AdaRound
from .base import Algorithm, AlgorithmPart, Method, Part, UnitWork
from .bias import BiasCorrection
from .equalization import EqualizationLearning
from .gptq import GPTQ, GPTQStart
from .qdrop import BlockQDrop
from .scales import ScaleLearning

ALGORITHMS: dict[str, type[Algorithm]] = {algorithm.name: algorithm for algorithm in (AdaRound, AdaQuant, GPTQ)}
# The methods that join the algorithm where they apply, in the order the tuner asks them: GPTQ's start
# moves the weights before bias correction's first correction measures them.
EXTENSIONS: tuple[type[Method], ...] = (GPTQStart, BiasCorrection, ScaleLearning, EqualizationLearning, BlockQDrop)


def run_methods(config: FastFinetune) -> list[Method]:
    """The methods of a run with `config`: its algorithm first, then each extension that applies."""
    algorithm = ALGORITHMS[config.algorithm](config)
    return [algorithm, *(method(config, algorithm) for method in EXTENSIONS if method.applies(config, algorithm))]


def corrects_bias(config: FastFinetune) -> bool:
    """Whether a run with `config` corrects biases (see BiasCorrection.applies)."""
    return BiasCorrection.applies(config, ALGORITHMS[config.algorithm](config))


__all__ = ["ALGORITHMS", "EXTENSIONS", "Algorithm", "AlgorithmPart", "Method", "Part", "UnitWork", "corrects_bias", "run_methods"]
