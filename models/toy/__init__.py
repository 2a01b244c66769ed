"""The toy zoo: a procedural video world with exact ground truth (world.py), on which reelflow trains its own small Video-LLMs."""
