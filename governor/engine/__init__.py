"""governor.engine: llama-cpp-python behind an OpenAI-compatible local socket."""
