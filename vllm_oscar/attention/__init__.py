"""The OSCAR attention backend for vLLM."""
