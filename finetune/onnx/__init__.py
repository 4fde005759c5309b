"""Everything that reads or writes ONNX protos."""

from .functions import CUSTOM_DOMAIN, QUARK_DOMAIN, attach_custom_ops

__all__ = ["CUSTOM_DOMAIN", "QUARK_DOMAIN", "attach_custom_ops"]
