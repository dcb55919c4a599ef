"""The agent side: tool-call grammar, harness with context manager, scripted actors, SFT."""
