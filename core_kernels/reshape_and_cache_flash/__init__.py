from .checks import check_reshape_and_cache_flash
from .op import RESHAPE_AND_CACHE_FLASH
from .plan import (KV_CACHE_DTYPES, ReshapeAndCacheConfig, check_kv_cache_dtype, default_config,
                   plan_reshape_and_cache_flash)
from .reference import quantize_fp8_reference, reshape_and_cache_flash_reference

__all__ = ["KV_CACHE_DTYPES", "RESHAPE_AND_CACHE_FLASH", "ReshapeAndCacheConfig", "check_kv_cache_dtype",
           "check_reshape_and_cache_flash", "default_config", "plan_reshape_and_cache_flash",
           "quantize_fp8_reference", "reshape_and_cache_flash_reference"]
