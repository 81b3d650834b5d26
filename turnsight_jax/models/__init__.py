"""Qwen3 in Flax NNX: the model, its attention kernels (chunked XLA and fused Pallas), the paged KV
cache, device meshes and sharding, and Hugging Face weights in and out."""
