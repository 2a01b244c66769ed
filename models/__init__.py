"""Model adapters over transformers (Qwen2.5-VL, LLaVA-OneVision), the lean decode path, Sparrow's
draft head, and the pure math the stages share (pruning, sampling, memory)."""
