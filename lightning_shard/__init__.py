"""lightning_shard: ZeRO-1/2 (and later 3/FSDP) strategies for PyTorch Lightning."""
