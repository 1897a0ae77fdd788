"""Drop-in ``nn.Module`` s built on the fused ops."""

from .rms_norm import WiolaRMSNorm
from .srpe import SpiralRotaryEmbedding

__all__ = ["SpiralRotaryEmbedding", "WiolaRMSNorm"]
