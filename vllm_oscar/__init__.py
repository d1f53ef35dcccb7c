"""vllm_oscar: an attention-aware 2-bit KV cache (the OSCAR method) for vLLM.

Importing this package needs neither a GPU nor vLLM.
"""

__version__ = "0.1.0"
