"""Data: sources (arms), tokenizers and token caches, the mixer, and the per-step batch pipeline."""
