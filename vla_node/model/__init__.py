"""The VLA model: vision tower, projector, decoder, tokenizer, action head, checkpoints (torch modules, no
cache logic)."""
