"""Drop-in ``nn.Module`` s built on the fused ops."""

from .rms_norm import RMSNorm, WiolaRMSNorm
from .srpe import SpiralRotaryEmbedding

__all__ = ["RMSNorm", "SpiralRotaryEmbedding", "WiolaRMSNorm"]
