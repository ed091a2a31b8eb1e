"""Helpers shared by the test packages (imported as ``tests.support.<module>``):
``keys`` (test keys and payloads), ``daemon`` (the real daemon in a thread),
``waits`` (on health or on a condition, never on sleeps)."""
