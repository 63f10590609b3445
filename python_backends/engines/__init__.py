"""Hosting vLLM: the colocated engine of ``llm``/``epd``, its prompt, its videos, the generated-
text chunk type, engine-core processes.
"""
