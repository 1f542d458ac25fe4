"""RoPE tables (Meta's adjacent-pair layout, LLaMA-3.1 scaling)."""
import math

import numpy as np

# LLaMA-3.1 scaled RoPE constants
ROPE_SCALE_FACTOR = 8.0
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_ORIGINAL_CONTEXT = 8192


def rope_frequencies(head_dim: int, theta: float, use_scaled: bool) -> np.ndarray:
    """theta^(-2i/hd) for i < hd/2, in float32 as Meta computes them; optionally 3.1-scaled."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32)[: head_dim // 2] / np.float32(head_dim)
    freqs = (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)
    if use_scaled:
        freqs = scale_rope_frequencies(freqs)
    return freqs


def scale_rope_frequencies(freqs: np.ndarray) -> np.ndarray:
    """Keep high frequencies, divide low ones by 8, interpolate smoothly in between."""
    low_freq_wavelen = ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ_FACTOR
    high_freq_wavelen = ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (ROPE_ORIGINAL_CONTEXT / wavelen - ROPE_LOW_FREQ_FACTOR) / (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR)
    blended = (1 - smooth) * freqs / ROPE_SCALE_FACTOR + smooth * freqs
    scaled = np.where(wavelen < high_freq_wavelen, freqs,
                      np.where(wavelen > low_freq_wavelen, freqs / ROPE_SCALE_FACTOR, blended))
    return scaled.astype(np.float32)


def rope_tables(head_dim: int, end: int, theta: float, use_scaled: bool):
    """cos, sin of shape [end, hd/2]; angles in float32 like Meta's torch.outer."""
    freqs = rope_frequencies(head_dim, theta, use_scaled)
    angles = np.outer(np.arange(end, dtype=np.float32), freqs).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
