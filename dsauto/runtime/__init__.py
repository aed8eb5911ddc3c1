"""Applying a plan inside the stock engines: the DeepSpeed hook, the Megatron-core plugin, operator splitting."""
