"""Runnable examples of durable-capabilities."""
