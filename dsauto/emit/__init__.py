"""Writers of the artifacts: ds_config.json, megatron_args.txt and plan.yaml."""
