"""finetune: quantize ONNX models and recover their accuracy with AdaRound, AdaQuant and GPTQ.

The flow, one package each: formats -> onnx -> calibrate -> quantize -> lift -> recon -> export.
LAYERS orders every package (recon's sub-packages apart) from the lowest up: a package imports only
its own modules and those of lower layers, which tests/test_layout.py checks."""

__version__ = "0.1.0"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("files", "notices", "formats", "host_memory"),  # leaves: atomic writes, the notices of summaries, the numerics, freed heap
    ("onnx",),
    ("calibrate",),
    ("config",),
    ("quantize", "lift", "tools", "zoo", "zoo_decoder", "zoo_gguf"),
    ("export",),
    ("recon.units",),  # what is tuned
    ("recon.data",),  # what each unit trains on
    ("recon.methods",),  # how a unit's tensors change
    ("recon",),  # the engine that runs them
    ("automp",),
    ("pipeline",),
    ("cli",),
)
