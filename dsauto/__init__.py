"""dsauto: plans hybrid-parallel training (ZeRO, tensor, pipeline, checkpointing, operator splitting)
for DeepSpeed and Megatron-core, from a cost model and a dynamic program under the memory limit."""

__version__ = "0.1.0"
