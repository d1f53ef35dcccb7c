"""vllm_oscar: an attention-aware 2-bit KV cache (the OSCAR method) for vLLM.

Importing this package needs neither a GPU nor vLLM.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM plugin entry point (``vllm.general_plugins``): registers the OSCAR backend.

    Idempotent; vLLM calls it in every process. Details: vllm_oscar.attention.registration.
    """
    from vllm_oscar.attention.registration import register as _register

    _register()
