from .prefill_plan import LightningGluonConfig, LightningTritonConfig, plan_lightning_attention, prefill_state_shape
from .decode_plan import LightningDecodeConfig, plan_linear_decode
from .reference import (lightning_attention_backward_reference, lightning_attention_reference,
                        linear_decode_reference)

__all__ = ["LightningTritonConfig", "LightningGluonConfig", "LightningDecodeConfig",
           "plan_lightning_attention", "plan_linear_decode", "prefill_state_shape",
           "check_slot_ids", "lightning_attention_reference", "linear_decode_reference"]
from .varlen_plan import (LightningVarlenConfig, LightningVarlenGluonConfig, check_varlen_host_data,
                          plan_lightning_attention_varlen)
from .varlen_reference import lightning_attention_varlen_reference

__all__ += ["LightningVarlenConfig", "LightningVarlenGluonConfig", "plan_lightning_attention_varlen", "check_varlen_host_data",
            "lightning_attention_varlen_reference"]
from .backward_plan import (LightningBackwardConfig, plan_lightning_attention_backward,
                            plan_lightning_attention_varlen_backward)

__all__ += ["LightningBackwardConfig", "plan_lightning_attention_backward",
            "plan_lightning_attention_varlen_backward",
            "lightning_attention_backward_reference"]
from .checks import check_lightning_varlen, check_linear_decode, check_slot_ids

__all__ += ["check_lightning_varlen", "check_linear_decode"]
