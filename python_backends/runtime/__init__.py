"""What every python model's process needs besides Triton: the event loop thread, the heartbeat,
config parameters, test-only pauses.
"""
