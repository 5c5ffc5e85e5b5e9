"""The inference engine: pure inference, no Redis, no SQL, no Celery, no Flask.

Config, sequence, block manager, scheduler, model runner, output processor, LLMEngine and LLM. The
offline API is `from llmq import LLM, SamplingParams`.
"""
