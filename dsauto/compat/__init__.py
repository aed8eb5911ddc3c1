"""Running the real engines on a machine without a GPU (gloo backend), for tests and dry runs.

Nothing here acts on import: each shim is switched on explicitly (``enable()`` or a ``with`` block)
and switched off again by the handle it returns.
"""

from dsauto.compat.megatron_cpu import PATCHES, MegatronCpuShim, enable, megatron_on_cpu

__all__ = ["PATCHES", "MegatronCpuShim", "enable", "megatron_on_cpu"]
