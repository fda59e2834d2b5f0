from .op import EXAMPLE_SCALE
from .plan import plan_example_scale
from .reference import example_scale_reference

__all__ = ["EXAMPLE_SCALE", "plan_example_scale", "example_scale_reference"]
