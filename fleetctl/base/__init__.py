"""What every layer uses and that knows nothing of GPUs or vLLM: errors, limits, names, YAML
sources, text, tables, JSON output and progress."""
