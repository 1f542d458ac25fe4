"""RoPE tables (Meta's adjacent-pair layout; LLaMA-3.1's scaling with ModelArgs' rope_* parameters)."""
import math

import numpy as np


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """theta^(-2i/hd) for i < hd/2, in float32 as Meta computes them; scaled when `scaling` is
    (factor, low_freq_factor, high_freq_factor, original_context) (ModelArgs.rope_scaling)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32)[: head_dim // 2] / np.float32(head_dim)
    freqs = (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)
    if scaling is not None:
        freqs = scale_rope_frequencies(freqs, *scaling)
    return freqs


def scale_rope_frequencies(freqs: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                           original_context: int) -> np.ndarray:
    """Keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = np.where(wavelen < high_freq_wavelen, freqs,
                      np.where(wavelen > low_freq_wavelen, freqs / factor, blended))
    return scaled.astype(np.float32)


def rope_tables(head_dim: int, end: int, theta: float, scaling=None):
    """cos, sin of shape [end, hd/2]; angles in float32 like Meta's torch.outer."""
    freqs = rope_frequencies(head_dim, theta, scaling)
    angles = np.outer(np.arange(end, dtype=np.float32), freqs).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
