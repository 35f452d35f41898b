"""thinwire: distributed PyTorch training that is fast on cheap networks."""

from thinwire.compress import Compressor, compressor, compressors, register_compressor

__all__ = ["Compressor", "compressor", "compressors", "register_compressor"]
__version__ = "0.1.0"
