"""Pure tensor functions: no communication, no per-parameter state."""
