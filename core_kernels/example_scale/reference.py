"""float64 numpy reference for example_scale."""
import numpy as np


def example_scale_reference(x, scale):
    """x * scale in float64."""
    return np.asarray(x, dtype=np.float64) * float(scale)
