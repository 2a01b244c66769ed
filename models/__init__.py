"""Model adapters over transformers (Qwen2.5-VL, LLaVA-OneVision) and the toy zoo: next issues."""
