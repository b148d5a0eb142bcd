"""HF config -> megatron TransformerConfig, layer specs, model builders, the forward seam."""
