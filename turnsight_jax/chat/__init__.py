"""Qwen3 chat format: rendering, tool-call parsing, trajectories and hindsight blocks."""
