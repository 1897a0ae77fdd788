"""``SpiralRotaryEmbedding``: drop-in module for SPEC §4."""

from __future__ import annotations

from torch import Tensor, nn

from ..ops.srpe import srpe


class SpiralRotaryEmbedding(nn.Module):
    """Spiral rotary position encoding (SRPE) of queries and keys (SPEC §4).

    A rotate-half rotation by ``Θ_j(p) = p ω_j (1 + 1/k_s)`` scaled by the radial factor
    ``r_j(p) = 1 + a_s sin(p f_s ω_j)``; no learned parameters.

    Args:
        head_dim: d_h (even).
        theta: θ₀ (default 10000).
        spiral_divisor: k_s (default 8).
        radial_amplitude: a_s (default 0.1).
        radial_frequency: f_s (default 0.01).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, spiral_divisor: float = 8.0,
                 radial_amplitude: float = 0.1, radial_frequency: float = 0.01) -> None:
        super().__init__()
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
        self.head_dim = head_dim
        self.theta = float(theta)
        self.spiral_divisor = float(spiral_divisor)
        self.radial_amplitude = float(radial_amplitude)
        self.radial_frequency = float(radial_frequency)

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``q (B, H, T, d_h)``, ``k (B, H_kv, T, d_h)``, ``position_ids (B, T) | (1, T) | (T,)``."""
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q must have head dim {self.head_dim}, got {q.shape[-1]}")
        return srpe(q, k, position_ids, self.theta, self.spiral_divisor, self.radial_amplitude,
                    self.radial_frequency)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, theta={self.theta}, spiral_divisor={self.spiral_divisor}, "
                f"radial_amplitude={self.radial_amplitude}, radial_frequency={self.radial_frequency}")
