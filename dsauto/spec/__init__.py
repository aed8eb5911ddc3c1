"""Model, cluster and workload descriptions, and the loaders and presets that build them."""
