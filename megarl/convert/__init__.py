"""HF <-> Megatron checkpoint conversion: layout (shards <-> canonical) and HF mappings."""
