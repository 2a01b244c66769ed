"""Model adapters over transformers (Qwen2.5-VL, LLaVA-OneVision), the lean decode path, Sparrow's
draft head, and the pure math the stages share (pruning, sampling, memory)."""

from models.torchvision_check import hide_unloadable_torchvision

hide_unloadable_torchvision()        # before anything imports transformers' image utilities
