"""megamoe: a fused, trainable Mixture-of-Experts layer for NVIDIA Hopper GPUs."""

from ._fused_op import skip_expert_outputs
from .buffer import Buffer
from .errors import LibraryError, MegaMoEError, NotBuiltError
from .module import MoE, route
from .ops import moe

__version__ = "0.1.0"

__all__ = ["moe", "MoE", "route", "Buffer", "skip_expert_outputs", "MegaMoEError",
           "NotBuiltError", "LibraryError", "__version__"]
