"""The agent side: tool-call grammar, harness with context manager, notes compressor, scripted actors, SFT."""
